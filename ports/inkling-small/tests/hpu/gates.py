"""The page's serving gates (run through run_gates.sh). Python standard library only, so it runs
in the image or on any client machine. Each gate returns (passed, result text); the table at the
end has the page's shape, then "N judged, N passed, K skipped (why)". Gates that need something
absent (SERVER_LOG, the image's tests, a context that fits their lengths, a trained model) are
reported as skipped with the reason, never as passed, and a run with a skip the caller did not accept
does not exit 0.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BASE_URL = os.environ.get("BASE_URL", "").rstrip("/")
MODEL = os.environ.get("MODEL", "")            # empty: the first model /v1/models lists
TIMEOUT = float(os.environ.get("GATE_TIMEOUT", "900"))
BLOCK_SIZE = int(os.environ.get("BLOCK_SIZE", "128"))   # the server's --block-size (the page's)
# STAND_IN=1: the server serves a stand-in checkpoint (random weights, e.g. tools/tiny_model.py).
# Gates whose pass condition needs a trained model (answers, needles, tool calls) still send their
# requests, then report "needs a trained model" as skipped; the others judge as usual.
STAND_IN = os.environ.get("STAND_IN") == "1"
PORT_DIR = Path(__file__).resolve().parents[2]
SKIP = None  # a gate result that is neither pass nor fail
SERVER: dict = {}  # filled by main() from /v1/models: model id, max_model_len and root (the checkpoint)
# PREFIX_LOGPROB_TOLERANCE: the prefix-cache gate also requires each warm token the cold run sampled too to
# carry the cold run's logprob within this (set it where the server's numerics repeat exactly: fp32 on CPU
# gives equal logprobs to 1e-6; on HPU's bf16 repeats differ by more, and it is unset: not judged).
PREFIX_LOGPROB_TOLERANCE = float(os.environ["PREFIX_LOGPROB_TOLERANCE"]) if os.environ.get("PREFIX_LOGPROB_TOLERANCE") else None
RESERVE = 64       # tokens kept free under max_model_len for the chat template, question and answer

FILLER = ("The committee reviewed the quarterly figures, noted the weather in the northern valley, "
          "and moved on to the next item on a long and uneventful agenda. ")
NEEDS_MODEL = "needs a trained model (STAND_IN=1: random weights)"
STAND_IN_ANSWER_TOKENS = 64   # random weights never stop early, and their answers are not judged


def answer_tokens(n: int) -> int:
    """max_tokens of a request whose answer a gate judges: n, or fewer on a stand-in."""
    return min(n, STAND_IN_ANSWER_TOKENS) if STAND_IN else n


class GateError(RuntimeError):
    """A request a gate needed failed: carries the request and the server's message."""


# --- HTTP --------------------------------------------------------------------------------------
def describe(body: dict) -> str:
    """The request in one line, long texts shortened to their size."""
    def short(value):
        if isinstance(value, str) and len(value) > 80:
            return f"<{len(value):,} chars>"
        if isinstance(value, list):
            return [short(v) for v in value]
        if isinstance(value, dict):
            return {k: short(v) for k, v in value.items()}
        return value
    return json.dumps(short(body))[:400]


