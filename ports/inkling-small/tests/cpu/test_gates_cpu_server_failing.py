"""Configurations that must fail, on a real vLLM 0.30.0 CPU server with the port: started with
--no-enable-prefix-caching, the prefix-cache gate fails (warm runs report cached_tokens 0: it reads
the counter, not just the output); started with a block size the port refuses, the server does not
start and says why. The stock scheduler failing the long-prompt gate: test_gates_cpu_server_long_prefill."""
from __future__ import annotations

import pytest

from cpu_server_helpers import prepared, rows, run_gates

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(2400)]


def test_prefix_cache_gate_fails_with_caching_off(tmp_path):
    with prepared(tmp_path / "server.log", ["--no-enable-prefix-caching"]) as server:
        code, report, _ = run_gates(server, "quick", "--only", "prefix-cache")
    row = rows(report)["prefix-cache"]
    assert code == 1 and row["passed"] is False, f"expected the gate to fail, found exit {code}: {row}"
    assert "warm run cached_tokens 0 of" in row["result"], row["result"]


def test_guard_breaking_setting_refuses_to_start(tmp_path):
    """--block-size 64 (the conv-state snapshots are taken at 128-token boundaries): the port's config
    guard stops the server before any weight is read, and the log names expected vs found."""
    server = prepared(tmp_path / "server.log", ["--block-size", "64"])
    with pytest.raises(RuntimeError, match="exited with") as refused:
        server.start()
    assert "Inkling-Small refuses to start" in str(refused.value) or "Inkling-Small refuses to start" in server.tail(400)
    assert "expected --block-size 128, found 64" in server.log.read_text(errors="replace")
    assert "text tensors from" not in server.log.read_text(errors="replace")      # refused before the weights
