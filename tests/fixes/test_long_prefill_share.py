"""vllm-long-prefill-share (opt-in): vLLM 0.30.0's real v1 Scheduler and AsyncScheduler, 16
decode streams and one 250,000-token prompt, on a modelled clock.

Pristine: every step from the long prompt's arrival to its first token carries a chunk of
it, so the decodes stall for the whole prefill. Patched with VLLM_LONG_PREFILL_SHARE=0.5: the
steps carrying a long chunk take 0.5 of the modelled time (within SHARE_TOLERANCE), the other
steps run the decodes alone, and the prompt still completes without losing progress.
Patched with the variables unset: the very same SchedulerOutputs as pristine. Bad values stop
start-up with a message naming the variable, the value and the allowed range.

The engine core's timing hook is checked with vLLM's real EngineCore loop (sync `step` and
async `step_with_batch_queue`) over `ModelledTimeDevice`, an executor test double standing in
for the device (engine_scenario.py): every step is reported once and the share holds.

Each scenario runs in its own process (tests/fixes/long_prefill_share_support/scenario.py,
engine_scenario.py) with PYTHONPATH=<vllm tree>:<pristine sdist root>; see scenario.py for
the step-time model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cookbook.api import patched_copy

SUPPORT = Path(__file__).resolve().parent / "long_prefill_share_support"
LONG_PROMPT_TOKENS = 250_000
SHARE = 0.5
# Granularity bound: one long step (~2 s at 250K context) in ~300 s of prefill is < 1 %.
SHARE_TOLERANCE = 0.03

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def trees(vllm_src, tmp_path_factory):
    """{"pristine": sdist root, "patched": copy with the fix applied by the fix-pack library}."""
    dest = tmp_path_factory.mktemp("vllm-long-prefill-share")
    return {"pristine": vllm_src,
            "patched": patched_copy(vllm_src, "vllm", ["vllm-long-prefill-share"], dest)}


def run_support(script: str, tree: Path, sdist: Path, argument, env_vars: dict[str, str]):
    # No inherited VLLM_* variable: vLLM's unknown-variable check must see only ours.
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(env_vars, VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="WARNING",
               PYTHONPATH=os.pathsep.join([str(tree), str(sdist)]))
    proc = subprocess.run([sys.executable, str(SUPPORT / script), json.dumps(argument)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


_results: dict[tuple, dict] = {}


@pytest.fixture(scope="module")
def scenario(trees, vllm_src):
    """scenario(tree_name, async_scheduling, **variables) -> the scenario's JSON (cached)."""
    def run(tree_name: str, async_scheduling: bool, **variables: str) -> dict:
        key = (tree_name, async_scheduling, tuple(sorted(variables.items())))
        if key not in _results:
            options = {"async_scheduling": async_scheduling, "digest": not variables}
            _results[key], _ = run_support("scenario.py", trees[tree_name], vllm_src,
                                           options, variables)
        return _results[key]
    return run


def prefill_window(result: dict) -> list[dict]:
    """The steps from the long prompt's arrival to the one that completes its prefill."""
    assert result["first_token_step"] is not None, "the long prompt never finished its prefill"
    return result["steps"][result["arrival_step"]:result["first_token_step"] + 1]


def long_time_share(steps: list[dict]) -> float:
    total = sum(s["duration"] for s in steps)
    return sum(s["duration"] for s in steps if s["long_tokens"]) / total


def back_to_back_long_steps(steps: list[dict]) -> int:
    return sum(1 for a, b in zip(steps, steps[1:]) if a["long_tokens"] and b["long_tokens"])


def assert_prompt_completed_without_lost_progress(result: dict) -> None:
    steps = result["steps"]
    assert result["long_finished"] and result["long_output_tokens"] >= 1
    # Skipped steps keep the progress: every prompt token is scheduled exactly once.
    assert sum(s["long_tokens"] for s in steps) == LONG_PROMPT_TOKENS
    computed = [s["long_computed"] for s in steps[result["arrival_step"]:]]
    assert computed == sorted(computed), "the long prompt's computed tokens went backwards"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_long_prefill_gets_its_share_and_decodes_the_rest(scenario, async_scheduling):
    pristine = prefill_window(scenario("pristine", async_scheduling))
    # The bug: all 124 steps of the prefill carry a 2032-token chunk beside the 16 decodes.
    assert len(pristine) == 124
    assert all(s["long_tokens"] > 0 for s in pristine)
    assert long_time_share(pristine) == 1.0

    variables = {"VLLM_LONG_PREFILL_SHARE": str(SHARE)}
    if async_scheduling:
        variables["VLLM_LONG_PREFILL_SHARE_ASYNC"] = "1"
    result = scenario("patched", async_scheduling, **variables)
    patched = prefill_window(result)
    share = long_time_share(patched)
    assert abs(share - SHARE) <= SHARE_TOLERANCE, f"long-chunk time share {share:.4f}"
    decode_only = [s for s in patched if not s["long_tokens"]]
    assert len(decode_only) > 10 * len(pristine)
    assert all(s["decode_tokens"] == 16 for s in decode_only)
    # The share holds along the way too, not only at the end (after a 10% warm-up).
    elapsed = long_elapsed = 0.0
    for i, s in enumerate(patched):
        elapsed += s["duration"]
        long_elapsed += s["duration"] if s["long_tokens"] else 0.0
        if i >= len(patched) // 10:
            assert long_elapsed / elapsed <= SHARE + SHARE_TOLERANCE
    assert_prompt_completed_without_lost_progress(result)


