"""The page's serving gates (run through run_gates.sh). Python standard library only, so it runs
in the image or on any client machine. Each gate returns (passed, result text); the table at the
end has the page's shape. Gates that need something absent (SERVER_LOG, the image's tests) are
reported as skipped with the reason, never as passed.
"""
from __future__ import annotations

import argparse
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
MODEL = os.environ.get("MODEL", "thinkingmachines/Inkling-Small")
MAX_MODEL_LEN = int(os.environ.get("MAX_MODEL_LEN", "262144"))
TIMEOUT = float(os.environ.get("GATE_TIMEOUT", "900"))
PORT_DIR = Path(__file__).resolve().parents[2]
SKIP = None  # a gate result that is neither pass nor fail

FILLER = ("The committee reviewed the quarterly figures, noted the weather in the northern valley, "
          "and moved on to the next item on a long and uneventful agenda. ")


# --- HTTP --------------------------------------------------------------------------------------
def post(path: str, body: dict, timeout: float = TIMEOUT) -> tuple[int, dict]:
    req = urllib.request.Request(BASE_URL + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        try:
            return err.code, json.loads(err.read() or b"{}")
        except ValueError:
            return err.code, {}


def chat(messages, **params) -> dict:
    status, body = post("/v1/chat/completions", {"model": MODEL, "messages": messages, **params})
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {json.dumps(body)[:300]}")
    return body


def stream_chat(messages, on_delta=None, **params) -> dict:
    """Streamed chat; returns the joined content/reasoning/tool-call text and the raw deltas."""
    body = {"model": MODEL, "messages": messages, "stream": True, **params}
    req = urllib.request.Request(BASE_URL + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    content, reasoning, tools, chunks = [], [], [], 0
    with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            choices = json.loads(line[5:])["choices"]
            delta = choices[0]["delta"] if choices else {}
            chunks += 1
            content.append(delta.get("content") or "")
            reasoning.append(delta.get("reasoning_content") or delta.get("reasoning") or "")
            for call in delta.get("tool_calls") or []:
                tools.append(json.dumps(call))
            if on_delta:
                on_delta(delta)
    return {"content": "".join(content), "reasoning": "".join(reasoning), "tools": "".join(tools), "chunks": chunks}


def count_tokens(text: str) -> int:
    status, body = post("/tokenize", {"model": MODEL, "prompt": text})
    if status != 200:
        raise RuntimeError(f"/tokenize: HTTP {status}")
    return int(body["count"])


def metric(name: str) -> float:
    with urllib.request.urlopen(BASE_URL + "/metrics", timeout=60) as resp:
        text = resp.read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)]
    return sum(values)


# --- prompts -------------------------------------------------------------------------------------
_TOKENS_PER_FILLER: list[float] = []


def filler(tokens: int) -> str:
    if not _TOKENS_PER_FILLER:
        _TOKENS_PER_FILLER.append(count_tokens(FILLER * 50) / 50)
    return FILLER * max(1, int(tokens / _TOKENS_PER_FILLER[0]))


def needle_prompt(tokens: int, depth: float, rng: random.Random) -> tuple[list[dict], str]:
    code = f"{rng.randrange(10**6):06d}"
    name = rng.choice(["Aldebaran", "Bellatrix", "Capella", "Deneb", "Electra", "Fomalhaut"])
    body = filler(tokens - 60)
    cut = int(len(body) * depth)
    cut = body.rfind(". ", 0, cut) + 2 if cut else 0
    text = body[:cut] + f"The secret code of {name} is {code}. " + body[cut:]
    question = f"\n\nWhat is the secret code of {name}? Answer with the six digits only."
    return [{"role": "user", "content": text + question}], code


def run_needle(tokens: int, depth: float, seed: int) -> bool:
    messages, code = needle_prompt(tokens, depth, random.Random(seed))
    out = chat(messages, max_tokens=24, temperature=0.0,
               chat_template_kwargs={"reasoning_effort": "none"})
    return code in (out["choices"][0]["message"].get("content") or "")


