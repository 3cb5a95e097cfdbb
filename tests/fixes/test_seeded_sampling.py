"""seeded-sampling: a seeded request's random stream must not depend on batch padding.

Real HPUModelRunner on CPU (tests/gaudi_harness), vLLM's Sampler (random_sample draws
q[i].exponential_(generator=g) once per generators entry). The decode batch is padded to its
bucket by repeating request 0, and pristine make_selective_sampling_metadata gives every padding
row request 0's generator too. S (seed 1234, temperature 1, uniform logits) is row 0; two greedy
requests make 3 decodes, padded to a bucket of 4.

Observed on pristine 091bbadd: decode metadata generators at rows [0, 3] (the pad row shares S's
generator); S alone emits [25, 23, 27, 8, 31, 18, 3], S with the others [25, 23, 8, 18, 20, 19, 22]
(every decode step consumes two draws). Patched: generators at row [0] only; S emits
[25, 23, 27, 8, 31, 18, 3] in both cases.
"""
from __future__ import annotations

import pytest

from gaudi_harness.compare import run_pristine_and_patched

FIX = "seeded-sampling"
SCENARIOS = ["scenario_padded_decode"]


def _run(with_others: bool) -> dict:
    from gaudi_harness import builders
    from gaudi_harness import drivers as d

    runner = builders.make_runner()
    d.install_model(runner, d.logits_table(builders.VOCAB_SIZE))  # all zeros: uniform for S
    calls = d.record_sampling(runner)
    steps = d.StepDriver(runner)
    steps.add("S", [1], d.random_params(temperature=1.0, seed=1234))
    others = ["G1", "G2"] if with_others else []
    for req_id in others:
        steps.add(req_id, [2], d.greedy_params())
    first = {"S": 1, **{r: 1 for r in others}}
    steps.step(first)
    for _ in range(6):
        steps.step(first)
    decode_calls = [c for c in calls if c["req_ids"][:1] == ["S"] and len(c["req_ids"]) == 1 + len(others)]
    return {"S_tokens": steps.reqs["S"].outputs, "order": d.batch_order(runner),
            "decode_generator_rows": decode_calls[-1]["rows"]["generators"],
            "decode_rows_sampled": len(decode_calls[-1]["sampled"])}


def scenario_padded_decode() -> dict:
    return {"together": _run(True), "alone": _run(False)}


@pytest.fixture(scope="module")
def results(vllm_gaudi_src, vllm_src, tmp_path_factory):
    return run_pristine_and_patched(__file__, SCENARIOS, FIX, vllm_gaudi_src, vllm_src,
                                    tmp_path_factory.mktemp("seeded_sampling"))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_seeded_stream_independent_of_padding(results):
    pristine, patched = (r["scenario_padded_decode"] for r in results)
    assert pristine["alone"]["S_tokens"] == patched["alone"]["S_tokens"]  # alone: no padding, no bug
    assert pristine["together"]["order"][0] == "S"
    assert pristine["together"]["decode_rows_sampled"] == 4  # 3 decodes padded to a bucket of 4
    assert pristine["together"]["decode_generator_rows"] == [0, 3], pristine
    assert pristine["together"]["S_tokens"] != pristine["alone"]["S_tokens"], pristine
    assert patched["together"]["decode_generator_rows"] == [0], patched
    assert patched["together"]["S_tokens"] == patched["alone"]["S_tokens"], patched
