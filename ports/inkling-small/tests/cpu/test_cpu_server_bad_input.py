"""Bad requests against the real vLLM 0.30.0 CPU server with the port (the tiny Inkling, the recipe's CPU
variant): each gets a 4xx naming the problem, or is served as vLLM 0.30.0 documents (below), while other
clients stream; afterwards /health is OK, the streams carry transformers' greedy tokens, requests sharing
prefixes still equal transformers', and the server log holds no engine error. One server for the module;
the token-id edges come from its checkpoint folder (`checkpoint_edges`)."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest

from cpu_server_helpers import assert_concurrent_shared_prefixes_equal_transformers, reference_greedy, served_reference

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(2400)]

MODEL = "tiny-inkling-stand-in"
MESSAGES = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@dataclass(frozen=True)
class Case:
    name: str
    body: dict | bytes                  # a JSON body, or raw bytes sent as application/json
    status: int                         # the status expected
    says: str = ""                      # a part of the error message naming the problem
    path: str = "/v1/completions"


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": [5, 6], "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **fields}


def token_id_cases(rows: int, vocab: int, tokenizer_largest: int) -> list[Case]:
    """Prompt ids at every edge: vLLM admits up to max(its tokenizer max_token_id, vocab_size - 1); the port
    refuses to start unless each of those has an embedding row, so the first id past them is a 400."""
    served = {"tokenizer's largest": tokenizer_largest, "vocab - 1": vocab - 1, "vocab": vocab,
              "last embedding row": rows - 1}
    cases = [Case(f"prompt id {i} ({what})", completion(prompt=[5, i]), 200) for what, i in served.items()]
    return cases + [
        Case(f"prompt id {rows} (embedding rows)", completion(prompt=[5, rows]), 400,
             f"Token id {rows} is out of vocabulary"),
        Case("prompt id -1", completion(prompt=[5, -1]), 400, "greater than or equal to 0"),
        Case("prompt id 10**9", completion(prompt=[5, 10**9]), 400, "Token id 1000000000 is out of vocabulary"),
        Case("prompt id 2**63", completion(prompt=[5, 2**63]), 400, f"Token id {2**63} is out of vocabulary"),
        Case("prompt id 10**20", completion(prompt=[[5, 6], [5, 10**20]]), 400, "is out of vocabulary"),
        Case("stop_token_ids past vocab", completion(stop_token_ids=[vocab]), 400, "out-of-vocab token ids"),
        Case("logit_bias past vocab", completion(logit_bias={str(vocab): 1}), 400, "out-of-vocab token ids"),
        Case("allowed_token_ids past vocab", completion(allowed_token_ids=[vocab]), 400, "out-of-vocab token id"),
        Case("logprob_token_ids past vocab", completion(logprobs=1, logprob_token_ids=[vocab]), 400,
             "out-of-vocab token ids"),
    ]


TOO_LONG = [5] * 5000
CASES = [
    Case("empty prompt", completion(prompt=""), 400, "must be provided and non-empty"),
    Case("empty prompt list", completion(prompt=[]), 400, "at least one prompt"),
    Case("empty message list", chat(messages=[]), 400, "empty conversation", "/v1/chat/completions"),
    Case("max_tokens 0", completion(max_tokens=0), 400, "max_tokens must be at least 1, got 0"),
    Case("max_tokens -1", completion(max_tokens=-1), 400, "max_tokens must be at least 1, got -1"),
    Case("max_tokens past the context", completion(max_tokens=5000), 400, "cannot be greater than max_model_len"),
    Case("max_completion_tokens 0", chat(max_completion_tokens=0), 400, "max_tokens must be at least 1",
         "/v1/chat/completions"),
    Case("logprobs 21", completion(logprobs=21), 400, "greater than max allowed: 20"),
    Case("logprobs -1 (the vocabulary)", completion(logprobs=-1), 400, "greater than max allowed: 20"),
    Case("top_logprobs 21", chat(logprobs=True, top_logprobs=21), 400, "greater than max allowed: 20",
         "/v1/chat/completions"),
    Case("prompt_logprobs 21", completion(prompt_logprobs=21), 400, "prompt logprobs of 21"),
    Case("prompt_logprobs -2", completion(prompt_logprobs=-2), 400, "must be a positive value or -1"),
    Case("n 0", completion(n=0), 400, "n must be at least 1"),
    Case("n 16385", completion(n=16385), 400, "n must be at most 16384"),
    Case("n 2 greedy", completion(n=2, temperature=0), 400, "n must be 1 when using greedy sampling"),
    Case("response_format malformed schema", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}), 400, "Invalid type: nonsense", "/v1/chat/completions"),
    Case("response_format unsatisfiable schema", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}), 400, "Unsatisfiable schema",
        "/v1/chat/completions"),
    Case("response_format bad pattern", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(["}}}), 400, "regex parse error", "/v1/chat/completions"),
    Case("response_format json_schema without schema", chat(response_format={"type": "json_schema"}), 400,
         "'json_schema' field must be provided", "/v1/chat/completions"),
    Case("tool without function", chat(tools=[{"type": "function"}]), 400, "tools.0.function", "/v1/chat/completions"),
    Case("tool parameters not an object", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
         400, "tools.0.function.parameters", "/v1/chat/completions"),
    Case("tool without name", chat(tools=[{"type": "function", "function": {"parameters": {}}}]), 400,
         "tools.0.function.name", "/v1/chat/completions"),
    Case("tool_choice naming no tool", chat(tools=[WEATHER], tool_choice={"type": "function", "function": {
        "name": "nope"}}), 400, "does not match any of the specified `tools`", "/v1/chat/completions"),
    Case("tool_choice required without tools", chat(tool_choice="required"), 400, "`tools` must be set",
         "/v1/chat/completions"),
    Case("unknown chat role", chat(messages=[{"role": "wizard", "content": "hi"}]), 400,
         "unsupported message role wizard", "/v1/chat/completions"),
    Case("body not JSON", b"{not json", 400, "JSON decode error"),
    Case("body not UTF-8", b'{"model": "tiny-inkling-stand-in", "prompt": "\xff\xfe", "max_tokens": 2}', 400,
         "error parsing the body"),
    Case("body a JSON list", b"[1, 2]", 400, "valid dictionary"),
    Case("prompt over --max-model-len", completion(prompt=TOO_LONG), 400, "maximum context length is 4096 tokens"),
    Case("chat prompt over --max-model-len", chat(messages=[{"role": "user", "content": "7 " * 5000}]), 400,
         "maximum context length is 4096 tokens", "/v1/chat/completions"),
    Case("5 stop strings", completion(stop=[f"s{i}" for i in range(5)]), 400, "List should have at most 4 items"),
    Case("10,000 stop strings", completion(stop=[f"s{i}" for i in range(10000)]), 400, "List should have at most 4 items"),
    Case("temperature NaN", b'{"model": "tiny-inkling-stand-in", "prompt": [5, 6], "temperature": NaN}', 400,
         "temperature must be a finite number"),
    Case("unknown model", completion(model="nope"), 404, "The model `nope` does not exist"),
    # Served by vLLM 0.30.0's design (the port README's "what a bad request can still do"): best_of is
    # accepted and ignored (v1 has no best_of), a stop string may be of any length, n up to 16,384.
    Case("best_of 1000 (ignored)", completion(best_of=1000), 200),
    Case("a 100,000-character stop string", completion(stop=["x" * 100_000]), 200),
]


def send(base_url: str, case: Case) -> tuple[int, str]:
    data = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
    request = urllib.request.Request(base_url + case.path, data, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def checkpoint_edges(model_dir) -> tuple[int, int, int]:
    """(embedding rows, vLLM's vocab_size, the tokenizer's largest id) of the served checkpoint."""
    from transformers import AutoTokenizer

    from inkling_hpu.model import InklingPortConfig

    raw = json.loads((model_dir / "config.json").read_text())
    largest = max(AutoTokenizer.from_pretrained(str(model_dir)).get_vocab().values())
    return InklingPortConfig.from_dict(raw).vocab_rows, raw["vocab_size"], largest


class Stream(threading.Thread):
    """One greedy streamed completion (ignore_eos), its token ids as they arrive and when the last came."""

    def __init__(self, base_url: str, prompt: list[int], max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.base_url, self.prompt, self.max_tokens = base_url, prompt, max_tokens
        self.tokens: list[int] = []
        self.last_token_at = 0.0
        self.error: Exception | None = None

    def run(self) -> None:
        body = json.dumps({"model": MODEL, "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0,
                           "ignore_eos": True, "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True})
        request = urllib.request.Request(self.base_url + "/v1/completions", body.encode(),
                                         {"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                for line in response:
                    line = line.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    logprobs = json.loads(line[6:])["choices"][0].get("logprobs") or {}
                    self.tokens += [int(t.split(":", 1)[1]) for t in logprobs.get("tokens", [])]
                    self.last_token_at = time.monotonic()
        except Exception as exc:       # reported by the test, with the tokens received so far
            self.error = exc


def test_bad_requests_get_4xx_while_other_clients_stream_unharmed(server):
    import torch

    reference, vocab_out = served_reference(server)
    generator = torch.Generator().manual_seed(23)
    prompts = [torch.randint(10, vocab_out, (length,), generator=generator).tolist() for length in (30, 200, 400)]
    streams = [Stream(server.base_url, prompt, 160) for prompt in prompts]
    for stream in streams:
        stream.start()
    while not all(stream.tokens for stream in streams):     # every stream decoding before the first bad request
        assert all(stream.is_alive() for stream in streams), [stream.error for stream in streams]
        time.sleep(0.05)
    cases = token_id_cases(*checkpoint_edges(server.model)) + CASES
    answers = {case.name: send(server.base_url, case) for case in cases}
    bad_done = time.monotonic()
    for stream in streams:
        stream.join(600)

    wrong = {case.name: (status, text[:300]) for case in cases for status, text in [answers[case.name]]
             if status != case.status or case.says not in text}
    assert not wrong, f"expected status and message differ: {wrong}"
    with urllib.request.urlopen(server.base_url + "/health", timeout=30) as health:
        assert health.status == 200
    for stream in streams:
        assert stream.error is None, stream.error
        assert stream.last_token_at > bad_done, "the streams ended before the bad requests did: nothing overlapped"
        want = reference_greedy(reference, vocab_out, stream.prompt, stream.max_tokens)
        assert stream.tokens == want, f"{len(stream.prompt)}-token stream beside the bad requests: server " \
                                      f"{stream.tokens}, transformers {want}"
    assert_concurrent_shared_prefixes_equal_transformers(server)
    log = server.log.read_text(errors="replace")
    for sign in ("EngineDeadError", "Traceback", "EngineCore encountered"):
        assert sign not in log, f"{sign} in the server log:\n{server.tail(60)}"
