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
"""
from __future__ import annotations

import pytest

from gaudi_harness.compare import run_pristine_and_patched

FIX = "resumed-prefill-logits"
BLOCK = 128


def scenario_resume_with_cached_block() -> dict:
    from gaudi_harness import builders
    from gaudi_harness import drivers as d

    runner = builders.make_runner()
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
    with d._config_context(runner):
        runner.execute_model(so)
        out = runner.sample_tokens(None)
    row = runner.input_batch.req_id_to_index["R"]
    return {
        "outputs_before": outputs_before,
        "sampled": {rid: list(out.sampled_token_ids[out.req_id_to_index[rid]]) for rid in ("R", "Q")},
        "R_num_tokens": int(runner.input_batch.num_tokens_no_spec[row]),
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resumed_request_samples_one_token(vllm_gaudi_src, vllm_src, tmp_path):
    pristine, patched = (r["scenario_resume_with_cached_block"] for r in run_pristine_and_patched(
        __file__, ["scenario_resume_with_cached_block"], FIX, vllm_gaudi_src, vllm_src, tmp_path))
    assert pristine["outputs_before"] == patched["outputs_before"] == [2, 3, 4]
    assert pristine["sampled"]["R"] == [2, 3, 4, 5], pristine  # bug: one token per recomputed output
    assert pristine["R_num_tokens"] == 137
    assert patched["sampled"]["R"] == [5], patched
    assert patched["R_num_tokens"] == BLOCK + 2 + 3 + 1
    assert pristine["sampled"]["Q"] == patched["sampled"]["Q"] == [9]
