"""Drive a real vLLM MultiprocExecutor with two CPU worker processes through one scenario and
print what the caller observed as one JSON line prefixed "RESULT ".

Run with the vLLM tree under test and tests/fixes on PYTHONPATH, VLLM_TARGET_DEVICE=cpu and
VLLM_CPU_OMP_THREADS_BIND=nobind; VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS bounds each execute_model.

    python run_scenario.py {fail-before-all-reduce|fail-after-all-reduce} {async|sync} MODEL_DIR
"""
from __future__ import annotations

import json
import os
import sys
import time

WORKER_CLS = "rank_exception_fatal_support.allreduce_worker.AllReduceWorker"
# Bound for the `ping` sent after a failure before the all-reduce.
FOLLOW_UP_TIMEOUT_SECONDS = 3

PLANS = {
    "fail-before-all-reduce": {"fail_rank": 1, "fail_when": "before"},
    "fail-after-all-reduce": {"fail_rank": 1, "fail_when": "after"},
}


def build_config(model_dir: str, async_scheduling: bool):
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig

    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32")
    parallel_config = ParallelConfig(
        tensor_parallel_size=2, distributed_executor_backend="mp", worker_cls=WORKER_CLS
    )
    config = VllmConfig(model_config=model_config, parallel_config=parallel_config)
    # The CPU platform turns async scheduling off; Gaudi keeps vLLM's default (on), with which
    # the workers send their replies from a separate output thread.
    config.scheduler_config.async_scheduling = async_scheduling
    return config


def observe(call) -> dict:
    """Run one executor call; record how it ended and how long it took."""
    start = time.monotonic()
    try:
        value = call()
    except BaseException as error:  # noqa: BLE001 - the test inspects whatever came out
        return {"outcome": "raised", "error_type": type(error).__name__, "error": str(error),
                "seconds": round(time.monotonic() - start, 2)}
    return {"outcome": "returned", "value": value, "seconds": round(time.monotonic() - start, 2)}


def follow_up(executor, scenario: str):
    """The call made after the failing one."""
    if scenario == "fail-before-all-reduce":
        # No collective in it: a live rank 0 answers at once.
        return executor.collective_rpc(
            "ping", unique_reply_rank=0, timeout=FOLLOW_UP_TIMEOUT_SECONDS)
    # A healthy step: rank 0 answers only after rank 1 joined its all-reduce, which rank 1 does
    # only after it has handled the failure of the previous step.
    return executor.execute_model({})


def main() -> None:
    if len(sys.argv) != 4 or sys.argv[1] not in PLANS or sys.argv[2] not in ("async", "sync"):
        sys.exit(f"usage: run_scenario.py {{{'|'.join(PLANS)}}} {{async|sync}} MODEL_DIR; "
                 f"got {sys.argv[1:]}")
    plan = PLANS[sys.argv[1]]

    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    config = build_config(sys.argv[3], async_scheduling=sys.argv[2] == "async")
    result: dict = {"async_scheduling": config.scheduler_config.async_scheduling}
    start = time.monotonic()
    executor = MultiprocExecutor(config)
    result["startup_seconds"] = round(time.monotonic() - start, 2)

    result["healthy"] = observe(lambda: executor.execute_model({}))
    result["failing"] = observe(lambda: executor.execute_model(plan))
    result["is_failed"] = executor.is_failed
    result["follow_up"] = observe(lambda: follow_up(executor, sys.argv[1]))
    result["is_failed_after_follow_up"] = executor.is_failed

    start = time.monotonic()
    executor.shutdown()
    result["shutdown_seconds"] = round(time.monotonic() - start, 2)

    print("RESULT " + json.dumps(result), flush=True)
    # The executor's message queues keep zmq sockets open that would hold the exit: leave now.
    os._exit(0)


if __name__ == "__main__":
    main()
