"""`inkling_py`: Inkling tool-call and reasoning parsers for vLLM 0.30.0, pure Python.

Inkling's output is a sequence of typed blocks, each opened by a special token and closed by
`<|end_message|>` or `<|content_model_end_sampling|>`:

    <|content_thinking|> reasoning <|end_message|>
    <|message_model|> <|content_text|> visible text <|end_message|>
    <|message_model|> [header, e.g. fn name] <|content_invoke_tool_json|> {"name":..,"args":{..}} <|end_message|>
    <|content_invoke_tool_text|> / <|content_tool_error|> ...   (rendered as visible text)

The block grammar, its transitions and the adapter protocol (two passes through vLLM's
DelegatingParser: a reasoning pass that leaves tool markup in the content, then a tool pass
over that content) reproduce vLLM 0.30.0's `inkling` parser. Differences, all where vLLM loses
or crashes on model output, are listed in docs/parsers.md.

Every delta is processed once: markers are found with a bounded look-back (at most one
marker's length is held between deltas) and tool payloads are scanned one character at a
time with a small state machine, so streaming costs O(output length) in total.

Loadable two ways: `inkling_hpu.parsers.register()`, or `--tool-parser-plugin <this file>`
(loaded by path, the module registers itself).
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Sequence
from functools import cached_property

from vllm.entrypoints.generate.base.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from vllm.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager
from vllm.tool_parsers.abstract_tool_parser import ToolParser, ToolParserManager

PARSER_NAME = "inkling_py"

MESSAGE_MODEL = "<|message_model|>"
CONTENT_TEXT = "<|content_text|>"
CONTENT_THINKING = "<|content_thinking|>"
CONTENT_INVOKE_TOOL_JSON = "<|content_invoke_tool_json|>"
CONTENT_INVOKE_TOOL_TEXT = "<|content_invoke_tool_text|>"
CONTENT_TOOL_ERROR = "<|content_tool_error|>"
CONTENT_MODEL_END_SAMPLING = "<|content_model_end_sampling|>"
END_MESSAGE = "<|end_message|>"

# Marker kinds (the grammar's terminals).
OPEN_HEADER, OPEN_TEXT, OPEN_THINKING, OPEN_TOOL, OPEN_VISIBLE, CLOSE, DROP = range(7)
MARKERS = {
    MESSAGE_MODEL: OPEN_HEADER,
    CONTENT_TEXT: OPEN_TEXT,
    CONTENT_THINKING: OPEN_THINKING,
    CONTENT_INVOKE_TOOL_JSON: OPEN_TOOL,
    CONTENT_INVOKE_TOOL_TEXT: OPEN_VISIBLE,
    CONTENT_TOOL_ERROR: OPEN_VISIBLE,
    END_MESSAGE: CLOSE,
    CONTENT_MODEL_END_SAMPLING: CLOSE,
}

# Parser states.
HEADER, CONTENT, REASONING, TOOL = "header", "content", "reasoning", "tool"

# Keys whose value is the call's arguments object. vLLM reads only "args" while streaming.
ARGS_KEYS = ("args", "arguments", "parameters")
_ARGS_KEY_MAX = max(len(k) for k in ARGS_KEYS)
_JSON_WS = " \t\r\n"
# Unicode White_Space: what `\s` means in vLLM's tool-name regex (`"name"\s*:\s*"([^"]*)"`).
_NAME_WS = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
    "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
_NAME_KEY = '"name"'


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().int & 0xFFFFFFFFFFFFFFFF:016x}"


@functools.lru_cache(maxsize=16)
def _lexer_tables(literal_items: tuple[tuple[str, int], ...]):
    """Lookup tables for a set of literals, shared by every request of a tokenizer."""
    literals = dict(literal_items)
    first_chars = frozenset(lit[0] for lit in literals)
    prefixes = frozenset(lit[:i] for lit in literals for i in range(1, len(lit)))
    by_first: dict[str, list[str]] = {}
    for lit in sorted(literals, key=len, reverse=True):  # longest first at one position
        by_first.setdefault(lit[0], []).append(lit)
    return literals, first_chars, prefixes, max(len(lit) for lit in literals), by_first


class MarkerLexer:
    """Splits streamed text into text pieces and markers.

    A marker split across deltas is held back: only a tail that is a proper prefix of some
    marker is kept between calls, so each character is examined a bounded number of times.
    """

    def __init__(self, literals: dict[str, int]) -> None:
        tables = _lexer_tables(tuple(sorted(literals.items())))
        self.literals, self.first_chars, self.prefixes, self.max_len, self.by_first = tables
        self.held = ""

    def reset(self) -> None:
        self.held = ""

    def feed(self, text: str, out: list) -> None:
        """Append (kind, value) items to out; kind None means plain text."""
        if self.held:
            text = self.held + text
            self.held = ""
        elif self.first_chars.isdisjoint(text):
            if text:
                out.append((None, text))
            return
        n = len(text)
        start = 0  # start of pending plain text
        i = 0
        by_first = self.by_first
        while i < n:
            if text[i] not in self.first_chars:
                i += 1
                continue
            for lit in by_first[text[i]]:
                if text.startswith(lit, i):
                    if i > start:
                        out.append((None, text[start:i]))
                    out.append((self.literals[lit], lit))
                    i += len(lit)
                    start = i
                    break
            else:
                if n - i < self.max_len and text[i:] in self.prefixes:
                    if i > start:
                        out.append((None, text[start:i]))
                    self.held = text[i:]
                    return
                i += 1
        if start < n:
            out.append((None, text[start:]))

    def flush(self, out: list) -> None:
        if self.held:
            out.append((None, self.held))
            self.held = ""


class ToolCallScanner:
    """Incremental reader of one `{"name": ..., "args": {...}}` payload.

    Finds the tool name the way vLLM does (the first `"name"\\s*:\\s*"..."` anywhere in the
    payload) and the verbatim text of the arguments object (the value of the first top-level
    args key), one character at a time. Nothing is evaluated: the arguments are the model's
    own JSON text.
    """

    __slots__ = (
        "parts", "name", "name_failed", "_nm_state", "_nm_progress", "_nm_ws", "_nm_chars",
        "depth", "in_string", "escape", "_key_chars", "_key_overflow", "last_key_is_args",
        "args_state", "args_parts", "args_depth", "args_in_string", "args_escape",
    )

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.name: str | None = None
        self.name_failed = False
        self._nm_state = 0  # 0: seek '"name"', 1: seek ':', 2: seek '"', 3: in value
        self._nm_progress = 0
        self._nm_ws = False
        self._nm_chars: list[str] = []
        self.depth = 0
        self.in_string = False
        self.escape = False
        self._key_chars: list[str] = []
        self._key_overflow = False
        self.last_key_is_args = False
        # args_state: 0 no args key yet, 1 after args key colon, 2 in args object,
        # 3 args object complete, 4 args value is not an object
        self.args_state = 0
        self.args_parts: list[str] = []
        self.args_depth = 0
        self.args_in_string = False
        self.args_escape = False

    @property
    def payload(self) -> str:
        return "".join(self.parts)

    @property
    def arguments(self) -> str:
        return "".join(self.args_parts)

    def feed(self, text: str) -> str:
        """Consume payload text; return the newly available arguments text."""
        self.parts.append(text)
        new_args: list[str] = []
        for ch in text:
            if self.name is None and not self.name_failed:
                self._scan_name(ch)
            state = self.args_state
            if state == 2:
                new_args.append(ch)
                self._scan_args_object(ch)
            elif state == 0:
                self._scan_wrapper(ch)
            elif state == 1:
                if ch in _JSON_WS:
                    continue
                if ch == "{":
                    self.args_state = 2
                    self.args_depth = 1
                    new_args.append(ch)
                else:
                    self.args_state = 4
        if new_args:
            chunk = "".join(new_args)
            self.args_parts.append(chunk)
            return chunk
        return ""

    def _scan_name(self, ch: str) -> None:
        state = self._nm_state
        if state == 3:
            if ch == '"':
                value = "".join(self._nm_chars)
                if value.strip():
                    self.name = value.strip()
                else:
                    # The first match decides (vLLM's regex keeps finding it): no name, ever.
                    self.name_failed = True
            else:
                self._nm_chars.append(ch)
            return
        if state == 1:
            if ch in _NAME_WS:
                self._nm_ws = True
                return
            if ch == ":":
                self._nm_state = 2
                return
            # The literal's closing quote may open the next candidate.
            self._nm_state = 0
            self._nm_progress = 0 if self._nm_ws else 1
        elif state == 2:
            if ch in _NAME_WS:
                return
            if ch == '"':
                self._nm_state = 3
                self._nm_chars = []
                return
            self._nm_state = 0
            self._nm_progress = 0
        progress = self._nm_progress
        if ch == _NAME_KEY[progress]:
            progress += 1
            if progress == len(_NAME_KEY):
                self._nm_state = 1
                self._nm_ws = False
                progress = 0
        else:
            progress = 1 if ch == '"' else 0
        self._nm_progress = progress

    def _scan_wrapper(self, ch: str) -> None:
        if self.escape:
            self.escape = False
            if self.depth == 1:
                self._key_char(ch)
            return
        if self.in_string:
            if ch == "\\":
                self.escape = True
                if self.depth == 1:
                    self._key_char(ch)
            elif ch == '"':
                self.in_string = False
                if self.depth == 1:
                    self.last_key_is_args = (
                        not self._key_overflow and "".join(self._key_chars) in ARGS_KEYS
                    )
            elif self.depth == 1:
                self._key_char(ch)
            return
        if ch == '"':
            self.in_string = True
            self._key_chars = []
            self._key_overflow = False
        elif ch == ":" and self.depth == 1 and self.last_key_is_args:
            self.args_state = 1
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1

    def _key_char(self, ch: str) -> None:
        if len(self._key_chars) < _ARGS_KEY_MAX:
            self._key_chars.append(ch)
        else:
            self._key_overflow = True

    def _scan_args_object(self, ch: str) -> None:
        if self.args_escape:
            self.args_escape = False
        elif self.args_in_string:
            if ch == "\\":
                self.args_escape = True
            elif ch == '"':
                self.args_in_string = False
        elif ch == '"':
            self.args_in_string = True
        elif ch == "{":
            self.args_depth += 1
        elif ch == "}":
            self.args_depth -= 1
            if self.args_depth == 0:
                self.args_state = 3

    @property
    def is_call(self) -> bool:
        """A usable call: a name, and arguments that are an object or absent."""
        return self.name is not None and self.args_state != 4

    @property
    def can_announce(self) -> bool:
        """Safe to send the name: the arguments are known to be an object."""
        return self.name is not None and self.args_state in (2, 3)


class ToolSlot:
    __slots__ = ("index", "scanner", "id", "name_sent", "unsent", "closed", "accepted")

    def __init__(self, index: int) -> None:
        self.index = index
        self.scanner = ToolCallScanner()
        self.id: str | None = None
        self.name_sent = False
        self.unsent: list[str] = []  # argument text scanned but not streamed yet
        self.closed = False
        self.accepted = False


class InklingStream:
    """One request's parse state: markers -> reasoning / content / tool-call deltas."""

    def __init__(self, tokenizer, initial_state: str = HEADER) -> None:
        self.tokenizer = tokenizer
        literals = dict(MARKERS)
        self.drop_token_ids: frozenset[int] = frozenset()
        try:
            specials = list(tokenizer.all_special_tokens)
            special_ids = list(tokenizer.all_special_ids)
        except (AttributeError, NotImplementedError, TypeError):
            specials, special_ids = [], []
        drop_ids = set()
        for text, token_id in zip(specials, special_ids):
            # Other special tokens (end of text, other roles) are removed from the output.
            if isinstance(text, str) and text and text not in MARKERS:
                literals[text] = DROP
                drop_ids.add(token_id)
        self.drop_token_ids = frozenset(drop_ids)
        self.lexer = MarkerLexer(literals)
        self.skip_tool_parsing = False
        self.suppress_tool_calls = False
        # Reasoning pass while streaming: the delta in which reasoning ends is handed to the
        # tool pass unparsed (see _replay_prefix), so no block is cut in two passes.
        self.hand_off_after_reasoning = False
        # No reasoning parser configured: thinking text is ordinary content (the whole
        # response has no reasoning field to carry it, and streaming must agree).
        self.reasoning_as_content = False
        # Whole-response reasoning pass: its content is lexed again by the tool pass, so
        # literal text must not join across a removed marker into a marker string.
        self.guard_marker_junctions = False
        self.reset(initial_state)

    def reset(self, initial_state: str = HEADER) -> None:
        self.state = initial_state
        self.lexer.reset()
        self.header_parts: list[str] = []
        self.slots: list[ToolSlot] = []
        self.in_skipped_tool_span = False
        self.reasoning_ended = False
        self.passing_through = False
        self.ever_had_token_ids = False
        self.finished = False
        # Visible content: leading whitespace waits until real text arrives.
        self.content_started = False
        self.content_tail = ""
        self.pending_ws = ""
        # Reasoning: trailing whitespace waits for more reasoning (dropped at the end).
        self.reasoning_ws = ""
        # Output of the current call.
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._touched: list[ToolSlot] = []

    # ---- input -------------------------------------------------------------------------

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> None:
        if self.passing_through:
            self._content.append(text)
            return
        hand_off = self.hand_off_after_reasoning and not self.reasoning_ended
        replay = self._replay_prefix() if hand_off else ""
        items: list = []
        if token_ids:
            self.ever_had_token_ids = True
        if self.drop_token_ids and token_ids and any(t in self.drop_token_ids for t in token_ids):
            self._feed_with_dropped_tokens(text, token_ids, items)
        else:
            self.lexer.feed(text, items)
        self._process(items)
        if hand_off and self.reasoning_ended:
            # This delta goes to the tool pass whole, after markers that reopen the block
            # it started in: the tool pass then parses it exactly as a single pass would.
            self.passing_through = True
            self.lexer.reset()
            self._reasoning = []
            self._content = [replay + text]

    def _replay_prefix(self) -> str:
        """Text that brings a fresh content-state parser to this parser's current state."""
        prefix = self.pending_ws
        if self.state == REASONING:
            prefix += CONTENT_THINKING + self.reasoning_ws
        elif self.state == HEADER:
            prefix += MESSAGE_MODEL + "".join(self.header_parts)
        return prefix + self.lexer.held

    def _feed_with_dropped_tokens(self, text: str, token_ids: Sequence[int], items: list) -> None:
        # A special token given by id is removed where its text sits in this delta; the text
        # before it is lexed (and the lexer flushed) first, as vLLM's token-id scanner does.
        pos = 0
        for token_id in token_ids:
            if token_id not in self.drop_token_ids:
                continue
            token_text = self.tokenizer.decode([token_id])
            found = text.find(token_text, pos) if token_text else -1
            if found < 0:
                continue
            self.lexer.feed(text[pos:found], items)
            self.lexer.flush(items)
            items.append((DROP, ""))
            pos = found + len(token_text)
        self.lexer.feed(text[pos:], items)

    def finish(self) -> None:
        if self.finished:
            return
        if self.passing_through:
            self.finished = True
            return
        items: list = []
        self.lexer.flush(items)
        self._process(items)
        if self.state == TOOL:
            self._close_tool_block()
            self.state = CONTENT
        elif self.state == REASONING:
            self._end_reasoning()
        elif self.state == HEADER:
            # Bare text after the opener with no kind marker is visible content.
            self._add_content("".join(self.header_parts))
            self.header_parts = []
            self.state = CONTENT
        self.finished = True
        # Whitespace-only content: kept unless a tool call was returned.
        if not self.content_started and self.pending_ws:
            if not any(slot.accepted for slot in self.slots):
                self._content.append(self.pending_ws)
            self.pending_ws = ""
        self.reasoning_ws = ""

    # ---- grammar -----------------------------------------------------------------------

    def _process(self, items: list) -> None:
        for kind, value in items:
            if kind is None:
                self._text(value)
            elif kind == DROP:
                # Textual special tokens survive as text once token ids are in play.
                if self.ever_had_token_ids and value:
                    self._text(value)
            else:
                self._marker(kind, value)

    def _text(self, text: str) -> None:
        if not text:
            return
        state = self.state
        if state == CONTENT:
            self._add_content(text)
        elif state == REASONING:
            self._add_reasoning(text)
        elif state == HEADER:
            self.header_parts.append(text)
        else:
            self._tool_text(text)

    def _marker(self, kind: int, value: str) -> None:
        state = self.state
        if self.skip_tool_parsing:
            if self.in_skipped_tool_span and kind != CLOSE:
                self._add_content(value, markup=True)  # inside a payload: payload text
                return
            if kind in (OPEN_TOOL, CLOSE) and self._skip_mode_marker(kind, value):
                return
        if state == TOOL:
            if kind == CLOSE:
                self._close_tool_block()
                self.state = CONTENT
            else:
                self._tool_text(value)  # a marker inside a payload is payload text
            return
        if state == REASONING:
            if kind == CLOSE:
                self._end_reasoning()
            elif kind == OPEN_TOOL:
                self._end_reasoning()
                self._open_tool_block()
            elif kind != OPEN_THINKING:
                self._add_reasoning(value)  # no transition: the marker text is reasoning
            return
        # HEADER or CONTENT
        if kind == OPEN_HEADER:
            self.header_parts = []
            self.state = HEADER
            return
        if kind == CLOSE:
            if state == HEADER:
                self._add_content("".join(self.header_parts))
                self.header_parts = []
            self.state = CONTENT
            return
        self.header_parts = []  # the header (e.g. a function name) is metadata
        if kind == OPEN_THINKING:
            self.state = REASONING
        elif kind == OPEN_TOOL:
            self._open_tool_block()
        else:  # text or visible tool text/error block
            self.reasoning_ended = True
            self.state = CONTENT

    def _skip_mode_marker(self, kind: int, value: str) -> bool:
        """Reasoning pass: keep tool blocks (markers included) as content text for the
        tool pass. Returns False when the marker is an ordinary block closer."""
        if kind == CLOSE and not self.in_skipped_tool_span:
            return False
        state = self.state
        if kind == OPEN_TOOL:
            self.in_skipped_tool_span = True
        else:
            self.in_skipped_tool_span = False
        if kind == OPEN_TOOL or state == REASONING:
            # Opening a tool block (or closing reasoning inside one) ends reasoning.
            self.header_parts = []
            self._end_reasoning()
            self._add_content(value, markup=True)
        elif state == HEADER:
            self.header_parts = []
            self.state = CONTENT
            self._add_content(value, markup=True)
        elif state == CONTENT:
            self._add_content(value, markup=True)
        return True

    # ---- outputs -----------------------------------------------------------------------

    def _add_content(self, text: str, markup: bool = False) -> None:
        if not text:
            return
        if self.content_started:
            self._emit_content(text, markup)
        elif text.strip():
            self.content_started = True
            self._emit_content(self.pending_ws + text, markup)
            self.pending_ws = ""
        else:
            self.pending_ws += text

    def _emit_content(self, text: str, markup: bool) -> None:
        if self.guard_marker_junctions:
            if not markup and self._joins_into_marker(self.content_tail, text):
                self._content.append(END_MESSAGE)  # a no-op for the tool pass, in content
            self.content_tail = (self.content_tail + text)[-self.lexer.max_len:]
        self._content.append(text)

    def _joins_into_marker(self, before: str, after: str) -> bool:
        joined = before + after[: self.lexer.max_len]
        for literal in self.lexer.literals:
            start = joined.find(literal, max(0, len(before) - len(literal) + 1))
            while 0 <= start < len(before):
                if start + len(literal) > len(before):
                    return True
                start = joined.find(literal, start + 1)
        return False

    def _end_reasoning(self) -> None:
        self.reasoning_ended = True
        self.reasoning_ws = ""  # a thinking block's trailing whitespace is not kept
        self.state = CONTENT

    def _add_reasoning(self, text: str) -> None:
        if self.reasoning_as_content:
            self._add_content(text)
            return
        text = self.reasoning_ws + text
        body = text.rstrip()
        self.reasoning_ws = text[len(body):]
        if body:
            self._reasoning.append(body)

    def _open_tool_block(self) -> None:
        self.reasoning_ended = True
        self.state = TOOL
        if self.suppress_tool_calls:
            self.slots.append(ToolSlot(len(self.slots)))
            self.slots[-1].closed = True  # tool_choice "none": the block is not returned
            return
        if not self.content_started:
            self.pending_ws = ""  # whitespace before the first tool call is dropped
        self.slots.append(ToolSlot(len(self.slots)))

    def _tool_text(self, text: str) -> None:
        slot = self.slots[-1]
        if slot.closed:
            return
        arguments = slot.scanner.feed(text)
        if arguments:
            slot.unsent.append(arguments)
        if slot not in self._touched:
            self._touched.append(slot)

    def _close_tool_block(self) -> None:
        slot = self.slots[-1]
        if slot.closed:
            return
        slot.closed = True
        if slot.scanner.is_call:
            slot.accepted = True
            if slot not in self._touched:
                self._touched.append(slot)
        else:
            # No name, or arguments that are not an object: the model's text stays visible.
            self._add_content(slot.scanner.payload)

    def _collect_tool_deltas(self) -> list[DeltaToolCall]:
        deltas = []
        for slot in self._touched:
            scanner = slot.scanner
            if not slot.name_sent:
                if not (scanner.can_announce or slot.accepted):
                    continue
                slot.name_sent = True
                slot.id = new_tool_call_id()
                args = scanner.arguments
                if slot.closed and scanner.args_state in (0, 1):
                    args = "{}"
                slot.unsent = []
                deltas.append(DeltaToolCall(
                    index=slot.index, id=slot.id, type="function",
                    function=DeltaFunctionCall(name=scanner.name, arguments=args or None),
                ))
                continue
            new = "".join(slot.unsent)
            slot.unsent = []
            if new:
                deltas.append(DeltaToolCall(index=slot.index, function=DeltaFunctionCall(arguments=new)))
        # A closed block has sent everything it ever will.
        self._touched = [s for s in self._touched if not s.closed]
        return deltas

    def take_delta(self) -> DeltaMessage | None:
        """The output produced since the last call, as one DeltaMessage (or None)."""
        tool_calls = self._collect_tool_deltas() if self._touched else []
        content = "".join(self._content) or None
        reasoning = "".join(self._reasoning) or None
        self._content = []
        self._reasoning = []
        if content is None and reasoning is None and not tool_calls:
            return None
        message = DeltaMessage(content=content, reasoning=reasoning)
        if tool_calls:
            message.tool_calls = tool_calls
        return message

    def calls(self) -> list[ToolCall]:
        result = []
        for slot in self.slots:
            if not slot.accepted:
                continue
            scanner = slot.scanner
            if slot.id is None:
                slot.id = new_tool_call_id()
            arguments = scanner.arguments if scanner.args_state in (2, 3) else "{}"
            result.append(ToolCall(
                id=slot.id,
                function=FunctionCall(name=scanner.name, arguments=arguments),
            ))
        return result


