"""Shared setup for the model tests: shipped configs, cached tiny checkpoints."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from inkling_hpu import parity
from inkling_hpu.model.knobs import Knobs
from inkling_hpu.model.modeling import AllExpertsMethod, SortedDispatchMoEMethod

PORT_ROOT = Path(__file__).resolve().parents[2]

CONFIG_DIR = PORT_ROOT / "inkling_hpu" / "configs"
SHIPPED_CONFIGS = sorted(path.name for path in CONFIG_DIR.glob("*.json"))

# A relative-bias budget small enough to split the tiny configs' prefill attention into chunks (the page sets
# one, scaled to Inkling-Small), and none (one chunk).
BIAS_BUDGET = Knobs(prefill_bias_budget=2048)
NO_BUDGET = Knobs()


def load_config(name: str) -> dict:
    return json.loads((CONFIG_DIR / name).read_text())


@functools.lru_cache(maxsize=None)
def _reference_and_checkpoint(name: str, seed: int, dtype_name: str):
    dtype = getattr(torch, dtype_name)
    reference = parity.build_reference(load_config(name), seed, dtype)
    return reference, parity.reference_to_checkpoint(reference)


def reference_model(name: str, seed: int = 0, dtype_name: str = "float32"):
    return _reference_and_checkpoint(name, seed, dtype_name)[0]


def checkpoint(name: str, seed: int = 0, dtype_name: str = "float32") -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors (`model.llm.*`) of a seeded random reference model."""
    return _reference_and_checkpoint(name, seed, dtype_name)[1]


def port_model(name: str, knobs: Knobs = NO_BUDGET, seed: int = 0, dtype_name: str = "float32"):
    dtype = getattr(torch, dtype_name)
    return parity.build_port(load_config(name), checkpoint(name, seed, dtype_name), dtype, knobs)


def as_on_hpu(model):
    """For a graph trace: on HPU each MoE layer's routed experts are one fused op (vllm-gaudi's MoE method)
    with no data-dependent shapes; the all-experts reference stands in for it (the sdist's sorted dispatch
    reads its per-expert counts on the host, a graph break)."""
    for module in model.modules():
        if isinstance(getattr(module, "quant_method", None), SortedDispatchMoEMethod):
            module._replace_quant_method(AllExpertsMethod(module.moe_config))
    return model


def workload(name: str, seed: int = 0) -> parity.Workload:
    raw = load_config(name)
    vocab_out = parity.InklingPortConfig.from_dict(
        {k: v for k, v in raw.items() if k not in parity.NON_MODEL_KEYS}).vocab_out
    return parity.make_workload(raw, vocab_out, seed)


def max_abs_between(a: dict, b: dict) -> float:
    """Largest logit difference between two run_port results, over every phase."""
    diffs = [(a[k] - b[k]).abs().max().item() for k in ("prefill_chunked", "decode")]
    diffs += [(x - y).abs().max().item() for x, y in zip(a["mixed"], b["mixed"])]
    return max(diffs)


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Import this fixture into a test module to run its tiny models on one torch thread."""
    with parity.single_thread():
        yield
