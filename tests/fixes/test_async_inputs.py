"""async-inputs: under async scheduling the runner's CPU-side token state follows the sampled tokens.

Drives the real HPUModelRunner (execute_model + sample_tokens, vLLM 0.30.0 Sampler) on CPU through
tests/gaudi_harness, with async scheduling on (the vLLM 0.30.0 default): the runner returns
AsyncHPUModelRunnerOutput and keeps the sampled ids on the device for the next step's inputs. The
harness's step driver reads each output before the next step (the scheduler outputs are the ones the
async scheduler sends for steady decodes). Only the model is a hand-made logits table: token t
prefers itself (logit 10), then t + 1 (logit 9).

A: prompt [3], greedy, presence_penalty=2 (a token already generated drops from 10 to 8, below t + 1).
Observed on pristine 091bbadd: without async A generates [3, 4, 5, 6, 7]; with async [3, 3, 3, 3, 3]
(the penalty never sees a generated token): the runner's output_token_ids for A stay [] and its
token count stays 1 after 5 steps.
Patched: with async A generates [3, 4, 5, 6, 7]; the runner holds [3, 4, 5, 6, -1] (the last token
is still in flight: a placeholder, replaced before the next sampling) and a token count of 6.
"""
from __future__ import annotations

import pytest

from gaudi_harness.compare import run_pristine_and_patched

FIX = "async-inputs"
NUM_STEPS = 5


def _penalised_decode(async_scheduling: bool) -> dict:
    from gaudi_harness import builders
    from gaudi_harness import drivers as d

    runner = builders.make_runner(async_scheduling=async_scheduling)
    vocab = builders.VOCAB_SIZE
    d.install_model(runner, d.logits_table(vocab, {t: [t, (t + 1) % vocab] for t in range(vocab)}))
    steps = d.StepDriver(runner)
    steps.add("A", [3], d.greedy_params(presence_penalty=2.0))
    steps.add("B", [10, 11], d.greedy_params())  # no penalty: must keep repeating its favourite
    steps.step({"A": 1, "B": 2})
    for _ in range(NUM_STEPS - 1):
        steps.step({"A": 1, "B": 1})
    batch = runner.input_batch
    row = batch.req_id_to_index["A"]
    return {
        "A": steps.reqs["A"].outputs,
        "B": steps.reqs["B"].outputs,
        "A_runner_output_token_ids": list(runner.requests["A"].output_token_ids),
        "A_num_tokens": int(batch.num_tokens_no_spec[row]),
        "A_token_ids_cpu": batch.token_ids_cpu[row, :NUM_STEPS + 1].tolist(),
    }


def scenario_sync() -> dict:
    return _penalised_decode(async_scheduling=False)


def scenario_async() -> dict:
    return _penalised_decode(async_scheduling=True)


@pytest.fixture(scope="module")
def results(vllm_gaudi_src, vllm_src, tmp_path_factory):
    return run_pristine_and_patched(__file__, ["scenario_sync", "scenario_async"], FIX, vllm_gaudi_src, vllm_src,
                                    tmp_path_factory.mktemp("async-inputs"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_penalties_see_generated_tokens_under_async_scheduling(results):
    pristine, patched = results
    expected = [3, 4, 5, 6, 7]
    assert pristine["scenario_sync"]["A"] == patched["scenario_sync"]["A"] == expected
    assert pristine["scenario_async"]["A"] == [3, 3, 3, 3, 3], pristine  # bug: penalty sees no outputs
    assert patched["scenario_async"]["A"] == expected, patched
    for tree in (pristine, patched):
        assert tree["scenario_sync"]["B"] == tree["scenario_async"]["B"] == [11] * NUM_STEPS


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cpu_token_state_advances_under_async_scheduling(results):
    pristine, patched = (r["scenario_async"] for r in results)
    assert pristine["A_runner_output_token_ids"] == [] and pristine["A_num_tokens"] == 1, pristine
    assert patched["A_runner_output_token_ids"] == [3, 4, 5, 6, -1], patched
    assert patched["A_num_tokens"] == 1 + NUM_STEPS
    assert patched["A_token_ids_cpu"] == [3, 3, 4, 5, 6, -1]
