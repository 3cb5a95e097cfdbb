"""Inkling port: what the per-block conv-state snapshots cost and what a prefix-cache hit saves, side by
side in one run (medians of several runs, the port's model on CPU, block size 128).

    PYTHONPATH=ports/inkling-small python -m benchmarks.conv_snapshots [--runs 5] [--requests 16] [--context 1000]

1. Per-step cost of the snapshot writes: one forward of a decode step of N requests, and one of a
   512-token prefill chunk (5 blocks touched), with the conv-state writes the step needs vs the
   same step with no conv-state write at all (the write list emptied; numerically wrong, for timing
   only); and the writes alone (gather of the new rows + index_copy_ into every layer's 4 streams).
2. Prefill time saved by a 3-block hit: a 404-token prompt computed cold (404 tokens from position
   0) vs on a 3-block prefix-cache hit (20 tokens from position 384, seeded from block 2's snapshot).

The model is a CPU-sized Inkling (hidden 512, 4 layers, window 256) with random weights: the
figures say how the costs compare, not what a Gaudi measures.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from inkling_hpu.model import InklingForCausalLM, InklingPortConfig, RequestChunk, reference_step_metadata
from inkling_hpu.model.knobs import Knobs

BLOCK = 128
CONFIG = {
    "vocab_size": 1024, "hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 64, "sliding_window_size": 256, "d_rel": 16, "rel_extent": 512,
    "local_layer_ids": [0, 1, 2], "dense_mlp_idx": 4, "dense_intermediate_size": 1024, "intermediate_size": 256,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "sconv_kernel_size": 4,
    "logits_mup_width_multiplier": 1.0, "use_embed_norm": True, "max_position_embeddings": 8192,
}


def build_model() -> InklingForCausalLM:
    torch.manual_seed(0)
    model = InklingForCausalLM(InklingPortConfig.from_dict(CONFIG), knobs=Knobs())
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    return model.eval()


def without_conv_writes(meta):
    """The same step with no conv-state write (timing reference only)."""
    return replace(meta, conv_write_blocks=meta.conv_write_blocks[:0], conv_write_source=meta.conv_write_source[:0])


def median_seconds(func, runs: int) -> float:
    func()                                   # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        func()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--context", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_model()
    blocks_per_request = -(-(args.context + 2048) // BLOCK)
    num_blocks = args.requests * blocks_per_request + 2
    pad = num_blocks - 1
    caches = model.allocate_caches(num_blocks, BLOCK)
    tables = [list(range(r * blocks_per_request, (r + 1) * blocks_per_request)) for r in range(args.requests)]

    def run(meta):
        with torch.no_grad():
            model(meta, caches)

    def write_only(meta):
        """What the snapshot writes add to a step: per layer and stream, gather the new rows and write them."""
        taps = CONFIG["sconv_kernel_size"] - 1
        for layer in caches.layers:
            for state in layer.conv.values():
                source = torch.cat([state.new_zeros(meta.num_tokens, state.shape[-1]),
                                    state.index_select(0, meta.conv_read_blocks).flatten(0, 1),
                                    state.new_zeros(1, state.shape[-1])])
                new = source.index_select(0, meta.conv_write_source.reshape(-1)).view(-1, taps, state.shape[-1])
                state.index_copy_(0, meta.conv_write_blocks, new)

    decode = reference_step_metadata([RequestChunk([5], args.context, tables[r]) for r in range(args.requests)],
                                 block_size=BLOCK, conv_kernel_size=4, pad_block_id=pad)
    chunk = reference_step_metadata([RequestChunk([7] * 512, args.context, tables[0])], block_size=BLOCK,
                                conv_kernel_size=4, pad_block_id=pad)
    rows = []
    for name, meta in ((f"decode step, {args.requests} requests at {args.context}", decode),
                       (f"prefill chunk of 512 at {args.context}", chunk)):
        bare = without_conv_writes(meta)
        with_writes, no_writes = [], []
        for _ in range(2):                   # alternate, so drift hits both
            with_writes.append(median_seconds(lambda: run(meta), args.runs))
            no_writes.append(median_seconds(lambda: run(bare), args.runs))
        rows.append((name, len(meta.conv_write_blocks), min(with_writes), min(no_writes),
                     median_seconds(lambda: write_only(meta), args.runs)))

    print(f"Per-step cost of conv-state writes (medians of {args.runs} runs, 1 thread)")
    print(f"{'step':40} {'blocks written':>14} {'with writes':>12} {'no writes':>10} {'writes alone':>13}")
    for name, writes, with_t, none_t, alone_t in rows:
        print(f"{name:40} {writes:>14} {with_t * 1e3:>10.2f}ms {none_t * 1e3:>8.2f}ms {alone_t * 1e3:>11.3f}ms"
              f"  ({alone_t / with_t:.2%} of the step)")

    prompt = [(11 * i + 3) % CONFIG["vocab_size"] for i in range(3 * BLOCK + 20)]
    cold_meta = reference_step_metadata([RequestChunk(prompt, 0, tables[1])], block_size=BLOCK, conv_kernel_size=4,
                                    pad_block_id=pad)
    run(cold_meta)                           # fills blocks 0..2 and their snapshots (what a hit reuses)
    hit_meta = reference_step_metadata([RequestChunk(prompt[3 * BLOCK:], 3 * BLOCK, tables[1])], block_size=BLOCK,
                                   conv_kernel_size=4, pad_block_id=pad)
    cold, hit = [], []
    for _ in range(2):
        cold.append(median_seconds(lambda: run(cold_meta), args.runs))
        hit.append(median_seconds(lambda: run(hit_meta), args.runs))
    cold_t, hit_t = min(cold), min(hit)
    print()
    print(f"Prefill of a {len(prompt)}-token prompt (medians of {args.runs} runs, 1 thread)")
    print(f"{'cold (404 tokens from 0)':34} {cold_t * 1e3:>9.2f}ms")
    print(f"{'3-block hit (20 tokens from 384)':34} {hit_t * 1e3:>9.2f}ms   saves {1 - hit_t / cold_t:.0%} "
          f"({cold_t / hit_t:.1f}x faster)")


if __name__ == "__main__":
    main()
