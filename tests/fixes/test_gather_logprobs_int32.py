"""gather-logprobs-int32: the HPU replacement of Sampler.gather_logprobs takes int32 token ids.

vllm-gaudi installs `patches._hpu_gather_logprobs` as vLLM's `Sampler.gather_logprobs` (the harness
loads vllm_gaudi as a real plugin, so the installed function is the HPU one). It keeps upstream's
`assert token_ids.dtype == torch.int64` while the sampled ids it pairs with are int32 on both sides
(SamplerOutput.sampled_token_ids, vllm-gaudi's rejection_sample output).

Where the failure is (and is not), checked on the real code:
- scenario_callers: a dtype spy on the installed gather_logprobs while the real runner samples a
  prefill and a decode with logprobs: every v0.30.0 caller Gaudi reaches passes int64 (the Sampler
  casts with `sampled.long()` first, sampler.py:140; the rejection sampler casts with
  `.to(torch.int64)`, rejection_sampler.py:264; prompt logprobs use vllm-gaudi's own
  `_gather_prompt_logprobs_hpu`). So vLLM's half needs no change: no vLLM patch.
- scenario_int32_ids: the installed function called with int32 ids (what those callers hold before
  their cast). Observed on pristine 091bbadd: AssertionError (bare assert, no message).
  Patched: same result as with int64 ids; a float tensor is refused with a TypeError naming the dtype.
"""
from __future__ import annotations

import pytest

from gaudi_harness.compare import run_pristine_and_patched

FIX = "gather-logprobs-int32"


def scenario_int32_ids() -> dict:
    import torch
    import vllm.v1.sample.sampler as sampler_mod

    gather = sampler_mod.Sampler.gather_logprobs
    logprobs = torch.log_softmax(torch.randn(3, 16, generator=torch.Generator().manual_seed(0)), -1)
    ids64 = torch.tensor([4, 0, 15], dtype=torch.int64)
    reference = gather(logprobs, 2, ids64)
    result = {"installed": f"{gather.__module__}.{gather.__name__}"}
    try:
        got = gather(logprobs, 2, ids64.to(torch.int32))
        result["int32"] = {
            "same_ids": torch.equal(got.logprob_token_ids, reference.logprob_token_ids),
            "same_logprobs": torch.equal(got.logprobs, reference.logprobs),
            "same_ranks": torch.equal(got.selected_token_ranks, reference.selected_token_ranks),
        }
    except AssertionError as e:
        result["int32"] = f"AssertionError: {e}"
    try:
        gather(logprobs, 2, ids64.float())
        result["float"] = "accepted"
    except (AssertionError, TypeError) as e:
        result["float"] = f"{type(e).__name__}: {e}"
    return result


def scenario_callers() -> dict:
    """Which dtypes reach the installed gather_logprobs from the runner's real sampling paths."""
    import torch
    import vllm.v1.sample.sampler as sampler_mod

    from gaudi_harness import builders
    from gaudi_harness import drivers as d

    seen: list[str] = []
    installed = sampler_mod.Sampler.gather_logprobs

    def spy(logprobs, num_logprobs, token_ids):
        seen.append(str(token_ids.dtype))
        return installed(logprobs, num_logprobs, token_ids)

    sampler_mod.Sampler.gather_logprobs = staticmethod(spy)
    runner = builders.make_runner()
    vocab = builders.VOCAB_SIZE
    d.install_model(runner, torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0)))
    steps = d.StepDriver(runner)
    steps.add("A", [1, 2, 3], d.greedy_params(logprobs=2))
    steps.add("B", [4, 5], d.random_params(logprobs=1, seed=7, prompt_logprobs=1))
    steps.step({"A": 3, "B": 2})  # prefill segment
    steps.step({"A": 1, "B": 1})  # decode segment
    rows = steps.last_output.logprobs.logprob_token_ids
    return {"dtypes": seen, "sampled_ids_in_column_0": [int(rows[steps.last_output.req_id_to_index[r]][0])
                                                         for r in ("A", "B")],
            "sampled": [steps.reqs[r].outputs[-1] for r in ("A", "B")]}


@pytest.fixture(scope="module")
def results(vllm_gaudi_src, vllm_src, tmp_path_factory):
    return run_pristine_and_patched(__file__, ["scenario_int32_ids", "scenario_callers"], FIX, vllm_gaudi_src,
                                    vllm_src, tmp_path_factory.mktemp("gather-logprobs-int32"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hpu_gather_logprobs_takes_int32_ids(results):
    pristine, patched = (r["scenario_int32_ids"] for r in results)
    assert pristine["installed"] == patched["installed"] == "vllm_gaudi.patches._hpu_gather_logprobs"
    assert pristine["int32"].startswith("AssertionError"), pristine
    assert patched["int32"] == {"same_ids": True, "same_logprobs": True, "same_ranks": True}, patched
    assert patched["float"] == "TypeError: gather_logprobs: token_ids must be an integer tensor, found torch.float32"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gaudi_callers_pass_int64_so_vllm_needs_no_change(results):
    for tree in results:
        callers = tree["scenario_callers"]
        # one call per sampled segment (each prefill batch, the decode batch), all int64
        assert len(callers["dtypes"]) >= 2 and set(callers["dtypes"]) == {"torch.int64"}, callers
        assert callers["sampled_ids_in_column_0"] == callers["sampled"]
