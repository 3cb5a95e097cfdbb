"""structured-output-rows: with structured output, sampling-metadata rows must follow the logits
rows (decodes first, then prompts), as in vllm-gaudi releases/v0.21.0 1e9ce8b6 (PR #1466).

Real HPUModelRunner on CPU (tests/gaudi_harness): sample_tokens' structured-output branch
concatenates decode logits then prompt logits, applies the grammar bitmask (xgrammar CPU kernel),
and samples once. Both requests use a grammar that allows every token, so only row order matters.
D: decoding, greedy, repetition_penalty 10, prompt [5, 6] (prefers 5 unless penalised, then 9).
P: new prompt ending in 1, greedy, no penalty (prefers 5, then 7).

Observed on pristine 091bbadd: metadata order [P, D] for logits rows [D, P]: D emits 5 (its
penalty went to P's row; alone D emits 9); P's row is penalised with D's prompt [5, 6] and output
[7] (P still emits 5 here only because both its candidates are penalised alike). Patched: metadata
order [D, P]; D 9, P 5, as each alone.
"""
from __future__ import annotations

import pytest

from gaudi_harness.compare import run_pristine_and_patched

FIX = "structured-output-rows"
SCENARIOS = ["scenario_mixed_step"]
PREFS = {6: [5, 7], 5: [5, 9], 7: [5, 9], 9: [5, 9], 1: [5, 7]}


def _run(with_d: bool, with_p: bool) -> dict:
    from gaudi_harness import builders
    from gaudi_harness import drivers as d

    runner = builders.make_runner()
    d.install_model(runner, d.logits_table(builders.VOCAB_SIZE, PREFS, default=[3]))
    calls = d.record_sampling(runner)
    steps = d.StepDriver(runner)
    vocab = builders.VOCAB_SIZE
    if with_d:
        steps.add("D", [5, 6], d.greedy_params(repetition_penalty=10.0))
        steps.step({"D": 2}, grammar_output=d.grammar_output({"D": None}, vocab))  # D's first token: 7
    schedule, allowed = {}, {}
    if with_p:
        steps.add("P", [4, 1], d.greedy_params())
        schedule["P"], allowed["P"] = 2, None
    if with_d:
        schedule["D"], allowed["D"] = 1, None
    sampled = steps.step(schedule, grammar_output=d.grammar_output(allowed, vocab))
    return {"order": d.batch_order(runner), "sampled": sampled, "metadata_order": calls[-1]["req_ids"]}


def scenario_mixed_step() -> dict:
    return {"together": _run(True, True), "D_alone": _run(True, False), "P_alone": _run(False, True)}


@pytest.fixture(scope="module")
def results(vllm_gaudi_src, vllm_src, tmp_path_factory):
    return run_pristine_and_patched(__file__, SCENARIOS, FIX, vllm_gaudi_src, vllm_src,
                                    tmp_path_factory.mktemp("structured_output_rows"))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_structured_output_rows_follow_logits(results):
    pristine, patched = (r["scenario_mixed_step"] for r in results)
    alone = {"D": patched["D_alone"]["sampled"]["D"], "P": patched["P_alone"]["sampled"]["P"]}
    assert alone == {"D": [9], "P": [5]}
    assert pristine["together"]["order"] == patched["together"]["order"] == ["D", "P"]
    assert pristine["together"]["metadata_order"] == ["P", "D"], pristine
    assert pristine["together"]["sampled"]["D"] == [5], pristine  # D sampled without its penalty
    assert patched["together"]["metadata_order"] == ["D", "P"], patched
    assert patched["together"]["sampled"] == alone, patched