def test_async_scheduling_needs_the_async_accounting(scenario):
    """Step times arrive one step late under async scheduling: without
    VLLM_LONG_PREFILL_SHARE_ASYNC=1 long chunks come in back-to-back pairs; with it they
    do not (but for the very first, before any long step was measured)."""
    lagged = prefill_window(scenario("patched", True, VLLM_LONG_PREFILL_SHARE=str(SHARE)))
    counted = prefill_window(scenario("patched", True, VLLM_LONG_PREFILL_SHARE=str(SHARE),
                                      VLLM_LONG_PREFILL_SHARE_ASYNC="1"))
    assert back_to_back_long_steps(lagged) >= 40
    assert back_to_back_long_steps(counted) <= 1


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_unset_is_the_pristine_schedule(scenario, async_scheduling):
    pristine = scenario("pristine", async_scheduling)
    patched = scenario("patched", async_scheduling)
    assert not pristine["has_record_step_time"] and patched["has_record_step_time"]
    digests = [s["digest"] for s in patched["steps"]]
    assert len(digests) == len(pristine["steps"]) > 124
    assert digests == [s["digest"] for s in pristine["steps"]]


BAD_VALUES = [
    ("VLLM_LONG_PREFILL_SHARE", "0", "a number with 0 < share <= 1"),
    ("VLLM_LONG_PREFILL_SHARE", "-0.5", "a number with 0 < share <= 1"),
    ("VLLM_LONG_PREFILL_SHARE", "1.5", "a number with 0 < share <= 1"),
    ("VLLM_LONG_PREFILL_SHARE", "half", "a number with 0 < share <= 1"),
    ("VLLM_LONG_PREFILL_SHARE", "nan", "a number with 0 < share <= 1"),
    ("VLLM_LONG_PREFILL_MIN_TOKENS", "0", "an integer >= 1"),
    ("VLLM_LONG_PREFILL_MIN_TOKENS", "32k", "an integer >= 1"),
    ("VLLM_LONG_PREFILL_SHARE_ASYNC", "yes", "0 or 1"),
]
GOOD_VALUES = [
    {"VLLM_LONG_PREFILL_SHARE": "0.5", "VLLM_LONG_PREFILL_SHARE_ASYNC": "1",
     "VLLM_LONG_PREFILL_MIN_TOKENS": "32768"},
    {"VLLM_LONG_PREFILL_SHARE": "1"},
]


def test_variables_registered_and_bad_values_fail_at_startup(trees, vllm_src):
    cases = [{"VLLM_LONG_PREFILL_SHARE": "0.5", name: value} for name, value, _ in BAD_VALUES]
    cases += GOOD_VALUES
    pristine, _ = run_support("startup_check.py", trees["pristine"], vllm_src, cases, {})
    patched, _ = run_support("startup_check.py", trees["patched"], vllm_src, cases, {})

    # Pristine: the variables are unknown to vLLM and bad values pass silently.
    for case, outcome in zip(cases, pristine):
        assert outcome["validate_environ"].startswith(
            "ValueError: Unknown vLLM environment variable detected: VLLM_LONG_PREFILL"), case
        assert outcome["scheduler"] == "ok", case

    for (name, value, expected), outcome in zip(BAD_VALUES, patched):
        assert outcome["validate_environ"] == "ok"
        assert outcome["scheduler"] == (
            f"ValueError: Invalid value {value!r} for {name}: expected {expected}.")
    for case, outcome in zip(GOOD_VALUES, patched[len(BAD_VALUES):]):
        assert outcome == {"validate_environ": "ok", "scheduler": "ok"}, case


@pytest.fixture(scope="module")
def engine_scenario(trees, vllm_src):
    def run(tree_name: str, async_scheduling: bool, **variables: str) -> dict:
        result, _ = run_support("engine_scenario.py", trees[tree_name], vllm_src,
                                {"async_scheduling": async_scheduling}, variables)
        steps = result["steps"]
        last_long = max(i for i, s in enumerate(steps) if s["long_tokens"])
        result["window"] = steps[result["arrival_index"]:last_long + 1]
        return result
    return run


ENGINE_SHARE_TOLERANCE = 0.1  # real sleeps and host overhead on a shared machine


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["step", "step_with_batch_queue"])
def test_engine_core_reports_step_times(engine_scenario, async_scheduling):
    """The real EngineCore loop over a device test double whose steps take (scaled) modelled
    time: the patched engine core reports every step's wall-clock duration to the scheduler
    exactly once, and the long chunks' share of that time holds."""
    if not async_scheduling:  # pristine: the engine core has no reports, every step is long
        pristine = engine_scenario("pristine", False)
        assert not pristine["reports_watched"]
        assert all(s["long_tokens"] for s in pristine["window"])
    variables = {"VLLM_LONG_PREFILL_SHARE": str(SHARE), "VLLM_LONG_PREFILL_SHARE_ASYNC": "1"}
    result = engine_scenario("patched", async_scheduling, **variables)
    window = result["window"]
    assert result["long_output_tokens"] == 2
    assert all(s["reported"] is not None for s in result["steps"]), "a step was not reported"
    reported_total = sum(s["reported"] for s in window)
    long_share = sum(s["reported"] for s in window if s["long_tokens"]) / reported_total
    assert abs(long_share - SHARE) <= ENGINE_SHARE_TOLERANCE, f"reported long share {long_share:.3f}"
    # The reports measure the device: a long step's reported time covers its device time.
    scale = result["options"]["time_scale"]
    ratios = sorted(s["reported"] / (s["modelled"] * scale) for s in window if s["long_tokens"])
    assert ratios[len(ratios) // 2] >= 0.9
    assert sum(1 for s in window if not s["long_tokens"]) > len(ratios)
