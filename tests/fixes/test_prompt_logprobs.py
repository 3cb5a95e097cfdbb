"""prompt-logprobs: partial prompt logprobs survive a step in which the request is not scheduled.

Drives the real HPUModelRunner (execute_model + sample_tokens, vLLM 0.30.0 Sampler) on CPU through
tests/gaudi_harness; only the model is a hand-made logits table (a seeded random [vocab, vocab] table,
so every prompt position has its own reference logprob).

Scenario: P (10-token prompt, prompt_logprobs=2) prefills 4 tokens; the next step schedules only the
decode D (P unscheduled, as the long-prefill share or a full token budget does); then P prefills the
remaining 6 tokens.
Observed on pristine 091bbadd: the unscheduled step drops P's prompt-logprob state
(`InputBatch.remove_request`), so the first 4 positions of P's prompt logprobs are uninitialised
memory (e.g. token ids [766570696, 32558, 129, 32559], logprobs 0.0) instead of the prompt's tokens
and their logprobs; with prompt_logprobs=-1 the first prefill chunk raises
"RuntimeError: selected index k out of range" (topk with k=-1).
Patched: all 9 positions equal the reference; -1 gives the whole vocabulary (k = vocab size).
"""
from __future__ import annotations

import pytest

from gaudi_harness.compare import run_pristine_and_patched

FIX = "prompt-logprobs"
PROMPT_LEN = 10


def _chunked_prompt_logprobs(skip_step: bool, prompt_logprobs: int) -> dict:
    import torch

    from gaudi_harness import builders
    from gaudi_harness import drivers as d

    runner = builders.make_runner()
    vocab = builders.VOCAB_SIZE
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0))
    d.install_model(runner, table)
    steps = d.StepDriver(runner)
    prompt = torch.randint(0, vocab, (PROMPT_LEN, ), generator=torch.Generator().manual_seed(1)).tolist()
    steps.add("P", prompt, d.greedy_params(prompt_logprobs=prompt_logprobs))
    steps.add("D", [2, 2], d.greedy_params())
    try:
        steps.step({"P": 4, "D": 2})
        if skip_step:
            steps.step({"D": 1})  # P is not scheduled in this step
        steps.step({"P": PROMPT_LEN - 4, "D": 1})
    except RuntimeError as e:
        return {"error": f"RuntimeError: {e}"}
    got = steps.last_output.prompt_logprobs_dict["P"]
    reference = torch.log_softmax(table[prompt[:-1]], -1)
    expected = reference.gather(-1, torch.tensor(prompt[1:]).unsqueeze(-1)).squeeze(-1)
    return {
        "token_ids": got.logprob_token_ids[:, 0].tolist(),
        "expected_token_ids": prompt[1:],
        "logprobs": got.logprobs[:, 0].tolist(),
        "expected_logprobs": expected.tolist(),
        "num_columns": got.logprob_token_ids.shape[1],
        "top1_ids": got.logprob_token_ids[:, 1].tolist(),
        "expected_top1_ids": reference.argmax(-1).tolist(),
    }


def scenario_skipped_step() -> dict:
    return _chunked_prompt_logprobs(skip_step=True, prompt_logprobs=2)


def scenario_whole_vocabulary() -> dict:
    return _chunked_prompt_logprobs(skip_step=False, prompt_logprobs=-1)


@pytest.fixture(scope="module")
def results(vllm_gaudi_src, vllm_src, tmp_path_factory):
    """({scenario: result} on pristine, same on patched): one child process per tree."""
    return run_pristine_and_patched(__file__, ["scenario_skipped_step", "scenario_whole_vocabulary"], FIX,
                                    vllm_gaudi_src, vllm_src, tmp_path_factory.mktemp("prompt-logprobs"))


def _close(a, b, tol=1e-4):
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_partial_prompt_logprobs_survive_unscheduled_step(results):
    pristine, patched = (r["scenario_skipped_step"] for r in results)
    # The chunk computed after the skipped step is right on both trees ...
    assert pristine["token_ids"][4:] == pristine["expected_token_ids"][4:]
    # ... the chunk computed before it is lost on pristine (uninitialised rows) ...
    assert pristine["token_ids"][:4] != pristine["expected_token_ids"][:4], pristine
    assert not _close(pristine["logprobs"][:4], pristine["expected_logprobs"][:4]), pristine
    # ... and kept when patched.
    assert patched["token_ids"] == patched["expected_token_ids"], patched
    assert _close(patched["logprobs"], patched["expected_logprobs"]), patched
    assert patched["top1_ids"] == patched["expected_top1_ids"]
    assert patched["num_columns"] == 3


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_prompt_logprobs_minus_one_means_whole_vocabulary(results):
    pristine, patched = (r["scenario_whole_vocabulary"] for r in results)
    assert pristine.get("error") == "RuntimeError: selected index k out of range", pristine
    assert "error" not in patched, patched
    assert patched["num_columns"] == 32 + 1  # the whole vocabulary plus the prompt token
    assert patched["token_ids"] == patched["expected_token_ids"]
    assert _close(patched["logprobs"], patched["expected_logprobs"])
