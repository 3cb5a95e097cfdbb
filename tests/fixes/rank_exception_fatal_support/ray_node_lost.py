"""Drive a real vLLM RayExecutorV2 over two Ray nodes of this machine (tools/ray_nodes.py, the recipe's CPU
layout: two worker slots per node) at TP 2 x PP 2, with the no-model AllReduceWorker, lose the second node
while an execute_model call is in flight, and print what the caller observed as one JSON line prefixed
"RESULT ".

The reply rank (TP 0 of the last stage, rank 2) is on the lost node: the caller reads its reply over TCP.
Run with the TEST-ONLY Ray device stand-in (tools/ray_standin), the vLLM tree under test, tests/fixes and
the repository on PYTHONPATH, in that order, VLLM_TARGET_DEVICE=cpu; VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS bounds
the call.

    python ray_node_lost.py MODEL_DIR LOG
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

WORKER_CLS = "rank_exception_fatal_support.allreduce_worker.AllReduceWorker"
# How long the in-flight step runs: longer than any wait the test accepts.
STEP_SECONDS = 600
# Time for every rank to be inside the step before the node goes.
IN_FLIGHT_AFTER_SECONDS = 2


def main() -> None:
    from tools.cpu_server import free_port
    from tools.ray_nodes import RayNodes
    from rank_exception_fatal_support.run_scenario import observe

    from vllm.config import ModelConfig, ParallelConfig, VllmConfig
    from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

    model_dir, log = sys.argv[1], Path(sys.argv[2])
    nodes = RayNodes(Path(sys.prefix), dict(os.environ), free_port(), log)
    result: dict = {}
    with nodes:
        os.environ["RAY_ADDRESS"] = nodes.address
        config = VllmConfig(
            model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32"),
            parallel_config=ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2,
                                           distributed_executor_backend="ray", worker_cls=WORKER_CLS))
        executor = RayExecutorV2(config)
        result["output_rank"] = executor.output_rank
        result["placement"] = nodes.actors()
        result["healthy"] = observe(lambda: executor.execute_model({}))
        future = executor.execute_model({"sleep_seconds": STEP_SECONDS}, non_block=True)
        time.sleep(IN_FLIGHT_AFTER_SECONDS)
        nodes.kill_node(1)
        result["in_flight"] = observe(future.result)
        result["is_failed"] = executor.is_failed
        print("RESULT " + json.dumps(result), flush=True)
    # The executor's message queues keep zmq sockets open that would hold the exit: leave now.
    os._exit(0)


if __name__ == "__main__":
    main()
