"""The recipe's two-node variant rehearsed on one machine: two Ray nodes on loopback addresses (127.0.0.2
and 127.0.0.3, tools/ray_nodes.py, the `ray start` lines of `recipes.launch multi-node --cpu`), each with
the two worker slots of one pipeline stage's TP pair, and the real vLLM 0.30.0 CPU server at TP 2 x PP 2
through vLLM's Ray executor (RayExecutorV2), fix pack applied, the inkling_hpu plugin in every worker. vLLM's
CPU platform has no Ray device: a TEST-ONLY stand-in (tools/ray_standin) lets its workers take Ray GPU slots.

Greedy tokens equal transformers' Inkling (fp32) cold, on prefix hits, and with requests sharing prefixes in
flight at once; Ray's own view places one stage's TP pair on each node; each worker reads only its share.
A lost node (its raylet and workers killed) ends the API server with exit code 1 within 30 s, with a request
in flight (the client gets an error, not a hang) and idle (fixes rank-exception-fatal and
engine-death-exit-code). Not proven here: HCCL between Gaudi cards, the HPU device placement (vllm-gaudi's
platform declares its own Ray device), a network between real hosts.
"""
from __future__ import annotations

import json
import re
import threading
import time
import urllib.request

import pytest

from cpu_server_helpers import (assert_concurrent_shared_prefixes_equal_transformers,
                                assert_greedy_tokens_equal_transformers, assert_workers_read_their_share, prepared,
                                run_gates, table)

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(1200)]

# The page's bound: a lost node ends the server within this, not at VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS.
NODE_LOSS_SECONDS = 30
HEAD, SECOND = "127.0.0.2", "127.0.0.3"


def _stream(server, max_tokens: int, started: threading.Event, events: list) -> None:
    """A streamed completion whose events (decoded `data:` lines, or the exception that ended it) go to `events`;
    `started` is set at its first token."""
    body = json.dumps({"model": "tiny-inkling-stand-in", "prompt": [5, 6, 7, 8], "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    request = urllib.request.Request(server.base_url + "/v1/completions", body, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=NODE_LOSS_SECONDS + 30) as response:
            for line in response:
                if line.startswith(b"data: "):
                    events.append(line[6:].strip().decode())
                    started.set()
    except Exception as error:  # noqa: BLE001 - what ended the stream is the observation
        events.append(error)
    finally:
        started.set()


def _lose_the_second_node(server) -> tuple[int, float, str]:
    """Kill the second node's raylet and workers; (the server's exit code, seconds to it, its log)."""
    start = time.monotonic()
    server.ray_nodes.kill_node(1)
    code = server.proc.wait(NODE_LOSS_SECONDS)          # TimeoutExpired: the server outlived the bound
    return code, time.monotonic() - start, server.log.read_text(errors="replace")


def test_a_node_lost_with_a_request_in_flight_ends_the_server(tmp_path):
    """Its own server, first in this module (one pair of nodes at a time: the second node's agent ports are
    fixed): the reply rank (TP 0 of the last stage) is on the lost node, mid-step."""
    with prepared(tmp_path / "server.log", nodes=2) as server:
        started, events = threading.Event(), []
        client = threading.Thread(target=_stream, args=(server, 3000, started, events), daemon=True)
        client.start()
        assert started.wait(120) and events and not isinstance(events[0], Exception), events
        code, seconds, log = _lose_the_second_node(server)
        client.join(NODE_LOSS_SECONDS)
        assert not client.is_alive(), "the client still waits after the server exited"
    print(f"node lost in flight: server exit {code} after {seconds:.1f} s")
    assert code == 1 and seconds < NODE_LOSS_SECONDS, (code, seconds)
    assert re.search(r"RayWorkerProc rank=\[[23]\] died unexpectedly", log), log[-4000:]
    assert "Executor failed while waiting for rank 2's reply" in log, log[-4000:]
    assert "API server: exiting with code 1 because the engine died" in log, log[-4000:]
    assert any(isinstance(e, str) and '"error"' in e for e in events) or isinstance(events[-1], Exception), events[-3:]


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory):
    srv = prepared(tmp_path_factory.mktemp("cpu-server-ray") / "server.log", nodes=2)
    with srv:
        yield srv


def test_greedy_tokens_equal_transformers(ray_server):
    assert_greedy_tokens_equal_transformers(ray_server)


def test_requests_sharing_prefixes_in_flight_at_once(ray_server):
    assert_concurrent_shared_prefixes_equal_transformers(ray_server)


def test_each_node_holds_one_stage_s_tensor_parallel_pair(ray_server):
    """From Ray's actor table: vLLM's workers (vllm_Worker_<id>_TP<t>_PP<p>) by node."""
    workers = {tuple(int(x) for x in re.search(r"_TP(\d+)_PP(\d+)$", name).groups()): node
               for name, node in ray_server.ray_nodes.actors().items() if name.startswith("vllm_Worker_")}
    assert workers == {(0, 0): HEAD, (1, 0): HEAD, (0, 1): SECOND, (1, 1): SECOND}, workers


def test_each_worker_reads_only_its_share(ray_server):
    assert_workers_read_their_share(ray_server, 2, 2)
    # each worker's line reaches the server log once (a node's log monitor forwards its own session's logs)
    done = re.findall(r"Inkling loading, [^\n]*\(100%\)", ray_server.log.read_text())
    assert len(done) == 4, done


def test_quick_gates_that_need_no_trained_model_pass(ray_server):
    """What `make gates NODES=2 TP=2 PP=2` judges on the stand-in, but its long rows (the greedy repeats, the
    logprobs load, the over-long prompt and the server log's lines; the whole table passes there too)."""
    code, report, stderr = run_gates(ray_server, "quick", "--only", "greedy,overlong,server-log")
    assert code == 0 and report["summary"].startswith("3 judged, 3 passed"), f"exit {code}:\n{table(report)}\n{stderr[-2000:]}"


def test_a_node_lost_while_idle_ends_the_server(ray_server):
    """Last in this module: it ends the shared server."""
    code, seconds, log = _lose_the_second_node(ray_server)
    print(f"node lost while idle: server exit {code} after {seconds:.1f} s")
    assert code == 1 and seconds < NODE_LOSS_SECONDS, (code, seconds)
    assert re.search(r"RayWorkerProc rank=\[[23]\] died unexpectedly", log), log[-4000:]
    assert "API server: exiting with code 1 because the engine died" in log, log[-4000:]