def post(path: str, body: dict, timeout: float = TIMEOUT) -> tuple[int, dict]:
    req = urllib.request.Request(BASE_URL + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        raw = err.read() or b""
        try:
            return err.code, json.loads(raw or b"{}")
        except ValueError:
            return err.code, {"raw": raw.decode(errors="replace")[:500]}


def server_message(body: dict) -> str:
    error = body.get("error")
    if isinstance(error, dict):
        return error.get("message") or json.dumps(error)
    return body.get("message") or body.get("detail") or body.get("raw") or json.dumps(body)[:500]


def post_ok(path: str, body: dict, timeout: float = TIMEOUT) -> dict:
    status, out = post(path, body, timeout)
    if status != 200:
        raise GateError(f"POST {path} {describe(body)} -> HTTP {status}: {server_message(out)}")
    return out


def chat(messages, **params) -> dict:
    return post_ok("/v1/chat/completions", {"model": MODEL, "messages": messages, **params})


def stream_chat(messages, on_delta=None, **params) -> dict:
    """Streamed chat; returns the joined content/reasoning/tool-call text and the raw deltas.
    `on_delta(delta, event)` returning True stops the stream (the connection is closed: vLLM aborts the request)."""
    body = {"model": MODEL, "messages": messages, "stream": True, **params}
    req = urllib.request.Request(BASE_URL + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    content, reasoning, tools, chunks = [], [], [], 0
    try:
        resp = urllib.request.urlopen(req, timeout=TIMEOUT)
    except urllib.error.HTTPError as err:
        raise GateError(f"POST /v1/chat/completions {describe(body)} -> HTTP {err.code}: "
                        f"{err.read().decode(errors='replace')[:500]}") from None
    with resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise GateError(f"stream {describe(body)}: {server_message(event)}")
            choices = event["choices"]
            delta = choices[0]["delta"] if choices else {}
            chunks += 1
            content.append(delta.get("content") or "")
            reasoning.append(delta.get("reasoning_content") or delta.get("reasoning") or "")
            for call in delta.get("tool_calls") or []:
                tools.append(json.dumps(call))
            if on_delta and on_delta(delta, event):
                break
    return {"content": "".join(content), "reasoning": "".join(reasoning), "tools": "".join(tools), "chunks": chunks}


def count_tokens(text: str | None = None, messages: list | None = None) -> int:
    body = {"model": MODEL, "prompt": text} if messages is None else {"model": MODEL, "messages": messages}
    return int(post_ok("/tokenize", body, timeout=120)["count"])


def metrics() -> dict[str, float]:
    """vLLM's Prometheus metrics, each name summed over its labels."""
    with urllib.request.urlopen(BASE_URL + "/metrics", timeout=60) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name = re.split(r"[{ ]", line, 1)[0]
        out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def metric(name: str) -> float:
    found = metrics()
    if name not in found:
        raise GateError(f"/metrics has no {name} (found {len(found)} metrics)")
    return found[name]


class MetricsWatch:
    """Polls /metrics in the background: the most requests running at once, and when the running
    count first reached a given value."""

    def __init__(self, period: float = 0.1):
        self.period, self.samples, self._stop = period, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                m = metrics()
                self.samples.append((time.perf_counter(), m.get("vllm:num_requests_running", 0.0),
                                     m.get("vllm:num_requests_waiting", 0.0)))
            except OSError:
                pass
            self._stop.wait(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)

    def max_running(self) -> float:
        return max((r for _, r, _ in self.samples), default=0.0)

    def first_time(self, running_at_least: float, after: float = 0.0) -> float | None:
        return next((t for t, r, _ in self.samples if r >= running_at_least and t >= after), None)

    def latest_running(self) -> float:
        return self.samples[-1][1] if self.samples else 0.0


# --- lengths -------------------------------------------------------------------------------------
def max_model_len() -> int:
    return SERVER["max_model_len"]


def fitting(sizes, answer_tokens: int = 24) -> tuple[list[int], list[int]]:
    """The sizes a request of that many prompt tokens plus the answer fits in, and the others."""
    limit = max_model_len() - RESERVE - answer_tokens
    return [s for s in sizes if s <= limit], [s for s in sizes if s > limit]


def lengths_note(used, dropped) -> str:
    note = "lengths " + ", ".join(f"{s:,}" for s in used) if used else "no length fits"
    if dropped:
        note += (f"; {', '.join(f'{s:,}' for s in dropped)} not run (over max_model_len "
                 f"{max_model_len():,} less {RESERVE} + answer)")
    return note


# --- prompts -------------------------------------------------------------------------------------
_TOKENS_PER_FILLER: list[float] = []


def tokens_per_filler() -> float:
    """Tokens of one FILLER sentence (asked of the server once)."""
    if not _TOKENS_PER_FILLER:
        _TOKENS_PER_FILLER.append(count_tokens(FILLER * 50) / 50)
    return _TOKENS_PER_FILLER[0]


def filler(tokens: int) -> str:
    return FILLER * max(1, int(tokens / tokens_per_filler()))


def needle(rng: random.Random) -> tuple[str, str, str]:
    """A random code for a random name: the code, its sentence and the question that asks for it."""
    code = f"{rng.randrange(10**6):06d}"
    name = rng.choice(["Aldebaran", "Bellatrix", "Capella", "Deneb", "Electra", "Fomalhaut"])
    return code, f"The secret code of {name} is {code}. ", f"\n\nWhat is the secret code of {name}? Answer with the six digits only."


def needle_prompt(tokens: int, depth: float, rng: random.Random, head: str = "") -> tuple[list[dict], str]:
    """A prompt of about `tokens` tokens (never more) with a secret code at `depth`; `head` goes first."""
    code, sentence, question = needle(rng)
    body = filler(tokens - 60)
    cut = int(len(body) * depth)
    cut = body.rfind(". ", 0, cut) + 2 if cut else 0
    return [{"role": "user", "content": head + body[:cut] + sentence + body[cut:] + question}], code


def code_span(token_strs: list[str], code: str) -> tuple[int, int]:
    """Token indices [first, end) of the tokens that spell the last `code` in the prompt (its digits may
    be one token each or grouped)."""
    ends = list(itertools.accumulate(map(len, token_strs)))
    at = "".join(token_strs).rfind(code)
    if at < 0:
        raise GateError(f"the code {code} is not in the tokenized prompt")
    first = next(i for i, end in enumerate(ends) if end > at)
    return first, next(i for i, end in enumerate(ends) if end >= at + len(code)) + 1


def cache_edge_needle_prompt(tokens: int, rng: random.Random, head: str) -> tuple[list[dict], str, int]:
    """A needle prompt of at most `tokens` tokens, its code last before the question, that a warm run's
    prefix hit cuts inside the code: the cached blocks end after the code's first token(s), so the rest
    of the code are the first tokens computed, on the conv state of the hit's last block (a snapshot not
    restored shows there, where a needle deep in the cached part would not notice it). The filler before
    the needle starts mid-word, by as many characters as it takes. Returns the messages, the code and the
    tokens a warm run must find cached."""
    code, sentence, question = needle(rng)
    text = filler(tokens)
    chars_per_token = len(FILLER) / tokens_per_filler()
    start = int((BLOCK_SIZE + 64) * chars_per_token)   # room to add a block's tokens and stay under `tokens`
    for _ in range(64):
        messages = [{"role": "user", "content": head + text[start:] + sentence + question}]
        out = post_ok("/tokenize", {"model": MODEL, "messages": messages, "return_token_strs": True}, timeout=120)
        first, end = code_span(out["token_strs"], code)
        cut = (out["count"] - 1) // BLOCK_SIZE * BLOCK_SIZE    # a hit keeps the full blocks but the last token's
        want = first + (end - first) // 2                       # the middle of the code (its start if one token)
        if first < cut < end or cut == want:
            return messages, code, cut
        shift = (cut - want + BLOCK_SIZE // 2) % BLOCK_SIZE - BLOCK_SIZE // 2    # tokens to add before the needle
        start = max(0, start - (round(shift * chars_per_token) or (1 if shift > 0 else -1)))
    raise GateError(f"no filler start found that puts a block boundary inside the code ({tokens:,} tokens)")


def fresh_head() -> str:
    """A first line no earlier request had: the prompt after it cannot hit the prefix cache."""
    return f"Document {random.SystemRandom().randrange(16**12):012x}. "


def run_needle(tokens: int, depth: float, seed: int, head: str = "") -> bool:
    messages, code = needle_prompt(tokens, depth, random.Random(seed), head)
    out = chat(messages, max_tokens=24, temperature=0.0,
               chat_template_kwargs={"reasoning_effort": "none"})
    return code in (out["choices"][0]["message"].get("content") or "")


def needle_gate(sizes, depths) -> tuple[bool | None, str]:
    used, dropped = fitting(sizes)
    if not used:
        return SKIP, f"skipped: {lengths_note(used, dropped)}"
    cases = [(s, d) for s in used for d in depths]
    found = sum(run_needle(s, d, seed=i) for i, (s, d) in enumerate(cases))
    if STAND_IN:
        return SKIP, f"{NEEDS_MODEL}: {len(cases)} needle requests served, recall not judged; {lengths_note(used, dropped)}"
    return found == len(cases), f"{found}/{len(cases)}; {lengths_note(used, dropped)}"


# --- quick gates ---------------------------------------------------------------------------------
def gate_preflight() -> tuple[bool | None, str]:
    """The image's own preflight (python3 -m inkling_hpu.preflight, from $COOKBOOK): commits, the port's
    runner patches and stamp, the KV layout, the served checkpoint's token ids, the plugin, the parsers
    through vLLM's plugin loader, the CPU tests.
    Skipped from a machine where the port is not installed (a client of the server)."""
    from importlib.metadata import entry_points

    names = [ep.value for ep in entry_points(group="vllm.general_plugins")]
    cookbook = os.environ.get("COOKBOOK", "/opt/gaudi-cookbook")
    if "inkling_hpu:register" not in names or not Path(cookbook, "fixes", "apply_all.py").is_file():
        return SKIP, (f"skipped: not inside the image (no inkling_hpu entry point for {sys.executable} or no "
                      f"cookbook at {cookbook}); run the gates inside the port image for this one")
    model = SERVER.get("root")      # the served checkpoint, when it is a folder here: its token ids are checked
    proc = subprocess.run([sys.executable, "-m", "inkling_hpu.preflight", "--json",
                           *(["--model", str(Path(model).resolve())] if model and Path(model).is_dir() else [])],
                          capture_output=True, text=True, cwd=cookbook)
    try:
        report = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return False, f"preflight printed no report (exit {proc.returncode}): {proc.stderr[-300:]}"
    parts = [f"{c['name']} {c['status']}" + (f" ({c['detail']})" if c["name"] == "CPU tests" or c["status"] != "pass" else "")
             for c in report["checks"]]
    return bool(report["ok"]), "; ".join(parts)


WEATHER_TOOL = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def gate_smoke() -> tuple[bool | None, str]:
    failures = []
    out = chat([{"role": "user", "content": "What is 17 + 25? Answer with the number only."}],
               max_tokens=answer_tokens(512), temperature=0.0)
    if "42" not in (out["choices"][0]["message"].get("content") or ""):
        failures.append("arithmetic")
    out = chat([{"role": "user", "content": "Give a JSON object with keys a=1 and b=2."}], max_tokens=answer_tokens(512),
               temperature=0.0, response_format={"type": "json_object"})
    try:
        if json.loads(out["choices"][0]["message"]["content"]) != {"a": 1, "b": 2}:
            failures.append("JSON mode (values)")
    except (ValueError, TypeError):
        failures.append("JSON mode (not JSON)")
    if STAND_IN:  # tool calls need the page's tool parser and a model that calls tools
        return SKIP, f"{NEEDS_MODEL}: arithmetic and JSON mode served, answers not judged; tool calls not sent"
    for choice in ("auto", "required"):
        out = chat([{"role": "user", "content": "What is the weather in Paris?"}], tools=WEATHER_TOOL,
                   tool_choice=choice, max_tokens=512, temperature=0.0)
        calls = out["choices"][0]["message"].get("tool_calls") or []
        if not calls or calls[0]["function"]["name"] != "get_weather" or \
                "city" not in json.loads(calls[0]["function"]["arguments"] or "{}"):
            failures.append(f"tool call ({choice})")
    return not failures, "pass" if not failures else "fail: " + ", ".join(failures)


MARKERS = re.compile(r"<\|(message_|content_|end_message)")


def gate_greedy() -> tuple[bool, str]:
    """Model-independent: three greedy runs and a streamed greedy run give the same text."""
    messages = [{"role": "user", "content": "Name three prime numbers above 100, briefly."}]
    outs = [chat(messages, max_tokens=128, temperature=0.0)["choices"][0]["message"]["content"] or ""
            for _ in range(3)]
    streamed = stream_chat(messages, max_tokens=128, temperature=0.0)["content"]
    variants = len(set(outs + [streamed]))
    if not outs[0]:
        return False, "fail: greedy output is empty"
    return variants == 1, (f"3 greedy runs and 1 streamed: {variants} variant(s) of {len(outs[0])} chars"
                           + ("" if variants == 1 else f"; first: {outs[0][:60]!r}, streamed: {streamed[:60]!r}"))


def gate_reasoning_tools() -> tuple[bool | None, str]:
    failures = []
    msg = chat([{"role": "user", "content": "Think, then answer: is 221 prime?"}], max_tokens=answer_tokens(1024),
               temperature=0.0)["choices"][0]["message"]
    reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
    if not reasoning or not msg.get("content") or MARKERS.search(reasoning + msg["content"]):
        failures.append("reasoning split")
    streamed = stream_chat([{"role": "user", "content": "Think, then answer: is 221 prime?"}],
                           max_tokens=answer_tokens(1024),
                           temperature=0.0)
    if not streamed["reasoning"] or MARKERS.search(streamed["reasoning"] + streamed["content"]):
        failures.append("streamed reasoning")
    if STAND_IN:
        return SKIP, f"{NEEDS_MODEL}: reasoning requests served, split not judged; streamed tool call not sent"
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}}]
    streamed = stream_chat([{"role": "user", "content": "What time is it in UTC? Use the tool."}], tools=tools,
                           max_tokens=512, temperature=0.0)
    if "get_time" not in streamed["tools"] or MARKERS.search(streamed["content"] + streamed["tools"]):
        failures.append("streamed tool call")
    return not failures, "pass" if not failures else "fail: " + ", ".join(failures)


