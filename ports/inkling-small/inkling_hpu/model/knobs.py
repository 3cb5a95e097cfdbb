"""Environment settings of the Inkling HPU model, read once when the model is built.

`KNOBS` documents the one setting (name -> default, meaning) for other modules to import; `read_knobs()`
parses it strictly. The page's launch block also sets four flags to 1 (`FIXED_FLAGS`). Each named an
optimisation that was once optional; the model now always does it, so a flag is accepted unset or at
1 and refused at any other value: a launch that asks for the other path is told it is gone.
docs/knobs.md has the full definitions.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class KnobSpec:
    default: str
    meaning: str


KNOBS: dict[str, KnobSpec] = {
    "INKLING_PREFILL_BIAS_BUDGET": KnobSpec(
        "0",
        "Upper bound in bytes for the relative-bias block [requests, heads, query rows, keys] (fp32) that "
        "prefill attention materialises; the query rows are processed in chunks small enough to stay under "
        "it. 0 = no bound (one chunk). The page uses 805306368 (768 MiB)."),
}

FIXED_FLAGS: dict[str, str] = {
    "INKLING_LOCAL_WINDOW_PREFILL":
        "prefill on sliding-window layers reads only the KV blocks that hold keys inside the window of its "
        "query rows",
    "INKLING_DECODE_WINDOW_PLUS1":
        "decode on sliding-window layers reads only the last ceil((window-1)/block)+1 KV blocks of each request",
    "INKLING_MOE_SINGLE_REDUCE":
        "the routed and shared experts' partial outputs are summed before one tensor-parallel reduction",
    "INKLING_STEP_HOIST":
        "the attention plans are built once per forward and layer kind",
}


class KnobError(ValueError):
    """A setting the model does not accept."""


@dataclass(frozen=True)
class Knobs:
    prefill_bias_budget: int = 0

    def as_env(self) -> dict[str, str]:
        """The environment that reproduces these settings (for logs and subprocesses)."""
        return {"INKLING_PREFILL_BIAS_BUDGET": str(self.prefill_bias_budget)}


def read_knobs(environ: Mapping[str, str] | None = None) -> Knobs:
    env = os.environ if environ is None else environ
    for name, always in FIXED_FLAGS.items():
        raw = env.get(name)
        if raw is not None and raw.strip() != "1":
            raise KnobError(f"{name} must be 1 or unset; found {raw!r}: the model has one path, in which {always}")
    name = "INKLING_PREFILL_BIAS_BUDGET"
    raw = env.get(name, KNOBS[name].default)
    if not raw.strip().isdigit():
        raise KnobError(f"{name} must be a whole number of bytes >= 0; found {raw!r}")
    return Knobs(prefill_bias_budget=int(raw.strip()))
