"""tools/cpu_server's command line, as `make serve` / `make gates` pass it: nothing is silently dropped."""
from __future__ import annotations

from tools.cpu_server import CPU_SERVER_SKIPS, parse_args, with_cpu_server_skips


def test_serve_passes_options_it_does_not_know_to_vllm():
    # make serve SERVE_ARGS="--max-num-seqs 4 --no-prefix-caching --max-model-len 8192"
    args, gate_args, vllm_args = parse_args(["serve", "--tp", "1", "--pp", "1", "--max-num-seqs", "4",
                                             "--no-prefix-caching", "--max-model-len", "8192"])
    assert (args.command, args.no_prefix_caching, args.max_model_len) == ("serve", True, 8192)
    assert gate_args == [] and vllm_args == ["--max-num-seqs", "4"]


def test_gates_pass_their_own_options_to_run_gates_and_vllm_s_after_the_separator():
    # make gates GATES_ARGS="long --only prefix-cache" TP=2 SERVE_ARGS="--max-num-seqs 4 --port 8123"
    args, gate_args, vllm_args = parse_args(["gates", "long", "--only", "prefix-cache", "--tp", "2", "--pp", "1",
                                             "--", "--max-num-seqs", "4", "--port", "8123"])
    assert (args.mode, args.tensor_parallel_size, args.port) == ("long", 2, 8123)
    assert gate_args == ["--only", "prefix-cache"] and vllm_args == ["--max-num-seqs", "4"]


def test_the_mode_is_taken_by_place_not_from_an_option_s_value():
    # without a mode, an option's value must not be read as one (newer argparse would try)
    args, gate_args, _ = parse_args(["gates", "--only", "prefix-cache"])
    assert (args.mode, gate_args) == ("quick", ["--only", "prefix-cache"])
    args, _, vllm_args = parse_args(["serve", "--max-num-seqs", "4"])
    assert (args.mode, vllm_args) == ("quick", ["--max-num-seqs", "4"])


def test_an_allowed_skip_adds_to_the_cpu_server_s_own():
    assert with_cpu_server_skips(["--only", "smoke,preflight", "--allow-skip", "smoke"], "quick") == [
        "--only", "smoke,preflight", "--allow-skip", f"{CPU_SERVER_SKIPS['quick']},smoke"]
    assert with_cpu_server_skips(["--allow-skip=needles-long"], "long") == ["--allow-skip", "needles-long"]
    assert with_cpu_server_skips([], "quick") == ["--allow-skip", CPU_SERVER_SKIPS["quick"]]


def test_two_nodes_take_the_two_node_variant_s_sizes_or_refuse(capsys):
    # make gates NODES=2 TP=2 PP=2
    args, _, _ = parse_args(["gates", "quick", "--tp", "2", "--pp", "2", "--nodes", "2", "--"])
    assert (args.nodes, args.tensor_parallel_size, args.pipeline_parallel_size) == (2, 2, 2)
    # make gates NODES=2 (TP and PP left at 1): refused before anything starts, saying what it needs
    from tools.cpu_server import main

    assert main(["gates", "quick", "--tp", "1", "--pp", "1", "--nodes", "2", "--"]) == 2
    assert "TP 2 x PP 2 (one stage per node); found TP 1 x PP 1" in capsys.readouterr().err