def needle_gate(sizes, depths) -> tuple[bool, str]:
    cases = [(s, d) for s in sizes for d in depths]
    found = sum(run_needle(s, d, seed=i) for i, (s, d) in enumerate(cases))
    return found == len(cases), f"{found}/{len(cases)}"


# --- quick gates ---------------------------------------------------------------------------------
def gate_preflight() -> tuple[bool | None, str]:
    from importlib.metadata import entry_points

    names = [ep.value for ep in entry_points(group="vllm.general_plugins")]
    if "inkling_hpu:register" not in names:
        return False, f"inkling_hpu entry point not installed for {sys.executable}"
    if os.environ.get("PREFLIGHT_TESTS") != "1":
        return SKIP, "plugin installed; CPU tests not run (set PREFLIGHT_TESTS=1 inside the image)"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(PORT_DIR / "tests" / "cpu")], capture_output=True, text=True, cwd=PORT_DIR.parents[1])
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-200:]
    return proc.returncode == 0, summary


def gate_smoke() -> tuple[bool, str]:
    failures = []
    out = chat([{"role": "user", "content": "What is 17 + 25? Answer with the number only."}],
               max_tokens=512, temperature=0.0)
    if "42" not in (out["choices"][0]["message"].get("content") or ""):
        failures.append("arithmetic")
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                              "required": ["city"]}}}]
    for choice in ("auto", "required"):
        out = chat([{"role": "user", "content": "What is the weather in Paris?"}], tools=tools, tool_choice=choice,
                   max_tokens=512, temperature=0.0)
        calls = out["choices"][0]["message"].get("tool_calls") or []
        if not calls or calls[0]["function"]["name"] != "get_weather" or \
                "city" not in json.loads(calls[0]["function"]["arguments"] or "{}"):
            failures.append(f"tool call ({choice})")
    out = chat([{"role": "user", "content": "Give a JSON object with keys a=1 and b=2."}], max_tokens=512,
               temperature=0.0, response_format={"type": "json_object"})
    try:
        if json.loads(out["choices"][0]["message"]["content"]) != {"a": 1, "b": 2}:
            failures.append("JSON mode (values)")
    except (ValueError, TypeError):
        failures.append("JSON mode (not JSON)")
    return not failures, "pass" if not failures else "fail: " + ", ".join(failures)


MARKERS = re.compile(r"<\|(message_|content_|end_message)")


def gate_greedy_reasoning_streaming() -> tuple[bool, str]:
    failures = []
    messages = [{"role": "user", "content": "Name three prime numbers above 100, briefly."}]
    outs = {chat(messages, max_tokens=128, temperature=0.0)["choices"][0]["message"]["content"] for _ in range(3)}
    if len(outs) != 1:
        failures.append(f"greedy repeats differ ({len(outs)} variants)")
    msg = chat([{"role": "user", "content": "Think, then answer: is 221 prime?"}], max_tokens=1024,
               temperature=0.0)["choices"][0]["message"]
    reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
    if not reasoning or not msg.get("content") or MARKERS.search(reasoning + msg["content"]):
        failures.append("reasoning split")
    streamed = stream_chat([{"role": "user", "content": "Think, then answer: is 221 prime?"}], max_tokens=1024,
                           temperature=0.0)
    if not streamed["reasoning"] or MARKERS.search(streamed["reasoning"] + streamed["content"]):
        failures.append("streamed reasoning")
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}}]
    streamed = stream_chat([{"role": "user", "content": "What time is it in UTC? Use the tool."}], tools=tools,
                           max_tokens=512, temperature=0.0)
    if "get_time" not in streamed["tools"] or MARKERS.search(streamed["content"] + streamed["tools"]):
        failures.append("streamed tool call")
    return not failures, "pass" if not failures else "fail: " + ", ".join(failures)


def gate_needles_short() -> tuple[bool, str]:
    return needle_gate([3000, 6000], [0.02, 0.98])


