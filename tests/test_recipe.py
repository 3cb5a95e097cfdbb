"""The recipe says what the published page says, and names only fixes and knobs that exist."""
from __future__ import annotations

import copy
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cookbook.api import load_profile

REPO = Path(__file__).resolve().parents[1]
RECIPE = yaml.safe_load((REPO / "recipes/thinkingmachines/Inkling-Small/recipe.yaml").read_text())
PAGE = REPO.parent / "shared" / "seeds" / "cookbook-page-inkling-small-gaudi2.txt"


def test_recipe_fixes_exist_in_its_profile():
    profile = load_profile(RECIPE["profile"])
    assert set(RECIPE["opt-in-fixes"]) <= set(profile.opt_in)
    assert profile.plan(RECIPE["opt-in-fixes"])[0][-1].name == "vllm-long-prefill-share"
    assert RECIPE["fix-step"].endswith(f"--profile {profile.name} {' '.join(RECIPE['opt-in-fixes'])} || exit 1")


def test_long_prefill_variables_are_declared_by_their_fix():
    fix = load_profile(RECIPE["profile"]).fix("vllm-long-prefill-share")
    declared = {entry["name"] for entry in fix.meta.get("env") or []}
    used = {k for k in RECIPE["env"] if k.startswith("VLLM_LONG_PREFILL")}
    assert used <= declared, f"not declared in fix.yaml env: {used - declared}"


def test_kv_pool_is_the_pages_memory_guard():
    serve = dict(a.split("=", 1) for a in RECIPE["serve"] if "=" in a)
    blocks, block = int(serve["--num-gpu-blocks-override"]), int(serve["--block-size"])
    assert blocks * block == RECIPE["kv-pool-tokens"] == 327680
    assert RECIPE["kv-pool-tokens"] >= int(serve["--max-model-len"]) == RECIPE["context"]


def _page_launch(text: str):
    env = dict(re.findall(r"export (\w+)=(\S+)", text))  # the page runs lines together
    serve = text[text.index("vllm serve thinkingmachines/Inkling-Small"):]
    serve = serve[: serve.index("$COOKBOOK is")] if "$COOKBOOK is" in serve else serve
    tokens = serve.replace("\\\n", " ").split()
    args, i = [], 3
    while i < len(tokens) and tokens[i].startswith("--"):
        if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            args.append(f"{tokens[i]}={tokens[i + 1]}")
            i += 2
        else:
            args.append(tokens[i])
            i += 1
    fix_step = re.search(r"^python3 .*apply_all\.py.*$", text, re.M).group(0)
    return env, tokens[:3] + args, fix_step


@pytest.mark.skipif(not PAGE.exists(), reason=f"the published page is not beside the repository ({PAGE})")
def test_recipe_matches_the_published_launch_block():
    env, serve, fix_step = _page_launch(PAGE.read_text())
    assert env == RECIPE["env"]
    assert serve == RECIPE["serve"]
    assert fix_step == RECIPE["fix-step"]


# --- the launch rendered from the recipe (recipes/launch.py) ----------------------------------------
from recipes.launch import (cpu_docker_run, cpu_multi_node_args, cpu_ray_start, cpu_serve_args, docker_run, launch_block, multi_node_block,  # noqa: E402
                            multi_node_serve, serve_command)

SERVE_FLAGS_ARE_PARSED = r'''
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
args = parser.parse_args(json.loads(sys.argv[1]))
validate_parsed_serve_args(args)
engine = AsyncEngineArgs.from_cli_args(args)
print(json.dumps({"model": args.model_tag or engine.model, "tp": engine.tensor_parallel_size,
    "pp": engine.pipeline_parallel_size, "backend": engine.distributed_executor_backend,
    "max_model_len": engine.max_model_len, "block_size": engine.block_size,
    "blocks": engine.num_gpu_blocks_override, "max_num_seqs": engine.max_num_seqs,
    "batched": engine.max_num_batched_tokens, "dtype": engine.dtype,
    "prompt_tokens_details": args.enable_prompt_tokens_details, "tool_parser": args.tool_call_parser,
    "reasoning_parser": engine.reasoning_parser, "prefix_caching": engine.enable_prefix_caching}))
'''


