"""vLLM 0.30.0's Inkling parser test groups (tests/parser/engine/test_inkling.py), ported to
`inkling_py` with our own inputs, run through vLLM's real served composition
(ParserManager -> DelegatingParser) whole and streamed."""

from __future__ import annotations

import json

import pytest

from tools import parser_cases as pc
from tools.parser_cases import END, END_SAMPLING, MSG, TEXT, THINK, TOOL, TOOL_ERROR, TOOL_TEXT
from inkling_hpu.parsers.inkling_py import (
    CONTENT, HEADER, REASONING, InklingPyReasoningParser, InklingPyToolParser, InklingStream,
    ToolCallScanner,
)

pytestmark = pytest.mark.timeout(300)

TOK = pc.MarkerTokenizer()


def tool_block(name: str, args: str, closer: str = END) -> str:
    return f'{TOOL}{{"name":"{name}","args":{args}}}{closer}'


def scan(payload: str) -> ToolCallScanner:
    scanner = ToolCallScanner()
    scanner.feed(payload)
    return scanner


# ---- TestArgConverter -------------------------------------------------------------------

class TestToolPayloadScanner:
    def test_complete_wrapper(self):
        s = scan('{"name":"lookup","args":{"q":"tides"}}')
        assert (s.name, s.arguments, s.is_call) == ("lookup", '{"q":"tides"}', True)

    def test_partial_before_args(self):
        s = scan('{"name":"look')
        assert s.name is None and s.arguments == ""

    def test_partial_inside_args(self):
        s = scan('{"name":"x","args":{"n":7')
        assert s.arguments == '{"n":7' and s.args_state == 2

    def test_arguments_grow_by_appending(self):
        full = '{"name":"x","args":{"a":{"b":[1,"}"]},"c":"d\\"}"}}'
        scanner, seen = ToolCallScanner(), ""
        for ch in full:
            seen += scanner.feed(ch)
            assert scanner.arguments == seen
        assert seen == '{"a":{"b":[1,"}"]},"c":"d\\"}"}'

    def test_args_as_name_value(self):
        assert scan('{"name":"args","args":{"k":2}}').arguments == '{"k":2}'

    def test_whitespace_tolerated(self):
        s = scan('{ "name" : "x" , "args" :\n {"a": 1} }')
        assert (s.name, s.arguments) == ("x", '{"a": 1}')

    def test_missing_args_is_no_arguments(self):
        s = scan('{"name":"x"}')
        assert s.is_call and s.args_state == 0

    def test_non_object_args_is_not_a_call(self):
        assert not scan('{"name":"x","args":[1]}').is_call


# ---- whole and streamed through the served parser ----------------------------------------

# (id, model output, expected reasoning, expected content, expected [(name, args json)])
CASES = [
    ("bare-text", "plain words", None, "plain words", []),
    ("bare-text-end", f"plain words{END}", None, "plain words", []),
    ("bare-text-end-sampling", f"plain words{END_SAMPLING}", None, "plain words", []),
    ("text-block", f"{TEXT}An answer.{END}", None, "An answer.", []),
    ("reasoning-text-tool",
     f"{THINK}Need the forecast.{END}{MSG}{TEXT}Checking.{END}{MSG}"
     + tool_block("forecast", '{"town":"Oslo"}'),
     "Need the forecast.", "Checking.", [("forecast", {"town": "Oslo"})]),
    ("header-name-hidden", "forecast" + tool_block("forecast", '{"town":"Oslo"}'),
     None, None, [("forecast", {"town": "Oslo"})]),
    ("parallel", tool_block("a", "{}") + MSG + tool_block("b", '{"v":[3,4]}'),
     None, None, [("a", {}), ("b", {"v": [3, 4]})]),
    ("nested-args", tool_block("f", '{"q":{"deep":{"l":[{"k":"v"}]}},"s":"x}y"}'),
     None, None, [("f", {"q": {"deep": {"l": [{"k": "v"}]}}, "s": "x}y"})]),
    ("tool-text-visible", f"{TOOL_TEXT}run it{END}", None, "run it", []),
    ("tool-error-visible", f"{TOOL_ERROR}failed{END}", None, "failed", []),
    ("end-sampling-closes", f"{THINK}mm{END}{MSG}{TEXT}yo{END_SAMPLING}", "mm", "yo", []),
    ("reasoning-blocks-concatenate",
     f"{THINK}first{END}{MSG}{TEXT}middle{END}{MSG}{THINK}second{END}",
     "firstsecond", "middle", []),
    ("text-after-tool", tool_block("f", "{}") + f"{MSG}{TEXT}finished{END}",
     None, "finished", [("f", {})]),
    ("two-tools-then-text",
     tool_block("f", "{}") + MSG + tool_block("g", "{}") + f"{MSG}{TEXT}after{END}",
     None, "after", [("f", {}), ("g", {})]),
    ("prose-marker-is-structural", f"{TEXT}look {TEXT} here{END}", None, "look  here", []),
    ("end-sampling-tool-closer", f'{TOOL}{{"name":"f","args":{{}}}}{END_SAMPLING}',
     None, None, [("f", {})]),
    ("content-state-tool-start", f"{TEXT}intro{END}" + tool_block("lookup", '{"q":"x"}'),
     None, "intro", [("lookup", {"q": "x"})]),
    ("reasoning-then-tool", f"{THINK}plan{END}{MSG}" + tool_block("f", '{"x":1}'),
     "plan", None, [("f", {"x": 1})]),
    ("tool-while-thinking-open", f"{THINK}plan" + tool_block("f", '{"x":1}'),
     "plan", None, [("f", {"x": 1})]),
    ("visible-then-tool-text", f"{TEXT}checking{END}{MSG}" + tool_block("w", '{"c":"SF"}'),
     None, "checking", [("w", {"c": "SF"})]),
    ("visible-then-tool-tooltext", f"{TOOL_TEXT}checking{END}{MSG}" + tool_block("w", '{"c":"SF"}'),
     None, "checking", [("w", {"c": "SF"})]),
    ("visible-then-tool-error", f"{TOOL_ERROR}checking{END}{MSG}" + tool_block("w", '{"c":"SF"}'),
     None, "checking", [("w", {"c": "SF"})]),
]


