"""Property tests (hypothesis) of `inkling_py` through vLLM's served DelegatingParser:
random and mutated block sequences never raise; streamed == whole for any split; every
non-whitespace character of the model's text ends up in exactly one of reasoning, content or
a tool call; streaming work is linear in the output length."""

from __future__ import annotations

import collections
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tools import parser_cases as pc
from inkling_hpu.parsers import inkling_py
from inkling_hpu.parsers.inkling_py import MarkerLexer, ToolCallScanner

pytestmark = pytest.mark.timeout(900)

TOK = pc.MarkerTokenizer()
MARKERS = list(pc.MARKER_IDS)
FRAGMENTS = ["hello", " ", "\n", "{", "}", "[", "]", '"', ":", ",", "\\", "<", "<|", "|>",
             "<|content", "_text|>", '"name"', '"args"', '"arguments"', "f", "42", "é", "日本",
             '{"name":"f","args":{', '{"name":"get_weather","args":{"city":"Oslo"}}',
             '{"name":"', '"args":[1]', "null", "true"]

SETTINGS = settings(max_examples=120, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def block_sequences(draw):
    """Arbitrary sequences of markers and text fragments (well-formed or not)."""
    pieces = draw(st.lists(st.one_of(st.sampled_from(MARKERS), st.sampled_from(FRAGMENTS),
                                     st.text(max_size=6)), max_size=40))
    return "".join(pieces)


@st.composite
def mutated_outputs(draw):
    """Generated well-formed outputs, then cut, spliced, duplicated or marker-injected."""
    text = pc.generate_output(random.Random(draw(st.integers(0, 10**6))), truncate=False)
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(text)))
        j = draw(st.integers(i, min(len(text), i + 40)))
        op = draw(st.sampled_from(["cut", "delete", "duplicate", "inject"]))
        if op == "cut":
            text = text[:i]
        elif op == "delete":
            text = text[:i] + text[j:]
        elif op == "duplicate":
            text = text[:j] + text[i:j] + text[j:]
        else:
            text = text[:i] + draw(st.sampled_from(MARKERS + FRAGMENTS)) + text[i:]
    return text


def split(text: str, seed: int, by_tokens: bool):
    rng = random.Random(seed)
    if by_tokens:
        return pc.token_deltas(TOK.tokenize(text), rng, rng.choice([1, 2, 5, 17]))
    return pc.char_deltas(text, rng, rng.choice([1, 3, 11]))


def request():
    return pc.make_request(tools=[pc.function_tool()])


# ---- an independent whole-text segmentation of the block grammar -----------------------

def segment(text: str):
    """Split text into (kind, text) segments: reasoning, content, header (metadata), tool
    payload. Marker strings are structure; inside a tool payload, and inside a thinking
    block for the non-closing kinds, they are literal text."""
    pos, state, out, current = 0, "header", [], []
    kinds = {m: k for m, k in inkling_py.MARKERS.items()}

    def emit(kind):
        out.append((kind, "".join(current)))
        current.clear()

    while pos < len(text):
        marker = next((m for m in MARKERS if text.startswith(m, pos)), None)
        if marker is None:
            current.append(text[pos])
            pos += 1
            continue
        pos += len(marker)
        kind = kinds[marker]
        if state == "tool":
            if kind == inkling_py.CLOSE:
                emit("tool")
                state = "content"
            else:
                current.append(marker)
        elif state == "reasoning":
            if kind in (inkling_py.CLOSE, inkling_py.OPEN_TOOL):
                emit("reasoning")
                state = "tool" if kind == inkling_py.OPEN_TOOL else "content"
            elif kind != inkling_py.OPEN_THINKING:
                current.append(marker)
        else:
            header_closed_by_end = state == "header" and kind == inkling_py.CLOSE
            emit("content" if state == "content" or header_closed_by_end else "header")
            state = {inkling_py.OPEN_HEADER: "header", inkling_py.OPEN_THINKING: "reasoning",
                     inkling_py.OPEN_TOOL: "tool"}.get(kind, "content")
    emit({"header": "content"}.get(state, state))
    return out


def nonblank(text: str | None) -> collections.Counter:
    return collections.Counter(ch for ch in (text or "") if not ch.isspace())