def _page_block(text: str) -> str:
    end_marker = "--reasoning-parser inkling_py"
    return text[text.index("export PT_HPU_LAZY_MODE"): text.index(end_marker) + len(end_marker)]


@pytest.mark.skipif(not PAGE.exists(), reason=f"the published page is not beside the repository ({PAGE})")
def test_rendered_launch_block_is_the_pages():
    rendered, page = launch_block(RECIPE), _page_block(PAGE.read_text())
    assert rendered == page, "\n".join(f"expected {p!r}, found {r!r}" for r, p in
                                       zip(rendered.splitlines(), page.splitlines()) if r != p) or "line count differs"


def test_the_rendered_blocks_say_where_the_cookbook_is(capsys):
    from recipes.launch import main

    for what in ("block", "multi-node"):
        main([what])
        out = capsys.readouterr().out
        assert out.startswith("# $COOKBOOK is the cookbook's folder: /opt/gaudi-cookbook in the port image"), out[:200]
        assert "$COOKBOOK/fixes/apply_all.py" in out


def test_docker_run_line_serves_the_recipe_on_gaudi():
    line = docker_run(RECIPE, image="inkling-small:port")
    argv = shlex.split(line.replace("\\\n", " "))
    for needed in ("--runtime=habana", "HABANA_VISIBLE_DEVICES=all", "--ipc=host",
                   f"COOKBOOK={RECIPE['image']['cookbook-path']}"):
        assert needed in argv, f"expected {needed} in the docker run line, found {argv}"
    # runs without a TTY, and the container (its log) outlives the server: detached and named, no --rm
    assert argv[:5] == ["docker", "run", "-d", "--name", "inkling-small"], argv[:5]
    assert not {"-it", "-t", "-i", "--rm"} & set(argv), argv
    envs = {argv[i + 1].split("=", 1)[0]: argv[i + 1].split("=", 1)[1] for i, a in enumerate(argv) if a == "-e"}
    assert {k: envs[k] for k in RECIPE["env"]} == RECIPE["env"]
    # the container runs bash -c SCRIPT: the fix step, then the serve command, whatever the base's ENTRYPOINT
    assert argv[argv.index("--entrypoint") + 1:argv.index("--entrypoint") + 4] == ["/bin/bash", "inkling-small:port", "-c"]
    script = argv[-1]
    log = RECIPE["image"]["server-log"]
    prepare, fix, serve = script.split(" && ")
    assert prepare == f"mkdir -p {Path(log).parent}" and fix + " || exit 1" == RECIPE["fix-step"]
    serve, _, redirect = serve.partition(" > ")
    assert shlex.split(serve) == ["exec", *serve_command(RECIPE)]
    assert redirect == f">(tee -a {log}) 2>&1"   # docker logs, and the log file the gates read inside


def test_the_cpu_docker_line_serves_the_port_image_on_the_cpu_variant():
    line = cpu_docker_run(RECIPE, "inkling-small:cpu", "/srv/tiny", 8123)
    argv = shlex.split(line.replace("\\\n", " "))
    assert argv[:10] == ["docker", "run", "-d", "--name", "inkling-small-cpu", "--net=host", "--ipc=host", "--stop-timeout",
                         "30", "-e"]
    assert not {"-it", "-t", "-i", "--rm", "--runtime=habana"} & set(argv), argv
    envs = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "-e")
    docker = RECIPE["cpu-variant"]["docker"]
    assert envs == {"COOKBOOK": RECIPE["image"]["cookbook-path"], "COOKBOOK_PROFILE": docker["profile"],
                    "COOKBOOK_PORT_PROFILE": docker["port-profile"], **RECIPE["cpu-variant"]["env"]}
    assert argv[argv.index("-v") + 1] == f"/srv/tiny:{docker['model']}:ro"
    script = argv[-1]
    assert f'apply_all.py" --profile "$COOKBOOK/$COOKBOOK_PROFILE" {" ".join(RECIPE["opt-in-fixes"])}' in script
    serve = shlex.split(script.split(" && exec ")[1].split(" > ")[0])
    assert serve == ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", docker["model"], "--host",
                     "127.0.0.1", "--port", "8123", *cpu_serve_args(RECIPE)]
    for profile in (docker["profile"], docker["port-profile"]):
        assert (REPO / profile).is_file(), profile


