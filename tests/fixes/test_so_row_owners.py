"""so-row-owners: the grammar bitmask of a structured-output request must land on the logits row
that request owns, not on the row numbered like its persistent index.

Real HPUModelRunner on CPU (tests/gaudi_harness): sample_tokens' structured-output branch,
apply_grammar_bitmask with xgrammar's CPU kernel, vLLM's Sampler. A is a long prompt whose chunk
does not finish in this step, so it owns no logits row (the runner decides the "at least one row
under structured output" rule from the previous step's flag); every request after A is one row
above its persistent index. Token 1 prefers 5, then 7; the grammar of S allows only 7.

Observed on pristine 091bbadd:
- rows [S, Q] for batch [A, S, Q]: S's mask goes to row 1 (Q's): S emits 5 (violates its
  grammar), Q emits 7 (a plain request constrained by S's grammar). Patched: S 7, Q 5.
- rows [S] for batch [A, S]: IndexError "index 1 is out of bounds for axis 0 with size 1".
  Patched: S emits 7.
"""
from __future__ import annotations

import pytest

from gaudi_harness.compare import run_pristine_and_patched

FIX = ["structured-output-rows", "so-row-owners"]  # the patch sits on structured-output-rows (context)
SCENARIOS = ["scenario_rows_shifted"]


def _run(with_q: bool) -> dict:
    from gaudi_harness import builders
    from gaudi_harness import drivers as d

    runner = builders.make_runner()
    d.install_model(runner, d.logits_table(builders.VOCAB_SIZE, {1: [5, 7]}, default=[3]))
    steps = d.StepDriver(runner)
    steps.add("A", list(range(10, 26)) * 2, d.greedy_params())
    steps.step({"A": 4})  # no structured output yet
    steps.add("S", [4, 1], d.greedy_params())
    schedule = {"A": 4, "S": 2}
    if with_q:
        steps.add("Q", [4, 1], d.greedy_params())
        schedule["Q"] = 2
    try:
        sampled = steps.step(schedule, grammar_output=d.grammar_output({"S": [7]}, builders.VOCAB_SIZE))
    except IndexError as e:
        return {"error": f"IndexError: {e}"}
    return {"order": d.batch_order(runner), "sampled": sampled}


def scenario_rows_shifted() -> dict:
    return {"with_q": _run(True), "s_last": _run(False)}


@pytest.fixture(scope="module")
def results(vllm_gaudi_src, vllm_src, tmp_path_factory):
    return run_pristine_and_patched(__file__, SCENARIOS, FIX, vllm_gaudi_src, vllm_src,
                                    tmp_path_factory.mktemp("so_row_owners"))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_grammar_lands_on_its_request(results):
    pristine, patched = (r["scenario_rows_shifted"]["with_q"] for r in results)
    assert pristine["order"] == patched["order"] == ["A", "S", "Q"]
    assert pristine["sampled"] == {"S": [5], "Q": [7]}, pristine  # bug: S unconstrained, Q constrained
    assert patched["sampled"] == {"S": [7], "Q": [5]}, patched


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_no_index_error_when_a_request_owns_no_row(results):
    pristine, patched = (r["scenario_rows_shifted"]["s_last"] for r in results)
    assert "index 1 is out of bounds" in pristine.get("error", ""), pristine
    assert patched.get("sampled") == {"S": [7]}, patched
