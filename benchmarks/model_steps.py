"""Inkling port: one decode step and one prefill chunk of the served tiny Inkling, this tree's port beside
the port of a git ref, side by side in one run (each measured in its own process, runs interleaved).

    python -m benchmarks.model_steps [--before <git ref>] [--runs 5] [--threads 1] [--profile]

The model is the CPU server's tiny Inkling at benchmarks.native_peer's widths (hidden 128, 4 layers of
which the first is dense, 4 query / 2 KV heads of dim 64, 64 routed experts of width 64, 6 per token,
one shared expert), random weights, fp32, block 128. The steps are the ones the CPU server runs at
`vllm bench serve`'s concurrency 8 and input 512: a decode step of 8 requests at context 540 over the
flat block list (model/device_metadata.decode_step_metadata, as cpu_glue builds it; local layers read
the window's blocks) and a 512-token prefill chunk. Each process builds the model once and reports the
median of 20 calls; the table gives the median of --runs processes per tree. --profile prints this
tree's decode step by operator (torch.profiler, grouped by input shape): what a step spends its time on.
Run by the CPU server venv's python (tools/server_env.sh), the model computes with vLLM's compiled CPU kernels
as served (its CPU experts, its oneDNN linears); by the test venv's, with the sdist's (SortedDispatchMoEMethod,
torch's linear).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REQUESTS, CONTEXT, PREFILL, BLOCK = 8, 540, 512, 128
EXPERTS = (64, 6)          # benchmarks.native_peer's served experts, top-k


def build(threads: int):
    """(model, caches, decode step, prefill step) of the port on the path."""
    import torch

    from inkling_hpu.model import InklingForCausalLM, InklingPortConfig, RequestChunk, reference_step_metadata
    from inkling_hpu.model.device_metadata import decode_step_metadata
    from inkling_hpu.model.knobs import Knobs
    from tools.tiny_model import INKLING, VOCAB_ROWS

    torch.set_num_threads(threads)
    raw = dict(INKLING, n_routed_experts=EXPERTS[0], num_experts_per_tok=EXPERTS[1], vocab_size=VOCAB_ROWS,
               max_position_embeddings=8192)
    torch.manual_seed(0)
    model = InklingForCausalLM(InklingPortConfig.from_dict(raw), knobs=Knobs())
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    process_weights_after_loading(model)     # on vLLM's CPU build: its kernels' packed weights, as served
    model.eval()
    per_request = -(-(CONTEXT + 1) // BLOCK)
    tables = [list(range(1 + r * per_request, 1 + (r + 1) * per_request)) for r in range(REQUESTS)]
    caches = model.allocate_caches(1 + REQUESTS * per_request + per_request, BLOCK)
    tokens = torch.Generator().manual_seed(0)
    with torch.no_grad():      # each request's context, computed once
        for table in tables:
            prompt = torch.randint(0, 1000, (CONTEXT,), generator=tokens).tolist()
            model(reference_step_metadata([RequestChunk(prompt, 0, table)], block_size=BLOCK, conv_kernel_size=4,
                                          pad_block_id=0), caches)
    window = -(-(INKLING["sliding_window_size"] - 1) // BLOCK) + 1      # cpu_glue.decode_window_blocks
    decode = decode_step_metadata(
        torch.randint(0, 1000, (REQUESTS, 1), generator=tokens), torch.full((REQUESTS, 1), CONTEXT),
        torch.tensor([[table[CONTEXT // BLOCK] * BLOCK + CONTEXT % BLOCK] for table in tables]),
        torch.tensor([b for table in tables for b in table]),
        torch.tensor([r for r, table in enumerate(tables) for _ in table]),
        torch.tensor([b for table in tables for b in table[-window:]]),
        torch.tensor([r for r, table in enumerate(tables) for _ in table[-window:]]),
        block_size=BLOCK, pad_block=0, taps=3)
    free = list(range(1 + REQUESTS * per_request, 1 + REQUESTS * per_request + per_request))
    prompt = torch.randint(0, 1000, (PREFILL,), generator=tokens).tolist()
    prefill = reference_step_metadata([RequestChunk(prompt, 0, free)], block_size=BLOCK, conv_kernel_size=4,
                                      pad_block_id=0)
    return model, caches, decode, prefill


def process_weights_after_loading(model) -> None:
    """As served: the port's own step after loading (vLLM's loader does it in a worker), or, for a port from
    before it (--before), the same loop over its layers' methods."""
    try:
        from inkling_hpu.model.modeling import process_weights_after_loading as port_step
    except ImportError:
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

        from inkling_hpu.model.modeling import vllm_layers_buildable

        with vllm_layers_buildable(model.tp, model.stage, model.dtype):
            for module in model.modules():
                if isinstance(getattr(module, "quant_method", None), QuantizeMethodBase):
                    module.quant_method.process_weights_after_loading(module)
        return
    port_step(model)


def measure(threads: int) -> dict:
    """Median ms of 20 calls of each step (after 3 warm-up calls), the port on the path."""
    import time

    import torch

    model, caches, decode, prefill = build(threads)
    result = {}
    for name, step, logits in (("decode", decode, True), ("prefill", prefill, False)):
        def call():
            with torch.no_grad():
                hidden = model(step, caches)
                if logits:
                    model.compute_logits(hidden)
        for _ in range(3):
            call()
        times = []
        for _ in range(20):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        result[name] = 1e3 * statistics.median(times)
    return result


def profile(threads: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    model, caches, decode, _ = build(threads)
    with torch.no_grad():
        for _ in range(3):
            model.compute_logits(model(decode, caches))
        with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(5):
                model.compute_logits(model(decode, caches))
    print(f"\nthis tree, decode step of {REQUESTS} requests at context {CONTEXT}, 5 steps, by operator and input shape:")
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=15))


def _run_measure(port: Path, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(port), str(REPO)]))
    done = subprocess.run([sys.executable, "-m", "benchmarks.model_steps", "--measure", "--threads", str(threads)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"measuring the port at {port} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="16ea392",
                        help="git ref whose port is measured beside this tree's (default: the port before its "
                             "heads-major KV blocks and decode-sized MoE by pairs)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="print this tree's decode step by operator")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)   # one process's figures
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.threads)))
        return
    if args.before:
        from tools.cpu_server import port_at

        with tempfile.TemporaryDirectory() as scratch:
            trees = {f"before ({args.before})": port_at(args.before, Path(scratch)),
                     "this tree": REPO / "ports/inkling-small"}
            runs = {label: [] for label in trees}
            for _ in range(args.runs):
                for label, port in trees.items():
                    runs[label].append(_run_measure(port, args.threads))
        print(f"served tiny Inkling widths ({EXPERTS[0]} routed experts, top-{EXPERTS[1]}, hidden 128, 4 layers), "
              f"fp32, {args.threads} thread(s); medians of {args.runs} processes, interleaved; {os.cpu_count()} CPUs")
        print(f"{'step':<40} " + " ".join(f"{label + ' ms':>22}" for label in trees) + f" {'speed-up':>9}")
        for name, what in (("decode", f"decode, {REQUESTS} requests at context {CONTEXT}"),
                           ("prefill", f"prefill chunk of {PREFILL} tokens")):
            before, after = (statistics.median(r[name] for r in runs[label]) for label in trees)
            print(f"{what:<40} {before:>22.2f} {after:>22.2f} {before / after:>8.2f}x")
    if args.profile:
        profile(args.threads)


if __name__ == "__main__":
    main()