# What vLLM 0.30.0's parser makes of the page's serve flags (prefix_caching None: vLLM's default, on).
SINGLE_NODE_PARSED = {"model": "thinkingmachines/Inkling-Small", "tp": 8, "pp": 1, "backend": None,
                      "max_model_len": 262144, "block_size": 128, "blocks": 2560, "max_num_seqs": 16,
                      "batched": 2048, "dtype": "bfloat16", "prompt_tokens_details": True,
                      "tool_parser": "inkling_py", "reasoning_parser": "inkling_py", "prefix_caching": None}


def _parse_with_vllm(vllm_src, argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(vllm_src), "VLLM_TARGET_DEVICE": "cpu"}
    return subprocess.run([sys.executable, "-c", SERVE_FLAGS_ARE_PARSED, json.dumps(argv)], capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.mark.slow
def test_the_pages_flags_pass_vllms_own_argument_parser(vllm_src):
    if PAGE.exists():
        _, serve, _ = _page_launch(PAGE.read_text())
        argv = serve_command({"serve": serve})
    else:
        argv = serve_command(RECIPE)
    assert argv[:2] == ["vllm", "serve"]
    proc = _parse_with_vllm(vllm_src, argv[2:])
    assert proc.returncode == 0, f"vLLM 0.30.0's parser refused the page's flags:\n{proc.stderr[-3000:]}"
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert parsed == SINGLE_NODE_PARSED, parsed
    # the CPU variant's flags, as tools/cpu_server.py passes them
    proc = _parse_with_vllm(vllm_src, ["--model", "tiny"] + cpu_serve_args(RECIPE))
    assert proc.returncode == 0, proc.stderr[-3000:]
    cpu = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (cpu["max_model_len"], cpu["prompt_tokens_details"], cpu["prefix_caching"]) == (4096, True, True), cpu
    # the CPU variant at the two-node sizes, through Ray (tools/cpu_server.py --nodes 2)
    proc = _parse_with_vllm(vllm_src, ["--model", "tiny"] + cpu_multi_node_args(RECIPE))
    assert proc.returncode == 0, proc.stderr[-3000:]
    two_nodes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert two_nodes == {**cpu, "tp": 2, "pp": 2, "backend": "ray"}, two_nodes
    # the parser can refuse: a flag vLLM 0.30.0 does not have
    proc = _parse_with_vllm(vllm_src, argv[2:] + ["--max-num-sequences", "16"])
    assert proc.returncode == 2 and "unrecognized arguments: --max-num-sequences" in proc.stderr, proc.stderr[-500:]


# --- the two-node variant (recipes.launch multi-node) -----------------------------------------------
MULTI = RECIPE["multi-node"]
PR_1634_COMMIT = "26a59cd6"   # vllm-gaudi PR #1634: pipeline parallel in the HPU runner
VLLM_GAUDI_MAIN = "091bbadd"  # the newest public vllm-gaudi, standing in for the page's releases/v0.30.0


def _multi_node_sections(block: str) -> list[tuple[str, list[str]]]:
    """(header, non-blank lines) in order: the preamble, node 0's setup, node 1's setup, node 0's server."""
    sections = [("preamble", [])]
    for line in block.splitlines():
        if line.startswith("# --- "):
            sections.append((line, []))
        elif line:
            sections[-1][1].append(line)
    return sections


def _single_node_setup() -> list[str]:
    """The single-node block up to its serve command: env exports, then the fix step and its comments."""
    lines = launch_block(RECIPE).splitlines()
    return lines[:next(i for i, line in enumerate(lines) if line.startswith("vllm serve"))]


def _ray_start_env(node_lines: list[str], tmp_path: Path, node_ifname: str | None, ray_importable: bool = True):
    """Run one node's setup in bash with `python3` and `ray` stubbed: (exit code, stderr, the env `ray`
    was started with or None, its arguments)."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    (stubs / "python3").write_text('#!/bin/sh\n[ "$1" = -c ] && exit %d\nexit 0\n' % (0 if ray_importable else 1))
    (stubs / "ray").write_text('#!/bin/sh\nenv -0 > "$RECORD.env"\nprintf "%s\\n" "$@" > "$RECORD.args"\n')
    for stub in ("python3", "ray"):
        (stubs / stub).chmod(0o755)
    record = tmp_path / "ray"
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "COOKBOOK": "/opt/gaudi-cookbook", "RECORD": str(record),
           "HEAD_NODE_IP": "10.0.0.1"}
    if node_ifname is not None:
        env["NODE_IFNAME"] = node_ifname
    proc = subprocess.run(["bash", "-c", "\n".join(node_lines)], env=env, capture_output=True, text=True, timeout=60)
    started = Path(f"{record}.env")
    seen = None
    if started.exists():
        seen = dict(item.split("=", 1) for item in started.read_text().split("\0") if "=" in item)
    args = Path(f"{record}.args").read_text().split() if started.exists() else None
    for leftover in (started, Path(f"{record}.args")):
        leftover.unlink(missing_ok=True)
    return proc.returncode, proc.stderr, seen, args


def test_multi_node_block_is_two_node_setups_then_the_server():
    block = multi_node_block(RECIPE)
    assert subprocess.run(["bash", "-n"], input=block, text=True, capture_output=True).returncode == 0
    headers = [header for header, _ in _multi_node_sections(block)]
    assert len(headers) == 4 and headers[1].startswith("# --- node 0") and headers[2].startswith("# --- node 1") \
        and headers[3].startswith("# --- node 0"), headers
    # the fix step, with the page's comment lines, once on each node and nowhere else
    assert block.count(RECIPE["fix-step"]) == 2
    setup = _single_node_setup()
    fix_lines = setup[len(RECIPE["env"]):]
    for header, lines in _multi_node_sections(block)[1:3]:
        assert lines[:len(RECIPE["env"])] == setup[:len(RECIPE["env"])], header   # the page's exports, first
        assert lines.count(RECIPE["fix-step"]) == 1, header
        start = lines.index(fix_lines[0])
        assert lines[start:start + len(fix_lines)] == fix_lines, header
    head, worker = (lines[-1] for _, lines in _multi_node_sections(block)[1:3])
    port = MULTI["ray"]["port"]
    assert head == f"ray start --head --port={port}"
    assert shlex.split(worker) == ["ray", "start", f"--address=${{{MULTI['head-ip-variable']}:?}}:{port}"]


@pytest.mark.parametrize("node", [1, 2], ids=["node-0-head", "node-1-worker"])
def test_each_node_starts_ray_with_the_single_node_env_and_its_socket_interface(node, tmp_path):
    lines = _multi_node_sections(multi_node_block(RECIPE))[node][1]
    code, stderr, seen, args = _ray_start_env(lines, tmp_path, node_ifname="ens7")
    assert code == 0, stderr
    assert {k: seen.get(k) for k in RECIPE["env"]} == RECIPE["env"]
    assert {name: seen.get(name) for name in ("GLOO_SOCKET_IFNAME", "HCCL_SOCKET_IFNAME")} == \
        {"GLOO_SOCKET_IFNAME": "ens7", "HCCL_SOCKET_IFNAME": "ens7"}
    assert args[0] == "start" and (args[1:] == ["--head", "--port=6379"] if node == 1 else
                                   args[1:] == ["--address=10.0.0.1:6379"]), args
    # an unset interface stops the node before Ray starts, as does an image without Ray
    code, stderr, seen, _ = _ray_start_env(lines, tmp_path, node_ifname=None)
    assert code != 0 and seen is None and "NODE_IFNAME" in stderr, stderr
    code, stderr, seen, _ = _ray_start_env(lines, tmp_path, node_ifname="ens7", ray_importable=False)
    assert code == 1 and seen is None and f"pip install {MULTI['ray']['package']}" in stderr, stderr


def test_multi_node_serve_is_the_single_node_serve_at_tp8_pp2_over_ray():
    block = multi_node_block(RECIPE)
    _, server = _multi_node_sections(block)[3]
    _, serve, _ = _page_launch(block)   # the page's own reading of a serve command, on the rendered block
    assert serve == multi_node_serve(RECIPE)
    parallel = ["--tensor-parallel-size=8", "--pipeline-parallel-size=2", "--distributed-executor-backend=ray"]
    assert [a for a in serve if a in parallel] == parallel
    single_node_rest = [a for a in RECIPE["serve"] if not a.startswith("--tensor-parallel-size=")]
    assert [a for a in serve if a not in parallel] == single_node_rest
    assert "--max-num-seqs=16" in serve and any("micro batch" in line for line in server if line.startswith("#"))
    assert not any(line.startswith(("ray ", "python3 ", "export ")) for line in server)


def test_rendering_multi_node_leaves_the_single_node_launch_as_it_was():
    recipe, before = copy.deepcopy(RECIPE), launch_block(RECIPE)
    multi_node_block(recipe)
    assert recipe == RECIPE and launch_block(recipe) == before
    assert "--tensor-parallel-size 8" in before and "--pipeline-parallel-size" not in before
    assert "--distributed-executor-backend" not in before


def test_multi_node_note_states_what_pipeline_parallel_needs():
    block = multi_node_block(RECIPE)
    for fact in ("PR #1634", PR_1634_COMMIT, VLLM_GAUDI_MAIN, "intermediate_tensors", "refuses",
                 "not been run on Gaudi"):
        assert fact in block, fact


@pytest.mark.slow
def test_the_multi_node_flags_pass_vllms_own_argument_parser(vllm_src):
    _, serve, _ = _page_launch(multi_node_block(RECIPE))
    argv = serve_command({"serve": serve})
    proc = _parse_with_vllm(vllm_src, argv[2:])
    assert proc.returncode == 0, f"vLLM 0.30.0's parser refused the multi-node flags:\n{proc.stderr[-3000:]}"
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert parsed == {**SINGLE_NODE_PARSED, "tp": 8, "pp": 2, "backend": "ray"}, parsed


def test_max_num_seqs_caps_every_running_request_in_vllm(vllm_src):
    """The serve comment's reason to keep --max-num-seqs: one v1 scheduler, one cap, PP batches in flight."""
    scheduler = (vllm_src / "vllm/v1/core/sched/scheduler.py").read_text()
    assert "self.max_num_running_reqs = self.scheduler_config.max_num_seqs" in scheduler
    assert "PP requires PP-size concurrent batches" in (vllm_src / "vllm/config/vllm.py").read_text()


def test_ray_is_optional_in_vllm_and_the_pin_is_its_tests(vllm_src):
    requirements = vllm_src / "requirements"
    if not requirements.is_dir():
        pytest.skip(f"{vllm_src} has no requirements/ (an installed vLLM, not the sdist)")
    pins = re.findall(r"^ray==(\S+)", (requirements / "test" / "cuda.txt").read_text(), re.M)
    assert [f"ray=={v}" for v in pins] == [MULTI["ray"]["package"]]
    for needed in ("common.txt", "cuda.txt"):
        assert not re.search(r"^ray\b", (requirements / needed).read_text(), re.M), needed


def test_multi_node_follows_vllm_gaudis_docs_and_runner(vllm_gaudi_src):
    docs = vllm_gaudi_src / "docs" / "configuration"
    multi_node = (docs / "multi_node.md").read_text()
    for name in MULTI["socket-env"]:
        assert f"export {name}=" in multi_node, name
    assert f"ray start --head --port={MULTI['ray']['port']}" in multi_node
    assert "micro batch for each virtual engine" in (docs / "pipeline_parallelism.md").read_text()
    # no pipeline-parallel hand-off in the HPU runner, and no Ray in vllm-gaudi's requirements
    assert "intermediate_tensors" not in (vllm_gaudi_src / "vllm_gaudi/v1/worker/hpu_model_runner.py").read_text()
    assert not re.search(r"^ray\b", (vllm_gaudi_src / "requirements.txt").read_text(), re.M | re.I)


def test_pipeline_parallel_commit_is_not_in_vllm_gaudi_main():
    mirror = os.environ.get("VLLM_GAUDI_MIRROR")
    if not mirror:
        pytest.skip("VLLM_GAUDI_MIRROR is not set: no vllm-gaudi clone to read the history from")
    gitdir = Path(mirror) / ".git" if (Path(mirror) / ".git").is_dir() else Path(mirror)

    def git(*args):
        return subprocess.run(["git", "--git-dir", str(gitdir), *args], capture_output=True, text=True, timeout=60)

    for commit in (PR_1634_COMMIT, VLLM_GAUDI_MAIN):
        if git("cat-file", "-e", f"{commit}^{{commit}}").returncode:
            pytest.skip(f"{mirror} has no commit {commit}")
    assert git("log", "-1", "--format=%s", PR_1634_COMMIT).stdout.strip() == "Enable Nemotron-H (TP8xPP2) on HPU"
    assert git("merge-base", "--is-ancestor", PR_1634_COMMIT, VLLM_GAUDI_MAIN).returncode == 1
    runner = "vllm_gaudi/v1/worker/hpu_model_runner.py"
    assert "intermediate_tensors" in git("show", f"{PR_1634_COMMIT}:{runner}").stdout
    assert "intermediate_tensors" not in git("show", f"{VLLM_GAUDI_MAIN}:{runner}").stdout


def _readers(root: Path, name: str, pattern: str = "*.py") -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(pattern)
                  if p.is_file() and name.encode() in p.read_bytes())


