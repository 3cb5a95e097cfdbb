"""The port at pipeline-parallel size 2 through vLLM's own executor:
the real vLLM 0.30.0 CPU server (`mp` executor, one worker process per stage and rank, gloo), fix pack
applied, the inkling_hpu plugin in every worker. Each stage holds the layers vLLM's get_pp_indices gives
it (the first the embedding, the last the final norm and the head), reads only their tensors, keeps K/V
and conv snapshots for them, and hands its hidden states to the next stage as IntermediateTensors.
Greedy tokens equal transformers' Inkling (fp32): prompts of 1 to 6 blocks cold and on prefix-cache
hits, and requests sharing prefixes in flight at once. One server, shared by its tests. TP 2 x PP 2 is served
through vLLM's Ray executor, as the page's two-node variant runs it (test_cpu_server_ray.py, the same checks).
(In-process proofs that a broken hand-off or collective fails the same comparison: test_pipeline_stages.py,
test_model_weights.py.)"""
from __future__ import annotations

import re

import pytest

from cpu_server_helpers import (assert_concurrent_shared_prefixes_equal_transformers,
                                assert_greedy_tokens_equal_transformers, assert_workers_read_their_share, prepared,
                                JUDGED_ON_THE_STAND_IN, run_gates, table)
from tools.cpu_server import parallel_args

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(2400)]


def _server(tmp_path_factory, tp: int, pp: int):
    srv = prepared(tmp_path_factory.mktemp(f"cpu-server-tp{tp}-pp{pp}") / "server.log", parallel_args(tp, pp))
    srv.sizes = (tp, pp)
    with srv:
        yield srv


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    yield from _server(tmp_path_factory, 1, 2)


@pytest.fixture
def server(pp2):
    return pp2


def test_greedy_tokens_equal_transformers(server):
    assert_greedy_tokens_equal_transformers(server)


def test_requests_sharing_prefixes_in_flight_at_once(server):
    assert_concurrent_shared_prefixes_equal_transformers(server)


def test_each_stage_reads_only_its_layers(server):
    assert_workers_read_their_share(server, *server.sizes)


def test_each_worker_says_which_layers_it_holds(server):
    """The tiny Inkling's 4 layers: 0..1 with the embedding, 2..3 with the final norm and the head, on
    every tensor-parallel rank of each stage. The lines are read by what they say, not by vLLM's
    "(Worker_PP0 pid=…)" prefix: a worker writes that prefix apart from its line, so with unbuffered
    output another worker's prefix can stand before it."""
    tp, _ = server.sizes
    lines = re.findall(r"Inkling pipeline stage (\d) of 2: (layers [^\n]*?\(TP rank \d+ of \d+\))", server.log.read_text())
    assert len(lines) == 2 * tp and set(lines) == {
        ("0", f"layers 0..1 of 4, the embedding (TP rank {r} of {tp})") for r in range(tp)} | {
        ("1", f"layers 2..3 of 4, the final norm and the head (TP rank {r} of {tp})") for r in range(tp)}, lines


def test_quick_gates_pass_at_pipeline_parallel_two(pp2):
    """The rows `make gates PP=2` judges on the stand-in. Its semantic rows only run their requests there
    ('needs a trained model'); they do so at TP 1 inside the port container (tests/builder/test_cpu_image.py)."""
    code, report, stderr = run_gates(pp2, "quick", "--only", JUDGED_ON_THE_STAND_IN)
    assert code == 0 and report["summary"].startswith("5 judged, 5 passed"), f"exit {code}:\n{table(report)}\n{stderr[-2000:]}"
