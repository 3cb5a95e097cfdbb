"""The long-prompt gate judges the long-prefill share, on the real CPU server: 15 streams decode while
a 16,296-token prompt prefills in 17 chunks (the long gates' 16K context, cpu_server.LONG_GATES_CONTEXT;
the recipe's budget of 1024). With the recipe's share (0.5) the streams keep about half their rate
and the gate passes; with the stock scheduler every step carries a chunk, the streams fall to about
0.02 of their rate, and the gate, told the page's share, fails. The shared 2-core machine's noise is
allowed for (cpu_server.CPU_SERVER_SHARE_TOLERANCE). One server per configuration."""
from __future__ import annotations

import pytest

from cpu_server_helpers import prepared, rows, run_gates
from tools import cpu_server

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(2400)]

# what the gate is told: the page's share at the CPU variant's threshold
CLAIM = {"VLLM_LONG_PREFILL_SHARE": "0.5", "VLLM_LONG_PREFILL_MIN_TOKENS": "2048", "STREAM_WARMUP_S": "5",
         "STREAM_WINDOW_S": "10"}
FLOOR = "expected >= 0.33 (VLLM_LONG_PREFILL_SHARE 0.5, 17 chunks at --max-num-batched-tokens 1,024)"


def long_prompt_row(tmp_path, env: dict) -> tuple[int, dict]:
    with prepared(tmp_path / "server.log", max_model_len=cpu_server.LONG_GATES_CONTEXT, env=env) as server:
        code, report, _ = run_gates(server, "long", "--only", "prefill-with-decodes", env=CLAIM)
    return code, rows(report)["prefill-with-decodes"]


def test_the_streams_keep_their_share_while_a_long_prompt_prefills(tmp_path):
    code, row = long_prompt_row(tmp_path, {})                        # the recipe's CPU variant: share 0.5
    assert code == 0 and row["passed"] is True, f"expected a pass, found exit {code}: {row}"
    assert "16,296-token prompt beside 15 streams" in row["result"] and FLOOR in row["result"], row["result"]
    assert "with 16 running" in row["result"] and "15/15 streams alive" in row["result"], row["result"]


def test_the_stock_scheduler_fails_the_share_s_floor(tmp_path):
    code, row = long_prompt_row(tmp_path, cpu_server.STOCK_SCHEDULER_ENV)
    assert code == 1 and row["passed"] is False, f"expected a failure, found exit {code}: {row}"
    assert FLOOR in row["result"] and "15/15 streams alive" in row["result"], row["result"]