def gate_needles_mid() -> tuple[bool, str]:
    return needle_gate([8192, 32768, 131072], [0.1, 0.5, 0.9])


def gate_logprobs() -> tuple[bool, str]:
    def one(i: int) -> bool:
        out = chat([{"role": "user", "content": f"Write one sentence about the number {i}."}], max_tokens=48,
                   temperature=0.7, seed=i, logprobs=True, top_logprobs=5)
        entries = out["choices"][0]["logprobs"]["content"]
        for entry in entries:
            tops = [t["logprob"] for t in entry["top_logprobs"]]
            if not (math.isfinite(entry["logprob"]) and entry["logprob"] <= 0 and len(tops) == 5
                    and tops == sorted(tops, reverse=True) and all(math.isfinite(t) for t in tops)):
                return False
        return bool(entries)

    with ThreadPoolExecutor(8) as pool:
        ok = sum(pool.map(one, range(200)))
    return ok == 200, f"{ok}/200 clean"


def gate_prefix_cache() -> tuple[bool, str]:
    """Each prompt twice: cold, then a prefix-cache hit. Every hit must recall its code; an output
    that differs from the cold one must first differ at a near-tie (top-2 logprob gap < 0.5)."""
    identical, recalled, near_tie_splits, cases = 0, 0, 0, 14
    for i in range(cases):
        messages, code = needle_prompt(4096, 0.5, random.Random(1000 + i))
        runs = [chat(messages, max_tokens=48, temperature=0.0, logprobs=True, top_logprobs=2)["choices"][0]
                for _ in range(2)]
        texts = [r["message"]["content"] or "" for r in runs]
        recalled += code in texts[1]
        if texts[0] == texts[1]:
            identical += 1
            continue
        for a, b in zip(runs[0]["logprobs"]["content"], runs[1]["logprobs"]["content"]):
            if a["token"] != b["token"]:
                gaps = [abs(r["top_logprobs"][0]["logprob"] - r["top_logprobs"][1]["logprob"]) for r in (a, b)]
                near_tie_splits += min(gaps) < 0.5
                break
    splits = cases - identical
    passed = recalled == cases and near_tie_splits == splits
    return passed, (f"{recalled}/{cases} hits recalled their code; {identical}/{cases} byte-identical; "
                    f"{near_tie_splits}/{splits} splits at a near-tie")


def gate_concurrent_needles() -> tuple[bool, str]:
    with ThreadPoolExecutor(16) as pool:
        found = sum(pool.map(lambda i: run_needle(4096, 0.5, seed=2000 + i), range(16)))
    return found == 16, f"{found}/16"


def gate_overlong_prompt() -> tuple[bool, str]:
    target = MAX_MODEL_LEN + 1967                      # the page used a 264,111-token prompt
    text = filler(target)
    tokens = count_tokens(text)
    start = time.perf_counter()
    status, _ = post("/v1/chat/completions", {"model": MODEL, "max_tokens": 8,
                                              "messages": [{"role": "user", "content": text}]})
    seconds = time.perf_counter() - start
    return status == 400, f"{tokens:,}-token prompt: HTTP {status} in {seconds:.1f} s"


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
    return not failed, "pass" if not failed else "missing: " + ", ".join(failed)


# --- long gates ----------------------------------------------------------------------------------
def gate_needles_long() -> tuple[bool, str]:
    return needle_gate([200_000, 250_000], [0.1, 0.5, 0.9])


def gate_three_resident() -> tuple[bool, str]:
    before = metric("vllm:num_preemptions_total")
    with ThreadPoolExecutor(3) as pool:
        found = sum(pool.map(lambda i: run_needle(100_000, 0.5, seed=3000 + i), range(3)))
    preempted = metric("vllm:num_preemptions_total") - before
    return found == 3 and preempted == 0, f"{found}/3 needles; {preempted:.0f} preemptions"