# ---- token-id questions (pure functions of the ids, as vLLM's InklingParser) ---------------

def _vocab_ids(vocab: dict[str, int], *texts: str) -> list[int | None]:
    return [vocab.get(text) for text in texts]


def is_reasoning_end(vocab: dict[str, int], input_ids: Sequence[int]) -> bool:
    thinking, text, model, end_sampling = _vocab_ids(
        vocab, CONTENT_THINKING, CONTENT_TEXT, MESSAGE_MODEL, CONTENT_MODEL_END_SAMPLING)
    for token_id in reversed(input_ids):
        if token_id == thinking or token_id == model:
            return False
        if token_id == text or token_id == end_sampling:
            return True
    return False


def count_reasoning_tokens(vocab: dict[str, int], token_ids: Sequence[int]) -> int:
    thinking = vocab.get(CONTENT_THINKING)
    closers = {i for i in _vocab_ids(vocab, END_MESSAGE, CONTENT_MODEL_END_SAMPLING) if i is not None}
    inside = False
    count = 0
    for token_id in token_ids:
        if token_id == thinking:
            inside = True
        elif token_id in closers:
            inside = False
        elif inside:
            count += 1
    return count


def initial_state_from_prompt(vocab: dict[str, int], prompt_token_ids: Sequence[int]) -> str | None:
    """The state generation continues in, from the last block marker of the prompt."""
    thinking, text, model = _vocab_ids(vocab, CONTENT_THINKING, CONTENT_TEXT, MESSAGE_MODEL)
    special = {vocab[m] for m in MARKERS if m in vocab}
    for token_id in reversed(prompt_token_ids):
        if token_id == thinking:
            return REASONING
        if token_id == text:
            return CONTENT
        if token_id == model:
            return HEADER
        if token_id in special:
            return None
    return None


