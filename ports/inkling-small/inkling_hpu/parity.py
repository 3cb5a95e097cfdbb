"""Parity of the port's logits against transformers 5.24.0's InklingForCausalLM.

    python -m inkling_hpu.parity --config CONFIG.json [--seed N] [--dtype float32|bfloat16]

Builds the reference from a tiny config with random weights, converts its weights to the checkpoint
names (`model.llm.*`, w13 re-interleaved), loads them into the port through
`inkling_hpu.model.weights`, and runs the port on the same tokens in three phases:

- prefill_chunked: one request's prompt in chunks (sizes from the config, not aligned to blocks);
- decode: the same request, one token per step;
- mixed: several requests on fresh caches, staggered so that steps mix prefill chunks and decodes,
  with padding (tokens, requests, block-table columns) and scattered block ids.

The reference is transformers' full forward over each request's whole sequence. Prints JSON with, per
phase, the max abs difference of logits and the relative difference (max abs difference / max |ref
logit|); exits 0 when every phase is within tolerance, 1 when not, 2 on bad input.
Config file: checkpoint config fields at the top level plus an optional "parity" section
(block_size, prefill_chunks, decode_steps, mixed: {prompt_lens, chunk, decode_steps}).
"""
from __future__ import annotations

import os

if __name__ == "__main__":   # stdout is its JSON: vLLM's log lines, some printed while it imports, go to stderr
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

import argparse
import contextlib
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inkling_hpu.model.config import InklingConfigError, InklingPortConfig
from inkling_hpu.model.knobs import KnobError, Knobs, read_knobs
from inkling_hpu.model.metadata import RequestChunk, reference_step_metadata
from inkling_hpu.model.modeling import InklingForCausalLM, process_weights_after_loading
from inkling_hpu.model.weights import load_checkpoint

TOLERANCE = {
    "float32": {"max_abs": 1e-4},
    # bf16: the port mostly matches the reference bit for bit, but a different matmul split (fused
    # projection, chunked queries) can move a logit by a few bf16 ulps
    "bfloat16": {"max_rel": 0.05},
}
DEFAULT_PARITY = {
    "block_size": 128,
    "prefill_chunks": [7, 9, 16],
    "decode_steps": 6,
    "mixed": {"prompt_lens": [5, 11, 3], "chunk": 6, "decode_steps": 4},
}
NON_MODEL_KEYS = ("parity", "description", "_comment")


def write_checkpoint_config(raw_config: dict[str, Any], model_dir: Path, torch_dtype: str,
                            max_position: int = 4096) -> Path:
    """model_dir/config.json for a shipped config, in the checkpoint's own format (vLLM's
    `inkling_model`). vLLM's InklingModelConfig defaults these fields to what the checkpoint does not
    use; a real checkpoint's config states them. Returns model_dir."""
    config = {k: v for k, v in raw_config.items() if k not in NON_MODEL_KEYS}
    config.update(architectures=["InklingForCausalLM"], model_type="inkling_model",
                  max_position_embeddings=max_position, torch_dtype=torch_dtype, shared_expert_sink=True,
                  norm_after_topk=True, gate_activation="sigmoid", inference_moe_w13_interleaved=True)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


# --------------------------------------------------------------------------------------------------
# Reference model and weight conversion
# --------------------------------------------------------------------------------------------------
def build_reference(raw_config: dict[str, Any], seed: int, dtype: torch.dtype):
    """transformers' InklingForCausalLM with seeded random weights (all of them, scales and biases too)."""
    from transformers.models.inkling import InklingForCausalLM as ReferenceLM
    from transformers.models.inkling import InklingTextConfig

    hf_kwargs = {k: v for k, v in raw_config.items() if k not in NON_MODEL_KEYS}
    hf_config = InklingTextConfig(**hf_kwargs)
    torch.manual_seed(seed)
    reference = ReferenceLM(hf_config).eval()
    # the readable implementations: eager attention (honours the bias) and the per-expert loop
    # (transformers' default grouped_mm needs 16-byte strides that tiny bf16 shapes do not have)
    reference.config._attn_implementation = "eager"
    reference.config._experts_implementation = "eager"
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(reference.named_parameters()) + list(reference.named_buffers()):
            tensor.copy_(_random_like(name, tensor, generator))
    if dtype != torch.float32:
        keep = {n: t.detach().clone() for n, t in list(reference.named_parameters()) + list(reference.named_buffers())
                if _hf_keeps_fp32(n)}
        reference.to(dtype)
        for name, value in keep.items():   # as transformers keeps these modules in fp32
            _set_tensor(reference, name, value)
    return reference


