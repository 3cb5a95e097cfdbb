"""Inkling port: routed experts computed only for the tokens routed to them vs every expert on every
token, side by side in one run (medians of several runs, interleaved, the port's model on CPU).

    PYTHONPATH=ports/inkling-small python -m benchmarks.moe [--runs 5] [--threads 1]
    python -m benchmarks.moe --cpu-server --before <git ref> [--runs 3]

The real expert ratio (256 routed experts, top-6, 2 shared) at a CPU size (hidden 512, expert width
128): one MoE block (router, routed and shared experts) and one whole decoder layer (attention, short
convolutions, MoE), for a 2048-token prefill chunk (the page's --max-num-batched-tokens) and a
16-request decode step. "all experts" is modeling.AllExpertsMethod (every expert on every token, what the
port computed once); "routed" is the sdist's method of vLLM's MoE layer (SortedDispatchMoEMethod, a sorted
dispatch). Served, vLLM's CPU build runs its CPU experts and vllm-gaudi its fused op instead (--cpu-server
measures the former).
Random weights: the figures compare the two paths, they are not what a Gaudi measures.

--cpu-server: the page's `vllm bench serve` scaled for a CPU (random input 512, output 64, 32 prompts,
concurrency 8, ignore EOS) against the real vLLM 0.30.0 CPU server (fix pack applied) serving a tiny
random Inkling of 64 routed experts, 6 per token, with the port of the git ref `--before` (say, the
commit before the routed experts moved onto vLLM's MoE layer) and with this tree's port, the servers one
after the other, runs alternated.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

from inkling_hpu.model import InklingForCausalLM, InklingPortConfig, RequestChunk, reference_step_metadata
from inkling_hpu.model.knobs import Knobs
from inkling_hpu.model.modeling import AllExpertsMethod, SortedDispatchMoEMethod

BLOCK = 128
CONFIG = {
    "vocab_size": 1024, "hidden_size": 512, "num_hidden_layers": 1, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 64, "sliding_window_size": 512, "d_rel": 16, "rel_extent": 512,
    "local_layer_ids": [0], "dense_mlp_idx": 0, "dense_intermediate_size": 1024, "intermediate_size": 128,
    "n_routed_experts": 256, "n_shared_experts": 2, "num_experts_per_tok": 6, "sconv_kernel_size": 4,
    "logits_mup_width_multiplier": 1.0, "use_embed_norm": True, "max_position_embeddings": 8192,
}
PREFILL_TOKENS = 2048
DECODE_REQUESTS, DECODE_CONTEXT = 16, 1000


def build_model() -> InklingForCausalLM:
    torch.manual_seed(0)
    model = InklingForCausalLM(InklingPortConfig.from_dict(CONFIG), knobs=Knobs())
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    return model.eval()


def use_all_experts(experts, on: bool) -> None:
    routed = experts.routed_experts       # vLLM's MoE layer's experts: their method computes them
    routed._replace_quant_method((AllExpertsMethod if on else SortedDispatchMoEMethod)(routed.moe_config))


def cache_tensors(caches) -> list[torch.Tensor]:
    layer = caches.layers[0]
    return [layer.key, layer.value, *layer.conv.values()]


def steps(model: InklingForCausalLM):
    """(name, step metadata, caches) for the prefill chunk and the decode step."""
    blocks_per_request = -(-(DECODE_CONTEXT + 1) // BLOCK)
    pad = DECODE_REQUESTS * blocks_per_request
    caches = model.allocate_caches(pad + 1, BLOCK)
    tokens = torch.randint(0, CONFIG["vocab_size"], (PREFILL_TOKENS,), generator=torch.Generator().manual_seed(1))
    prefill = reference_step_metadata([RequestChunk(tokens.tolist(), 0, list(range(PREFILL_TOKENS // BLOCK)))],
                                  block_size=BLOCK, conv_kernel_size=4, pad_block_id=pad)
    decode = reference_step_metadata(
        [RequestChunk([7 + r], DECODE_CONTEXT, list(range(r * blocks_per_request, (r + 1) * blocks_per_request)))
         for r in range(DECODE_REQUESTS)], block_size=BLOCK, conv_kernel_size=4, pad_block_id=pad)
    return [(f"prefill chunk of {PREFILL_TOKENS} tokens", prefill, caches),
            (f"decode step of {DECODE_REQUESTS} requests", decode, caches)]


SERVED_EXPERTS = (64, 6)


def cpu_server_mode(args) -> None:
    from tools import cpu_server

    venv = cpu_server.server_venv()
    print(f"fix pack: {cpu_server.patch_vllm(venv)}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as scratch:
        plugins = {f"before ({args.before})": cpu_server.port_install(venv, cpu_server.port_at(args.before, scratch)),
                   "this tree": cpu_server.port_install(venv)}
    model = cpu_server.tiny_model(venv, plugins["this tree"], experts=SERVED_EXPERTS)
    results = cpu_server.bench_alternated(venv, {label: (model, plugin) for label, plugin in plugins.items()},
                                          args.runs, "moe")
    before, after = cpu_server.print_bench_medians(results, (
        f"vllm bench serve: random input 512, output 64, 32 prompts, concurrency 8, ignore EOS; real vLLM 0.30.0 "
        f"CPU server, tiny random Inkling with {SERVED_EXPERTS[0]} routed experts, top-{SERVED_EXPERTS[1]}; "
        f"medians of {args.runs} runs (servers alternated)")).values()
    print(f"\nthis tree vs before: output throughput {after['output_throughput'] / before['output_throughput']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cpu-server", action="store_true", help="vllm bench serve on the CPU server instead")
    parser.add_argument("--before", default="caf4cd0", help="git ref whose port is compared (--cpu-server)")
    args = parser.parse_args()
    if args.cpu_server:
        return cpu_server_mode(args)
    torch.set_num_threads(args.threads)
    model = build_model()
    layer = model.model.layers[0]
    experts = layer.mlp.experts
    print(f"{CONFIG['n_routed_experts']} routed experts, top-{CONFIG['num_experts_per_tok']}, "
          f"{CONFIG['n_shared_experts']} shared; hidden {CONFIG['hidden_size']}, expert width "
          f"{CONFIG['intermediate_size']}; fp32, {args.threads} thread(s); medians of {args.runs} runs, interleaved")
    print(f"{'what':<22} {'step':<32} {'all experts ms':>14} {'routed ms':>10} {'speed-up':>9}")
    for step_name, meta, caches in steps(model):
        hidden = torch.randn(meta.input_ids.shape[0], CONFIG["hidden_size"])
        cases = {"MoE block": lambda: layer.mlp(hidden),
                 "decoder layer": lambda: layer(hidden, meta, caches.layers[0])}
        for what, run in cases.items():
            times = {True: [], False: []}
            with torch.inference_mode():
                saved = [t.clone() for t in cache_tensors(caches)]
                for on in (True, False):        # warm-up, and the two outputs compared on the same caches
                    for tensor, before in zip(cache_tensors(caches), saved):
                        tensor.copy_(before)
                    use_all_experts(experts, on)
                    times[on].append(run())
                difference = float((times[True].pop() - times[False].pop()).abs().max())
                for _ in range(args.runs):
                    for on in (True, False):
                        use_all_experts(experts, on)
                        start = time.perf_counter()
                        run()
                        times[on].append(time.perf_counter() - start)
            dense, routed = statistics.median(times[True]), statistics.median(times[False])
            print(f"{what:<22} {step_name:<32} {dense * 1e3:>14.1f} {routed * 1e3:>10.1f} {dense / routed:>8.1f}x"
                  f"   (outputs differ by {difference:.1e})")
    use_all_experts(experts, False)


if __name__ == "__main__":
    main()