def _request_tools(request) -> list:
    return getattr(request, "tools", None) or []


# ---- vLLM adapters ---------------------------------------------------------------------

class InklingPyReasoningParser(ReasoningParser):
    """Reasoning pass: splits thinking from everything else; tool markup stays in content."""

    engine_based_streaming = True

    def __init__(self, tokenizer, *args, **kwargs) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        self._stream = InklingStream(tokenizer)
        self._stream.skip_tool_parsing = True
        self._stream.hand_off_after_reasoning = True
        self._streaming_started = False

    @cached_property
    def vocab(self) -> dict[str, int]:
        return self.model_tokenizer.get_vocab()

    @property
    def reasoning_start_str(self) -> str | None:
        return CONTENT_THINKING

    @property
    def reasoning_end_str(self) -> str | None:
        return END_MESSAGE

    @property
    def reasoning_end_token_ids(self) -> frozenset[int]:
        # <|end_message|> closes every block kind, so no single id marks reasoning's end.
        return frozenset()

    def find_reasoning_end_offset(self, token_ids: Sequence[int]) -> int | None:
        return None

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        return is_reasoning_end(self.vocab, input_ids)

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        return input_ids

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        return count_reasoning_tokens(self.vocab, token_ids)

    def adjust_request(self, request):
        request.skip_special_tokens = False  # the markers are the grammar
        return request

    def adjust_initial_state_from_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        state = initial_state_from_prompt(self.vocab, prompt_token_ids)
        if state is not None:
            self._stream.reset(state)
            self._streaming_started = True

    def has_engine_confirmed_reasoning_end(self) -> bool:
        return self._stream.reasoning_ended

    def get_streaming_fallback_content(self, text: str, request) -> str | None:
        return None

    def extract_reasoning(self, model_output: str, request) -> tuple[str | None, str | None]:
        stream = InklingStream(self.model_tokenizer)
        stream.skip_tool_parsing = True
        stream.guard_marker_junctions = True
        stream.feed(model_output)
        stream.finish()
        reasoning = "".join(stream._reasoning) or None
        content = "".join(stream._content) or None
        return reasoning, content

    def extract_reasoning_streaming(
        self, previous_text, current_text, delta_text,
        previous_token_ids, current_token_ids, delta_token_ids,
    ) -> DeltaMessage | None:
        if not self._streaming_started:
            self._streaming_started = True
            self._stream.reset(HEADER)
        self._stream.feed(delta_text, delta_token_ids)
        return self._stream.take_delta()

    def finish_streaming(self) -> DeltaMessage | None:
        self._stream.finish()
        return self._stream.take_delta()


