#!/usr/bin/env python3
"""Inkling output parsing throughput: `inkling_py` (ours) vs vLLM 0.30.0's `inkling`, in one run.

    PYTHONPATH=ports/inkling-small python -m benchmarks.parser_throughput [--lengths 1024 8192 65536] [--runs 5] [--vllm-runs-64k 1]

Both parsers run in vLLM's served composition (ParserManager -> DelegatingParser, reasoning and
tool parser, tool_choice "auto"), fed token by token through parse_delta as the server does,
on the same corpus: outputs of thinking, text and tool calls whose arguments are large JSON
objects (about 60% of the tokens: four calls, or one per 2K tokens past 8K), then closing text. Tokens are 1-6 characters (markers
are single tokens). Prints the median tokens/s of each parser per length, the ratio, and the
time per token relative to the shortest length (flat = linear streaming cost). Times are the
process's CPU time (the test machine is shared; wall time measures the other tenants too).

vLLM re-reads a tool call's whole argument text for every character of it, so its cost grows
with the square of each call's argument length (hence the cap on call size: uncapped, one
vLLM run at 64K tokens takes tens of minutes). At 64K one vLLM run still takes minutes, hence
--vllm-runs-64k (default 1) for lengths of 32K and more.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import os
import statistics
import sys
import time

from tools import parser_cases as pc  # appends the pristine vLLM tree to sys.path


class BenchTokenizer(pc.MarkerTokenizer):
    """Markers are special tokens; other text is cut into 1-6 character pieces, each piece
    text a vocabulary entry (ids from 1000 up)."""

    def __init__(self) -> None:
        super().__init__()
        self.piece_ids: dict[str, int] = {}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.id_to_text[i] for i in ids)

    def pieces(self, text: str, rng: random.Random) -> list[tuple[int, str]]:
        out = []
        for token_id, token in self.tokenize_markers(text):
            if token_id is not None:
                out.append((token_id, token))
                continue
            i = 0
            while i < len(token):
                piece = token[i:i + rng.randint(1, 6)]
                i += len(piece)
                if piece not in self.piece_ids:
                    self.piece_ids[piece] = 1000 + len(self.piece_ids)
                    self.id_to_text[self.piece_ids[piece]] = piece
                out.append((self.piece_ids[piece], piece))
        return out

    def tokenize_markers(self, text: str):
        i, start = 0, 0
        while i < len(text):
            marker = next((m for m in self._markers if text.startswith(m, i)), None)
            if marker is None:
                i += 1
                continue
            if i > start:
                yield None, text[start:i]
            yield self.specials[marker], marker
            i += len(marker)
            start = i
        if start < len(text):
            yield None, text[start:]


def prose(rng: random.Random, n_tokens: int) -> str:
    words = ["the", "tide", "tables", "for", "Oslo", "show", "a", "rise", "of", "42", "cm",
             "so", "I", "will", "check", "again", "before", "answering", "é", "日本"]
    return " ".join(rng.choice(words) for _ in range(int(n_tokens * 0.8)))


def big_arguments(rng: random.Random, n_tokens: int) -> str:
    rows = [{"id": i, "name": f"item-{i}", "tags": ["a", "b"], "note": "x\"y}z",
             "nested": {"v": rng.random()}} for i in range(max(1, n_tokens // 17))]
    return json.dumps({"query": "tides", "rows": rows}, separators=(",", ":"))


def make_output(length: int, seed: int, tokenizer: BenchTokenizer) -> list[tuple[int, str]]:
    """About `length` tokens: 20% thinking, 10% text, 60% tool-call arguments (4 calls, more
    past 8K tokens so that no call exceeds ~1.2K tokens of arguments), 10% closing text."""
    n_calls = max(4, length // 2048)
    scale = 1.0
    for _ in range(3):  # calibrate the size knobs to the token count
        rng = random.Random(seed)
        size = length * scale
        parts = [pc.THINK, prose(rng, size * 0.2), pc.END, pc.MSG, pc.TEXT,
                 prose(rng, size * 0.1), pc.END]
        for i in range(n_calls):
            args = big_arguments(rng, int(size * 0.6 / n_calls))
            name = f"tool_{i % 4}"
            parts += [pc.MSG, name, pc.TOOL, f'{{"name":"{name}","args":{args}}}', pc.END]
        parts += [pc.MSG, pc.TEXT, prose(rng, size * 0.1), pc.END_SAMPLING]
        tokens = tokenizer.pieces("".join(parts), rng)
        scale *= length / len(tokens)
    return tokens


def stream(name: str, tokens, tokenizer) -> tuple[float, tuple]:
    request = pc.make_request(tools=[pc.function_tool(f"tool_{i}") for i in range(4)])
    parser = pc.served_parser(name, tokenizer, request.tools)
    parser.adjust_request(request)
    last = len(tokens) - 1
    calls: dict[int, list[str]] = {}
    content_chars = reasoning_chars = 0
    start = time.process_time()  # CPU time: the machine is shared, wall time is not ours
    for i, (token_id, text) in enumerate(tokens):
        delta = parser.parse_delta(text, [token_id], request,
                                   prompt_token_ids=pc.GEN_PROMPT if i == 0 else None,
                                   finished=(i == last))
        if delta is not None:
            content_chars += len(delta.content or "")
            reasoning_chars += len(delta.reasoning or "")
            for tc in delta.tool_calls or []:
                calls.setdefault(tc.index, []).append(tc.function.arguments or "")
    elapsed = time.process_time() - start
    summary = (content_chars, reasoning_chars, {k: len("".join(v)) for k, v in calls.items()})
    return elapsed, summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 65536])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--vllm-runs-64k", type=int, default=1,
                    help="runs of vLLM's parser at lengths >= 32K tokens (it is quadratic)")
    args = ap.parse_args()

    tokenizer = BenchTokenizer()
    warm = make_output(512, seed=1, tokenizer=tokenizer)
    for name in ("inkling_py", "inkling"):
        stream(name, warm, tokenizer)
    outputs = {length: make_output(length, seed=length, tokenizer=tokenizer)
               for length in args.lengths}
    times = {(length, name): [] for length in outputs for name in ("inkling_py", "inkling")}
    summaries = {}
    # Rounds interleave lengths and parsers (the machine's load drifts); short outputs get
    # more runs so every median covers about as many tokens; GC starts clean for each run.
    for round_ in range(args.runs):
        for length, tokens in outputs.items():
            repeats = max(1, min(8, 8192 // length))
            for name in ("inkling_py", "inkling"):
                if name == "inkling" and length >= 32768 and round_ >= args.vllm_runs_64k:
                    continue
                for _ in range(repeats):
                    gc.collect()
                    elapsed, summary = stream(name, tokens, tokenizer)
                    times[length, name].append(elapsed)
                    summaries[length, name] = summary
        print(f"... round {round_ + 1}/{args.runs} done", file=sys.stderr, flush=True)
    rows = []
    for length, tokens in outputs.items():
        if summaries[length, "inkling_py"] != summaries[length, "inkling"]:
            print(f"warning: outputs differ at {length}", file=sys.stderr)
        ours = len(tokens) / statistics.median(times[length, "inkling_py"])
        vllm = len(tokens) / statistics.median(times[length, "inkling"])
        rows.append((length, len(tokens), ours, vllm, len(times[length, "inkling_py"]),
                     len(times[length, "inkling"])))

    base_ours = 1 / rows[0][2]
    base_vllm = 1 / rows[0][3]
    print(f"streamed token by token through DelegatingParser; medians of process CPU time; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'length':>8} {'tokens':>7} {'inkling_py tok/s':>17} {'vLLM inkling tok/s':>19} "
          f"{'ratio':>7} {'us/tok ours':>12} {'us/tok vLLM':>12} {'ours vs 1st':>12} "
          f"{'vLLM vs 1st':>12} {'runs':>7}")
    for length, n, ours, vllm, runs_ours, runs_vllm in rows:
        print(f"{length:>8} {n:>7} {ours:>17,.0f} {vllm:>19,.0f} {ours / vllm:>6.1f}x "
              f"{1e6 / ours:>12.1f} {1e6 / vllm:>12.1f} {(1 / ours) / base_ours:>11.2f}x "
              f"{(1 / vllm) / base_vllm:>11.2f}x {runs_ours:>3}/{runs_vllm:<3}")
    print("ratio = ours / vLLM throughput (medians); 'vs 1st' = time per token relative to the "
          "shortest length; runs = ours/vLLM")
    return 0


if __name__ == "__main__":
    sys.exit(main())
