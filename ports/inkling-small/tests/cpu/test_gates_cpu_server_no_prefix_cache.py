"""The prefix-cache gate fails on a real vLLM 0.30.0 CPU server started with
--no-enable-prefix-caching: warm runs report cached_tokens 0 (it read the counter, not just the
output)."""
from __future__ import annotations

import pytest

from cpu_server_helpers import prepared, rows, run_gates

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


def test_prefix_cache_gate_fails_with_caching_off(tmp_path):
    with prepared(tmp_path / "server.log", ["--no-enable-prefix-caching"]) as server:
        code, report, _ = run_gates(server, "quick", "--only", "prefix-cache")
    row = rows(report)["prefix-cache"]
    assert code == 1 and row["passed"] is False, f"expected the gate to fail, found exit {code}: {row}"
    assert "warm run cached_tokens 0 of" in row["result"], row["result"]