def check(result: pc.Result, reasoning, content, calls):
    assert result.reasoning == reasoning
    assert result.content == content
    assert [name for name, _ in result.calls] == [name for name, _ in calls]
    assert [json.loads(args) for _, args in result.calls] == [args for _, args in calls]
    assert result.ids_ok
    for marker in pc.MARKER_IDS:
        assert marker not in (result.content or "")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_whole(case):
    _, text, reasoning, content, calls = case
    req = pc.make_request(tools=[pc.function_tool()])
    check(pc.parse_whole("inkling_py", text, req, TOK), reasoning, content, calls)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("size", [1, 3, 7, 64, 4096])
def test_streamed_by_tokens(case, size):
    _, text, reasoning, content, calls = case
    tokens = TOK.tokenize(text)
    deltas = [("".join(t for _, t in tokens[i:i + size]), [tid for tid, _ in tokens[i:i + size]])
              for i in range(0, len(tokens), size)]
    req = pc.make_request(tools=[pc.function_tool()])
    check(pc.parse_stream("inkling_py", deltas, req, TOK), reasoning, content, calls)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("size", [1, 3, 7, 64])
def test_streamed_text_only(case, size):
    """No token ids, cut at character boundaries: markers arrive split across deltas."""
    _, text, reasoning, content, calls = case
    deltas = [(text[i:i + size], []) for i in range(0, len(text), size)]
    req = pc.make_request(tools=[pc.function_tool()])
    check(pc.parse_stream("inkling_py", deltas, req, TOK), reasoning, content, calls)


def test_incomplete_tool_call_at_eos_is_returned():
    # Truncated arguments stay visible as the call's (unterminated) arguments text.
    text = f'{TOOL}{{"name":"d","args":{{"k":"v"'
    req = pc.make_request(tools=[pc.function_tool()])
    whole = pc.parse_whole("inkling_py", text, req, TOK)
    assert whole.calls == [("d", '{"k":"v"')]
    deltas = [(t, [i]) for i, t in TOK.tokenize(text)]
    assert pc.parse_stream("inkling_py", deltas, req, TOK).calls == whole.calls


# ---- streaming details --------------------------------------------------------------------

def stream_tool_parser(text: str, size: int, request=None, ids: bool = True):
    parser = InklingPyToolParser(TOK, [])
    request = request or pc.make_request(tools=[pc.function_tool()])
    deltas = []
    if ids:
        tokens = TOK.tokenize(text)
        chunks = [tokens[i:i + size] for i in range(0, len(tokens), size)]
        pairs = [("".join(t for _, t in c), [tid for tid, _ in c]) for c in chunks]
    else:
        pairs = [(text[i:i + size], []) for i in range(0, len(text), size)]
    for delta_text, delta_ids in pairs:
        deltas.append(parser.extract_tool_calls_streaming("", "", delta_text, [], [], delta_ids, request))
    deltas.append(parser.finish_streaming())
    return [d for d in deltas if d is not None]


def test_split_marker_held_across_chunks():
    deltas = stream_tool_parser(f"{TEXT}hello{END}", 9, ids=False)
    assert "".join(d.content or "" for d in deltas) == "hello"