class InklingPyToolParser(ToolParser):
    """Tool pass: tool blocks become calls; text blocks (and later thinking) pass through."""

    engine_based_streaming = True
    # No structural-tag grammar for Inkling: "required"/named are parsed like "auto".
    structural_tag_model = None
    supports_required_and_named = False

    def __init__(self, tokenizer, tools=None) -> None:
        super().__init__(tokenizer, tools)
        self._stream = InklingStream(tokenizer, initial_state=CONTENT)
        self._streaming_started = False

    @property
    def skip_reasoning_parsing(self) -> bool:
        return self._stream.reasoning_as_content

    @skip_reasoning_parsing.setter
    def skip_reasoning_parsing(self, value: bool) -> None:
        # vLLM's DelegatingParser sets this when no reasoning parser is configured.
        self._stream.reasoning_as_content = value

    def adjust_request(self, request):
        # Not ToolParser.adjust_request: its JSON-schema constraint for "required"/named
        # would force bare JSON where Inkling writes tool blocks (no call could be parsed).
        request.skip_special_tokens = False
        return request

    def _apply_tool_choice(self, stream: InklingStream, request) -> None:
        if getattr(request, "tool_choice", None) == "none" and _request_tools(request):
            stream.suppress_tool_calls = True

    def extract_tool_calls(self, model_output: str, request) -> ExtractedToolCallInformation:
        stream = InklingStream(self.model_tokenizer, initial_state=CONTENT)
        stream.reasoning_as_content = self.skip_reasoning_parsing
        self._apply_tool_choice(stream, request)
        stream.feed(model_output)
        stream.finish()
        calls = stream.calls()
        content = "".join(stream._content) or None
        return ExtractedToolCallInformation(
            tools_called=bool(calls), tool_calls=calls, content=content)

    def extract_tool_calls_streaming(
        self, previous_text, current_text, delta_text,
        previous_token_ids, current_token_ids, delta_token_ids, request,
    ) -> DeltaMessage | None:
        if not self._streaming_started:
            self._streaming_started = True
            self._stream.reset(CONTENT)
        self._apply_tool_choice(self._stream, request)
        self._stream.feed(delta_text, delta_token_ids)
        return self._stream.take_delta()

    def finish_streaming(self) -> DeltaMessage | None:
        self._stream.finish()
        return self._stream.take_delta()


def register() -> None:
    """Register both parsers as "inkling_py" with vLLM's managers (idempotent)."""
    ToolParserManager.register_module(PARSER_NAME, force=True, module=InklingPyToolParser)
    ReasoningParserManager.register_module(PARSER_NAME, force=True, module=InklingPyReasoningParser)


if not __package__:
    # Loaded by file path (`--tool-parser-plugin .../inkling_py.py`): register now.
    register()
