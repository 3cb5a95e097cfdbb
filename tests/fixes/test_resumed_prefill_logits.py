"""resumed-prefill-logits: a request resumed with cached blocks samples one token, not one per output.

Drives the real HPUModelRunner (execute_model + sample_tokens, vLLM 0.30.0 Sampler) on CPU through
tests/gaudi_harness; only the model is a hand-made logits table (token t -> prefers t + 1).

Scenario: R (130-token prompt, block size 128) prefills and decodes 3 tokens [2, 3, 4]; it is then
preempted and resumes with its first 128-token block still in the prefix cache, exactly as vLLM's
scheduler sends it: a cached request in `resumed_req_ids`, num_computed_tokens=128, 5 tokens scheduled
(2 prompt tokens + the 3 outputs). Q (prefilled while R was out) decodes in the same step.
Observed on pristine 091bbadd: `add_request` leaves num_prompt_tokens = 130 when
num_computed_tokens > 0, so `_extract_prefill_batch_contents` gives R 4 logits rows: R "samples"
[2, 3, 4, 5] in one step (its old outputs again, then the real token) and its CPU token count becomes
137 instead of 134.
Patched: R samples [5]; Q is unaffected on both trees.
With async scheduling (the v0.30.0 default) pristine R's 4 rows go into the "row == persistent index"
tensor: R receives [2] (an old output again) and the other rows spill past it; patched R receives [5].
"""
from __future__ import annotations

import pytest

from gaudi_harness.compare import run_pristine_and_patched

FIX = "resumed-prefill-logits"
BLOCK = 128


def _resume_with_cached_block(async_scheduling: bool) -> dict:
    from gaudi_harness import builders
    from gaudi_harness import drivers as d

    runner = builders.make_runner(async_scheduling=async_scheduling)
    vocab = builders.VOCAB_SIZE
    d.install_model(runner, d.logits_table(vocab, {t: [(t + 1) % vocab] for t in range(vocab)}))
    steps = d.StepDriver(runner)
    steps.add("R", [i % vocab for i in range(BLOCK + 2)], d.greedy_params())
    steps.add("Q", [5, 6, 7], d.greedy_params())
    steps.step({"R": BLOCK + 2})
    steps.step({"R": 1})
    steps.step({"R": 1})
    r = steps.reqs["R"]
    outputs_before = list(r.outputs)
    steps.step({"Q": 3})  # R preempted: not scheduled
    # R resumes: its first block is a prefix-cache hit, the rest (prompt tail + outputs) is recomputed.
    r.num_computed = BLOCK
    so = steps.scheduler_output({"R": r.num_tokens - BLOCK, "Q": 1})
    cached = so.scheduled_cached_reqs
    cached.resumed_req_ids.add("R")
    cached.new_block_ids[cached.req_ids.index("R")] = (list(r.block_ids), )
    cached.all_token_ids["R"] = r.prompt + r.outputs  # async: the runner recovers R's outputs from it
    with d._config_context(runner):
        runner.execute_model(so)
        out = runner.sample_tokens(None)
    if hasattr(out, "get_output"):  # async scheduling: AsyncModelRunnerOutput
        out = out.get_output()
    row = runner.input_batch.req_id_to_index["R"]
    return {
        "outputs_before": outputs_before,
        "sampled": {rid: list(out.sampled_token_ids[out.req_id_to_index[rid]]) for rid in ("R", "Q")},
        "R_num_tokens": int(runner.input_batch.num_tokens_no_spec[row]),
    }


def scenario_resume_with_cached_block() -> dict:
    return _resume_with_cached_block(async_scheduling=False)


def scenario_resume_with_cached_block_async() -> dict:
    return _resume_with_cached_block(async_scheduling=True)


@pytest.fixture(scope="module")
def results(vllm_gaudi_src, vllm_src, tmp_path_factory):
    return run_pristine_and_patched(__file__, ["scenario_resume_with_cached_block",
                                               "scenario_resume_with_cached_block_async"], FIX, vllm_gaudi_src,
                                    vllm_src, tmp_path_factory.mktemp("resumed-prefill-logits"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resumed_request_samples_one_token(results):
    pristine, patched = (r["scenario_resume_with_cached_block"] for r in results)
    assert pristine["outputs_before"] == patched["outputs_before"] == [2, 3, 4]
    assert pristine["sampled"]["R"] == [2, 3, 4, 5], pristine  # bug: one token per recomputed output
    assert pristine["R_num_tokens"] == 137
    assert patched["sampled"]["R"] == [5], patched
    assert patched["R_num_tokens"] == BLOCK + 2 + 3 + 1
    assert pristine["sampled"]["Q"] == patched["sampled"]["Q"] == [9]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resumed_request_keeps_its_row_under_async_scheduling(results):
    pristine, patched = (r["scenario_resume_with_cached_block_async"] for r in results)
    # Async: R's 4 rows are concatenated into the rows-by-persistent-index tensor; R's slot gets the
    # first one, an old output again, and the rest spill past it.
    assert pristine["sampled"]["R"] == [2], pristine
    assert patched["sampled"]["R"] == [5], patched
    assert pristine["sampled"]["Q"] == patched["sampled"]["Q"] == [9]