def assert_every_character_once(text: str, result: pc.Result) -> None:
    segments = segment(text)
    payloads = [body for kind, body in segments if kind == "tool"]
    calls_made = [p for p in payloads if _scan(p).is_call]
    assert len(calls_made) == len(result.calls)
    expected = collections.Counter()
    for kind, body in segments:
        if kind != "header":
            expected += nonblank(body)
    got = nonblank(result.reasoning) + nonblank(result.content)
    for payload, (name, arguments) in zip(calls_made, result.calls):
        assert name in payload and arguments in payload + "{}"
        got += nonblank(payload)
    assert got == expected, f"{text!r}: missing {expected - got}, extra {got - expected}"


def _scan(payload: str) -> ToolCallScanner:
    scanner = ToolCallScanner()
    scanner.feed(payload)
    return scanner


def check(text: str, seed: int, by_tokens: bool) -> None:
    whole = pc.parse_whole("inkling_py", text, request(), TOK)
    streamed = pc.parse_stream("inkling_py", split(text, seed, by_tokens), request(), TOK)
    assert streamed.key() == whole.key(), (text, streamed.key(), whole.key())
    assert streamed.ids_ok and whole.ids_ok
    assert_every_character_once(text, whole)


@SETTINGS
@given(text=block_sequences(), seed=st.integers(0, 2**16), by_tokens=st.booleans())
def test_random_block_sequences(text, seed, by_tokens):
    check(text, seed, by_tokens)


@SETTINGS
@given(text=mutated_outputs(), seed=st.integers(0, 2**16), by_tokens=st.booleans())
def test_mutated_outputs(text, seed, by_tokens):
    check(text, seed, by_tokens)


@SETTINGS
@given(text=block_sequences(), prompt_tail=st.sampled_from(MARKERS), seed=st.integers(0, 99))
def test_any_prompt_tail_never_raises(text, prompt_tail, seed):
    pc.parse_stream("inkling_py", split(text, seed, True), request(), TOK,
                    prompt_token_ids=[pc.MARKER_IDS[prompt_tail]])


def test_segmentation_oracle_on_a_known_output():
    text = (f"{pc.THINK}r{pc.END}{pc.MSG}fn{pc.TOOL}{{\"name\":\"fn\"}}{pc.END}"
            f"{pc.MSG}{pc.TEXT}c{pc.END_SAMPLING}")
    assert [s for s in segment(text) if s[1]] == [
        ("reasoning", "r"), ("header", "fn"), ("tool", '{"name":"fn"}'), ("content", "c")]


# ---- linear streaming: each character is examined a bounded number of times -------------

def test_streaming_work_is_linear(monkeypatch):
    lexed = [0]
    scanned = [0]
    lexer_feed, scanner_feed = MarkerLexer.feed, ToolCallScanner.feed

    def counting_lexer_feed(self, text, out):
        lexed[0] += len(self.held) + len(text)
        return lexer_feed(self, text, out)

    def counting_scanner_feed(self, text):
        scanned[0] += len(text)
        return scanner_feed(self, text)

    monkeypatch.setattr(MarkerLexer, "feed", counting_lexer_feed)
    monkeypatch.setattr(ToolCallScanner, "feed", counting_scanner_feed)
    big_args = '{"code":"' + "x = 1\\n" * 4000 + '"}'
    text = (f"{pc.THINK}" + "think " * 2000 + f"{pc.END}{pc.MSG}{pc.TEXT}" + "text " * 2000
            + f"{pc.END}{pc.MSG}" + f'{pc.TOOL}{{"name":"run","args":{big_args}}}{pc.END}') * 3
    deltas = [(t, [tid]) for tid, t in TOK.tokenize(text)]
    result = pc.parse_stream("inkling_py", deltas, request(), TOK)
    assert [name for name, _ in result.calls] == ["run"] * 3
    longest_marker = max(len(m) for m in MARKERS)
    # The reasoning pass lexes until reasoning ends; the tool pass lexes the rest once.
    assert lexed[0] <= len(text) + longest_marker * len(deltas)
    payload_chars = 3 * len(f'{{"name":"run","args":{big_args}}}')
    assert scanned[0] == payload_chars
