"""logitsprocs-rows: min_p, logit_bias and min_tokens must act, on the request that asked for them.

Real HPUModelRunner on CPU (tests/gaudi_harness) with the logits processors the runner builds
(vLLM's build_logitsprocs: MinTokens, LogitBias, MinP) and vLLM's Sampler. Every position prefers
token 5 (logit 10) over 7 (9.9); others are far below. Batch rows [D, L, M, P], all decoding
(the decode segment is padded to a bucket of 4 with a repeat of D):
D plain greedy; L greedy, logit_bias {9: 50}; M greedy, min_tokens 3 with stop token 5;
P temperature 1, seed 7, min_p 0.95 (only 5 is above 0.95 x p(5)).

Observed on pristine 091bbadd (processors never get batch updates, so they do nothing):
L [5, 5, 5, 5, 5], M [5, 5, 5, 5, 5], P [7, 5, 5, 5, 5] (min_p not applied).
Patched: L [9, 9, 9, 9, 9], M [7, 7, 7, 5, 5], P [5, 5, 5, 5, 5], D [5, 5, 5, 5, 5] unchanged.
"""
from __future__ import annotations

import pytest

from gaudi_harness.compare import run_pristine_and_patched

FIX = ["sampling-rows-refresh", "bad-words-index", "logitsprocs-rows"]  # patch context sits on the first two
SCENARIOS = ["scenario_processors_act_on_their_rows"]


def scenario_processors_act_on_their_rows() -> dict:
    from gaudi_harness import builders
    from gaudi_harness import drivers as d

    runner = builders.make_runner()
    prefs = {t: [5, 7] for t in range(builders.VOCAB_SIZE)}
    table = d.logits_table(builders.VOCAB_SIZE, prefs)
    table[:, 7] = 9.9  # 5 and 7 almost tied; every other token far below
    d.install_model(runner, table)
    steps = d.StepDriver(runner)
    steps.add("D", [4, 1], d.greedy_params())
    steps.add("L", [4, 1], d.greedy_params(logit_bias={9: 50.0}))
    steps.add("M", [4, 1], d.greedy_params(min_tokens=3, stop_token_ids=[5]))
    steps.add("P", [4, 1], d.random_params(temperature=1.0, seed=7, min_p=0.95))
    everyone = {"D": 2, "L": 2, "M": 2, "P": 2}
    steps.step(everyone)
    for _ in range(4):
        steps.step({r: 1 for r in everyone})
    return {"order": d.batch_order(runner), "tokens": {r: steps.reqs[r].outputs for r in everyone}}


@pytest.fixture(scope="module")
def results(vllm_gaudi_src, vllm_src, tmp_path_factory):
    return run_pristine_and_patched(__file__, SCENARIOS, FIX, vllm_gaudi_src,
                                    vllm_src, tmp_path_factory.mktemp("logitsprocs_rows"))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_logits_processors_apply_to_their_requests(results):
    pristine, patched = (r["scenario_processors_act_on_their_rows"] for r in results)
    assert pristine["order"] == patched["order"] == ["D", "L", "M", "P"]
    # pristine: the processors never learn about the requests
    assert pristine["tokens"]["L"] == [5] * 5, pristine
    assert pristine["tokens"]["M"] == [5] * 5, pristine
    assert 7 in pristine["tokens"]["P"], pristine
    assert patched["tokens"] == {"D": [5] * 5, "L": [9] * 5, "M": [7, 7, 7, 5, 5], "P": [5] * 5}, patched
