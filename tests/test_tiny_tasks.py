"""The trained tiny Inkling's data (tools/tiny_tasks.py, tools/train_tiny_inkling.py): no gate prompt in it,
the training text is what the served chat template renders, and the assistant targets are what the
`inkling_py` parsers read as answers, tool calls and reasoning."""
from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "ports" / "inkling-small"))

from tools import tiny_tasks  # noqa: E402

SAMPLE = 4000


def sample(seed: int = 0, count: int = SAMPLE):
    rng = random.Random(seed)
    for i in range(count):
        yield tiny_tasks.needles(rng, 20) if i % 4 == 0 else tiny_tasks.short_example(rng)[1]


def test_gate_prompts_are_the_gates_own():
    """The list the data is screened against is the gates' own: a gate prompt changed there and not here would
    slip through the screen."""
    gates_py = REPO / "ports" / "inkling-small" / "tests" / "hpu" / "gates.py"
    spec = importlib.util.spec_from_file_location("gates_for_the_screen", gates_py)
    gates = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gates)
    source = gates_py.read_text()
    assert gates.FILLER == tiny_tasks.GATE_FILLER
    for prompt in tiny_tasks.gate_prompts():
        for name in tiny_tasks.GATE_NEEDLE_NAMES:
            prompt = prompt.replace(name, "{name}")     # the needle question, as gates.py writes it
        assert prompt == gates.FILLER or prompt in source, f"{prompt!r} is not in gates.py"
    for name in tiny_tasks.GATE_NEEDLE_NAMES:
        assert f'"{name}"' in source


def test_no_gate_prompt_in_the_training_data():
    """The screen the trainer applies (free_of_gate_prompts) rejects every drawn example that holds a gate's
    prompt; what passes it has none, no gate needle name, and the tokenizer's corpus has neither."""
    kept = rejected = 0
    for messages, tools, targets in sample():
        text = "\n".join([m["content"] or "" for m in messages] + targets + [json.dumps(tools)])
        if not tiny_tasks.free_of_gate_prompts(messages):
            rejected += 1
            continue
        kept += 1
        assert not any(p in text for p in tiny_tasks.gate_prompts())
        assert not any(name in text for name in tiny_tasks.GATE_NEEDLE_NAMES)
    assert kept > SAMPLE * 0.99
    corpus = "\n".join(tiny_tasks.tokenizer_corpus(0))
    assert not any(name in corpus for name in tiny_tasks.GATE_NEEDLE_NAMES)
    assert tiny_tasks.GATE_FILLER not in corpus


def test_the_screen_catches_a_gate_prompt():
    """The screen is not vacuous: an example carrying a gate's prompt is rejected."""
    for prompt in tiny_tasks.gate_prompts():
        assert not tiny_tasks.free_of_gate_prompts([{"role": "user", "content": "Before. " + prompt}])


def test_needle_answers_are_in_their_document():
    rng = random.Random(1)
    for _ in range(200):
        messages, _, targets = tiny_tasks.needles(rng, 10)
        questions = [m["content"] for m in messages if m["role"] == "user"]
        assert len(questions) == len(targets)
        for question, target in zip(questions, targets):
            name = question.rsplit("secret code of ", 1)[1].split("?")[0].split(".")[0]
            secret = target.removeprefix(tiny_tasks.TEXT).removesuffix(tiny_tasks.END)
            assert f"The secret code of {name} is {secret}. " in messages[0]["content"]


def expected_parse(name: str, targets: list[str], tools: list):
    """What the served parsers must make of a task's target: (reasoning, content, tool calls)."""
    target = targets[0]
    if name == "tool call":
        call = json.loads(target.removeprefix(tiny_tasks.TOOL_CALL).removesuffix(tiny_tasks.END))
        return None, None, [(call["name"], json.dumps(call["args"]))]
    if name in ("thinking", "addition"):      # additions reason column by column first
        reasoning, answer = target.removeprefix(tiny_tasks.THINK).split(tiny_tasks.END, 1)
        return reasoning, answer.removeprefix(tiny_tasks.TEXT).removesuffix(tiny_tasks.END), []
    if name == "JSON":
        return None, target, []
    return None, target.removeprefix(tiny_tasks.TEXT).removesuffix(tiny_tasks.END), []


def test_targets_parse_as_answers_calls_and_reasoning():
    """Each task's target, through vLLM's served parser composition with `inkling_py` (whole, and streamed in
    deltas cut anywhere), gives the answer as content, the call as a tool call, the thinking as reasoning:
    the model learns the markup the server's parsers read, and none of it is left in the content."""
    from tools import parser_cases as pc

    rng = random.Random(2)
    tokenizer = pc.MarkerTokenizer()
    for _ in range(60):
        name, (messages, tools, targets) = tiny_tasks.short_example(rng)
        request = pc.make_request(tools=tools or None)
        want = expected_parse(name, targets, tools)
        whole = pc.parse_whole("inkling_py", targets[0], request, tokenizer)
        streamed = pc.parse_stream("inkling_py", pc.char_deltas(targets[0], rng, 5), request, tokenizer)
        for got in (whole, streamed):
            calls = [(n, json.dumps(json.loads(a))) for n, a in got.calls]
            assert (got.reasoning, got.content, calls) == want, (name, targets[0])


def test_needle_documents_hold_numbers_that_are_not_codes():
    """Codes are found by their name, not as the only digits around: most documents carry an id, a date, a
    year or an order number besides them (the gates' prompts start with a hex id)."""
    import re

    rng, with_numbers = random.Random(2), 0
    for _ in range(200):
        messages, _, _ = tiny_tasks.needles(rng, 20)
        others = re.sub(r"The secret code of \w+ is \d{6}\. ", "", messages[0]["content"])
        with_numbers += bool(re.search(r"\d", others))
    assert with_numbers > 200 * tiny_tasks.HEAD_SHARE
