"""rank-exception-fatal: vLLM 0.30.0's real MultiprocExecutor with two CPU worker processes
(real shared-memory message queues, a real gloo TP group), where rank 1 raises during
execute_model, whose reply comes from rank 0 after an all-reduce.

Failure before the all-reduce (async scheduling, as on Gaudi):
  pristine: rank 1's exception is logged and dropped; rank 0 waits in the all-reduce; the call
  ends only at VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS with a TimeoutError that does not carry rank
  1's error; the executor is not marked failed and stays wedged (the next RPC times out too).
  patched: the call fails within a few seconds with rank 1's error in the message, the executor
  is marked failed and the next RPC fails at once.
Failure after the all-reduce (sync scheduling):
  pristine: the call and the next step succeed; the error is lost and the executor carries on.
  patched: the error reaches the caller by the next step at the latest; the executor is failed.

Each scenario runs in its own process (rank_exception_fatal_support/run_scenario.py) with
PYTHONPATH=<vllm tree>:tests/fixes, under a hard timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cookbook.api import patched_copy
from rank_exception_fatal_support import FAILURE_MARKER

FIXES_DIR = Path(__file__).resolve().parent
RUNNER = FIXES_DIR / "rank_exception_fatal_support" / "run_scenario.py"
# The execute timeout the runner's executor uses: the short stand-in for the page's 5400 s.
EXECUTE_TIMEOUT_SECONDS = 20
# Fail fast: the patched caller looks at the other ranks every second.
FAIL_FAST_SECONDS = 5
# Hard limit per scenario process: start-up (6-80 s on a loaded 2-core machine), the pristine
# wait, shutdown (up to 5 s grace + 4 s SIGTERM for a rank stuck in a collective).
PROCESS_TIMEOUT_SECONDS = 420

pytestmark = [pytest.mark.slow, pytest.mark.timeout(4 * PROCESS_TIMEOUT_SECONDS)]


@pytest.fixture(scope="module")
def trees(vllm_src, tmp_path_factory):
    """{"pristine": sdist root, "patched": copy with the fix applied by the fix-pack library}."""
    dest = tmp_path_factory.mktemp("rank-exception-fatal")
    return {"pristine": vllm_src,
            "patched": patched_copy(vllm_src, "vllm", ["rank-exception-fatal"], dest)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A model folder with only a config.json: enough for a real ModelConfig, no weights."""
    path = tmp_path_factory.mktemp("opt-config-only")
    (path / "config.json").write_text(
        json.dumps({"architectures": ["OPTForCausalLM"], "model_type": "opt"}))
    return path


def run_scenario(trees: dict, name: str, scenario: str, mode: str, model_dir: Path) -> dict:
    """The runner's observations for one scenario on the tree named `name`."""
    tree = trees[name]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=str(EXECUTE_TIMEOUT_SECONDS),
               PYTHONPATH=os.pathsep.join([str(tree), str(FIXES_DIR)]))
    proc = subprocess.run([sys.executable, str(RUNNER), scenario, mode, str(model_dir)],
                          env=env, capture_output=True, text=True,
                          timeout=PROCESS_TIMEOUT_SECONDS)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"{scenario} ({mode}) on {tree} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    print(f"{name} {scenario} {mode}: {json.dumps(result)}")
    return result


def test_failure_before_collective(trees, model_dir):
    pristine = run_scenario(trees, "pristine", "fail-before-all-reduce", "async", model_dir)
    patched = run_scenario(trees, "patched", "fail-before-all-reduce", "async", model_dir)

    for result in (pristine, patched):
        assert result["async_scheduling"] is True
        assert result["healthy"] == {"outcome": "returned", "value": 3.0,
                                     "seconds": result["healthy"]["seconds"]}

    # Pristine: the call runs into the execute timeout; rank 1's error is not in it.
    failing = pristine["failing"]
    assert failing["outcome"] == "raised" and failing["error_type"] == "TimeoutError", pristine
    assert failing["seconds"] >= EXECUTE_TIMEOUT_SECONDS - 0.5, pristine
    assert FAILURE_MARKER not in failing["error"], pristine
    # ... and the executor is not failed but wedged: rank 0 is still in the all-reduce.
    assert pristine["is_failed"] is False, pristine
    assert pristine["follow_up"]["error_type"] == "TimeoutError", pristine

    # Patched: the call fails fast with rank 1's own error; the executor is failed.
    failing = patched["failing"]
    assert failing["outcome"] == "raised" and failing["error_type"] == "RuntimeError", patched
    assert failing["seconds"] < FAIL_FAST_SECONDS, patched
    assert FAILURE_MARKER in failing["error"] and "rank 1" in failing["error"], patched
    assert patched["is_failed"] is True, patched
    assert patched["follow_up"]["error"] == "Executor failed.", patched
    assert patched["follow_up"]["seconds"] < 1, patched


def test_failure_after_collective(trees, model_dir):
    pristine = run_scenario(trees, "pristine", "fail-after-all-reduce", "sync", model_dir)
    patched = run_scenario(trees, "patched", "fail-after-all-reduce", "sync", model_dir)

    # Pristine: rank 0 answers, rank 1's error is dropped, and the next step runs as if nothing
    # happened.
    assert pristine["failing"] == {"outcome": "returned", "value": 3.0,
                                   "seconds": pristine["failing"]["seconds"]}, pristine
    assert pristine["follow_up"]["outcome"] == "returned", pristine
    assert pristine["is_failed_after_follow_up"] is False, pristine

    # Patched: rank 1's report may land just after rank 0's reply, but rank 1 makes it before
    # it joins the next step's all-reduce, so the caller sees it by the next step at the latest.
    errors = [patched[call].get("error", "") for call in ("failing", "follow_up")]
    assert any(FAILURE_MARKER in error and "rank 1" in error for error in errors), patched
    assert patched["is_failed_after_follow_up"] is True, patched
    assert all(patched[call]["seconds"] < FAIL_FAST_SECONDS for call in ("failing", "follow_up"))
