"""Environment knobs of the Inkling HPU model, read once when the model is built.

`KNOBS` documents every knob (name -> kind, default, meaning) for other modules (guards, start-up
log, README) to import; `read_knobs()` parses them strictly. docs/knobs.md has the full definitions.
Every knob except the bias budget is a pure optimisation: on and off give the same logits
(tests/cpu/test_knobs_equivalence.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class KnobSpec:
    kind: str        # "bytes" (integer >= 0) or "flag" ("0" or "1")
    default: str
    meaning: str


KNOBS: dict[str, KnobSpec] = {
    "INKLING_PREFILL_BIAS_BUDGET": KnobSpec(
        "bytes", "0",
        "Upper bound in bytes for the relative-bias block [requests, heads, query rows, keys] (fp32) that "
        "prefill attention materialises; the query rows are processed in chunks small enough to stay under "
        "it. 0 = no bound (one chunk). The page uses 805306368 (768 MiB)."),
    "INKLING_LOCAL_WINDOW_PREFILL": KnobSpec(
        "flag", "0",
        "Prefill on sliding-window layers reads only the KV blocks that hold keys inside the window of "
        "the query rows being computed, instead of every block of the request."),
    "INKLING_MOE_SINGLE_REDUCE": KnobSpec(
        "flag", "0",
        "Sum the routed-expert and shared-expert partial outputs before the tensor-parallel all-reduce: "
        "one collective per MoE layer instead of two."),
    "INKLING_STEP_HOIST": KnobSpec(
        "flag", "0",
        "Build the per-step attention plans (block gathers, key positions, masks, bias gather indices, "
        "log-scaling tau) once per forward and layer kind, instead of once per layer."),
    "INKLING_DECODE_WINDOW_PLUS1": KnobSpec(
        "flag", "0",
        "Decode on sliding-window layers reads only the last ceil((window-1)/block)+1 KV blocks of each "
        "request (window/block + 1 when the block divides the window: 5 blocks for 512/128), instead of "
        "every block of the request."),
}


class KnobError(ValueError):
    """A knob set to a value the model does not accept."""


@dataclass(frozen=True)
class Knobs:
    prefill_bias_budget: int = 0
    local_window_prefill: bool = False
    moe_single_reduce: bool = False
    step_hoist: bool = False
    decode_window_plus1: bool = False

    def as_env(self) -> dict[str, str]:
        """The environment that reproduces these knobs (for logs and subprocesses)."""
        return {
            "INKLING_PREFILL_BIAS_BUDGET": str(self.prefill_bias_budget),
            "INKLING_LOCAL_WINDOW_PREFILL": str(int(self.local_window_prefill)),
            "INKLING_MOE_SINGLE_REDUCE": str(int(self.moe_single_reduce)),
            "INKLING_STEP_HOIST": str(int(self.step_hoist)),
            "INKLING_DECODE_WINDOW_PLUS1": str(int(self.decode_window_plus1)),
        }


def _parse(name: str, raw: str) -> int | bool:
    spec = KNOBS[name]
    text = raw.strip()
    if spec.kind == "flag":
        if text not in ("0", "1"):
            raise KnobError(f"{name} must be 0 or 1; found {raw!r}")
        return text == "1"
    if not text.isdigit():
        raise KnobError(f"{name} must be a whole number of bytes >= 0; found {raw!r}")
    return int(text)


def read_knobs(environ: Mapping[str, str] | None = None) -> Knobs:
    env = os.environ if environ is None else environ

    def value(name: str):
        return _parse(name, env.get(name, KNOBS[name].default))

    return Knobs(
        prefill_bias_budget=value("INKLING_PREFILL_BIAS_BUDGET"),
        local_window_prefill=value("INKLING_LOCAL_WINDOW_PREFILL"),
        moe_single_reduce=value("INKLING_MOE_SINGLE_REDUCE"),
        step_hoist=value("INKLING_STEP_HOIST"),
        decode_window_plus1=value("INKLING_DECODE_WINDOW_PLUS1"),
    )
