"""The three-resident gate at the page's prompt/budget ratio, on the real CPU server: prompts about
47 times the batch budget (3,008 tokens at --max-num-batched-tokens 64; the page: 100K at 2048, 49x),
with the recipe's long-prefill share (its decode-only steps come between the chunks).
It passes on a healthy server, and fails when the third request queues for a seat
(--max-num-seqs 2) or when the pool cannot hold three (--num-gpu-blocks-override 64: 63 usable
blocks for three requests of at least 24 blocks each). One server per configuration."""
from __future__ import annotations

import pytest

from cpu_server_helpers import prepared, rows, run_gates

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(2400)]

PAGE_RATIO = ["--max-num-batched-tokens", "64"]


def three_resident(tmp_path, *flags: str) -> tuple[int, dict]:
    with prepared(tmp_path / "server.log", [*PAGE_RATIO, *flags]) as server:
        code, report, _ = run_gates(server, "long", "--only", "three-resident")
    return code, rows(report)["three-resident"]


def test_passes_on_a_healthy_server_at_the_page_s_ratio(tmp_path):
    code, row = three_resident(tmp_path)
    assert code == 0 and row["passed"] is True, row
    assert "all 3 running together for" in row["result"] and "0 preemptions" in row["result"], row
    assert ("prompts of 3,008 tokens, each decoding until all 3 started (at most 1,024 tokens, the most "
            "decoded ") in row["result"] and "; --max-num-batched-tokens 64)" in row["result"], row


def test_fails_when_a_request_queues_for_a_seat(tmp_path):
    code, row = three_resident(tmp_path, "--max-num-seqs", "2")
    assert code == 1 and row["passed"] is False, row
    assert "never all 3 running together" in row["result"], row


def test_fails_when_the_pool_cannot_hold_three(tmp_path):
    code, row = three_resident(tmp_path, "--num-gpu-blocks-override", "64")
    assert code == 1 and row["passed"] is False, row
    assert "never all 3 running together" in row["result"] or " 0 preemptions" not in row["result"], row
