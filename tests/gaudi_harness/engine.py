"""vLLM 0.30.0's real v1 Scheduler (KV cache manager, prefix caching, preemption) driving the real
HPUModelRunner on CPU, one engine step at a time, as EngineCore.step does:

    scheduler.schedule() -> runner.execute_model(so) -> runner.sample_tokens(None)
    -> scheduler.update_from_output(so, output)

Unlike drivers.StepDriver (hand-made SchedulerOutputs, no KV cache manager), block ids, prefix-cache
hits (num_computed_tokens at admission) and preemptions are the scheduler's own. The runner's KV
tensors must hold `num_blocks` blocks (plus vllm-gaudi's pad block). The scheduler class is the one the
config selects (`get_scheduler_cls`: with async scheduling vLLM's AsyncScheduler, which vllm-gaudi
rebinds to HPUAsyncScheduler). Under async scheduling each step's output is still resolved before the
next step is scheduled (no overlap of step N+1 with N, as drivers.StepDriver).
"""
from __future__ import annotations

import time


class EngineDriver:
    def __init__(self, runner, num_blocks: int):
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        self.runner = runner
        config = runner.vllm_config
        block_size = config.cache_config.block_size
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(block_size, sha256)
        # The scheduler needs only the group structure (one full-attention group) and the pool size.
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=config.model_config.dtype)
        kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
        config.cache_config.num_gpu_blocks = num_blocks
        register_all_kvcache_specs(config)
        scheduler_cls = config.scheduler_config.get_scheduler_cls()
        self.scheduler = scheduler_cls(vllm_config=config, kv_cache_config=kv_cache_config, block_size=block_size,
                                   log_stats=True, structured_output_manager=StructuredOutputManager(config))
        self.requests: dict = {}
        self.admitted_at: dict[str, list[int]] = {}   # req_id -> num_computed_tokens at each admission
        self.steps: list[dict[str, int]] = []          # scheduled tokens per step

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, None)
        request = Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=params,
                          pooling_params=None, block_hasher=self._hasher)
        self.requests[req_id] = request
        self.scheduler.add_request(request)

    def step(self) -> dict:
        from vllm.config import set_current_vllm_config

        so = self.scheduler.schedule()
        for new in so.scheduled_new_reqs:
            self.admitted_at.setdefault(new.req_id, []).append(new.num_computed_tokens)
        for i, req_id in enumerate(so.scheduled_cached_reqs.req_ids):
            if req_id in so.scheduled_cached_reqs.resumed_req_ids:
                self.admitted_at.setdefault(req_id, []).append(so.scheduled_cached_reqs.num_computed_tokens[i])
        self.steps.append(dict(so.num_scheduled_tokens))
        with set_current_vllm_config(self.runner.vllm_config):
            self.runner.execute_model(so)
            output = self.runner.sample_tokens(None)
        if hasattr(output, "get_output"):
            output = output.get_output()
        if output is None:   # nothing scheduled (e.g. only finished requests to report), as EngineCore
            from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT
            output = EMPTY_MODEL_RUNNER_OUTPUT
        return self.scheduler.update_from_output(so, output)

    def run(self, max_steps: int = 200) -> None:
        """Step until every request has finished."""
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise RuntimeError(f"requests still unfinished after {max_steps} steps")

    def preempt(self, req_id: str, evict: bool = False) -> None:
        """Preempt a running request with the scheduler's own `_preempt_request`, as schedule() does when
        the pool runs out: its blocks are freed (full ones stay in the prefix cache, unless `evict`, as
        when other requests reused them meanwhile). As with a preemption inside schedule(), it is not
        scheduled in the step that follows (one step is run without it; vllm-gaudi then drops it from
        its persistent batch) and resumes afterwards, from a prefix-cache hit or from 0."""
        request = self.requests[req_id]
        blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
        self.scheduler.running.remove(request)
        self.scheduler._preempt_request(request, time.monotonic())
        if evict:
            self.scheduler.kv_cache_manager.block_pool.evict_blocks(set(blocks))
        self.scheduler.waiting.remove_requests([request])
        self.step()
        self.scheduler.waiting.prepend_request(request)

    def outputs(self, req_id: str) -> list[int]:
        return list(self.requests[req_id].output_token_ids)