def test_name_streams_before_arguments_complete():
    deltas = stream_tool_parser(f'{TOOL}{{"name":"lookup","args":{{"q":"ti', 4096)
    names = [tc.function.name for d in deltas for tc in d.tool_calls if tc.function.name]
    assert names == ["lookup"]


def test_streamed_arguments_are_the_args_object_only():
    deltas = stream_tool_parser(tool_block("f", '{"a":1}'), 3)
    args = "".join(tc.function.arguments or "" for d in deltas for tc in d.tool_calls)
    assert json.loads(args) == {"a": 1} and "name" not in args


@pytest.mark.parametrize("size", [1, 9])
def test_parallel_calls_streaming_indices_and_ids(size):
    deltas = stream_tool_parser(tool_block("a", '{"i":1}') + MSG + tool_block("b", '{"i":2}'), size)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.tool_calls:
            slot = calls.setdefault(tc.index, {"id": [], "name": "", "args": ""})
            if tc.id:
                slot["id"].append(tc.id)
                assert tc.type == "function"
            slot["name"] += tc.function.name or ""
            slot["args"] += tc.function.arguments or ""
    assert sorted(calls) == [0, 1]
    assert [calls[i]["name"] for i in (0, 1)] == ["a", "b"]
    assert [json.loads(calls[i]["args"]) for i in (0, 1)] == [{"i": 1}, {"i": 2}]
    assert all(len(calls[i]["id"]) == 1 and calls[i]["id"][0].startswith("chatcmpl-tool-")
               for i in (0, 1))
    assert calls[0]["id"] != calls[1]["id"]


def test_reasoning_to_tool_handoff_through_delegating_parser():
    req = pc.make_request(tools=[pc.function_tool("lookup")])
    parser = pc.served_parser("inkling_py", TOK, req.tools)
    assert parser.parse_delta(THINK, [pc.MARKER_IDS[THINK]], req,
                              prompt_token_ids=[pc.MARKER_IDS[MSG]], finished=False) is None
    second = parser.parse_delta("musing", [ord(c) for c in "musing"], req, finished=False)
    assert second.reasoning == "musing"
    body = f'{END}{MSG}lookup{TOOL}{{"name":"lookup","args":{{"q":"tides"}}}}{END}'
    third = parser.parse_delta(body, [tid for tid, _ in TOK.tokenize(body)], req, finished=True)
    assert third.tool_calls[0].function.name == "lookup"
    assert "".join(tc.function.arguments or "" for tc in third.tool_calls) == '{"q":"tides"}'
    assert not third.content and not third.reasoning


# ---- prompt-seeded state ----------------------------------------------------------------

class TestPromptSeededState:
    @pytest.mark.parametrize("tail, state", [
        ([200001, pc.MARKER_IDS[THINK]], REASONING),
        ([200001, pc.MARKER_IDS[TEXT]], CONTENT),
        ([pc.MARKER_IDS[END], pc.MARKER_IDS[MSG]], HEADER),
    ])
    def test_prompt_tail_sets_state(self, tail, state):
        parser = InklingPyReasoningParser(TOK)
        parser.adjust_initial_state_from_prompt(tail)
        assert parser._stream.state == state

    def test_prompt_ending_in_thinking_streams_reasoning(self):
        deltas = [(c, [ord(c)]) for c in "hmm"] + [(END, [pc.MARKER_IDS[END]])]
        result = pc.parse_stream("inkling_py", deltas, pc.make_request(), TOK,
                                 prompt_token_ids=[pc.MARKER_IDS[MSG], pc.MARKER_IDS[THINK]])
        assert (result.reasoning, result.content) == ("hmm", None)

    def test_header_flushes_bare_text_at_finish(self):
        deltas = [("plain ", [ord(c) for c in "plain "]), ("answer", [ord(c) for c in "answer"])]
        result = pc.parse_stream("inkling_py", deltas, pc.make_request(), TOK)
        assert result.content == "plain answer"


# ---- reasoning/tool token-id questions ---------------------------------------------------

def test_reasoning_end_and_token_counts():
    parser = InklingPyReasoningParser(TOK)
    ids = pc.MARKER_IDS
    assert not parser.is_reasoning_end([ids[MSG], ids[THINK], 97])
    assert parser.is_reasoning_end([ids[THINK], 97, ids[END], ids[MSG], ids[TEXT], 98])
    assert not parser.is_reasoning_end([ids[TEXT], 98, ids[END], ids[MSG]])
    assert parser.is_reasoning_end([ids[END_SAMPLING]])
    assert parser.extract_content_ids([1, 2, 3]) == [1, 2, 3]
    tokens = [ids[THINK], 97, 98, ids[END], ids[MSG], ids[TEXT], 99, ids[END], ids[THINK], 100,
              ids[END_SAMPLING]]
    assert parser.count_reasoning_tokens(tokens) == 3
    assert parser.reasoning_start_str == THINK and parser.reasoning_end_str == END


