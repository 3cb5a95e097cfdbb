"""16 decode streams and one 250K-token prompt through vLLM's real v1 scheduler, on a
modelled clock.

Run as a script, in a process whose PYTHONPATH holds the vLLM tree under test first and
the pristine v0.30.0 sdist root after it (for the sdist's tests/v1/core/utils.py):

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=<tree>:<sdist> python scenario.py '<json options>'

It prints one JSON object (the last line of stdout) describing every step. The scheduler
and the request bookkeeping are vLLM's own (`create_scheduler` / `create_requests` from
the sdist's tests); only the model is replaced, by `step_cost`: each step "runs" for the
modelled time and yields one token for every request that is not mid-prefill, which is
what the engine core would hand back to `update_from_output`.

Step-time model (seconds), calibrated to the published Inkling-Small figures on one Gaudi 2
node (16 streams at 28.3 tok/s each => a 16-decode step takes ~35 ms; a 250K prompt alone
prefills in ~145 s). A step runs its prefill chunks, then its decodes (separate graphs on
HPU, so the costs add up):
    prefill chunk of n tokens after c tokens of context:
        n * (PREFILL_PER_TOKEN + PREFILL_PER_TOKEN_PER_CONTEXT * (c + n / 2))
    decodes: DECODE_STEP_BASE + DECODE_PER_REQUEST * number of decode requests
The attention term makes a 2K chunk cost ~0.3 s at the start of the prompt and ~2 s at
250K of context, while a decode step stays at ~35 ms.

When the vLLM tree has `Scheduler.record_step_time` (the long-prefill-share fix), each
step's modelled duration is reported to it the way the engine core does: right after the
step, or, with async scheduling, after the next step was scheduled (one step late).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import tempfile
from pathlib import Path

PREFILL_PER_TOKEN = 1.46e-4
PREFILL_PER_TOKEN_PER_CONTEXT = 3.47e-9
DECODE_STEP_BASE = 0.0200
DECODE_PER_REQUEST = 0.00096

DEFAULTS = {
    "async_scheduling": False,
    "num_decodes": 16,
    "decode_prompt_tokens": 1024,
    "long_prompt_tokens": 250_000,
    "long_max_tokens": 4,
    # decode-only steps, once every stream decodes, before the long prompt arrives
    "steps_before": 40,
    # decode-only steps after the long prompt finished
    "steps_after": 0,
    "digest": False,
    "max_steps": 20_000,
}


def step_cost(chunks: list[tuple[int, int]], num_decodes: int) -> float:
    """Modelled seconds of one step: `chunks` = (tokens, context before them) per
    prefilling request, `num_decodes` = requests decoding one token."""
    prefill = sum(
        n * (PREFILL_PER_TOKEN + PREFILL_PER_TOKEN_PER_CONTEXT * (c + n / 2))
        for n, c in chunks
    )
    decode = DECODE_STEP_BASE + DECODE_PER_REQUEST * num_decodes if num_decodes else 0.0
    return prefill + decode


def make_model_dir() -> str:
    """A model folder holding only a config.json: all the scheduler reads."""
    path = Path(tempfile.mkdtemp(prefix="lps-model-"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "max_position_embeddings": 262144,
    }))
    return str(path)


_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def output_digest(scheduler_output) -> str:
    """sha256 of the whole SchedulerOutput's repr (object addresses blanked)."""
    text = _ADDRESS.sub("0x", repr(scheduler_output))
    return hashlib.sha256(text.encode()).hexdigest()


def run(options: dict) -> dict:
    from tests.v1.core.utils import create_requests, create_scheduler
    from vllm.v1.outputs import ModelRunnerOutput

    opts = {**DEFAULTS, **options}
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise SystemExit(f"unknown options {sorted(unknown)}; expected some of {sorted(DEFAULTS)}")
    is_async = opts["async_scheduling"]
    scheduler = create_scheduler(
        model=make_model_dir(),
        skip_tokenizer_init=True,
        max_num_seqs=32,
        max_num_batched_tokens=2048,
        max_model_len=262144,
        block_size=128,
        num_blocks=4096,
        async_scheduling=is_async,
    )
    report = getattr(scheduler, "record_step_time", None)

    decodes = create_requests(
        opts["num_decodes"], num_tokens=opts["decode_prompt_tokens"], ignore_eos=True,
        max_tokens=200_000, block_size=128,
    ) if opts["num_decodes"] else []
    long_request = create_requests(
        1, num_tokens=opts["long_prompt_tokens"], ignore_eos=True,
        max_tokens=opts["long_max_tokens"], block_size=128, req_ids=["long"],
    )[0]
    decode_ids = {r.request_id for r in decodes}
    for request in decodes:
        scheduler.add_request(request)

    clock = 0.0
    steps: list[dict] = []
    in_flight = None  # async scheduling: the step not yet reported (finish's arguments)
    arrival_step = arrival_time = decoding_since = finished_step = None

    def finish(output, sampled: set[str], duration: float) -> None:
        """What the engine core does once a step's results are in."""
        if report is not None:
            report(output, duration)
        req_ids = list(output.num_scheduled_tokens)
        scheduler.update_from_output(output, ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=[[1] if rid in sampled else [] for rid in req_ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        ))

    while len(steps) < opts["max_steps"]:
        if arrival_step is None:
            if decoding_since is None and all(
                    r.num_computed_tokens >= r.num_prompt_tokens for r in decodes):
                decoding_since = len(steps)
            if decoding_since is not None and len(steps) - decoding_since >= opts["steps_before"]:
                arrival_step, arrival_time = len(steps), clock
                scheduler.add_request(long_request)
        elif finished_step is None and long_request.is_finished():
            finished_step = len(steps)
        if finished_step is not None and len(steps) - finished_step >= opts["steps_after"]:
            break

        output = scheduler.schedule()
        chunks, decode_tokens, long_tokens, sampled = [], 0, 0, set()
        for rid, n in output.num_scheduled_tokens.items():
            request = scheduler.requests[rid]
            context = request.num_computed_tokens - n  # schedule() already advanced it
            if context < request.num_prompt_tokens:
                chunks.append((n, context))
                if rid == "long":
                    long_tokens = n
            elif rid in decode_ids:
                decode_tokens += 1
            if not request.is_prefill_chunk:
                sampled.add(rid)
        duration = step_cost(chunks, len(output.num_scheduled_tokens) - len(chunks))
        clock += duration
        steps.append({
            "duration": duration,
            "end": clock,
            "long_tokens": long_tokens,
            "decode_tokens": decode_tokens,
            "long_computed": long_request.num_computed_tokens,
            "digest": output_digest(output) if opts["digest"] else None,
        })
        if is_async:
            if in_flight is not None:
                finish(*in_flight)
            in_flight = (output, sampled, duration)
        else:
            finish(output, sampled, duration)
    if in_flight is not None:
        finish(*in_flight)

    first_token_step = next(
        (i for i, s in enumerate(steps) if arrival_step is not None and i >= arrival_step
         and s["long_computed"] >= opts["long_prompt_tokens"]), None)
    return {
        "options": opts,
        "has_record_step_time": report is not None,
        "steps": steps,
        "arrival_step": arrival_step,
        "arrival_time": arrival_time,
        "first_token_step": first_token_step,
        "long_finished": long_request.is_finished(),
        "long_output_tokens": len(long_request.output_token_ids),
    }


if __name__ == "__main__":
    result = run(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {})
    sys.stdout.write("\n" + json.dumps(result) + "\n")
