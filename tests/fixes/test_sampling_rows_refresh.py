"""sampling-rows-refresh: device sampling rows must follow a swap made in a step with no add/remove.

Real HPUModelRunner on CPU (tests/gaudi_harness), hand-made logits. A (temperature 0.2, top_k 3)
and B (greedy, repetition_penalty 10, prompt [5, 6]) enter together as rows 0 and 1. Next step A is
still prefilling (chunked) and B decodes: `_ensure_decodes_first` swaps them, nothing was added or
removed, so `_run_sampling(batch_changed=False)` -> `skip_copy=True` reads device rows that were not
swapped.

Observed on pristine 091bbadd, B's decode-segment metadata: temperature 0.2, top_k 3, repetition
penalty 1.0 (all A's); B's tokens after its first one: [5, 5, 5] (5 is B's prompt token, which its
penalty should suppress). Patched: temperature -1.0 (greedy), top_k 32 (= vocab, off), repetition
penalty 10.0; B's tokens [9, 5, 5], the same as B running alone (the reference).
"""
from __future__ import annotations

import pytest

from gaudi_harness.compare import run_pristine_and_patched

FIX = "sampling-rows-refresh"
SCENARIOS = ["scenario_swap_without_batch_change"]


def _run(with_a: bool) -> dict:
    import torch

    from gaudi_harness import builders
    from gaudi_harness import drivers as d

    torch.manual_seed(0)
    runner = builders.make_runner()
    # B's rows: after its prompt (6) and after each of its tokens, 5 is best unless penalised.
    table = d.logits_table(builders.VOCAB_SIZE, {6: [5, 7], 5: [5, 9], 7: [5, 9], 9: [5, 9]}, default=[3, 4, 2])
    d.install_model(runner, table)
    calls = d.record_sampling(runner)
    steps = d.StepDriver(runner)
    a = {"A": 4} if with_a else {}
    if with_a:
        steps.add("A", list(range(10, 26)), d.random_params(temperature=0.2, top_k=3))
    steps.add("B", [5, 6], d.greedy_params(repetition_penalty=10.0))
    steps.step({**a, "B": 2})  # both added: batch changed, rows A=0, B=1
    b_tokens = []
    for _ in range(3):  # A keeps prefilling in chunks, B decodes: swapped each step, no add/remove
        b_tokens += steps.step({**a, "B": 1})["B"]
    b_decode = [c for c in calls if c["req_ids"] == ["B"]][1:]  # [0]: B's prefill in step 1
    return {"order": d.batch_order(runner), "B_first": steps.reqs["B"].outputs[0], "B_decoded": b_tokens,
            "B_decode_rows": b_decode[0]["rows"], "B_decode_batch_changed": b_decode[0]["batch_changed"]}


def scenario_swap_without_batch_change() -> dict:
    return {"concurrent": _run(with_a=True), "alone": _run(with_a=False)}


@pytest.fixture(scope="module")
def results(vllm_gaudi_src, vllm_src, tmp_path_factory):
    return run_pristine_and_patched(__file__, SCENARIOS, FIX, vllm_gaudi_src,
                                    vllm_src, tmp_path_factory.mktemp("sampling_rows_refresh"))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_decode_after_swap_uses_its_own_sampling_rows(results):
    (pristine, pristine_alone), (patched, patched_alone) = (
        (r["scenario_swap_without_batch_change"]["concurrent"], r["scenario_swap_without_batch_change"]["alone"])
        for r in results)
    assert pristine_alone["B_decoded"] == patched_alone["B_decoded"] == [9, 5, 5]  # B alone: the reference
    for r in (pristine, patched):
        assert r["order"] == ["B", "A"], r
        assert r["B_decode_batch_changed"] is False, r
        assert r["B_first"] == 7, r  # sampled in the step that added both: rows were refreshed
    rows = pristine["B_decode_rows"]
    assert (rows["temperature"], rows["top_k"], rows["repetition_penalties"]) == ([0.2], [3.0], [1.0]), rows
    assert pristine["B_decoded"] == [5, 5, 5], pristine
    rows = patched["B_decode_rows"]
    assert (rows["temperature"], rows["top_k"], rows["repetition_penalties"]) == ([-1.0], [32.0], [10.0]), rows
    assert patched["B_decoded"] == patched_alone["B_decoded"], patched
