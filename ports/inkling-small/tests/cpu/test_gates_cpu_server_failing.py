"""Configurations that must fail, on a real vLLM 0.30.0 CPU server with the port: started with
--no-enable-prefix-caching, the prefix-cache gate fails (warm runs report cached_tokens 0: it reads
the counter, not just the output); started with a block size the port refuses, the server does not
start and says why, and so does a checkpoint whose tokenizer admits an id without an embedding row, or no
tokenizer at all. The stock scheduler failing the long-prompt gate: test_gates_cpu_server_long_prefill."""
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
    log = _refused_at_start(prepared(tmp_path / "server.log", ["--block-size", "64"]))
    assert "Inkling-Small refuses to start" in log
    assert "expected --block-size 128, found 64" in log


def _refused_at_start(server) -> str:
    with pytest.raises(RuntimeError, match="exited with"):
        server.start()
    log = server.log.read_text(errors="replace")
    assert "text tensors from" not in log          # refused when the model is built, before the weights
    return log


def test_a_tokenizer_id_without_an_embedding_row_refuses_to_start(tmp_path):
    """The tiny checkpoint with two tokens added to its tokenizer (ids 1023 and 1024 beside 1,024 embedding
    rows): vLLM would admit id 1024, whose lookup ends the engine, so the CPU glue refuses to start, naming
    both numbers and the token."""
    from transformers import AutoTokenizer

    server = prepared(tmp_path / "server.log")
    model = tmp_path / "tokenizer-past-the-rows"
    tokenizer = AutoTokenizer.from_pretrained(str(server.model))
    tokenizer.add_tokens(["<|extra_a|>", "<|extra_b|>"])
    tokenizer.save_pretrained(str(model))          # first: nothing is written through a link into the cache
    for file in server.model.iterdir():
        if file.is_file() and not file.name.startswith(".") and not (model / file.name).exists():
            (model / file.name).symlink_to(file)
    server.cmd[server.cmd.index("--model") + 1] = str(model)
    log = _refused_at_start(server)
    assert ("Inkling-Small refuses to start: token ids: expected every prompt token id vLLM admits to have an "
            "embedding row, found ids up to 1024 admitted (the larger of the tokenizer's max_token_id 1024 and the "
            "config's vocab_size 1023 - 1;") in log, server.tail(60)
    assert "1024 embedding rows (ids 0..1023). Admitted ids without a row: '<|extra_b|>' = 1024." in log


def test_no_tokenizer_refuses_to_start(tmp_path):
    """--skip-tokenizer-init: vLLM then checks no prompt id against the vocabulary; the port refuses while the
    config is built (vLLM's reasoning config would otherwise fail first, on the missing tokenizer)."""
    log = _refused_at_start(prepared(tmp_path / "server.log", ["--skip-tokenizer-init"]))
    assert "Inkling-Small refuses to start: tokenizer: expected the checkpoint's tokenizer, found none" in log