def _vllm_readers(vllm_src: Path, name: str) -> list[str]:
    """vLLM's code that reads the variable. vllm/envs.py declares every variable vLLM knows (its
    parser and defaults), whether any code reads it or not: a declaration is not a read."""
    return [path for path in _readers(vllm_src / "vllm", name) if path != "envs.py"]


def test_unread_env_is_read_by_no_vllm_code(vllm_src):
    assert set(RECIPE["unread-env"]) <= set(RECIPE["env"])
    for name in RECIPE["unread-env"]:
        assert _vllm_readers(vllm_src, name) == [], f"{name} is read in vLLM 0.30.0: update unread-env"


def test_a_declaration_in_envs_py_is_not_a_read(vllm_src):
    """VLLM_ENGINE_ITERATION_TIMEOUT_S: vllm/envs.py declares it; nothing reads envs.VLLM_ENGINE_ITERATION_TIMEOUT_S."""
    assert "envs.py" in _readers(vllm_src / "vllm", "VLLM_ENGINE_ITERATION_TIMEOUT_S")
    assert _vllm_readers(vllm_src, "VLLM_ENGINE_ITERATION_TIMEOUT_S") == []
    assert "VLLM_ENGINE_ITERATION_TIMEOUT_S" in RECIPE["unread-env"]


