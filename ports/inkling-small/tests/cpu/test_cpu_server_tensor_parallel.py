"""The port at tensor-parallel size 2 through vLLM's own executor: the real vLLM 0.30.0 CPU server
(`mp` executor, two worker processes, gloo), fix pack applied, the inkling_hpu plugin in both workers.
Each rank holds its slab of every split tensor, its KV heads and its channels of the hidden streams'
conv snapshots (reduce-scatter after o_proj and the MLP, conv and residual on its channels, then an
all-gather); greedy tokens equal transformers' Inkling (fp32) cold and on prefix-cache hits. The checkpoint
carries its pre-sharded layout for two ranks (`python -m inkling_hpu.loader presplit --tp 2`): each rank
reads its own file. (In-place reads at TP 2: test_cpu_server_pipeline_parallel.py's TP 2 x PP 2 server.)"""
from __future__ import annotations

import re

import pytest

from cpu_server_helpers import (assert_concurrent_shared_prefixes_equal_transformers,
                                assert_greedy_tokens_equal_transformers, assert_workers_read_their_share, prepared,
                                JUDGED_ON_THE_STAND_IN, run_gates, table)

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(2400)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = prepared(tmp_path_factory.mktemp("cpu-server-tp2") / "server.log", ["--tensor-parallel-size", "2"],
                   presharded_tp=2)
    with srv:
        yield srv


def test_greedy_tokens_equal_transformers_at_tensor_parallel_two(server):
    assert_greedy_tokens_equal_transformers(server)


def test_requests_sharing_prefixes_in_flight_at_once(server):
    assert_concurrent_shared_prefixes_equal_transformers(server)


def test_each_rank_reads_its_slabs_from_the_pre_sharded_layout(server):
    log = server.log.read_text()
    for rank in (0, 1):
        assert f"Inkling: rank {rank} of 2 reads its own file of the pre-sharded layout {server.model}/presharded-tp2" in log
    assert_workers_read_their_share(server, 2, 1)


def test_each_rank_keeps_half_the_hidden_streams_conv_state(server):
    """Tiny Inkling, fp32, 4 layers: 3 taps x (K, V: 1 kv head x 64 each; attention and MLP outputs:
    64 of the 128 hidden channels each) x 4 bytes = 3,072 bytes per layer and block on each rank,
    half the 6,144 of one rank holding everything."""
    lines = re.findall(r"Inkling conv-state snapshots: [^\n]*", server.log.read_text())
    # one line per worker (read by what it says: vLLM's worker prefix is written apart from the line)
    assert len(lines) == 2 and all("snapshots: 12288 bytes per block per rank" in line for line in lines), lines


def test_each_rank_reports_its_own_load(server):
    """Each worker reads its slabs and says so, and the load time is the port's own."""
    log = server.log.read_text()
    for rank in (0, 1):
        assert re.search(rf"Inkling loading, rank {rank} of 2: [0-9.]+ [MG]B of [0-9.]+ [MG]B \(100%\)", log), log[-3000:]
    assert re.search(r"Loading weights took [0-9.]+ seconds \(the port's text-only load\)", log), log[-3000:]


def test_quick_gates_pass_at_tensor_parallel_two(server):
    """The rows `make gates TP=2` judges on the stand-in. Its semantic rows only run their requests there
    ('needs a trained model'); they do so at TP 1 inside the port container (tests/builder/test_cpu_image.py)."""
    code, report, stderr = run_gates(server, "quick", "--only", JUDGED_ON_THE_STAND_IN)
    assert code == 0 and report["summary"].startswith("5 judged, 5 passed"), f"exit {code}:\n{table(report)}\n{stderr[-2000:]}"


def test_routed_experts_run_on_vllm_s_cpu_experts(server):
    """The routed experts are vLLM's MoE layer with vLLM's unquantized method, on its CPU kernel, in each rank."""
    log = server.log.read_text()
    assert len(re.findall(r"Inkling MoE: routed experts on vLLM's MoE layer, method UnquantizedFusedMoEMethod\n",
                          log)) == 2, log[-3000:]
    assert "Using CPUUnquantizedExperts MoE backend" in log, log[-3000:]