def _hf_keeps_fp32(name: str) -> bool:
    return any(part in name for part in ("attn_sconv", "mlp_sconv", "k_sconv", "v_sconv",
                                          "e_score_correction_bias", "gate.global_scale"))


def _set_tensor(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    current = getattr(owner, leaf)
    if isinstance(current, torch.nn.Parameter):
        current.data = value
    else:
        setattr(owner, leaf, value)


def _random_like(name: str, tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    def normal(std: float) -> torch.Tensor:
        return torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * std

    if name.endswith("global_scale"):
        return 1.0 + normal(0.1)
    if name.endswith("e_score_correction_bias"):
        return normal(0.1)
    if "norm" in name and tensor.dim() == 1:
        return 1.0 + normal(0.1)
    if "sconv" in name:
        return normal(0.3)
    if name.endswith("rel_logits_proj.proj"):
        return normal(0.5)
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    return normal(tensor.shape[-1] ** -0.5)   # projections: unit-variance outputs


def _interleave(gate: torch.Tensor, up: torch.Tensor, dim: int) -> torch.Tensor:
    """[.., I, ..] gate and up -> [.., 2I, ..] with rows g0, u0, g1, u1, ... (the checkpoint's w13)."""
    stacked = torch.stack([gate, up], dim=dim + 1)
    shape = list(gate.shape)
    shape[dim] *= 2
    return stacked.reshape(shape)


_HF_LAYER_RENAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "self_attn.q_proj.weight": "attn.wq_du.weight",
    "self_attn.k_proj.weight": "attn.wk_dv.weight",
    "self_attn.v_proj.weight": "attn.wv_dv.weight",
    "self_attn.r_proj.weight": "attn.wr_du.weight",
    "self_attn.o_proj.weight": "attn.wo_ud.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "self_attn.k_sconv.conv1d.weight": "attn.k_sconv.weight",
    "self_attn.v_sconv.conv1d.weight": "attn.v_sconv.weight",
    "self_attn.rel_logits_proj.proj": "attn.rel_logits_proj.proj",
    "attn_sconv.conv1d.weight": "attn_sconv.weight",
    "mlp_sconv.conv1d.weight": "mlp_sconv.weight",
    "mlp.down_proj.weight": "mlp.w2_md.weight",
    "mlp.global_scale": "mlp.global_scale",
    "mlp.gate.weight": "mlp.gate.weight",
    "mlp.gate.e_score_correction_bias": "mlp.gate.bias",
    "mlp.gate.global_scale": "mlp.gate.global_scale",
    "mlp.experts.down_proj": "mlp.experts.w2_weight",
    "mlp.shared_experts.down_proj": "mlp.shared_experts.shared_w2_weight",
}
_HF_MODEL_RENAMES = {
    "model.embed_tokens.weight": "model.llm.embed.weight",
    "model.embed_tokens.embed_norm.weight": "model.llm.embed_norm.weight",
    "model.norm.weight": "model.llm.norm.weight",
    "lm_head.weight": "model.llm.unembed.weight",
}


def reference_to_checkpoint(reference: torch.nn.Module) -> dict[str, torch.Tensor]:
    """transformers' state dict -> checkpoint names and layouts (the reverse of its conversion mapping)."""
    state = {k: v.detach() for k, v in reference.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if name in _HF_MODEL_RENAMES:
            out[_HF_MODEL_RENAMES[name]] = value
            continue
        if not name.startswith("model.layers."):
            raise KeyError(f"no checkpoint name for reference tensor {name}")
        _, _, layer, rest = name.split(".", 3)
        base = f"model.llm.layers.{layer}."
        if rest in _HF_LAYER_RENAMES:
            out[base + _HF_LAYER_RENAMES[rest]] = value
        elif rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            if rest == "mlp.gate_proj.weight":
                up = state[f"model.layers.{layer}.mlp.up_proj.weight"]
                out[base + "mlp.w13_dn.weight"] = _interleave(value, up, dim=0)
        elif rest == "mlp.experts.gate_up_proj":
            gate, up = value.chunk(2, dim=1)
            out[base + "mlp.experts.w13_weight"] = _interleave(gate, up, dim=1)
        elif rest in ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"):
            if rest == "mlp.shared_experts.gate_proj":
                up = state[f"model.layers.{layer}.mlp.shared_experts.up_proj"]
                out[base + "mlp.shared_experts.shared_w13_weight"] = _interleave(value, up, dim=1)
        else:
            raise KeyError(f"no checkpoint name for reference tensor {name}")
    return out


def checkpoint_to_reference(raw_config: dict[str, Any], checkpoint: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' fp32 InklingForCausalLM holding a checkpoint's text tensors: reference_to_checkpoint run
    backwards. Each reference element's global index (exact in fp32 below 2**24) goes through
    reference_to_checkpoint, which tells where every checkpoint element came from."""
    reference = build_reference(raw_config, 0, torch.float32)
    state = reference.state_dict()
    numbered, start = {}, 0
    for name, tensor in state.items():
        numbered[name] = torch.arange(start, start + tensor.numel(), dtype=torch.float32).view(tensor.shape)
        start += tensor.numel()
    if start >= 2**24:
        raise ValueError(f"{start} reference elements: more than fp32 numbers exactly")
    flat = torch.empty(start)
    for name, where in reference_to_checkpoint(_Numbered(numbered)).items():
        flat[where.reshape(-1).long()] = checkpoint[name].reshape(-1).float()
    with torch.no_grad():
        for name, index in numbered.items():
            _set_tensor(reference, name, flat[index.reshape(-1).long()].view(index.shape).to(state[name].dtype))
    return reference


class _Numbered:
    """A stand-in module for reference_to_checkpoint: its state dict is the numbered tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors


def reference_logits(reference: torch.nn.Module, tokens: list[int], vocab_out: int) -> torch.Tensor:
    with torch.no_grad():
        logits = reference(torch.tensor([tokens])).logits[0]
    return logits[:, :vocab_out].float()


# --------------------------------------------------------------------------------------------------
# Port runs
# --------------------------------------------------------------------------------------------------
def build_port(raw_config: dict[str, Any], checkpoint: dict[str, torch.Tensor], dtype: torch.dtype,
               knobs: Knobs) -> InklingForCausalLM:
    config = InklingPortConfig.from_dict({k: v for k, v in raw_config.items() if k not in NON_MODEL_KEYS})
    model = InklingForCausalLM(config, knobs=knobs, dtype=dtype)
    load_checkpoint(model, checkpoint)
    process_weights_after_loading(model)    # as vLLM's loader does in a worker: its kernels' weights, where it has them
    return model.eval()


class PortSession:
    """Caches plus a block allocator for one sequence of steps."""

    def __init__(self, model: InklingForCausalLM, block_size: int, max_tokens: int, num_requests: int,
                 seed: int) -> None:
        self.model = model
        self.block_size = block_size
        blocks_per_request = -(-max_tokens // block_size)
        self.num_blocks = num_requests * blocks_per_request + 2
        self.pad_block = self.num_blocks - 1
        self.caches = model.allocate_caches(self.num_blocks, block_size)
        free = list(range(self.num_blocks - 1))
        random.Random(seed).shuffle(free)            # scattered block ids: paging must not assume order
        self.tables = [free[r * blocks_per_request:(r + 1) * blocks_per_request] for r in range(num_requests)]
        self.history: list[tuple[int, int]] = []     # (prefill chunks, decodes) per step

    def step(self, work: list[tuple[int, list[int], int]], padded: bool = False) -> list[torch.Tensor]:
        """work: (request, new tokens, num_computed). Returns each request's logits for its new tokens."""
        chunks = [RequestChunk(tokens, done, self.tables[r]) for r, tokens, done in work]
        pads = {}
        if padded:
            n_prefill = sum(len(c.token_ids) > 1 for c in chunks)
            n_decode = len(chunks) - n_prefill
            longest = max([len(c.token_ids) for c in chunks if len(c.token_ids) > 1], default=1)
            pads = dict(pad_tokens_to=sum(len(c.token_ids) for c in chunks) + 3,
                        pad_prefill_rows_to=longest + 2, pad_prefill_requests_to=n_prefill + 1,
                        pad_decode_requests_to=n_decode + 1, pad_requests_to=len(chunks) + 1,
                        pad_blocks_to=len(self.tables[0]) + 1,
                        pad_conv_writes_to=sum(-(-(d + len(t)) // self.block_size) - d // self.block_size
                                               for _, t, d in work) + 2)
        self.history.append((sum(len(c.token_ids) > 1 for c in chunks), sum(len(c.token_ids) == 1 for c in chunks)))
        meta = reference_step_metadata(chunks, block_size=self.block_size,
                                   conv_kernel_size=self.model.config.conv_kernel_size,
                                   pad_block_id=self.pad_block, **pads)
        with torch.no_grad():
            logits = self.model.compute_logits(self.model(meta, self.caches)).float()
        out, start = [], 0
        for chunk in chunks:
            out.append(logits[start:start + len(chunk.token_ids)])
            start += len(chunk.token_ids)
        return out


def _diff(port: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    max_abs = (port - ref).abs().max().item()
    return {"max_abs": max_abs, "max_rel": max_abs / max(ref.abs().max().item(), 1e-30),
            "tokens": int(ref.shape[0])}


@dataclass
class Workload:
    """The tokens and schedule every phase runs (the same for the reference and the port)."""

    block_size: int
    chunk_sizes: list[int]          # single request: prefill chunk sizes
    single: list[int]               # single request: prompt + decode tokens
    prompt_lens: list[int]          # mixed: prompt length per request
    chunk: int                      # mixed: prefill chunk size
    sequences: list[list[int]]      # mixed: prompt + decode tokens per request


def make_workload(raw_config: dict[str, Any], vocab_out: int, seed: int) -> Workload:
    settings = {**DEFAULT_PARITY, **raw_config.get("parity", {})}
    mixed = {**DEFAULT_PARITY["mixed"], **settings.get("mixed", {})}
    rng = random.Random(seed + 1)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab_out) for _ in range(n)]

    chunk_sizes = [int(n) for n in settings["prefill_chunks"]]
    prompt_lens = [int(n) for n in mixed["prompt_lens"]]
    return Workload(
        block_size=int(settings["block_size"]),
        chunk_sizes=chunk_sizes,
        single=tokens(sum(chunk_sizes) + int(settings["decode_steps"])),
        prompt_lens=prompt_lens,
        chunk=int(mixed["chunk"]),
        sequences=[tokens(n + int(mixed["decode_steps"])) for n in prompt_lens],
    )


def run_port(model: InklingForCausalLM, work: Workload, seed: int) -> dict[str, Any]:
    """The port's logits per phase: {"prefill_chunked": [P, V], "decode": [D, V], "mixed": [[L_r, V]...]}."""
    session = PortSession(model, work.block_size, len(work.single), num_requests=1, seed=seed)
    prefill, done = [], 0
    for size in work.chunk_sizes:
        prefill += session.step([(0, work.single[done:done + size], done)])
        done += size
    decode = []
    while done < len(work.single):
        decode += session.step([(0, work.single[done:done + 1], done)])
        done += 1

    # several requests, staggered (request r arrives at step r): steps mix prefill chunks and
    # decodes; every other step is padded to a larger bucket
    sequences = work.sequences
    session = PortSession(model, work.block_size, max(map(len, sequences)), num_requests=len(sequences),
                          seed=seed + 2)
    done_by = [0] * len(sequences)
    got_by: list[list[torch.Tensor]] = [[] for _ in sequences]
    step = 0
    while any(done_by[r] < len(sequences[r]) for r in range(len(sequences))):
        batch = []
        for r, sequence in enumerate(sequences):
            if step < r or done_by[r] >= len(sequence):
                continue
            prompt_left = work.prompt_lens[r] - done_by[r]
            size = min(work.chunk, prompt_left) if prompt_left > 0 else 1
            batch.append((r, sequence[done_by[r]:done_by[r] + size], done_by[r]))
        if batch:
            for (r, new, _), logits in zip(batch, session.step(batch, padded=step % 2 == 1)):
                got_by[r].append(logits)
                done_by[r] += len(new)
        step += 1
    return {"prefill_chunked": torch.cat(prefill), "decode": torch.cat(decode),
            "mixed": [torch.cat(g) for g in got_by], "mixed_steps": step,
            "mixed_step_kinds": session.history}


def run_reference(reference: torch.nn.Module, work: Workload, vocab_out: int) -> dict[str, Any]:
    single = reference_logits(reference, work.single, vocab_out)
    prompt_len = sum(work.chunk_sizes)
    return {"prefill_chunked": single[:prompt_len], "decode": single[prompt_len:],
            "mixed": [reference_logits(reference, s, vocab_out) for s in work.sequences]}


def compare(port: dict[str, Any], ref: dict[str, Any]) -> dict[str, dict[str, float]]:
    phases = {name: _diff(port[name], ref[name]) for name in ("prefill_chunked", "decode")}
    diffs = [_diff(p, r) for p, r in zip(port["mixed"], ref["mixed"])]
    phases["mixed"] = {"max_abs": max(d["max_abs"] for d in diffs), "max_rel": max(d["max_rel"] for d in diffs),
                       "tokens": sum(d["tokens"] for d in diffs), "steps": port["mixed_steps"],
                       "steps_with_prefill_and_decode": sum(1 for p, d in port["mixed_step_kinds"] if p and d)}
    return phases


@contextlib.contextmanager
def single_thread():
    """Run torch on one thread: tiny tensors gain nothing from the pool, and on a busy machine its
    spinning threads make each small matmul ~10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_parity(raw_config: dict[str, Any], *, seed: int = 0, dtype_name: str = "float32",
               knobs: Knobs | None = None) -> dict[str, Any]:
    with single_thread():
        return _run_parity(raw_config, seed, dtype_name, knobs)


def _run_parity(raw_config: dict[str, Any], seed: int, dtype_name: str, knobs: Knobs | None) -> dict[str, Any]:
    if dtype_name not in TOLERANCE:
        raise ValueError(f"dtype must be one of {sorted(TOLERANCE)}; found {dtype_name!r}")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    knobs = read_knobs() if knobs is None else knobs
    reference = build_reference(raw_config, seed, dtype)
    model = build_port(raw_config, reference_to_checkpoint(reference), dtype, knobs)
    vocab_out = model.config.vocab_out
    work = make_workload(raw_config, vocab_out, seed)
    phases = compare(run_port(model, work, seed), run_reference(reference, work, vocab_out))
    tolerance = TOLERANCE[dtype_name]
    ok = all(all(p[key] <= limit for key, limit in tolerance.items()) for p in phases.values())
    return {"dtype": dtype_name, "seed": seed, "block_size": work.block_size, "knobs": knobs.as_env(),
            "tolerance": tolerance, "phases": phases, "ok": ok}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inkling_hpu.parity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, type=Path, help="tiny config JSON (see inkling_hpu/configs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(TOLERANCE), default="float32")
    args = parser.parse_args(argv)
    try:
        raw = json.loads(args.config.read_text())
        result = run_parity(raw, seed=args.seed, dtype_name=args.dtype)
    except (OSError, json.JSONDecodeError, InklingConfigError, KnobError) as error:
        print(f"parity: {error}", file=sys.stderr)
        return 2
    result = {"config": str(args.config), **result}
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
