"""The gates' own checks on hand-made inputs: vLLM's logprobs format (the sampled token first, then
the top k) and lengths derived from the server's max_model_len. The same checks run against a real
server in test_gates_cpu_server.py."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

GATES_PY = Path(__file__).resolve().parents[1] / "hpu" / "gates.py"


@pytest.fixture()
def gates(monkeypatch):
    # gates.py's settings at their defaults: inside a port container run_gates.sh's own environment
    # (LONG_PREFILL_TOLERANCE, MAX_NUM_BATCHED_TOKENS, ...) reaches the preflight's run of these tests
    for name in set(re.findall(r'os\.environ\.get\("([A-Z0-9_]+)"', GATES_PY.read_text())):
        monkeypatch.delenv(name, raising=False)
    spec = importlib.util.spec_from_file_location("gates_under_test", GATES_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.SERVER.update(model="m", max_model_len=4096)
    return module


def entry(token, logprob, tops):
    return {"token": token, "logprob": logprob, "top_logprobs": [{"token": t, "logprob": v} for t, v in tops]}


TOP5 = [("a", -0.5), ("b", -1.0), ("c", -2.0), ("d", -3.0), ("e", -4.0)]


def test_vllm_format_is_clean(gates):
    # a sampled token outside the top 5 comes first, then the top 5: k + 1 entries, not sorted overall
    assert gates.logprobs_problem(entry("z", -6.0, [("z", -6.0)] + TOP5)) is None
    # the sampled token is the top-1: listed once first, then the rest of the top 5
    assert gates.logprobs_problem(entry("a", -0.5, [("a", -0.5)] + TOP5[1:])) is None


@pytest.mark.parametrize("bad, expected", [
    (entry("z", -6.0, [("z", -6.0)] + TOP5[:3]), "4 top_logprobs (expected 5 or 6)"),
    (entry("z", -6.0, [("a", -0.5)] + TOP5[1:] + [("z", -6.0)]), "is not the sampled token"),
    (entry("z", -6.0, [("z", -5.9)] + TOP5), "is not the sampled token"),
    (entry("z", -6.0, [("z", -6.0), ("b", -1.0), ("a", -0.5)] + TOP5[2:]), "not sorted"),
    (entry("z", float("-inf"), [("z", float("-inf"))] + TOP5), "expected finite"),
    (entry("z", 0.3, [("z", 0.3)] + TOP5), "expected finite, <= 0"),
    (entry("z", -6.0, [("z", -6.0)] + TOP5[:4] + [("e", float("nan"))]), "expected finite"),
])
def test_each_format_violation_is_named(gates, bad, expected):
    problem = gates.logprobs_problem(bad)
    assert problem and expected in problem, f"expected {expected!r}, found {problem!r}"


def test_lengths_come_from_max_model_len(gates):
    assert gates.fitting([3000, 6000]) == ([3000], [6000])
    note = gates.lengths_note(*gates.fitting([8192, 32768]))
    assert note.startswith("no length fits") and "max_model_len 4,096" in note
    gates.SERVER["max_model_len"] = 262144
    assert gates.fitting([200_000, 250_000]) == ([200_000, 250_000], [])


@pytest.mark.parametrize("token_strs, span", [
    (["Ġis", "Ġ", "4", "8", "3", "9", "2", "1", ".", "Ġ4", "8"], (2, 8)),   # one digit a token (the tiny tokenizer)
    (["Ġis", "Ġ483", "921", "."], (1, 3)),                                  # grouped digits
    (["▁is", "▁483921."], (1, 2)),                                          # the code inside one token
    (["483", "921", "Ġand", "Ġ483", "92", "1"], (3, 6)),                    # the last one, when it recurs
])
def test_code_span_finds_the_codes_tokens(gates, token_strs, span):
    """The prefix-cache gate cuts a prompt inside its code by these token indices."""
    assert gates.code_span(token_strs, "483921") == span


def test_code_span_names_a_missing_code(gates):
    with pytest.raises(gates.GateError, match="483921 is not in the tokenized prompt"):
        gates.code_span(["Ġis", "Ġ48", "39"], "483921")


def test_request_errors_carry_the_request_and_the_servers_message(gates):
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 8}
    text = gates.describe(body)
    assert "<5,000 chars>" in text and '"max_tokens": 8' in text
    assert gates.server_message({"error": {"message": "This model's maximum context length is 4096"}}) \
        == "This model's maximum context length is 4096"


def _row(gate, passed, result):
    return {"gate": gate, "passed": passed, "result": result}


def test_a_skip_is_not_a_pass(gates):
    """Exit 0 only when every gate was judged and passed or its skip was accepted: --allow-skip names
    gates, STAND_IN accepts exactly the rows that need a trained model. Otherwise 4; a failure, 1."""
    rows = [_row("greedy", True, "3 greedy runs"),
            _row("preflight", None, "skipped: not inside the image (no entry point)"),
            _row("smoke", None, gates.NEEDS_MODEL + ": arithmetic served, not judged"),
            _row("needles-mid", None, "skipped: no length fits; 8,192 not run")]
    code, summary = gates.verdict(rows, set(), stand_in=False)
    assert code == gates.EXIT_SKIPPED == 4
    assert summary.startswith("1 judged, 1 passed, 3 skipped (preflight: not inside the image (NOT accepted); "
                              "smoke: needs a trained model (NOT accepted); needles-mid: no length fits (NOT accepted))")
    assert "skipped and not accepted: preflight, smoke, needles-mid" in summary
    code, summary = gates.verdict(rows, set(), stand_in=True)      # STAND_IN accepts the smoke row only
    assert code == 4 and "not accepted: preflight, needles-mid" in summary
    code, summary = gates.verdict(rows, {"preflight", "needles-mid"}, stand_in=True)
    assert code == 0 and summary == ("1 judged, 1 passed, 3 skipped (preflight: not inside the image; "
                                     "smoke: needs a trained model; needles-mid: no length fits)")
    code, _ = gates.verdict(rows + [_row("overlong", False, "HTTP 200")], {"preflight", "needles-mid"}, True)
    assert code == gates.EXIT_FAILED == 1


def simulate_chunked_prefill(prompt: int, budget: int, max_tokens: int, requests: int = 3,
                             decode_only_per_chunk: int = 0) -> float:
    """Steps of a chunked-prefill scheduler (decodes first, one token each; the rest of the budget to
    prefills in arrival order; with the long-prefill share, `decode_only_per_chunk` decode-only steps
    after each step that carried a chunk): the latest first token's step less the earliest end's (< 0:
    the three were never all running)."""
    left, out, first, end = [prompt] * requests, [0] * requests, [None] * requests, [None] * requests
    step = deferred = 0
    while None in end:
        step += 1
        room = budget
        for r in range(requests):                       # decodes
            if first[r] is not None and end[r] is None:
                out[r] += 1
                room -= 1
                if out[r] == max_tokens:
                    end[r] = step
        if deferred:                                    # a decode-only step: the share defers the chunk
            deferred -= 1
            continue
        for r in range(requests):                       # prefill chunks
            if left[r] and room:
                chunk = min(left[r], room)
                left[r] -= chunk
                room -= chunk
                deferred = decode_only_per_chunk
                if not left[r]:
                    first[r], out[r] = step, 1          # the prefill's step samples the first token
    return min(end) - max(first)


def test_three_resident_outputs_outlast_the_prefills_at_any_ratio(gates):
    """The old 24 output tokens: at the page's ratio (100K prompts, budget 2048) the first request ends
    long before the third is prefilled, so a healthy node could never pass. resident_tokens keeps all
    three running together, at the page's ratio and at the CPU server's."""
    assert simulate_chunked_prefill(100_000, 2048, 24) < 0
    for prompt, budget in ((100_000, 2048), (3_863, 80), (3_900, 1024), (250_000, 2048)):
        assert simulate_chunked_prefill(prompt, budget, gates.resident_tokens(prompt, budget)) > 0, (prompt, budget)
    # each decodes until all three started: the most it may decode is the room the context leaves
    gates.SERVER.update(max_model_len=262144)
    assert gates.resident_sizes() == (100_000, gates.RESIDENT_CAP)
    gates.SERVER.update(max_model_len=4096)
    gates.MAX_NUM_BATCHED_TOKENS = 64
    size, tokens = gates.resident_sizes()
    assert size + tokens == 4096 - gates.RESERVE and tokens >= 2 * gates.resident_tokens(size, 64), (size, tokens)
    assert (size, tokens) == (3_008, gates.RESIDENT_ROOM_MIN)          # ratio 47, the page 49
    gates.MAX_NUM_BATCHED_TOKENS = 1024
    assert gates.resident_sizes() == (3_008, gates.RESIDENT_ROOM_MIN)


def test_three_resident_room_outlasts_the_long_prefill_share(gates):
    """With the long-prefill share a decode-only step follows each chunk for about every (chunk step /
    decode step) of time: residents capped at resident_tokens end before the third starts, as the
    old 256-token room did on a busy CPU server (overlap -2.58 s at a budget of 1024). The room
    resident_sizes leaves holds at ratios 2-3 times those the CPU server shows (2-4 at a budget of 64,
    20-40 at 1024; at 64 it holds to 9), and the page's 32,768 at 100K prompts holds at 100."""
    assert simulate_chunked_prefill(3_776, 1024, 256, decode_only_per_chunk=40) < 0
    for context, budget, ratio in ((4096, 64, 8), (4096, 1024, 120), (262144, 2048, 100)):
        gates.SERVER.update(max_model_len=context)
        gates.MAX_NUM_BATCHED_TOKENS = budget
        prompt, tokens = gates.resident_sizes()
        assert simulate_chunked_prefill(prompt, budget, tokens, decode_only_per_chunk=ratio) > 0, (context, budget)


