"""prompt-order: decodes-first reordering keeps prompts in order, and a swap drops the cached
prompt-token matrix (used for penalties when no request was added or removed).

Real HPUModelRunner on CPU (tests/gaudi_harness), hand-made logits, all requests greedy with
repetition_penalty 10 (so only the prompt-token rows differ between them).

Stale cache. Rows [C, A, B]: C decodes, A is a long chunked prefill, B's prompt [5, 6] ends in step
2 (a step with no add/remove and no swap: the runner caches the prompt-token matrix). In step 3 B
is a decode and is swapped before A. Observed on pristine 091bbadd: B's penalty rows carry A's
prompt [10, 11, ..., 25, 10, ...] in its 3 decode steps, so B's own prompt token 5 is not penalised:
B emits [5, 9, 5] where B alone emits [9, 5, 5]. Patched: B's rows carry [5, 6, 32 (pad)...] in
every step and B emits [9, 5, 5], as alone.
Order. Rows [C, A1, A2, B] (A1, A2 prefilling, B just became a decode): pristine order after the
reorder [C, B, A2, A1] (prompts reversed); patched [C, B, A1, A2].
"""
from __future__ import annotations

import pytest

from gaudi_harness.compare import run_pristine_and_patched

FIX = "prompt-order"
SCENARIOS = ["scenario_penalty_prompt_rows", "scenario_prompts_keep_order"]
A_PROMPT = list(range(10, 26)) * 2  # 32 tokens: still prefilling (chunks of 4) for the whole scenario


def _penalty_run(with_others: bool) -> dict:
    from gaudi_harness import builders
    from gaudi_harness import drivers as d

    runner = builders.make_runner()
    table = d.logits_table(builders.VOCAB_SIZE, {6: [5, 7], 5: [5, 9], 7: [5, 9], 9: [5, 9]}, default=[3, 4, 2])
    d.install_model(runner, table)
    calls = d.record_sampling(runner)
    steps = d.StepDriver(runner)
    params = dict(repetition_penalty=10.0)
    if with_others:
        steps.add("C", [3], d.greedy_params(**params))
        steps.add("A", A_PROMPT, d.greedy_params(**params))
    steps.add("B", [5, 6], d.greedy_params(**params))
    c, a = ({"C": 1}, {"A": 4}) if with_others else ({}, {})
    steps.step({**c, **a, "B": 1})  # all added (batch changed)
    steps.step({**c, **a, "B": 1})  # B's prompt ends: sampled with skip_copy=True (cache built)
    b_tokens = []
    for _ in range(3):  # B decodes; A still prefilling; step 3 swaps B before A
        b_tokens += steps.step({**c, **a, "B": 1})["B"]
    b_rows = [c_["rows"]["prompt_token_ids"][c_["req_ids"].index("B")] for c_ in calls if "B" in c_["req_ids"]]
    return {"order": d.batch_order(runner), "B_decoded": b_tokens, "B_prompt_rows": b_rows}


def scenario_penalty_prompt_rows() -> dict:
    return {"concurrent": _penalty_run(True), "alone": _penalty_run(False)}


def scenario_prompts_keep_order() -> dict:
    from gaudi_harness import builders
    from gaudi_harness import drivers as d

    runner = builders.make_runner()
    d.install_model(runner, d.logits_table(builders.VOCAB_SIZE, default=[3]))
    steps = d.StepDriver(runner)
    for req_id, prompt in (("C", [3]), ("A1", A_PROMPT), ("A2", A_PROMPT), ("B", [4, 4])):
        steps.add(req_id, prompt, d.greedy_params())
    steps.step({"C": 1, "A1": 4, "A2": 4, "B": 2})
    steps.step({"C": 1, "A1": 4, "A2": 4, "B": 1})  # B turns decode behind two prompts
    return {"order": d.batch_order(runner)}


@pytest.fixture(scope="module")
def results(vllm_gaudi_src, vllm_src, tmp_path_factory):
    return run_pristine_and_patched(__file__, SCENARIOS, FIX,
                                    vllm_gaudi_src, vllm_src, tmp_path_factory.mktemp("prompt_order"))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_swap_drops_cached_prompt_rows(results):
    pristine, patched = (r["scenario_penalty_prompt_rows"] for r in results)
    alone = patched["alone"]["B_decoded"]
    assert pristine["alone"]["B_decoded"] == alone
    assert pristine["concurrent"]["order"] == patched["concurrent"]["order"] == ["C", "B", "A"]
    b_prompt = [5, 6] + [32] * (len(A_PROMPT) - 2)  # padded with vocab_size
    assert patched["concurrent"]["B_prompt_rows"] == [b_prompt] * 4, patched
    assert patched["concurrent"]["B_decoded"] == alone, patched
    assert A_PROMPT in pristine["concurrent"]["B_prompt_rows"], pristine  # bug: A's prompt in B's row
    assert pristine["concurrent"]["B_decoded"] != alone, pristine


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_prompts_keep_their_order(results):
    pristine, patched = (r["scenario_prompts_keep_order"] for r in results)
    assert pristine["order"] == ["C", "B", "A2", "A1"], pristine
    assert patched["order"] == ["C", "B", "A1", "A2"], patched