def gate_needles_short() -> tuple[bool | None, str]:
    return needle_gate([3000, 6000], [0.02, 0.98])


def gate_needles_mid() -> tuple[bool | None, str]:
    return needle_gate([8192, 32768, 131072], [0.1, 0.5, 0.9])


TOP_K = 5
LOGPROB_REQUESTS = int(os.environ.get("LOGPROB_REQUESTS", "200"))


def logprobs_problem(entry: dict, k: int = TOP_K) -> str | None:
    """What is wrong with one token's logprobs in vLLM's format, or None. vLLM lists the sampled
    token first in top_logprobs, then the top k (the sampled token once, if it is among them): so
    k or k+1 entries, the first equal to the token's own, the rest sorted, every value finite and <= 0."""
    tops = entry.get("top_logprobs") or []
    values = [t["logprob"] for t in tops]
    if not (math.isfinite(entry["logprob"]) and entry["logprob"] <= 0):
        return f"token {entry['token']!r}: logprob {entry['logprob']} (expected finite, <= 0)"
    if len(tops) not in (k, k + 1):
        return f"token {entry['token']!r}: {len(tops)} top_logprobs (expected {k} or {k + 1})"
    if not all(math.isfinite(v) and v <= 0 for v in values):
        return f"token {entry['token']!r}: top_logprobs {values} (expected finite, <= 0)"
    if tops[0]["token"] != entry["token"] or tops[0]["logprob"] != entry["logprob"]:
        return (f"first top_logprobs entry {tops[0]['token']!r} {tops[0]['logprob']} is not the sampled "
                f"token {entry['token']!r} {entry['logprob']}")
    if values[1:] != sorted(values[1:], reverse=True):
        return f"token {entry['token']!r}: top-k after the sampled token not sorted: {values[1:]}"
    return None


