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

A lost Ray node (vLLM's RayExecutorV2 on two Ray nodes of this machine, TP 2 x PP 2; the reply rank's node
killed mid-step):
  pristine: Ray's monitor marks the executor failed, but the call waits for the dead rank's TCP reply until
  VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS.
  patched: the call fails within seconds of the monitor, naming the rank it was waiting for.

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


# A lost node: vLLM's RayExecutorV2 on two Ray nodes of this machine (tools/ray_nodes.py), the second
# lost while a step is in flight (rank_exception_fatal_support/ray_node_lost.py).
RAY_NODE_LOST = FIXES_DIR / "rank_exception_fatal_support" / "ray_node_lost.py"
# The call has run this long when the node goes (ray_node_lost.IN_FLIGHT_AFTER_SECONDS).
IN_FLIGHT_SECONDS = 2
# Ray's worker monitor looks every 5 s; the patched caller then stops within its 1-s slice.
NODE_LOSS_SECONDS = 15
REPO = FIXES_DIR.parents[1]


def run_node_lost(tree: Path, model_dir: Path, log: Path) -> dict:
    from tools.ray_nodes import STAND_IN

    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "RAY_"))}
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1",
               VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=str(EXECUTE_TIMEOUT_SECONDS),
               PYTHONPATH=os.pathsep.join(map(str, [STAND_IN, tree, FIXES_DIR, REPO])))
    proc = subprocess.run([sys.executable, str(RAY_NODE_LOST), str(model_dir), str(log)], env=env,
                          capture_output=True, text=True, timeout=PROCESS_TIMEOUT_SECONDS)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"ray_node_lost.py on {tree} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1][len("RESULT "):])
    print(f"{tree.name} ray node lost: {json.dumps(result)}")
    return result


@pytest.mark.pristine
def test_a_lost_ray_node_ends_the_call_in_flight(trees, model_dir, tmp_path):
    """The reply rank's node dies mid-step. Ray's monitor marks the executor failed within seconds, but the
    pristine caller keeps reading the dead rank's TCP queue until VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (the
    page's 5400 s). Patched, the call fails once the executor is marked failed, naming the rank."""
    pristine = run_node_lost(trees["pristine"], model_dir, tmp_path / "pristine-ray.log")
    patched = run_node_lost(trees["patched"], model_dir, tmp_path / "patched-ray.log")
    for result in (pristine, patched):
        # the reply rank's TP group is ranks 2 and 3: (2 + 1) + (3 + 1)
        assert result["healthy"]["outcome"] == "returned" and result["healthy"]["value"] == 7.0, result
        assert result["output_rank"] == 2, result     # TP 0 of the last stage: on the node that goes
        assert sorted(result["placement"].values()) == ["127.0.0.2"] * 2 + ["127.0.0.3"] * 2, result
        assert result["is_failed"] is True, result    # the monitor saw the workers go, in both

    in_flight = pristine["in_flight"]
    assert in_flight["error_type"] == "TimeoutError", pristine
    assert in_flight["seconds"] >= EXECUTE_TIMEOUT_SECONDS - IN_FLIGHT_SECONDS - 0.5, pristine

    in_flight = patched["in_flight"]
    assert in_flight["error_type"] == "RuntimeError" and in_flight["seconds"] < NODE_LOSS_SECONDS, patched
    assert "Executor failed while waiting for rank 2's reply to execute_model" in in_flight["error"], patched
