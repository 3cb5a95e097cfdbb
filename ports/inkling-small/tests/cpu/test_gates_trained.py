"""The trained tiny Inkling (checkpoints/trained-tiny-inkling, made by tools/train_tiny_inkling.py) served end to
end: a real vLLM 0.30.0 CPU server with the recipe's CPU variant at the context the quick gates need
(cpu_server.TRAINED_QUICK_GATES_CONTEXT), the port's model code and the page's `inkling_py` parsers. Every
quick gate judges its answers and passes (none "needs a trained model"), and the server's responses carry
tool calls and reasoning parsed by `inkling_py`, whole and streamed, with no Inkling markup in the content.
The failure proofs (faults of the serving path that these gates catch) are in test_gates_trained_faults.py:
one server at a time."""
from __future__ import annotations

import json

import pytest

from cpu_server_helpers import GATES_NOT_ON_THIS_SERVER, load_gates, prepared, rows, run_gates, table
from tools import cpu_server

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(2400),
              pytest.mark.skipif(not (cpu_server.TRAINED_MODEL / "training.json").is_file(),
                                 reason=f"no trained checkpoint at {cpu_server.TRAINED_MODEL}: write it with "
                                        "tools/train_tiny_inkling.py (not committed yet)")]

MARKUP = ("<|message_", "<|content_", "<|end_message|>")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    srv = prepared(tmp_path_factory.mktemp("trained") / "server.log", trained=True,
                   max_model_len=cpu_server.TRAINED_QUICK_GATES_CONTEXT)
    with srv:
        yield srv


@pytest.fixture(scope="module")
def gates(trained):
    """The gates' own client (tests/hpu/gates.py) pointed at the server."""
    return load_gates(trained)


def test_every_quick_gate_judges_and_passes(trained):
    code, report, stderr = run_gates(trained, "quick", "--allow-skip", GATES_NOT_ON_THIS_SERVER)
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
