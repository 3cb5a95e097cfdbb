"""bad-words-index: bad words must be keyed by the row of the sampled segment, not the persistent row.

Drives the real HPUModelRunner (execute_model + sample_tokens, vLLM 0.30.0 Sampler) on CPU through
tests/gaudi_harness; only the model is a hand-made logits table (token 1 -> prefers 5 then 7).

Observed on pristine 091bbadd:
- wrong row: A (decoding, bad_words [[5]]) is persistent row 0; B (no bad words) prefills in the
  same step as its own segment, row 0. B's first token: 7 (A's ban hit B); correct: 5.
  The segment metadata carries {0: [[5]]} for segment [B].
- crash: C (bad_words [[5]]) is persistent row 2 behind two decodes; sampling its one-row prefill
  segment raises IndexError "index 2 is out of bounds for dimension 0 with size 1".
Patched: B samples 5; C's segment carries {0: [[5]]} and C samples 7 (its ban), A and B unaffected.
"""
from __future__ import annotations

import pytest

from gaudi_harness.compare import run_pristine_and_patched

FIX = "bad-words-index"
SCENARIOS = ["scenario_wrong_row", "scenario_out_of_range"]
PREFS = {1: [5, 7], 2: [9], 5: [9], 7: [9], 9: [11], 11: [13]}


def scenario_wrong_row() -> dict:
    """A: decoding with bad_words [[5]] (row 0). B: plain request prefilling (its own segment)."""
    from gaudi_harness import builders
    from gaudi_harness import drivers as d

    runner = builders.make_runner()
    d.install_model(runner, d.logits_table(builders.VOCAB_SIZE, PREFS, default=[3]))
    steps = d.StepDriver(runner)
    a_params = d.with_bad_words(d.greedy_params(), [[5]])
    steps.add("A", [2, 2], a_params)
    steps.step({"A": 2})
    steps.add("B", [4, 1], d.greedy_params())
    sampled = steps.step({"A": 1, "B": 2})
    return {"order": d.batch_order(runner), "B_first_token": sampled["B"][0], "A_token": sampled["A"][0]}


def scenario_out_of_range() -> dict:
    """A, B decoding (rows 0, 1); C with bad_words [[5]] prefills as row 2, alone in its segment."""
    from gaudi_harness import builders
    from gaudi_harness import drivers as d

    runner = builders.make_runner()
    d.install_model(runner, d.logits_table(builders.VOCAB_SIZE, PREFS, default=[3]))
    steps = d.StepDriver(runner)
    steps.add("A", [2], d.greedy_params())
    steps.add("B", [2], d.greedy_params())
    steps.step({"A": 1, "B": 1})
    c_params = d.with_bad_words(d.greedy_params(), [[5]])
    steps.add("C", [4, 1], c_params)
    try:
        sampled = steps.step({"A": 1, "B": 1, "C": 2})
    except IndexError as e:
        return {"error": f"IndexError: {e}"}
    return {"order": d.batch_order(runner), "sampled": sampled}


@pytest.fixture(scope="module")
def results(vllm_gaudi_src, vllm_src, tmp_path_factory):
    return run_pristine_and_patched(__file__, SCENARIOS, FIX, vllm_gaudi_src,
                                    vllm_src, tmp_path_factory.mktemp("bad_words_index"))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_bad_words_of_another_request_do_not_apply(results):
    pristine, patched = (r["scenario_wrong_row"] for r in results)
    assert pristine["order"] == ["A", "B"]
    assert pristine["B_first_token"] == 7, pristine  # bug: A's ban on token 5 applied to B's row
    assert patched["B_first_token"] == 5, patched
    assert patched["A_token"] == pristine["A_token"] == 11


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_bad_words_row_beyond_segment_does_not_crash(results):
    pristine, patched = (r["scenario_out_of_range"] for r in results)
    assert "index 2 is out of bounds" in pristine.get("error", ""), pristine
    assert "error" not in patched, patched
    assert patched["order"] == ["A", "B", "C"]
    assert patched["sampled"] == {"A": [11], "B": [11], "C": [7]}  # C's own ban applies to C only