def gate_long_prefill_with_decodes() -> tuple[bool, str]:
    counts, stop = [0] * 16, threading.Event()

    def stream(i: int) -> None:
        def on_delta(delta):
            counts[i] += 1
            if stop.is_set():
                raise StopIteration
        try:
            stream_chat([{"role": "user", "content": f"Count slowly from 1 upwards, story {i}."}], on_delta=on_delta,
                        max_tokens=8192, temperature=0.8, seed=i, ignore_eos=True)
        except StopIteration:
            pass

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(16)]
    for t in threads:
        t.start()
    time.sleep(30)                                     # streams reach steady decode
    c0, t0 = sum(counts), time.perf_counter()
    time.sleep(30)
    before = (sum(counts) - c0) / (time.perf_counter() - t0) / 16
    c1, t1 = sum(counts), time.perf_counter()
    found = run_needle(250_000, 0.5, seed=4000)
    long_seconds = time.perf_counter() - t1
    during = (sum(counts) - c1) / long_seconds / 16
    stop.set()
    return found and during > 0, (f"needle {'found' if found else 'missed'}, {long_seconds:.0f} s for the 250K "
                                  f"request; streams {before:.1f} tok/s before, {during:.1f} during")


GATES = {
    "quick": [
        ("preflight", "Preflight: plugin, parsers, KV layout and the CPU tests inside the image", gate_preflight),
        ("smoke", "Smoke: arithmetic, tool call, JSON mode, tool_choice required", gate_smoke),
        ("greedy", "Greedy repeats, reasoning split, streamed reasoning and tool call without block markers",
         gate_greedy_reasoning_streaming),
        ("needles-short", "Needles at both ends of 3K and 6K prompts (2 and 3 prefill chunks)", gate_needles_short),
        ("needles-mid", "Needles at 8K, 32K and 131K, depths 0.1 / 0.5 / 0.9", gate_needles_mid),
        ("logprobs", "200 logprobs requests at concurrency 8", gate_logprobs),
        ("prefix-cache", "Prefix-cache hit vs cold output, 14 prompts", gate_prefix_cache),
        ("concurrent-needles", "16 concurrent 4K needles", gate_concurrent_needles),
        ("overlong", "A prompt longer than --max-model-len", gate_overlong_prompt),
        ("server-log", "Server log: one KV group, the pool line, decode window of 5 blocks", gate_server_log),
    ],
    "long": [
        ("needles-long", "Needles at 200K and 250K, depths 0.1 / 0.5 / 0.9", gate_needles_long),
        ("three-resident", "Three 100K-token prompts resident at once", gate_three_resident),
        ("prefill-with-decodes", "A 250K prompt while 16 streams decode", gate_long_prefill_with_decodes),
    ],
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="run_gates.sh")
    parser.add_argument("mode", choices=sorted(GATES))
    parser.add_argument("--only", default="", help="comma-separated gate names")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    gates = GATES[args.mode]
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {g[0] for g in gates})
        if unknown:
            print(f"error: unknown gate(s) {unknown}; {args.mode} has {[g[0] for g in gates]}", file=sys.stderr)
            return 2
        gates = [g for g in gates if g[0] in wanted]
    try:
        urllib.request.urlopen(BASE_URL + "/v1/models", timeout=30).read()
    except (OSError, ValueError) as exc:
        print(f"error: no server at BASE_URL={BASE_URL!r}: {exc}", file=sys.stderr)
        return 3
    rows, failed = [], False
    for name, title, fn in gates:
        start = time.perf_counter()
        try:
            passed, result = fn()
        except Exception as exc:                       # a gate that errors has failed
            passed, result = False, f"error: {type(exc).__name__}: {exc}"
        failed |= passed is False
        rows.append({"gate": name, "title": title, "passed": passed, "result": result,
                     "seconds": round(time.perf_counter() - start, 1)})
        print(f"[{name}] {result}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"run_gates.sh {args.mode} against {BASE_URL} ({MODEL}):")
        print("| Gate | Result |")
        print("|---|---|")
        for row in rows:
            mark = "" if row["passed"] else (" (skipped)" if row["passed"] is None else " (FAIL)")
            print(f"| {row['title']} | {row['result']}{mark} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
