"""A real vLLM worker with no model: its `execute_model` is one all-reduce over the real gloo
tensor-parallel group, and a chosen rank can raise before or after it.

The CPU platform spawns the workers, which import this class by name
(`ParallelConfig.worker_cls`), so it lives in an importable module of its own.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from vllm.distributed import (
    ensure_model_parallel_initialized,
    get_tp_group,
    init_distributed_environment,
)
from vllm.v1.worker.worker_base import WorkerBase

from rank_exception_fatal_support import FAILURE_MARKER


class AllReduceWorker(WorkerBase):
    def init_device(self) -> None:
        self.device = torch.device("cpu")
        init_distributed_environment(
            world_size=self.parallel_config.world_size,
            rank=self.rank,
            distributed_init_method=self.distributed_init_method,
            local_rank=self.local_rank,
            backend="gloo",
        )
        ensure_model_parallel_initialized(self.parallel_config.tensor_parallel_size,
                                          self.parallel_config.pipeline_parallel_size)

    def load_model(self) -> None:
        pass

    def execute_model(self, plan: dict) -> float:
        """`plan` stands in for the SchedulerOutput: {"fail_rank": r, "fail_when": "before"|"after",
        "sleep_seconds": s}.
        Returns the sum of (rank + 1) over the TP group: 3.0 with two ranks."""
        time.sleep(plan.get("sleep_seconds", 0))   # a long step: the call stays in flight
        failing = plan.get("fail_rank") == self.rank
        if failing and plan.get("fail_when") == "before":
            raise ValueError(f"{FAILURE_MARKER}: rank {self.rank} raised before the all-reduce")
        total = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(total, group=get_tp_group().cpu_group)
        if failing and plan.get("fail_when") == "after":
            raise ValueError(f"{FAILURE_MARKER}: rank {self.rank} raised after the all-reduce")
        return total.item()

    def ping(self) -> int:
        """An RPC without any collective: answers at once unless the rank is stuck."""
        return self.rank