def gate_logprobs() -> tuple[bool, str]:
    problems: list[str] = []

    def one(i: int) -> bool:
        out = chat([{"role": "user", "content": f"Write one sentence about the number {i}."}], max_tokens=48,
                   temperature=0.7, seed=i, logprobs=True, top_logprobs=TOP_K)
        entries = out["choices"][0]["logprobs"]["content"]
        if not entries:
            problems.append(f"request {i}: no logprobs entries")
            return False
        for entry in entries:
            problem = logprobs_problem(entry)
            if problem:
                problems.append(f"request {i}: {problem}")
                return False
        return True

    with ThreadPoolExecutor(8) as pool:
        ok = sum(pool.map(one, range(LOGPROB_REQUESTS)))
    result = f"{ok}/{LOGPROB_REQUESTS} clean (sampled token first, then top {TOP_K} sorted)"
    return ok == LOGPROB_REQUESTS, result + (f"; first problem: {problems[0]}" if problems else "")


def cached_tokens(out: dict) -> int:
    details = (out.get("usage") or {}).get("prompt_tokens_details")
    if not details or details.get("cached_tokens") is None:
        raise GateError("usage.prompt_tokens_details.cached_tokens missing from the response: start the server "
                        f"with --enable-prompt-tokens-details (usage was {out.get('usage')})")
    return int(details["cached_tokens"])


def gate_prefix_cache() -> tuple[bool | None, str]:
    """Each prompt twice, cold then warm. Each prompt starts with its own header, so the cold run
    shares no block with anything sent before (cached_tokens must be 0) and the warm run must hit
    every full block but the last token's (cached_tokens >= prompt_tokens - block size). Outputs
    must be byte-identical or first differ at a near-tie (top-2 logprob gap < 0.5); every warm run
    must recall its code (trained model only); with PREFIX_LOGPROB_TOLERANCE, the tokens both runs sampled
    must carry the same logprobs within it. Half the codes sit at depth 0.5, in the hit's blocks;
    the other half are cut by the hit's last block (cache_edge_needle_prompt): the warm run computes
    the rest of the code on the conv state restored from that block."""
    cases, answer = 14, 48
    size = min(4096, max_model_len() - RESERVE - answer)     # the page used 4,096-token prompts
    identical, near_tie_splits, problems, prompt_sizes, colds, warms = 0, 0, [], [], [], []
    recalled = {"at depth 0.5": 0, "cut by the hit": 0}
    drift = dict.fromkeys(recalled, 0.0)
    for i in range(cases):
        rng, kind = random.Random(1000 + i), list(recalled)[i % 2]
        if i % 2:
            messages, code, cut = cache_edge_needle_prompt(size, rng, fresh_head())
        else:
            (messages, code), cut = needle_prompt(size, 0.5, rng, head=fresh_head()), None
        runs = [chat(messages, max_tokens=answer, temperature=0.0, logprobs=True, top_logprobs=2)
                for _ in range(2)]
        prompt_tokens = runs[0]["usage"]["prompt_tokens"]
        prompt_sizes.append(prompt_tokens)
        cold, warm = cached_tokens(runs[0]), cached_tokens(runs[1])
        colds.append(cold)
        warms.append(warm)
        if cold != 0:
            problems.append(f"prompt {i}: cold run cached_tokens {cold}, expected 0")
        if warm < prompt_tokens - BLOCK_SIZE:
            problems.append(f"prompt {i}: warm run cached_tokens {warm} of {prompt_tokens} prompt tokens, "
                            f"expected >= {prompt_tokens - BLOCK_SIZE} (prompt less one block of {BLOCK_SIZE})")
        elif cut is not None and warm != cut:
            problems.append(f"prompt {i}: warm run cached_tokens {warm}, expected {cut} (the cut inside the code)")
        choices = [r["choices"][0] for r in runs]
        texts = [c["message"]["content"] or "" for c in choices]
        recalled[kind] += code in texts[1]
        drift[kind] = max(drift[kind], logprob_drift(*(c["logprobs"]["content"] for c in choices)))
        if texts[0] == texts[1]:
            identical += 1
            continue
        for a, b in zip(choices[0]["logprobs"]["content"], choices[1]["logprobs"]["content"]):
            if a["token"] != b["token"]:
                gaps = [abs(r["top_logprobs"][0]["logprob"] - r["top_logprobs"][1]["logprob"]) for r in (a, b)]
                near_tie_splits += min(gaps) < 0.5
                break
    splits = cases - identical
    lengths = f"prompts of {min(prompt_sizes):,}-{max(prompt_sizes):,} tokens (max_model_len {max_model_len():,})"
    hits = ", ".join(f"{n}/{cases // 2} {kind}" for kind, n in recalled.items())
    result = (f"cached_tokens: cold {min(colds):,}-{max(colds):,}, warm {min(warms):,}-{max(warms):,} "
              f"(expected 0, and >= prompt less {BLOCK_SIZE}); {identical}/{cases} "
              f"byte-identical; {near_tie_splits}/{splits} splits at a near-tie; "
              + (f"recall {NEEDS_MODEL}" if STAND_IN else
                 f"{sum(recalled.values())}/{cases} hits recalled their code ({hits})")
              + f"; {lengths}")
    judge_drift = PREFIX_LOGPROB_TOLERANCE is not None
    result += ("; warm logprobs off the cold run's by at most " + ", ".join(f"{d:.1e} {kind}" for kind, d in drift.items())
               + (f" (tolerance {PREFIX_LOGPROB_TOLERANCE:.0e})" if judge_drift else " (not judged)"))
    if problems:
        result += f"; {len(problems)} cache problem(s), first: {problems[0]}"
    passed = (not problems and near_tie_splits == splits and (STAND_IN or sum(recalled.values()) == cases)
              and not (judge_drift and max(drift.values()) > PREFIX_LOGPROB_TOLERANCE))
    return passed, result