# ---- tool-call filtering ------------------------------------------------------------------

def test_reasoning_pass_keeps_tool_markup_for_tool_pass():
    text = (f"{THINK}plan{END}{MSG}" + tool_block("f", '{"a":1}') + MSG
            + tool_block("g", '{"b":[2]}'))
    req = pc.make_request()
    reasoning, content = InklingPyReasoningParser(TOK).extract_reasoning(text, req)
    assert reasoning == "plan" and content.count(TOOL) == 2
    info = InklingPyToolParser(TOK).extract_tool_calls(content, req)
    assert info.tools_called
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == [
        ("f", {"a": 1}), ("g", {"b": [2]})]


def none_request():
    return pc.make_request(tools=[pc.function_tool("f")], tool_choice="none")


def test_tool_choice_none_whole():
    text = f"{THINK}plan{END}{MSG}{TEXT}visible{END}{MSG}" + tool_block("f", '{"a":1}')
    result = pc.parse_whole("inkling_py", text, none_request(), TOK)
    assert (result.reasoning, result.content, result.calls) == ("plan", "visible", [])


@pytest.mark.parametrize("size", [1, 3])
def test_tool_choice_none_streaming(size):
    text = f"{TEXT}visible{END}{MSG}" + tool_block("f", '{"a":1}')
    deltas = stream_tool_parser(text, size, request=none_request())
    assert "".join(d.content or "" for d in deltas) == "visible"
    assert not any(d.tool_calls for d in deltas)


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_tool_choice_required_parsed_like_auto(choice):
    req = pc.make_request(tools=[pc.function_tool("f")], tool_choice=choice)
    result = pc.parse_whole("inkling_py", tool_block("f", '{"a":1}'), req, TOK)
    assert result.calls == [("f", '{"a":1}')]


def test_named_tool_choice_parsed_like_auto():
    req = pc.make_request(tools=[pc.function_tool("f")],
                          tool_choice={"type": "function", "function": {"name": "f"}})
    result = pc.parse_whole("inkling_py", tool_block("f", '{"a":1}'), req, TOK)
    assert result.calls == [("f", '{"a":1}')]


# ---- parser reuse, tool parser without reasoning parser ----------------------------------

def test_reuse_after_incomplete_tool_block():
    parser = pc.served_parser("inkling_py", TOK)
    req = pc.make_request()
    parser.parse(f'{TOOL}{{"name":"d","args":{{"k":"v"', req, enable_auto_tools=True)
    _, content, _ = parser.parse(f"{TEXT}fresh{END}", req, enable_auto_tools=True)
    assert content == "fresh"


@pytest.mark.parametrize("text, content, calls", [
    (f"{TEXT}The answer is 42.{END}", "The answer is 42.", []),
    (tool_block("w", '{"c":"SF"}'), None, [("w", '{"c":"SF"}')]),
    # No reasoning parser: thinking text is content (markers still parse as structure).
    (f"{THINK}plan{END}{MSG}{TEXT}Let me look.{END}", "planLet me look.", []),
    (f"{THINK}think{END}{MSG}" + tool_block("w", '{"x":1}'), "think", [("w", '{"x":1}')]),
])
@pytest.mark.parametrize("size", [0, 1, 3, 64])
def test_tool_parser_without_reasoning_parser(text, content, calls, size):
    req = pc.make_request(tools=[pc.function_tool()])
    if size == 0:
        result = pc.parse_whole("inkling_py", text, req, TOK, reasoning=False)
    else:
        tokens = TOK.tokenize(text)
        deltas = [("".join(t for _, t in tokens[i:i + size]), [tid for tid, _ in tokens[i:i + size]])
                  for i in range(0, len(tokens), size)]
        result = pc.parse_stream("inkling_py", deltas, req, TOK, reasoning=False)
    assert (result.content, result.calls) == (content, calls)


# ---- the two engine-level checks, on our stream -------------------------------------------

def test_reasoning_pass_tool_block_from_content_state_ends_reasoning():
    stream = InklingStream(TOK, initial_state=CONTENT)
    stream.skip_tool_parsing = True
    stream.feed(f'{TOOL}{{"name":"f","args":{{}}}}')
    assert stream.reasoning_ended
    assert "".join(stream._content).startswith(TOOL)


def test_text_after_tool_block_is_content_not_arguments():
    stream = InklingStream(TOK, initial_state=CONTENT)
    stream.feed(f'{TOOL}{{"name":"f","args":{{}}}}{END}after')
    stream.finish()
    assert "".join(stream._content) == "after"
    assert [(c.function.name, c.function.arguments) for c in stream.calls()] == [("f", "{}")]