def decode_only_part(share: float, chunks: int, t_chunk: float, t_decode: float) -> float:
    """The part of a long prefill that decode-only steps take under the long-prefill share's rule
    (fix vllm-long-prefill-share: a chunk waits while the chunks' time exceeds `share` of all step time
    since the prefill began), from its first chunk to the end of its last."""
    long_time = total = decode_only = 0.0
    done = 0
    while done < chunks:
        if done and long_time > share * total:
            decode_only += t_decode
            total += t_decode
        else:
            long_time += t_chunk
            total += t_chunk
            done += 1
    return decode_only / total


@pytest.mark.parametrize("share", [0.25, 0.5, 0.75, 1.0])
@pytest.mark.parametrize("chunks", [1, 2, 4, 17, 123])
def test_the_share_floor_is_what_the_scheduler_rule_guarantees(gates, share, chunks):
    """decode_only_share is a lower bound of what the rule gives at any step costs, and a tight one."""
    parts = [decode_only_part(share, chunks, t_chunk, t_decode)
             for t_chunk, t_decode in ((1.4, 0.04), (0.3, 0.05), (2.0, 0.035), (1.0, 0.3))]
    bound = gates.decode_only_share(share, chunks)
    assert min(parts) >= bound - 1e-9, (parts, bound)
    assert min(parts) <= bound + 0.05, (parts, bound)                  # decode steps overshoot by one at most
    assert gates.share_floor(share, chunks) == pytest.approx(bound - gates.SHARE_TOLERANCE)


def test_the_floor_at_the_page_s_settings(gates):
    # 250,000 tokens beside 15 decodes at --max-num-batched-tokens 2048: 123 chunks, share 0.5
    assert gates.decode_only_share(0.5, 123) == pytest.approx(0.498, abs=1e-3)
    assert gates.share_floor(0.5, 123) == pytest.approx(0.448, abs=1e-3)
    assert gates.share_floor(0.5, 4) == pytest.approx(0.379, abs=1e-3)      # the CPU server: 4,008 at 1,024
    assert gates.share_floor(1.0, 123) < 0                                 # share 1 promises nothing