def logprob_drift(cold: list[dict], warm: list[dict]) -> float:
    """The largest |logprob difference| over the tokens both runs sampled, up to where they split."""
    shared = itertools.takewhile(lambda pair: pair[0]["token"] == pair[1]["token"], zip(cold, warm))
    return max((abs(a["logprob"] - b["logprob"]) for a, b in shared), default=0.0)


def gate_concurrent_needles() -> tuple[bool | None, str]:
    used, dropped = fitting([4096])
    size = used[0] if used else max_model_len() - RESERVE - 24    # the page's 4K, or the most that fits
    with ThreadPoolExecutor(16) as pool:
        found = sum(pool.map(lambda i: run_needle(size, 0.5, seed=2000 + i), range(16)))
    note = f"prompts of {size:,} tokens"
    if STAND_IN:
        return SKIP, f"{NEEDS_MODEL}: 16 concurrent needle requests served, recall not judged; {note}"
    return found == 16, f"{found}/16; {note}"


def gate_overlong_prompt() -> tuple[bool, str]:
    target = max_model_len() + max(64, max_model_len() // 128)   # the page: 264,111 for 262,144
    text = filler(target)
    tokens = count_tokens(text)
    if tokens <= max_model_len():
        return False, f"fail: the prompt built has {tokens:,} tokens, expected more than max_model_len {max_model_len():,}"
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": text}]}
    start = time.perf_counter()
    status, out = post("/v1/chat/completions", body)
    seconds = time.perf_counter() - start
    result = f"{tokens:,}-token prompt (max_model_len {max_model_len():,}): HTTP {status} in {seconds:.1f} s"
    if status != 400:
        result += f" (expected 400); request {describe(body)}; server: {server_message(out)[:200]}"
    return status == 400, result


def gate_server_log() -> tuple[bool | None, str]:
    path = os.environ.get("SERVER_LOG")
    if not path:
        return SKIP, "skipped: set SERVER_LOG to the server's log file"
    log = Path(path).read_text(errors="replace")
    pool = re.search(r"KV pool: (\d+) blocks = (\d+) tokens = ([\d.]+) x max_model_len (\d+)", log)
    groups = re.findall(r"(\d+) KV group \((\w+)\)", log)
    window = re.search(r"Inkling decode window: (\d+) blocks", log)
    checks = {"one KV group": bool(groups) and groups[-1][0] == "1" and groups[-1][1].startswith("FullAttentionSpecx"),
              "pool line": bool(pool) and int(pool.group(2)) >= int(pool.group(4)),
              "decode window of 5 blocks": bool(window) and window.group(1) == "5"}
    failed = [name for name, ok in checks.items() if not ok]
    return not failed, "pass" if not failed else f"missing from {path}: " + ", ".join(failed)


# --- long gates ----------------------------------------------------------------------------------
def require_idle(wait_s: float = 60) -> None:
    """No request running or waiting (streams a previous gate closed take a moment to be aborted)."""
    deadline = time.monotonic() + wait_s
    while True:
        m = metrics()
        busy = m.get("vllm:num_requests_running", 0.0) + m.get("vllm:num_requests_waiting", 0.0)
        if not busy:
            return
        if time.monotonic() > deadline:
            raise GateError(f"server busy: {busy:.0f} requests running or waiting after {wait_s:.0f} s (expected 0)")
        time.sleep(0.5)


def gate_needles_long() -> tuple[bool | None, str]:
    return needle_gate([200_000, 250_000], [0.1, 0.5, 0.9])


# The server's --max-num-batched-tokens (the page's 2048): how many steps a long prompt's prefill takes.
MAX_NUM_BATCHED_TOKENS = int(os.environ.get("MAX_NUM_BATCHED_TOKENS", "2048"))


def resident_tokens(prompt: int, budget: int | None = None, requests: int = 3) -> int:
    """Output tokens that keep the first of `requests` prompts decoding until the last one's prefill is
    done, on a healthy server without the long-prefill share: each step decodes one token per running
    request and spends the rest of the budget on prefill, so the prefills take at most `requests` x
    ceil(prompt / (budget - requests)) steps; a margin on top. `budget`: MAX_NUM_BATCHED_TOKENS by default."""
    budget = budget or MAX_NUM_BATCHED_TOKENS
    return requests * math.ceil(prompt / (budget - requests)) + 16


RESIDENT_CAP = 32_768   # the most output tokens a resident decodes while it waits for the others to start
# The least room a resident gets to decode in. With the long-prefill share, decode-only steps come between
# the chunks, each a token for every running request: about (chunk step time / decode step time) per chunk
# at share 0.5, a ratio resident_tokens cannot know (the CPU server: 2-4 at a budget of 64, 20-40 at 1024).
RESIDENT_ROOM_MIN = 1024
ANSWER_TOKENS = 24      # a needle's answer


def resident_sizes(target: int = 100_000) -> tuple[int, int]:
    """(prompt tokens, the most output tokens each) for the three-resident gate: the page's 100K, or what
    leaves room for twice resident_tokens and at least RESIDENT_ROOM_MIN."""
    limit = max_model_len() - RESERVE
    size = min(target, limit)
    while limit - size < max(RESIDENT_ROOM_MIN, 2 * resident_tokens(size)):
        size -= 128
    return size, min(limit - size, RESIDENT_CAP)


def timed_needle(size: int, max_tokens: int, seed: int, started: list | None = None, requests: int = 1) -> dict:
    """One streamed needle request (a fresh head: a cold prefill) that decodes up to `max_tokens`
    (ignore_eos): when its first token came (its prefill was done: it was running) and when it ended,
    on this process's clock. With `started`, a list shared by `requests` such calls: each adds its first
    token's time there, and stops (closes its stream: vLLM aborts it) once all have started and it has
    its answer's tokens; one that reaches `max_tokens` first ends on its own."""
    messages, code = needle_prompt(size, 0.5, random.Random(seed), fresh_head())
    first: list[float] = []
    tokens = [0]

    def on_delta(delta, event) -> bool:
        if not first:
            first.append(time.perf_counter())
            if started is not None:
                started.append(first[0])
        tokens[0] += 1
        return started is not None and len(started) == requests and tokens[0] >= ANSWER_TOKENS

    out = stream_chat(messages, on_delta=on_delta, max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                      chat_template_kwargs={"reasoning_effort": "none"})
    return {"first": first[0] if first else None, "end": time.perf_counter(), "found": code in out["content"],
            "tokens": tokens[0]}


def gate_three_resident() -> tuple[bool | None, str]:
    """Three long prompts at once must be resident together (each admitted, prefilled and holding its
    KV at the same moment) with no preemption. Each decodes until all three have started (or up to
    the room the context leaves, RESIDENT_CAP at most), so on a healthy server the first is still
    decoding when the last finishes its prefill, at any prompt/budget ratio and with the long-prefill
    share's decode-only steps between the chunks; all three ran together iff the latest first token
    (client clock) came before the earliest end. A request that queued (no free seat) ends on its own
    first; a preemption (no room in the pool) is counted. /metrics polling is reported beside it."""
    size, max_tokens = resident_sizes()
    require_idle()
    before = metric("vllm:num_preemptions_total")
    started: list[float] = []
    with MetricsWatch() as watch, ThreadPoolExecutor(3) as pool:
        runs = list(pool.map(lambda i: timed_needle(size, max_tokens, 3000 + i, started, 3), range(3)))
    preempted = metric("vllm:num_preemptions_total") - before
    firsts = [r["first"] for r in runs]
    overlap = (min(r["end"] for r in runs) - max(firsts)) if None not in firsts else None
    found = sum(r["found"] for r in runs)
    together = overlap is not None and overlap > 0
    result = ((f"all 3 running together for {overlap:.2f} s" if together else
               f"never all 3 running together (overlap {'none' if overlap is None else f'{overlap:.2f} s'})")
              + f" (most in /metrics samples: {watch.max_running():.0f}/3 of {len(watch.samples)}); "
              f"{preempted:.0f} preemptions; prompts of {size:,} tokens, each decoding until all 3 started "
              f"(at most {max_tokens:,} tokens, the most decoded {max(r['tokens'] for r in runs):,}; "
              f"--max-num-batched-tokens {MAX_NUM_BATCHED_TOKENS}); "
              + (f"needles {NEEDS_MODEL}" if STAND_IN else f"{found}/3 needles"))
    return together and preempted == 0 and (STAND_IN or found == 3), result


DECODE_STREAMS = int(os.environ.get("DECODE_STREAMS", "15"))   # --max-num-seqs 16 less the long prompt
STREAM_WARMUP_S = float(os.environ.get("STREAM_WARMUP_S", "30"))
STREAM_WINDOW_S = float(os.environ.get("STREAM_WINDOW_S", "30"))
ADMIT_TIMEOUT_S = float(os.environ.get("ADMIT_TIMEOUT_S", "120"))  # long prompt not running by then: queued


def long_prompt_beside_streams(n: int, size: int, warmup_s: float, window_s: float,
                               admit_timeout_s: float = ADMIT_TIMEOUT_S) -> dict:
    """n streams decode; then a needle prompt of `size` tokens is sent. Returns what happened:
    `admitted_after` (seconds until vllm:num_requests_running reached n + 1, None: it queued),
    `prefill` (seconds from admission to its first token), the streams' tok/s each `before`
    (the `window_s` before it was sent) and `during` (its prefill, not its own decoding, whose steps
    attend over its whole context), streams `alive` at its end, `found`, `errors`.
    Tokens are counted exactly: each stream reads vLLM's running usage (continuous_usage_stats), since
    the server merges the deltas of a slow reader into one event. The /metrics poller and the token
    sampler run through both windows, so the client's own load is the same before and during."""
    stream_tokens = min(8192, max_model_len() - RESERVE)
    require_idle()
    counts, alive, stop, errors = [0] * n, [False] * n, threading.Event(), []
    out: dict = {"n": n, "size": size, "errors": errors, "admitted_after": None}

    def stream(i: int) -> None:
        def on_delta(delta, event):
            counts[i] = (event.get("usage") or {}).get("completion_tokens", counts[i])
            return stop.is_set()
        alive[i] = True
        try:
            stream_chat([{"role": "user", "content": f"Count slowly from 1 upwards, story {i}."}], on_delta=on_delta,
                        max_tokens=stream_tokens, temperature=0.8, seed=i, ignore_eos=True,
                        stream_options={"include_usage": True, "continuous_usage_stats": True})
        except Exception as exc:                                    # reported by the caller
            errors.append(f"stream {i}: {exc}")
        alive[i] = False

    snapshots: list[tuple[float, int]] = []                         # (time, tokens of all streams)
    sampler_stop = threading.Event()

    def sample():
        while not sampler_stop.is_set():
            snapshots.append((time.perf_counter(), sum(counts)))
            sampler_stop.wait(0.05)

    def rate(start: float, end: float) -> float:
        tokens_at = lambda t: next((c for when, c in snapshots if when >= t), snapshots[-1][1])  # noqa: E731
        return (tokens_at(end) - tokens_at(start)) / max(end - start, 1e-9) / n

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    long_result: list = []
    long_thread = threading.Thread(target=lambda: long_result.append(timed_needle(size, ANSWER_TOKENS, 4000)), daemon=True)
    sampler = threading.Thread(target=sample, daemon=True)
    try:
        with MetricsWatch(period=0.05) as watch:
            deadline = time.monotonic() + 120
            while watch.latest_running() < n and time.monotonic() < deadline and not errors:
                time.sleep(0.2)
            if errors or watch.latest_running() < n:
                out["streams_not_running"] = True
                return out
            sampler.start()
            time.sleep(warmup_s + window_s)                        # streams reach steady decode, then the window
            sent = time.perf_counter()
            long_thread.start()
            while long_thread.is_alive() and watch.first_time(n + 1, after=sent) is None \
                    and time.perf_counter() - sent < admit_timeout_s:
                long_thread.join(0.1)
            if watch.first_time(n + 1, after=sent) is not None:
                long_thread.join(TIMEOUT)
            ended = time.perf_counter()
            out["alive"] = sum(alive)
        admitted = watch.first_time(n + 1, after=sent)
        out.update(max_running=watch.max_running(), waited=ended - sent, before=rate(sent - window_s, sent))
    finally:
        stop.set()
        sampler_stop.set()
        for t in threads:
            t.join(30)
    if admitted is None:
        long_thread.join(TIMEOUT)                                  # runs alone now that the streams stopped
        return out
    if not long_result or long_result[0]["first"] is None:
        return {**out, "admitted_after": admitted - sent, "finished": False}
    prefilled = long_result[0]["first"]                             # its first token: the prefill is done
    out.update(admitted_after=admitted - sent, prefill=prefilled - admitted, finished=True,
               found=long_result[0]["found"], during=rate(admitted, prefilled))
    return out


# The long-prefill share the server runs with (fix vllm-long-prefill-share; the page exports 0.5 and a
# 32768-token threshold before `vllm serve`: run the gates in that shell, or set them). Unset: the page's.
LONG_PREFILL_SHARE = float(os.environ.get("VLLM_LONG_PREFILL_SHARE") or "0.5")
LONG_PREFILL_MIN_TOKENS = int(os.environ.get("VLLM_LONG_PREFILL_MIN_TOKENS") or "32768")
# Run-to-run noise allowed in the ratio: 0.05 on a dedicated node (the CPU server, a shared 2-core
# machine, allows more: tools/cpu_server.CPU_SERVER_SHARE_TOLERANCE).
SHARE_TOLERANCE = float(os.environ.get("LONG_PREFILL_TOLERANCE") or "0.05")


def decode_only_share(share: float, chunks: int) -> float:
    """The least part of a long prompt's prefill (`chunks` chunks) that decode-only steps get. Steps that
    carry a chunk take at most `share` of the wall-clock; after each chunk, decode-only steps run until
    the share is met again, and after the last one the prefill is over. So before chunk k, decode-only
    time >= (k - 1) t_chunk (1 - share) / share: (k - 1)(1 - share) / ((k - 1)(1 - share) + k share),
    0.43 at 4 chunks, 0.498 at the page's 123 (250,000 tokens at 2,048 less 15 decodes per step)."""
    decode_only = (chunks - 1) * (1 - share)
    return decode_only / (decode_only + chunks * share)


def share_floor(share: float, chunks: int) -> float:
    """The least rate the streams keep while the long prompt prefills, as a fraction of their rate
    before: decode-only steps run at the rate before (the chunk steps' own decodes add
    t_decode / t_chunk on top, left out), less the noise."""
    return decode_only_share(share, chunks) - SHARE_TOLERANCE


def gate_long_prefill_with_decodes() -> tuple[bool | None, str]:
    """DECODE_STREAMS streams decode; a long needle prompt is sent. The long prompt must be admitted
    while every stream still runs (vllm:num_requests_running reaches streams + 1: not queued), and
    the streams must keep at least share_floor(VLLM_LONG_PREFILL_SHARE, its chunks) of their rate before
    while it prefills ("during": from its admission to its end, not from when it was sent)."""
    n = DECODE_STREAMS
    used, _ = fitting([250_000])
    size = used[0] if used else max_model_len() - RESERVE - 24
    r = long_prompt_beside_streams(n, size, STREAM_WARMUP_S, STREAM_WINDOW_S)
    if r.get("streams_not_running"):
        return False, f"fail: the {n} streams did not all run within 120 s ({r['errors'][:1] or 'no error'})"
    if r["admitted_after"] is None:
        return False, (f"fail: the long prompt did not run beside the {n} streams within {r['waited']:.0f} s "
                       f"(most running at once {r['max_running']:.0f}, expected {n + 1}): it queued")
    if not r["finished"]:
        return False, f"fail: the long prompt gave no token within {TIMEOUT:.0f} s of its admission"
    ratio = r["during"] / r["before"] if r["before"] > 0 else 0.0
    if size >= LONG_PREFILL_MIN_TOKENS:
        chunks = math.ceil(size / (MAX_NUM_BATCHED_TOKENS - n))
        floor = share_floor(LONG_PREFILL_SHARE, chunks)
        judged = (f"ratio {ratio:.2f}, expected >= {floor:.2f} (VLLM_LONG_PREFILL_SHARE {LONG_PREFILL_SHARE:g}, "
                  f"{chunks} chunks at --max-num-batched-tokens {MAX_NUM_BATCHED_TOKENS:,})")
    else:
        floor = 0.0
        judged = (f"ratio {ratio:.2f}, not judged against the share: the prompt is under "
                  f"VLLM_LONG_PREFILL_MIN_TOKENS {LONG_PREFILL_MIN_TOKENS:,}")
    result = (f"{size:,}-token prompt beside {n} streams: admitted after {r['admitted_after']:.1f} s, prefilled "
              f"in {r['prefill']:.1f} s with {n + 1} running; streams {r['before']:.1f} tok/s before, "
              f"{r['during']:.1f} during: {judged}; {r['alive']}/{n} streams alive at its end; "
              + (f"needle {NEEDS_MODEL}" if STAND_IN else f"needle {'found' if r['found'] else 'missed'}"))
    errors = r["errors"]
    passed = (r["during"] > 0 and ratio >= floor and r["alive"] == n and not errors
              and (STAND_IN or r["found"]))
    return passed, result + (f"; {errors[0]}" if errors else "")


GATES = {
    "quick": [
        ("preflight", "Preflight: plugin, parsers, KV layout, token ids and the CPU tests inside the image", gate_preflight),
        ("smoke", "Smoke: arithmetic, tool call, JSON mode, tool_choice required", gate_smoke),
        ("greedy", "Greedy repeats and a streamed greedy run give the same text", gate_greedy),
        ("reasoning", "Reasoning split, streamed reasoning and tool call without block markers", gate_reasoning_tools),
        ("needles-short", "Needles at both ends of 3K and 6K prompts (2 and 3 prefill chunks)", gate_needles_short),
        ("needles-mid", "Needles at 8K, 32K and 131K, depths 0.1 / 0.5 / 0.9", gate_needles_mid),
        ("logprobs", f"{LOGPROB_REQUESTS} logprobs requests at concurrency 8", gate_logprobs),
        ("prefix-cache", "Prefix-cache hit vs cold, 14 prompts (cached_tokens, output)", gate_prefix_cache),
        ("concurrent-needles", "16 concurrent 4K needles", gate_concurrent_needles),
        ("overlong", "A prompt longer than --max-model-len", gate_overlong_prompt),
        ("server-log", "Server log: one KV group, the pool line, decode window of 5 blocks", gate_server_log),
    ],
    "long": [
        ("needles-long", "Needles at 200K and 250K, depths 0.1 / 0.5 / 0.9", gate_needles_long),
        ("three-resident", "Three 100K-token prompts resident at once", gate_three_resident),
        ("prefill-with-decodes", f"A 250K prompt while {DECODE_STREAMS} streams decode", gate_long_prefill_with_decodes),
    ],
}


def discover() -> None:
    """The served model and its real max_model_len, from /v1/models."""
    global MODEL
    with urllib.request.urlopen(BASE_URL + "/v1/models", timeout=30) as resp:
        models = json.loads(resp.read())["data"]
    chosen = next((m for m in models if m["id"] == MODEL), None) if MODEL else models[0]
    if chosen is None:
        raise GateError(f"MODEL={MODEL!r} is not served; /v1/models lists {[m['id'] for m in models]}")
    if not chosen.get("max_model_len"):
        raise GateError(f"/v1/models gives no max_model_len for {chosen['id']}: {chosen}")
    MODEL = chosen["id"]
    SERVER.update(model=MODEL, max_model_len=int(chosen["max_model_len"]), root=chosen.get("root"))


EXIT_PASSED, EXIT_FAILED, EXIT_USAGE, EXIT_NO_SERVER, EXIT_SKIPPED = 0, 1, 2, 3, 4


def verdict(rows: list[dict], allowed: set[str], stand_in: bool) -> tuple[int, str]:
    """(exit code, summary line) of a run. A skip is not a pass: the run passes (0) only when every
    gate was judged and passed, or skipped where the caller accepted it (`allowed` gate names; with
    STAND_IN=1, exactly the rows that need a trained model). A failure gives 1, else an unaccepted
    skip gives 4."""
    judged = [r for r in rows if r["passed"] is not None]
    passed = [r for r in judged if r["passed"]]
    skipped = [r for r in rows if r["passed"] is None]

    def accepted(row: dict) -> bool:
        return row["gate"] in allowed or (stand_in and row["result"].startswith(NEEDS_MODEL))

    unaccepted = [r["gate"] for r in skipped if not accepted(r)]
    why = "; ".join(f"{r['gate']}: {re.split(r' [(]|;|:', r['result'].removeprefix('skipped: '), maxsplit=1)[0]}"
                    f"{'' if accepted(r) else ' (NOT accepted)'}" for r in skipped)
    summary = f"{len(judged)} judged, {len(passed)} passed, {len(skipped)} skipped" + (f" ({why})" if skipped else "")
    if len(passed) < len(judged):
        return EXIT_FAILED, summary
    if unaccepted:
        return EXIT_SKIPPED, (summary + f"; skipped and not accepted: {', '.join(unaccepted)} "
                              "(accept with --allow-skip, or run where they can be judged)")
    return EXIT_PASSED, summary


def _names(option: str, text: str, known: list[str]) -> list[str] | None:
    names = [n for n in text.split(",") if n] if text else []
    unknown = sorted(set(names) - set(known))
    if unknown:
        print(f"error: {option}: unknown gate(s) {unknown}; this mode has {known}", file=sys.stderr)
        return None
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="run_gates.sh")
    parser.add_argument("mode", choices=sorted(GATES))
    parser.add_argument("--only", default="", help="comma-separated gate names")
    parser.add_argument("--allow-skip", default="", help="comma-separated gate names whose skip is accepted")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    gates = GATES[args.mode]
    known = [g[0] for g in gates]
    wanted, allowed = _names("--only", args.only, known), _names("--allow-skip", args.allow_skip, known)
    if wanted is None or allowed is None:
        return EXIT_USAGE
    if wanted:
        gates = [g for g in gates if g[0] in wanted]
    try:
        discover()
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: no server at BASE_URL={BASE_URL!r}: {exc}", file=sys.stderr)
        return EXIT_NO_SERVER
    except GateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_NO_SERVER
    rows = []
    for name, title, fn in gates:
        start = time.perf_counter()
        try:
            passed, result = fn()
        except Exception as exc:                       # a gate that errors has failed
            passed, result = False, f"error: {type(exc).__name__}: {exc}"
        rows.append({"gate": name, "title": title, "passed": passed, "result": result,
                     "seconds": round(time.perf_counter() - start, 1)})
        print(f"[{name}] {result}", file=sys.stderr, flush=True)
    code, summary = verdict(rows, set(allowed), STAND_IN)
    if args.json:
        print(json.dumps({"base_url": BASE_URL, "stand_in": STAND_IN, **SERVER, "gates": rows,
                          "allowed_skips": allowed, "summary": summary, "exit_code": code}, indent=2))
    else:
        print(f"run_gates.sh {args.mode} against {BASE_URL} ({MODEL}, max_model_len {max_model_len():,}"
              f"{', stand-in checkpoint' if STAND_IN else ''}):")
        print("| Gate | Result |")
        print("|---|---|")
        for row in rows:
            mark = {True: "", False: " (FAIL)", None: " (skipped)"}[row["passed"]]
            mark = "" if row["result"].startswith("skipped") else mark
            print(f"| {row['title']} | {row['result']}{mark} |")
        print(f"\n{summary}")
    return code


if __name__ == "__main__":
    sys.exit(main())
