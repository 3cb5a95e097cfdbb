"""The engine core's side of the long-prefill share: vLLM's real EngineCore (its `step` or,
with async scheduling, `step_with_batch_queue`) and real scheduler, over an executor test
double that stands in for the device: `ModelledTimeDevice` runs each step for the modelled
step time of scenario.py (scaled down, really sleeping, one step after the other as a device
would) and yields one token per request that is not mid-prefill.

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=<tree>:<sdist> python engine_scenario.py '<json>'

Prints one JSON object (last line of stdout): per step whether it carried a long chunk, the
device time, and the durations the engine core reported to the scheduler (patched tree).
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from scenario import make_model_dir, step_cost

DEFAULTS = {
    "async_scheduling": False,
    "num_decodes": 16,
    "long_prompt_tokens": 65_536,
    "steps_before": 10,
    # real seconds per modelled second
    "time_scale": 0.02,
}


def make_device_class(time_scale: float):
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.outputs import ModelRunnerOutput

    class ModelledTimeDevice(Executor):
        """Executor test double: no model, no device; steps take modelled time."""

        def _init_executor(self) -> None:
            self.worker = ThreadPoolExecutor(max_workers=1)  # one device, steps in order
            self.to_sample: list[tuple[list[str], set[str]]] = []
            self.device_log: list[dict] = []
            self.requests = None  # the scheduler's request table, set by the scenario

        @classmethod
        def supports_async_scheduling(cls) -> bool:
            return True

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None,
                           non_block=False, unique_reply_rank=None, kv_output_aggregator=None):
            replies = {
                "get_kv_cache_spec": lambda: {"layer.0": FullAttentionSpec(
                    block_size=128, num_kv_heads=1, head_size=1, dtype=torch.float32)},
                "determine_available_memory": lambda: 4096 * 1024,  # 4096 blocks of 1 KiB
                "get_supported_kv_cache_layouts": lambda: ["NHD"],
                "set_kv_cache_layout": lambda: None,
                "initialize_from_config": lambda: None,
            }
            if method == "compile_or_warm_up_model":
                return []
            if method not in replies:
                raise NotImplementedError(f"ModelledTimeDevice has no {method!r}")
            return [replies[method]()]

        def check_health(self) -> None:
            return None

        def execute_model(self, scheduler_output, non_block=False):
            chunks, sampled, long_tokens = [], set(), 0
            for rid, n in scheduler_output.num_scheduled_tokens.items():
                request = self.requests[rid]
                context = request.num_computed_tokens - n
                if context < request.num_prompt_tokens:
                    chunks.append((n, context))
                    long_tokens += n if rid == "long" else 0
                if not request.is_prefill_chunk:
                    sampled.add(rid)
            seconds = step_cost(chunks, len(scheduler_output.num_scheduled_tokens) - len(chunks))
            self.to_sample.append((list(scheduler_output.num_scheduled_tokens), sampled))
            entry = {"modelled": seconds, "long_tokens": long_tokens, "output": scheduler_output}
            self.device_log.append(entry)

            def run() -> None:
                time.sleep(seconds * time_scale)
            future: Future = self.worker.submit(run)
            return future if non_block else future.result()

        def sample_tokens(self, grammar_output, non_block=False):
            req_ids, sampled = self.to_sample.pop(0)

            def run() -> ModelRunnerOutput:
                return ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                    sampled_token_ids=[[1] if rid in sampled else [] for rid in req_ids],
                    logprobs=None, prompt_logprobs_dict={}, pooler_output=[])
            future = self.worker.submit(run)
            return future if non_block else future.result()

        def shutdown(self) -> None:
            self.worker.shutdown(wait=True)

    return ModelledTimeDevice


def run(options: dict) -> dict:
    from tests.v1.core.utils import create_requests, create_scheduler
    from vllm.v1.engine.core import EngineCore

    opts = {**DEFAULTS, **options}
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise SystemExit(f"unknown options {sorted(unknown)}; expected some of {sorted(DEFAULTS)}")
    vllm_config = create_scheduler(
        model=make_model_dir(), skip_tokenizer_init=True, max_num_seqs=32,
        max_num_batched_tokens=2048, max_model_len=262144, block_size=128, num_blocks=4096,
        async_scheduling=opts["async_scheduling"],
    ).vllm_config
    engine = EngineCore(vllm_config, make_device_class(opts["time_scale"]), log_stats=False)
    device = engine.model_executor
    device.requests = engine.scheduler.requests
    reported: dict[int, float] = {}
    if hasattr(engine.scheduler, "long_prefill_share"):  # patched tree: watch the reports
        record = engine.scheduler.record_step_time

        def watched(scheduler_output, seconds):
            assert id(scheduler_output) not in reported, "a step was reported twice"
            reported[id(scheduler_output)] = seconds
            record(scheduler_output, seconds)
        engine.scheduler.record_step_time = watched

    decodes = create_requests(opts["num_decodes"], num_tokens=512, ignore_eos=True,
                              max_tokens=100_000, block_size=128)
    long_request = create_requests(1, num_tokens=opts["long_prompt_tokens"], ignore_eos=True,
                                   max_tokens=2, block_size=128, req_ids=["long"])[0]
    for request in decodes:
        engine.scheduler.add_request(request)
    decoding_since = arrival_index = None
    started = time.monotonic()
    while not long_request.is_finished():
        if arrival_index is None:
            if decoding_since is None and all(
                    r.num_computed_tokens >= r.num_prompt_tokens for r in decodes):
                decoding_since = len(device.device_log)
            if (decoding_since is not None
                    and len(device.device_log) - decoding_since >= opts["steps_before"]):
                arrival_index = len(device.device_log)
                engine.scheduler.add_request(long_request)
        engine.step_fn()
        if time.monotonic() - started > 300:
            raise SystemExit("the long prompt did not finish within 300 s")
    # drain what is still in flight
    while engine.batch_queue:
        engine.step_fn()
    steps = [{"modelled": e["modelled"], "long_tokens": e["long_tokens"],
              "reported": reported.get(id(e["output"]))} for e in device.device_log]
    engine.shutdown()
    return {"options": opts, "arrival_index": arrival_index, "steps": steps,
            "reports_watched": hasattr(engine.scheduler, "long_prefill_share"),
            "long_output_tokens": len(long_request.output_token_ids)}


if __name__ == "__main__":
    result = run(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {})
    sys.stdout.write("\n" + json.dumps(result) + "\n")
