"""Where `inkling_py` differs from vLLM 0.30.0's `inkling` parser, and why.

Each test runs the pristine vLLM parser and ours on the same model output, asserts vLLM's
behaviour (a lost, misplaced or crashing piece of model output, or a streamed result that
disagrees with the whole one) and asserts ours. docs/parsers.md lists the same cases.
"""

from __future__ import annotations

import json

import pytest

from tools import parser_cases as pc
from tools.parser_cases import END, MSG, TEXT, THINK, TOOL

pytestmark = pytest.mark.timeout(300)

TOK = pc.MarkerTokenizer()


def ids(text: str) -> list[int]:
    return [tid for tid, _ in TOK.tokenize(text)]


def per_token(text: str):
    return [(t, [tid]) for tid, t in TOK.tokenize(text)]


def deltas_of(*pieces: str):
    return [(piece, ids(piece)) for piece in pieces]


def results(name: str, text: str, deltas=None, request=None, **kw):
    make = request or (lambda: pc.make_request(tools=[pc.function_tool("lookup")]))
    whole = pc.parse_whole(name, text, make(), TOK, **kw)
    streamed = pc.parse_stream(name, deltas or per_token(text), make(), TOK, **kw)
    return whole.key(), streamed.key()


# ---- streaming: vLLM's result depends on how the output was cut into deltas --------------

def test_reasoning_whitespace_before_a_held_marker_prefix():
    """vLLM holds a reasoning delta's trailing whitespace, then forgets it when the next delta
    yields no reasoning (here the '<' the lexer holds as a possible marker start)."""
    text = f"{THINK}a{END}{MSG}{TEXT}t{END}{MSG}{THINK}b <c{END}"
    whole, streamed = results("inkling", text)
    assert whole[0] == "ab <c" and streamed[0] == "ab<c"
    assert results("inkling_py", text) == (whole, whole)


def test_function_name_header_in_the_reasoning_end_delta():
    """A delta that ends reasoning and carries the next block's header: vLLM's reasoning pass
    flushes the header (the function name) as content before handing over."""
    tail = f'{TOOL}{{"name":"lookup","args":{{"q":1}}}}{END}'
    text = f"{THINK}plan{END}{MSG}lookup{tail}"
    deltas = deltas_of(THINK, "plan", f"{END}{MSG}lookup", tail)
    whole, streamed = results("inkling", text, deltas)
    assert whole[1] is None and streamed[1] == "lookup"
    assert results("inkling_py", text, deltas) == (whole, whole)


def test_thinking_block_opened_in_the_reasoning_end_delta():
    """vLLM hands the tool pass only the reasoning pass's content: a thinking block opened in
    the same delta continues, in the tool pass, as visible content."""
    text = f"{THINK}a{END}{MSG}{THINK}b c{END}{MSG}{TEXT}d{END}"
    deltas = deltas_of(THINK + "a", f"{END}{MSG}{THINK}b", f" c{END}{MSG}{TEXT}d{END}")
    whole, streamed = results("inkling", text, deltas)
    assert whole == ("ab c", "d", []) and streamed == ("ab", " cd", [])
    assert results("inkling_py", text, deltas) == (whole, whole)


# ---- tool blocks vLLM drops or crashes on -------------------------------------------------

@pytest.mark.parametrize("payload", [
    '{"name":"sea',                 # generation cut before the name completed
    '{"tool":"x","args":{}}' + END,  # no name key
    "call lookup now" + END,        # not JSON at all
])
def test_tool_block_without_a_name_stays_visible(payload):
    text = f"{TEXT}hi{END}{MSG}{TOOL}{payload}"
    vllm = results("inkling", text)
    assert vllm == ((None, "hi", []), (None, "hi", []))  # the payload is silently dropped
    visible = "hi" + payload.removesuffix(END)
    assert results("inkling_py", text) == ((None, visible, []), (None, visible, []))


