"""Shared helpers for the inkling_py parser tests and benchmark (tools.parser_cases).

Needs the repository root and the port (ports/inkling-small) importable (pytest's pythonpath, or
PYTHONPATH=ports/inkling-small with `python -m` from the root). Appends the vLLM tree (VLLM_SRC, else
the pristine 0.30.0 sdist located by cookbook.upstream) to sys.path, and provides: a small marker-aware
tokenizer, a generator of Inkling outputs, and drivers that run an output through vLLM's served
parser composition (DelegatingParser) for either parser name, whole or split into deltas.
"""

from __future__ import annotations

import json
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PORT_ROOT = REPO_ROOT / "ports" / "inkling-small"


def setup_paths() -> Path:
    """Make `vllm` importable; return its tree: VLLM_SRC when set (the image's preflight names the
    installed vLLM, with no network to fetch anything), else the pristine 0.30.0 sdist."""
    from cookbook import upstream

    tree = Path(os.environ.get("VLLM_SRC") or upstream.vllm_source())
    # Appended, not prepended: the sdist's own tests/ package must not shadow ours.
    if str(tree) not in sys.path:
        sys.path.append(str(tree))
    return tree


VLLM_TREE = setup_paths()

from vllm.entrypoints.openai.chat_completion.protocol import (  # noqa: E402
    ChatCompletionRequest,
    ChatCompletionToolsParam,
    FunctionDefinition,
)
from vllm.parser.parser_manager import ParserManager  # noqa: E402

import vllm  # noqa: E402

if not Path(vllm.__file__).resolve().is_relative_to(VLLM_TREE.resolve()):
    raise ImportError(f"expected vllm from the tree {VLLM_TREE}, "
                      f"found {vllm.__file__}")

import inkling_hpu.parsers  # noqa: E402
from inkling_hpu.parsers import inkling_py  # noqa: E402

inkling_hpu.parsers.register()

MSG = inkling_py.MESSAGE_MODEL
TEXT = inkling_py.CONTENT_TEXT
THINK = inkling_py.CONTENT_THINKING
TOOL = inkling_py.CONTENT_INVOKE_TOOL_JSON
TOOL_TEXT = inkling_py.CONTENT_INVOKE_TOOL_TEXT
TOOL_ERROR = inkling_py.CONTENT_TOOL_ERROR
END = inkling_py.END_MESSAGE
END_SAMPLING = inkling_py.CONTENT_MODEL_END_SAMPLING

# Ids as in vLLM's Inkling renderer tests (the model's vocabulary layout).
MARKER_IDS = {
    MSG: 200001, TEXT: 200004, END_SAMPLING: 200006, THINK: 200008, END: 200010,
    TOOL_ERROR: 200022, TOOL: 200049, TOOL_TEXT: 200057,
}
EXTRA_SPECIALS = {"<|message_user|>": 200000, "<|content_xml|>": 200024}
GEN_PROMPT = [MARKER_IDS[END], MARKER_IDS[MSG]]


class MarkerTokenizer:
    """A small real tokenizer: the Inkling markers are special tokens, any other text is one
    token per character (id = code point). `extra_specials` adds other special tokens (the
    real vocabulary has more, e.g. other roles), which the parsers must remove."""

    def __init__(self, extra_specials: dict[str, int] | None = None) -> None:
        self.specials = dict(MARKER_IDS)
        self.specials.update(extra_specials or {})
        self.id_to_text = {v: k for k, v in self.specials.items()}
        self.all_special_tokens = list(self.specials)
        self.all_special_ids = list(self.specials.values())
        self._markers = sorted(self.specials, key=len, reverse=True)

    def get_vocab(self) -> dict[str, int]:
        return dict(self.specials)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.id_to_text.get(i) or chr(i) for i in ids)

    def tokenize(self, text: str) -> list[tuple[int, str]]:
        tokens = []
        i = 0
        while i < len(text):
            for marker in self._markers:
                if text.startswith(marker, i):
                    tokens.append((self.specials[marker], marker))
                    i += len(marker)
                    break
            else:
                tokens.append((ord(text[i]), text[i]))
                i += 1
        return tokens

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [t for t, _ in self.tokenize(text)]


def function_tool(name: str = "get_weather") -> ChatCompletionToolsParam:
    return ChatCompletionToolsParam(
        function=FunctionDefinition(name=name, parameters={"type": "object", "properties": {}}))


def make_request(tools=None, tool_choice="auto", include_reasoning=True) -> ChatCompletionRequest:
    kwargs = {"messages": [{"role": "user", "content": "hi"}], "model": "inkling-small",
              "include_reasoning": include_reasoning}
    if tools is not None:
        kwargs["tools"] = [t.model_dump() if hasattr(t, "model_dump") else t for t in tools]
        kwargs["tool_choice"] = tool_choice
    return ChatCompletionRequest(**kwargs)


@dataclass
class Result:
    reasoning: str | None
    content: str | None
    calls: list[tuple[str, str]] = field(default_factory=list)
    ids_ok: bool = True

    def key(self):
        return (self.reasoning or None, self.content or None, self.calls)


def served_parser(name: str, tokenizer, tools=(), reasoning: bool = True, auto_tools: bool = True):
    cls = ParserManager.get_parser(
        tool_parser_name=name, reasoning_parser_name=name if reasoning else None,
        enable_auto_tools=auto_tools)
    return cls(tokenizer, list(tools))


def parse_whole(name: str, text: str, request, tokenizer, **kw) -> Result:
    parser = served_parser(name, tokenizer, request.tools or (), **kw)
    parser.adjust_request(request)
    reasoning, content, calls = parser.parse(text, request, enable_auto_tools=True)
    return Result(reasoning, content, [(c.name, c.arguments) for c in calls or []],
                  all(c.id for c in calls or []))


