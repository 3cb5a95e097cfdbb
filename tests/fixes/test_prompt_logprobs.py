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

End to end with the opt-in vLLM fix vllm-long-prefill-share (share 0.5, long = 100+ tokens): vLLM's
real Scheduler and vllm-gaudi's real runner, a running decode and a 200-token prompt with
prompt_logprobs=2 in 64-token chunks. The prompt sits out 31 steps mid-prefill; pristine vllm-gaudi
returns 188 of its 199 prompt-logprob positions wrong, patched none (share unset: no skips, both right).
"""
from __future__ import annotations

import pytest

from gaudi_harness.compare import SCENARIO_TIMEOUT, patched_tree, run_pristine_and_patched
from gaudi_harness.subproc import run_scenarios

FIX = "prompt-logprobs"
PROMPT_LEN = 10
LONG_PROMPT = 200
CHUNK_STEP_SECONDS, DECODE_STEP_SECONDS = 1.0, 0.1  # step-time model fed to the long-prefill share


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


def scenario_long_prefill_share(sdist_root: str, share: str | None) -> dict:
    """End to end: vLLM 0.30.0's real Scheduler (with the opt-in long-prefill share when `share` is
    set) schedules a running decode D and a 200-token prompt L with prompt_logprobs=2 (chunks of at
    most 64 tokens); vllm-gaudi's real runner executes every step; the scheduler gets the runner's
    outputs and a modelled step time (1 s with a prompt chunk, 0.1 s without). Returns how often L was
    skipped mid-prefill and how many of its 199 prompt-logprob positions differ from the reference."""
    import os
    import sys

    import torch

    if share is None:
        os.environ.pop("VLLM_LONG_PREFILL_SHARE", None)
    else:
        os.environ["VLLM_LONG_PREFILL_SHARE"] = share
    os.environ["VLLM_LONG_PREFILL_MIN_TOKENS"] = "100"
    # vLLM's own scheduler builder (the sdist's tests/v1/core/utils.py); the vllm-gaudi tree on the
    # path has a `tests` package too, so the sdist's goes first (vllm itself is already imported).
    if "tests.v1.core.utils" not in sys.modules:
        for name in [m for m in sys.modules if m == "tests" or m.startswith("tests.")]:
            del sys.modules[name]
        sys.path.insert(0, sdist_root)
    from tests.v1.core.utils import create_scheduler
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from gaudi_harness import builders
    from gaudi_harness import drivers as d

    vocab = builders.VOCAB_SIZE
    runner = builders.make_runner()
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0))
    d.install_model(runner, table)
    scheduler = create_scheduler(model=str(builders.write_model_dir()), skip_tokenizer_init=True, max_num_seqs=8,
                                 max_num_batched_tokens=64, max_model_len=256, block_size=128, num_blocks=64)
    prompt = torch.randint(0, vocab, (LONG_PROMPT, ), generator=torch.Generator().manual_seed(1)).tolist()
    decode = Request("D", [1, 2], SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0.0), None)
    long = Request("L", prompt, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0, prompt_logprobs=2),
                   None)
    scheduler.add_request(decode)
    prompt_logprobs, skipped_mid_prefill, steps = None, 0, 0
    while prompt_logprobs is None and steps < 200:
        if steps == 2:
            scheduler.add_request(long)
        so = scheduler.schedule()
        if steps > 2 and "L" not in so.num_scheduled_tokens and 0 < long.num_computed_tokens < LONG_PROMPT:
            skipped_mid_prefill += 1
        with d._config_context(runner):
            runner.execute_model(so)
            out = runner.sample_tokens(None)
        carries_chunk = any(n > 1 for n in so.num_scheduled_tokens.values())
        if hasattr(scheduler, "record_step_time"):  # the long-prefill-share fix's hook
            scheduler.record_step_time(so, CHUNK_STEP_SECONDS if carries_chunk else DECODE_STEP_SECONDS)
        for outputs in scheduler.update_from_output(so, out).values():
            for o in outputs.outputs:
                if o.request_id == "L" and o.new_prompt_logprobs_tensors is not None:
                    prompt_logprobs = o.new_prompt_logprobs_tensors
        steps += 1
    reference = torch.log_softmax(table[prompt[:-1]], -1).gather(-1, torch.tensor(prompt[1:]).unsqueeze(-1))
    got_ids, got = prompt_logprobs.logprob_token_ids[:, 0], prompt_logprobs.logprobs[:, 0]
    wrong = [i for i in range(LONG_PROMPT - 1)
             if int(got_ids[i]) != prompt[i + 1] or abs(float(got[i]) - float(reference[i, 0])) > 1e-4]
    return {"has_share_hook": hasattr(scheduler, "record_step_time"), "steps": steps,
            "skipped_mid_prefill": skipped_mid_prefill, "num_positions": len(got_ids), "num_wrong": len(wrong),
            "first_wrong": wrong[:5]}


def scenario_long_prefill_share_unset(sdist_root: str) -> dict:
    return scenario_long_prefill_share(sdist_root, None)


def scenario_long_prefill_share_half(sdist_root: str) -> dict:
    return scenario_long_prefill_share(sdist_root, "0.5")


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


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_long_prefill_share_keeps_partial_prompt_logprobs(vllm_gaudi_src, vllm_src, tmp_path):
    """The opt-in vLLM fix vllm-long-prefill-share skips the long prompt for steps at a time while a
    decode runs; with prompt-logprobs those skips no longer lose the prompt logprobs computed so far."""
    from cookbook.api import patched_copy

    vllm_with_share = patched_copy(vllm_src, "vllm", ["vllm-long-prefill-share"], tmp_path / "vllm")
    gaudi_patched = patched_tree(vllm_gaudi_src, [FIX], tmp_path / "vllm-gaudi")
    names = ["scenario_long_prefill_share_unset", "scenario_long_prefill_share_half"]
    kwargs = {"sdist_root": str(vllm_src)}
    pristine = run_scenarios(__file__, names, vllm_gaudi_src, vllm_with_share, SCENARIO_TIMEOUT, kwargs)
    patched = run_scenarios(__file__, names, gaudi_patched, vllm_with_share, SCENARIO_TIMEOUT, kwargs)
    for tree in (pristine, patched):
        unset, half = tree["scenario_long_prefill_share_unset"], tree["scenario_long_prefill_share_half"]
        assert unset["has_share_hook"] and unset["skipped_mid_prefill"] == 0, unset  # share off: never skipped
        assert unset["num_wrong"] == 0 and unset["num_positions"] == LONG_PROMPT - 1, unset
        assert half["skipped_mid_prefill"] > 0, half  # share 0.5: the prompt sits out steps
    # Pristine vllm-gaudi loses every chunk computed before a skipped step ...
    assert pristine["scenario_long_prefill_share_half"]["num_wrong"] > 0, pristine
    # ... patched keeps them: all 199 positions equal the reference.
    assert patched["scenario_long_prefill_share_half"]["num_wrong"] == 0, patched
