"""Failure proofs of the semantic gates: on the trained tiny Inkling (test_gates_cpu_server.py, where every quick
gate passes), two real faults of the serving path each make a named gate row fail.
- A prefix-cache hit whose conv-state snapshot is not restored (the CPU glue's TEST-ONLY fault switch,
  INKLING_TEST_ONLY_FAULT=conv-snapshot-not-restored): the prefix-cache row fails. Its prompts whose code the
  hit cuts in two catch it: the code's first uncached tokens read the missing state, so the warm answer
  splits from the cold one (a trained model barely notices a few wrong filler tokens: a needle deep in the
  cached part does not catch it).
- A server started without the port's parsers (the recipe's line less --tool-call-parser, --reasoning-parser
  and --enable-auto-tool-choice): the smoke and reasoning rows fail.
One server at a time, each for its own test."""
from __future__ import annotations

import pytest

from cpu_server_helpers import prepared, rows, run_gates, table
from inkling_hpu.cpu_glue import CONV_SNAPSHOT_NOT_RESTORED, TEST_ONLY_FAULT
from tools import cpu_server

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(2400)]

PARSER_FLAGS = {"--tool-call-parser": 1, "--reasoning-parser": 1, "--enable-auto-tool-choice": 0}


def without_flags(cmd: list[str], flags: dict[str, int]) -> list[str]:
    """`cmd` less each flag of `flags` and the number of values it takes."""
    out, skip = [], 0
    for arg in cmd:
        if skip:
            skip -= 1
        elif arg.split("=", 1)[0] in flags:
            skip = 0 if "=" in arg else flags[arg]
        else:
            out.append(arg)
    return out


def trained_server(log, env=None):
    return prepared(log, trained=True, max_model_len=cpu_server.TRAINED_QUICK_GATES_CONTEXT, env=env)


def test_prefix_hit_without_its_conv_snapshot_fails_the_prefix_cache_gate(tmp_path):
    server = trained_server(tmp_path / "server.log", env={TEST_ONLY_FAULT: CONV_SNAPSHOT_NOT_RESTORED})
    with server:
        code, report, stderr = run_gates(server, "quick", "--only", "prefix-cache")
    assert "TEST-ONLY fault" in server.log.read_text(), server.tail()
    row = rows(report)["prefix-cache"]
    assert code == 1 and row["passed"] is False, f"expected the row to fail, found exit {code}:\n{table(report)}"
    # the cache itself still hits every block: what fails is the state after the hit
    assert "cached_tokens: cold 0-0" in row["result"] and "cache problem" not in row["result"], row


def test_server_without_the_ports_parsers_fails_smoke_and_reasoning(tmp_path):
    server = trained_server(tmp_path / "server.log")
    server.cmd = without_flags(server.cmd, PARSER_FLAGS)
    assert not set(PARSER_FLAGS) & set(server.cmd)
    with server:
        code, report, stderr = run_gates(server, "quick", "--only", "smoke,reasoning")
    got = rows(report)
    assert code == 1, f"expected exit 1, found {code}:\n{table(report)}\n{stderr[-2000:]}"
    # vLLM itself refuses the gates' tool requests without a tool parser (HTTP 400), and each row says so
    refused = "tool choice requires --enable-auto-tool-choice and --tool-call-parser"
    for name in ("smoke", "reasoning"):
        assert got[name]["passed"] is False and refused in got[name]["result"], table(report)