def test_non_string_name_crashes_vllm_whole_response():
    text = f'{TOOL}{{"name":5,"args":{{}}}}{END}'
    with pytest.raises(Exception, match="valid string"):
        pc.parse_whole("inkling", text, pc.make_request(tools=[pc.function_tool()]), TOK)
    shown = (None, '{"name":5,"args":{}}', [])
    assert results("inkling_py", text) == (shown, shown)


@pytest.mark.parametrize("args, vllm_whole_args", [("[1,2]", "[1, 2]"), ('"{\\"a\\":1}"', '{"a":1}')])
def test_arguments_that_are_not_an_object(args, vllm_whole_args):
    """vLLM returns the call whole with re-serialised arguments, but streams it with empty
    arguments. Ours: not a valid call, so the model's text is shown as content."""
    text = f'{TOOL}{{"name":"lookup","args":{args}}}{END}'
    whole, streamed = results("inkling", text)
    assert whole[2] == [("lookup", vllm_whole_args)] and streamed[2] == [("lookup", "")]
    shown = (None, f'{{"name":"lookup","args":{args}}}', [])
    assert results("inkling_py", text) == (shown, shown)


def test_arguments_under_the_arguments_key():
    text = f'{TOOL}{{"name":"lookup","arguments":{{"q":"tides"}}}}{END}'
    assert results("inkling", text) == ((None, None, [("lookup", "{}")]),) * 2
    call = (None, None, [("lookup", '{"q":"tides"}')])
    assert results("inkling_py", text) == (call, call)


def test_schema_coercion_truncates_vllm_streamed_arguments():
    """vLLM rewrites arguments to the tool schema's types; the rewrite is not a continuation of
    what it already streamed, so the rest is dropped and the client gets invalid JSON.
    Ours passes the model's JSON through unchanged, whole and streamed."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}

    def request():
        return pc.make_request(tools=[{"type": "function",
                                       "function": {"name": "f", "parameters": schema}}])

    text = f'{TOOL}{{"name":"f","args":{{"n":"5","s":"x"}}}}{END}'
    whole, streamed = results("inkling", text, request=request)
    assert json.loads(whole[2][0][1]) == {"n": 5, "s": "x"}
    with pytest.raises(json.JSONDecodeError):
        json.loads(streamed[2][0][1])
    call = (None, None, [("f", '{"n":"5","s":"x"}')])
    assert results("inkling_py", text, request=request) == (call, call)


# ---- configuration ----------------------------------------------------------------------

def test_thinking_text_without_a_reasoning_parser():
    """Tool parser only: vLLM's whole response loses the thinking text (no field carries it)
    while streaming returns it as reasoning. Ours: content, in both."""
    text = f"{THINK}secret plan{END}{MSG}{TEXT}hi{END}"
    whole, streamed = results("inkling", text, reasoning=False)
    assert whole == (None, "hi", []) and streamed == ("secret plan", "hi", [])
    shown = (None, "secret planhi", [])
    assert results("inkling_py", text, reasoning=False) == (shown, shown)


def test_required_tool_choice_does_not_force_bare_json():
    """vLLM's tool adapter inherits a JSON-schema constraint for tool_choice="required" that
    makes the model write a bare JSON list, which its own Inkling grammar then returns as
    content with no tool call. Ours adds no constraint: the model writes its tool blocks."""
    forced = '[{"name":"f","parameters":{"a":1}}]'
    for name, constrained in (("inkling", True), ("inkling_py", False)):
        request = pc.make_request(tools=[pc.function_tool("f")], tool_choice="required")
        parser = pc.served_parser(name, TOK, request.tools)
        parser.adjust_request(request)
        assert (request.structured_outputs is not None) == constrained
        assert request.skip_special_tokens is False
    request = pc.make_request(tools=[pc.function_tool("f")], tool_choice="required")
    vllm = pc.served_parser("inkling", TOK, request.tools)
    assert vllm.parse(forced, request, enable_auto_tools=True)[1:] == (forced, None)