def test_unread_env_is_read_by_no_vllm_gaudi_code(vllm_gaudi_src):
    for name in RECIPE["unread-env"]:
        found = _readers(vllm_gaudi_src / "vllm_gaudi", name)
        assert found == [], f"{name} is read by vllm-gaudi code {found}: update unread-env"
    # only docs and example scripts mention them
    for name in RECIPE["unread-env"]:
        assert all(p.startswith(("docs/", "examples/")) for p in _readers(vllm_gaudi_src, name, "*"))


def test_every_other_env_variable_is_read_somewhere(vllm_src, vllm_gaudi_src):
    port = REPO / "ports" / "inkling-small"
    for name in set(RECIPE["env"]) - set(RECIPE["unread-env"]):
        readers = (_vllm_readers(vllm_src, name) + _readers(vllm_gaudi_src / "vllm_gaudi", name)
                   + _readers(port / "inkling_hpu", name) + _readers(REPO / "fixes", name, "*.patch"))
        assert readers, f"{name} is set by the recipe but read by nothing: add it to unread-env"


CPU_MULTI = RECIPE["cpu-variant"]["multi-node"]


def test_the_cpu_rehearsal_of_two_nodes_renders_what_tools_ray_nodes_runs(capsys):
    """`recipes.launch multi-node --cpu`: the CPU variant's env, the TEST-ONLY stand-in on PYTHONPATH before
    `ray start`, the two `ray start` lines tools/ray_nodes.py runs (head then second node, on their
    loopback addresses, two GPU slots each), then the server through Ray at TP 2 x PP 2."""
    from recipes.launch import main

    main(["multi-node", "--cpu"])
    block = capsys.readouterr().out
    lines = block.splitlines()
    head, second = (shlex.join(cpu_ray_start(RECIPE, node)) for node in (0, 1))
    stand_in = next(i for i, line in enumerate(lines) if "ray_standin" in line)
    assert lines.index(head) < lines.index(second) and stand_in < lines.index(head), block
    assert all(f"export {k}={v}" in lines for k, v in {**RECIPE["cpu-variant"]["env"], **CPU_MULTI["env"]}.items())
    assert "--head" in head and "--node-ip-address=127.0.0.2" in head and "--num-gpus=2" in head
    assert "--address=127.0.0.2:6379" in second and "--node-ip-address=127.0.0.3" in second
    assert f"export RAY_ADDRESS=127.0.0.2:{MULTI['ray']['port']}" in lines
    served = " ".join(line.rstrip(" \\") for line in lines[lines.index(f"export RAY_ADDRESS=127.0.0.2:6379") + 1:])
    assert served.endswith("--tensor-parallel-size 2 --pipeline-parallel-size 2 --distributed-executor-backend ray")


def test_the_ray_stand_in_stays_out_of_the_image_and_the_page_s_launch():
    assert "tools/ray_standin" in (REPO / ".dockerignore").read_text().splitlines()
    for block in (launch_block(RECIPE), multi_node_block(RECIPE), docker_run(RECIPE)):
        assert "ray_standin" not in block


def test_the_cpu_rehearsal_installs_the_ray_the_recipe_names():
    package = MULTI["ray"]["package"]
    assert package in (REPO / "tools" / "server_env.sh").read_text()
    assert package in (REPO / "requirements" / "test.txt").read_text().splitlines()


def test_the_ray_stand_in_gives_vllm_s_cpu_platform_a_ray_device(vllm_src):
    """vLLM 0.30.0's CPU platform has no Ray device; with tools/ray_standin on PYTHONPATH it has "GPU"."""
    script = "from vllm.platforms.cpu import CpuPlatform; print(repr(CpuPlatform.ray_device_key))"
    keys = []
    for path in ([str(vllm_src)], [str(REPO / CPU_MULTI["stand-in"]), str(vllm_src)]):
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(path), "VLLM_TARGET_DEVICE": "cpu"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        keys.append(proc.stdout.strip().splitlines()[-1])
    assert keys == ["''", "'GPU'"]
