"""The Inkling port beside a native vLLM MoE model of the same widths, served by the same real vLLM 0.30.0
CPU server build with the same flags, the same `vllm bench serve` on both, servers alternated.

    python -m benchmarks.native_peer [--runs 3]

The port serves the tiny random Inkling of benchmarks.moe --cpu-server (hidden 128, 4 layers of which the
first is dense, 4 query / 2 KV heads of dim 64, 64 routed experts of width 64, 6 per token, one shared
expert). The peer is vLLM's own Qwen3-MoE (`Qwen3MoeForCausalLM`) at those widths with random weights: the
same heads, layers, dense first layer, experts and top-k, the same tokenizer, without Inkling's short
convolutions, relative logits and shared expert. vLLM serves it with its own layers and CPU kernels
(fused MoE included). The port's routed experts are vLLM's MoE layer on the same CPU kernel, so what it
costs beyond the peer is what its own code costs: its relative-logits attention over the paged cache, its
convolutions and conv snapshots, its shared expert and its step metadata.

Both servers run the recipe's CPU variant (tools/cpu_server.CpuServer: fp32, block 128, eager, prefix
caching, the port's plugin on the path) and `vllm bench serve` at CPU scale (random input 512, output 64,
32 prompts, concurrency 8, ignore EOS). Prints medians of --runs runs and the port's output throughput as
a fraction of the peer's. Random weights: the figures compare serving paths, not answers.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from cookbook.upstream import CACHE_ROOT
from tools import cpu_server

SERVED_EXPERTS = (64, 6)     # benchmarks.moe --cpu-server's tiny Inkling
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

# Run by the server venv's python (transformers there): vLLM's Qwen3-MoE at the tiny Inkling's widths.
WRITE_PEER = """
import json, sys
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

out, inkling = sys.argv[1], json.load(open(sys.argv[2]))
experts, top_k = int(sys.argv[3]), int(sys.argv[4])
config = Qwen3MoeConfig(
    vocab_size=inkling["padded_vocab_size"], hidden_size=inkling["hidden_size"],
    num_hidden_layers=inkling["num_hidden_layers"], num_attention_heads=inkling["num_attention_heads"],
    num_key_value_heads=inkling["num_key_value_heads"], head_dim=inkling["head_dim"],
    intermediate_size=inkling["dense_intermediate_size"], moe_intermediate_size=inkling["intermediate_size"],
    num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
    mlp_only_layers=list(range(inkling["dense_mlp_idx"])), decoder_sparse_step=1,
    max_position_embeddings=inkling["max_position_embeddings"], tie_word_embeddings=False,
    rms_norm_eps=inkling.get("rms_norm_eps", 1e-6), torch_dtype="float32")
torch.manual_seed(0)
model = Qwen3MoeForCausalLM(config)
with torch.no_grad():
    for param in model.parameters():
        param.normal_(0, 0.02)
model.save_pretrained(out, safe_serialization=True)
"""


def peer_model(venv: Path, inkling: Path) -> Path:
    """vLLM's Qwen3-MoE at the Inkling's widths, random weights, the Inkling's tokenizer; built once per
    Inkling model and version of this script."""
    key = hashlib.sha256(Path(__file__).read_bytes() + inkling.name.encode()).hexdigest()[:12]
    out = CACHE_ROOT / f"native-peer-qwen3-moe-{key}"
    if not (out / ".complete").exists():
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run([str(venv / "bin" / "python"), "-c", WRITE_PEER, str(out), str(inkling / "config.json"),
                        *map(str, SERVED_EXPERTS)], check=True, capture_output=True, timeout=900)
        for name in TOKENIZER_FILES:
            if (inkling / name).exists():
                shutil.copy2(inkling / name, out / name)
        (out / ".complete").touch()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    venv = cpu_server.server_venv()
    print(f"fix pack: {cpu_server.patch_vllm(venv)}", file=sys.stderr)
    plugin = cpu_server.port_install(venv)
    inkling = cpu_server.tiny_model(venv, plugin, experts=SERVED_EXPERTS)
    served = {"Inkling (the port)": (inkling, plugin), "Qwen3-MoE (vLLM's own)": (peer_model(venv, inkling), plugin)}
    results = cpu_server.bench_alternated(venv, served, args.runs, "native-peer")
    port, peer = cpu_server.print_bench_medians(results, (
        f"vllm bench serve: random input 512, output 64, 32 prompts, concurrency 8, ignore EOS; real vLLM 0.30.0 "
        f"CPU server, the recipe's CPU flags; {SERVED_EXPERTS[0]} routed experts, top-{SERVED_EXPERTS[1]}, hidden 128, "
        f"4 layers; medians of {args.runs} runs (servers alternated); {os.cpu_count()} CPUs")).values()
    paired = [p["output_throughput"] / q["output_throughput"] for p, q in zip(*results.values())]
    print(f"\nthe port's output throughput / the peer's: {port['output_throughput'] / peer['output_throughput']:.2f}x "
          f"(per run: {', '.join(f'{r:.2f}x' for r in paired)})")


if __name__ == "__main__":
    main()