def parse_stream(name: str, deltas: list[tuple[str, list[int]]], request, tokenizer,
                 prompt_token_ids=GEN_PROMPT, **kw) -> Result:
    """Stream deltas through DelegatingParser.parse_delta, as the server does."""
    parser = served_parser(name, tokenizer, request.tools or (), **kw)
    parser.adjust_request(request)
    content, reasoning = [], []
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    ids: dict[int, str] = {}
    ids_ok = True
    last = len(deltas) - 1
    for i, (text, token_ids) in enumerate(deltas):
        delta = parser.parse_delta(text, list(token_ids), request,
                                   prompt_token_ids=prompt_token_ids if i == 0 else None,
                                   finished=(i == last))
        if delta is None:
            continue
        if delta.content:
            content.append(delta.content)
        if delta.reasoning:
            reasoning.append(delta.reasoning)
        for tc in delta.tool_calls or []:
            if tc.id:
                ids_ok &= tc.index not in ids  # one id per call, sent once
                ids[tc.index] = tc.id
            if tc.function and tc.function.name:
                names[tc.index] = tc.function.name
            if tc.function and tc.function.arguments:
                args.setdefault(tc.index, []).append(tc.function.arguments)
    calls = [(names.get(i, ""), "".join(args.get(i, []))) for i in sorted(set(names) | set(args))]
    ids_ok &= sorted(ids) == list(range(len(calls)))
    return Result("".join(reasoning) or None, "".join(content) or None, calls, ids_ok)


# ---- splitting ------------------------------------------------------------------------

def token_deltas(tokens: list[tuple[int, str]], rng: random.Random, max_group: int):
    """Deltas of 1..max_group whole tokens, with their ids (as the detokenizer gives them)."""
    out, i = [], 0
    while i < len(tokens):
        n = rng.randint(1, max_group)
        group = tokens[i:i + n]
        out.append(("".join(t for _, t in group), [tid for tid, _ in group]))
        i += n
    return out or [("", [])]


def char_deltas(text: str, rng: random.Random, max_len: int):
    """Text-only deltas cut at arbitrary character boundaries (markers split too)."""
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, max_len)
        out.append((text[i:i + n], []))
        i += n
    return out or [("", [])]


def split_patterns(text: str, tokenizer: MarkerTokenizer, rng: random.Random):
    """The split patterns every generated output is streamed with."""
    tokens = tokenizer.tokenize(text)
    yield "token-1", [(t, [tid]) for tid, t in tokens] or [("", [])]
    yield "token-rand4", token_deltas(tokens, rng, 4)
    yield "token-rand16", token_deltas(tokens, rng, 16)
    yield "char-1", char_deltas(text, rng, 1)
    yield "char-rand7", char_deltas(text, rng, 7)
    yield "char-rand40", char_deltas(text, rng, 40)


# ---- generator of model outputs -------------------------------------------------------

WORDS = ["the", "weather", "in", "Paris", "is", "mild", "42", "ok", "let", "me", "check",
         "{", "}", "[", "]", '"', ":", ",", "a}b", "é", "日本", "<", "|", "<|", "\\", "\n"]


def words(rng: random.Random, lo: int = 1, hi: int = 8) -> str:
    """Text with no leading/trailing whitespace and never a marker inside."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))
    text = text.replace("<|", "< |").strip()
    return text or "x"


def json_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.randint(-1000, 1000)
    if kind == 1:
        return words(rng, 1, 4)
    if kind == 2:
        return rng.choice([True, False, None, 1.5])
    if kind == 3:
        return 'quote " brace } bracket ] backslash \\ name "args":'
    if kind == 4:
        return [json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": json_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def tool_payload(rng: random.Random, name: str) -> str:
    args = {f"p{i}": json_value(rng) for i in range(rng.randint(0, 4))}
    compact = rng.random() < 0.7
    dumped = json.dumps({"name": name, "args": args}, ensure_ascii=rng.random() < 0.5,
                        separators=(",", ":") if compact else (", ", ": "))
    return dumped


def generate_output(rng: random.Random, max_blocks: int = 6, truncate: bool = True) -> str:
    """A model output in the block grammar: thinking, text, tool calls (with or without a
    name header), visible tool text/error blocks, either closer; sometimes bare text after
    the opener, sometimes cut at a token boundary (truncated generation)."""
    parts: list[str] = []
    if rng.random() < 0.1:
        parts.append(words(rng) + rng.choice(["", END, END_SAMPLING]))
        return "".join(parts)
    first = True
    for _ in range(rng.randint(1, max_blocks)):
        if not first:
            parts.append(MSG)
        first = False
        kind = rng.choice(["think", "think", "text", "text", "tool", "tool", "tool_text", "tool_error"])
        closer = END if rng.random() < 0.8 else END_SAMPLING
        if kind == "think":
            parts.append(THINK + words(rng, 1, 20) + closer)
        elif kind == "text":
            parts.append(TEXT + words(rng, 1, 20) + closer)
        elif kind == "tool":
            name = rng.choice(["get_weather", "search", "f", "run_code"])
            header = name if rng.random() < 0.5 else ""
            parts.append(header + TOOL + tool_payload(rng, name) + closer)
        elif kind == "tool_text":
            parts.append(TOOL_TEXT + words(rng) + closer)
        else:
            parts.append(TOOL_ERROR + words(rng) + closer)
    text = "".join(parts)
    if truncate and rng.random() < 0.15:
        tokens = MarkerTokenizer().tokenize(text)
        cut = rng.randint(1, len(tokens))
        text = "".join(t for _, t in tokens[:cut])
    return text
