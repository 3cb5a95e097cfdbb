"""Inkling's memory per rank, in bytes: the weights from a meta-device build of the text model (no
weight is read or allocated), K/V and conv-state snapshots per KV block, and the start-up memory
guard's arithmetic (guards.MemoryPlan) at a launch's settings.

    python -m inkling_hpu.memory [--config ports/inkling-small/configs/inkling-small/config.json]
        [--tp 8] [--blocks 2560] [--max-model-len 262144] [--device-gib 96]
        [--gpu-memory-utilization 0.75] [--graph-reserved-mem 0.4] [--checkpoint-json …] [--json]

The defaults are the page's launch (recipes/thinkingmachines/Inkling-Small/recipe.yaml; a test keeps
them equal) on a 96 GiB Gaudi 2.
"""
from __future__ import annotations

import os

if __name__ == "__main__":   # stdout is its report: vLLM's log lines, some printed while it imports, go to stderr
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from inkling_hpu import guards
from inkling_hpu.model import InklingForCausalLM, InklingPortConfig, TensorParallel
from inkling_hpu.model.knobs import Knobs

REAL_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "inkling-small" / "config.json"
GAUDI2_BYTES = 96 * guards.GiB
BLOCK_SIZE = guards.REQUIRED_BLOCK_SIZE


def weights_bytes(config: InklingPortConfig, tp_size: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of one rank's parameters and buffers (the fp32 ones as fp32), from a meta-device build."""
    with torch.device("meta"):
        model = InklingForCausalLM(config, tp=TensorParallel(rank=0, size=tp_size), knobs=Knobs(), dtype=dtype)
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class RankBytes:
    tp: int
    layers: int
    weights: int
    kv_per_block: int                  # K/V, every layer
    conv_per_block: int                # conv snapshots, every layer (hidden streams: this rank's channels)
    conv_per_block_unsharded: int      # what they were with every rank holding the whole hidden streams


def rank_bytes(config: InklingPortConfig, tp_size: int, dtype: torch.dtype = torch.bfloat16) -> RankBytes:
    dtype_bytes = torch.empty(0, dtype=dtype).element_size()
    shapes = []
    for layer in range(config.num_hidden_layers):
        _, kv_heads, head_dim = config.attention_shape(layer)
        shapes.append((kv_heads // tp_size, head_dim))
    kernel = config.conv_kernel_size
    return RankBytes(
        tp=tp_size, layers=len(shapes), weights=weights_bytes(config, tp_size, dtype),
        kv_per_block=guards.kv_bytes_per_block(shapes, BLOCK_SIZE, dtype_bytes),
        conv_per_block=guards.conv_snapshot_bytes_per_block(shapes, config.hidden_size // tp_size, kernel, dtype_bytes),
        conv_per_block_unsharded=guards.conv_snapshot_bytes_per_block(shapes, config.hidden_size, kernel, dtype_bytes))


def report(config_path: Path, args) -> tuple[str, dict]:
    config = InklingPortConfig.from_dict(json.loads(config_path.read_text()))
    per_rank = rank_bytes(config, args.tp)
    text_bytes = weights_bytes(config, 1)
    plan = guards.MemoryPlan(device_bytes=int(args.device_gib * guards.GiB), weights_bytes=per_rank.weights,
                             kv_bytes_per_block=per_rank.kv_per_block, conv_bytes_per_block=per_rank.conv_per_block,
                             blocks=args.blocks, utilization=args.gpu_memory_utilization,
                             graph_reserved=args.graph_reserved_mem)
    unsharded = guards.MemoryPlan(**{**asdict(plan), "conv_bytes_per_block": per_rank.conv_per_block_unsharded})
    gb = 1e9
    kv, conv, conv_full = per_rank.kv_per_block, per_rank.conv_per_block, per_rank.conv_per_block_unsharded
    tokens = args.blocks * BLOCK_SIZE
    lines = [f"{config_path}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
             f"{config.n_routed_experts} routed experts; bf16; tensor parallel {args.tp}; bytes per rank",
             f"  weights                {per_rank.weights / gb:9.2f} GB  (meta-device build of the text model, rank 0)",
             f"  text model, one copy   {text_bytes / gb:9.2f} GB"]
    data = {"config": str(config_path), **asdict(per_rank), "text_bytes": text_bytes}
    if args.checkpoint_json and Path(args.checkpoint_json).exists():
        index = json.loads(Path(args.checkpoint_json).read_text())["index_total_size"]
        lines.append(f"  checkpoint index       {index / gb:9.2f} GB: vision/audio towers and MTP "
                     f"{(index - text_bytes) / gb:.2f} GB ({(index - text_bytes) / index:.1%}), never read")
        data["checkpoint_index_bytes"] = index
    lines += [f"  K/V per block          {kv:>12,} bytes ({per_rank.layers} layers x {kv // per_rank.layers:,})",
              f"  conv snapshots/block   {conv:>12,} bytes ({per_rank.layers} x {conv // per_rank.layers:,} = "
              f"{conv / kv:.2f} x K/V; the hidden streams' channels split over the ranks)",
              f"    if not split         {conv_full:>12,} bytes ({per_rank.layers} x {conv_full // per_rank.layers:,} = "
              f"{conv_full / kv:.2f} x K/V)",
              f"  KV pool: {args.blocks} blocks = {tokens:,} tokens = {tokens / args.max_model_len:.2f} x "
              f"max_model_len {args.max_model_len:,}",
              f"  on the device          {plan.arithmetic()}",
              f"  verdict                {plan.refusal() or f'fits: {(plan.budget_bytes - plan.pool_bytes) / guards.GiB:.2f} GiB to spare'}",
              f"  if not split           pool {unsharded.pool_bytes / guards.GiB:.2f} GiB: "
              f"{unsharded.refusal() or f'fits: {(unsharded.budget_bytes - unsharded.pool_bytes) / guards.GiB:.2f} GiB to spare'}"]
    data.update(pool_bytes=plan.pool_bytes, budget_bytes=plan.budget_bytes, refusal=plan.refusal(),
                pool_bytes_unsharded=unsharded.pool_bytes, device_bytes=plan.device_bytes)
    return "\n".join(lines), data


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inkling_hpu.memory", description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REAL_CONFIG)
    parser.add_argument("--checkpoint-json", type=Path, default=REAL_CONFIG.with_name("checkpoint.json"),
                        help="the checkpoint index's figures, compared with the text model's bytes")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=2560, help="--num-gpu-blocks-override")
    parser.add_argument("--max-model-len", type=int, default=262144)
    parser.add_argument("--device-gib", type=float, default=GAUDI2_BYTES / guards.GiB)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.75)
    parser.add_argument("--graph-reserved-mem", type=float, default=0.4, help="VLLM_GRAPH_RESERVED_MEM")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    text, data = report(args.config, args)
    print(json.dumps(data, indent=1) if args.json else text)
    return 1 if data["refusal"] else 0


if __name__ == "__main__":
    sys.exit(main())
