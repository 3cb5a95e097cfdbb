"""logprobs-decode-guard: logprobs=-1 (whole vocabulary) works, and malformed segments are refused.

Drives the real HPUModelRunner (execute_model + sample_tokens, vLLM 0.30.0 Sampler with vllm-gaudi's
gather_logprobs) on CPU through tests/gaudi_harness; only the model is a seeded random logits table
over the harness's 32-token vocabulary.

Observed on pristine 091bbadd:
- only request A with logprobs=-1: the Sampler returns raw logprobs (empty token-id tensor) and
  `_build_logprobs_output` fails the step with "IndexError: tuple index out of range";
- A with logprobs=-1 next to B with logprobs=2: A gets 3 columns (B's 2 + the sampled token)
  instead of the whole vocabulary (33);
- a raw-logprobs segment handed to `_build_logprobs_output` raises that bare IndexError.
Patched: A gets all 33 columns (sampled token, then the 32 tokens by logprob) in both cases, and a
malformed segment is refused with a ValueError naming the expected and the found shape.
"""
from __future__ import annotations

import pytest

from gaudi_harness.compare import run_pristine_and_patched

FIX = "logprobs-decode-guard"


def _logprobs_run(logprobs_a, logprobs_b) -> dict:
    import torch

    from gaudi_harness import builders
    from gaudi_harness import drivers as d

    runner = builders.make_runner()
    vocab = builders.VOCAB_SIZE
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0))
    d.install_model(runner, table)
    steps = d.StepDriver(runner)
    steps.add("A", [1, 2, 3], d.greedy_params(logprobs=logprobs_a))
    steps.add("B", [4, 5], d.greedy_params(logprobs=logprobs_b))
    try:
        steps.step({"A": 3, "B": 2})
        steps.step({"A": 1, "B": 1})
    except IndexError as e:
        return {"error": f"IndexError: {e}"}
    out = steps.last_output
    row = out.req_id_to_index["A"]
    a_ids = [int(x) for x in out.logprobs.logprob_token_ids[row]]
    a_logprobs = [float(x) for x in out.logprobs.logprobs[row]]
    # Reference: A's last input token picks its logits row; greedy, so the sampled token is the argmax.
    reference = torch.log_softmax(table[steps.reqs["A"].outputs[-2]], -1)
    k = len(a_ids) - 1  # compare the top-k the row holds with the reference's top-k
    return {
        "num_columns": len(a_ids),
        "sampled_first": a_ids[0] == steps.reqs["A"].outputs[-1],
        "topk_ids": a_ids[1:],
        "expected_topk_ids": torch.argsort(reference, descending=True).tolist()[:k],
        "topk_logprobs_ok": torch.allclose(torch.tensor(a_logprobs[1:]), reference.sort(descending=True).values[:k],
                                           atol=1e-5),
    }


def scenario_whole_vocabulary_alone() -> dict:
    return _logprobs_run(-1, None)


def scenario_whole_vocabulary_next_to_top2() -> dict:
    return _logprobs_run(-1, 2)


def scenario_raw_segment() -> dict:
    """The runner's own _build_logprobs_output given the Sampler's raw (-1) form."""
    import torch
    from vllm.v1.outputs import LogprobsTensors

    from gaudi_harness import builders
    from gaudi_harness import drivers as d

    runner = builders.make_runner()
    steps = d.StepDriver(runner)
    d.install_model(runner, torch.zeros(builders.VOCAB_SIZE, builders.VOCAB_SIZE))
    steps.add("A", [1], d.greedy_params())
    steps.step({"A": 1})
    raw = LogprobsTensors(torch.empty(0), torch.zeros(1, builders.VOCAB_SIZE), torch.empty(0))
    try:
        runner._build_logprobs_output([(["A"], raw)], 1)
        return {"result": "accepted"}
    except (IndexError, ValueError) as e:
        return {"result": f"{type(e).__name__}: {e}"}


SCENARIOS = ["scenario_whole_vocabulary_alone", "scenario_whole_vocabulary_next_to_top2", "scenario_raw_segment"]


@pytest.fixture(scope="module")
def results(vllm_gaudi_src, vllm_src, tmp_path_factory):
    return run_pristine_and_patched(__file__, SCENARIOS, FIX, vllm_gaudi_src, vllm_src,
                                    tmp_path_factory.mktemp("logprobs-decode-guard"))


def _whole_vocabulary(result):
    return (result.get("num_columns") == 33 and result["sampled_first"] and result["topk_logprobs_ok"]
            and result["topk_ids"] == result["expected_topk_ids"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_logprobs_minus_one_alone_does_not_crash(results):
    pristine, patched = (r["scenario_whole_vocabulary_alone"] for r in results)
    assert pristine == {"error": "IndexError: tuple index out of range"}
    assert _whole_vocabulary(patched), patched


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_logprobs_minus_one_gets_whole_vocabulary_in_mixed_batch(results):
    pristine, patched = (r["scenario_whole_vocabulary_next_to_top2"] for r in results)
    assert pristine["num_columns"] == 3, pristine  # capped at B's 2 logprobs
    assert pristine["topk_ids"] == pristine["expected_topk_ids"]  # the right 2, but only 2
    assert _whole_vocabulary(patched), patched


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_malformed_segment_is_refused_by_name(results):
    pristine, patched = (r["scenario_raw_segment"] for r in results)
    assert pristine["result"] == "IndexError: tuple index out of range"
    assert patched["result"] == ("ValueError: logprobs segment for 1 requests: expected token ids of shape "
                                 "[>= 1, num_logprobs + 1], found (0,)")
