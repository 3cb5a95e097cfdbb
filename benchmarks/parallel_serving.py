"""Inkling port through vLLM's own executor at tensor-parallel 1, tensor-parallel 2 and pipeline-parallel
2, side by side in one run: start-up time, steady decode tokens/s, and the bytes each worker read.

    python -m benchmarks.parallel_serving [--runs 3] [--configs tp1,tp2,pp2,tp2xpp2,tp2xpp2-ray] [--before REF]

tp2xpp2-ray is the two-node variant on this machine (tools/ray_nodes.py: two Ray nodes, vLLM's Ray executor);
its start-up includes starting the two Ray nodes. `--configs tp2xpp2,tp2xpp2-ray` compares it with the mp
executor at the same sizes. `--before REF` also serves each configuration with the port of git ref REF
(alternated with this tree's) and prints this tree's figures as ratios of REF's.

The real vLLM 0.30.0 CPU server (tools/cpu_server.py: fix pack applied, the port's plugin, the recipe's CPU
flags) on the tiny random Inkling, one server per configuration and run, configurations alternated:
- start-up: from the server's launch to /v1/models answering (worker processes, model build, the port's
  load, the KV pool);
- decode tok/s, one stream: 128 greedy tokens after a 64-token prompt, timed against a 1-token request of
  the same prompt (the difference is 127 decode steps, prefill excluded); eight streams: 8 such requests
  at once, their tokens over the wall time;
- bytes per worker: what each worker's load line says it read (its stage's tensors, its slabs).
Medians of --runs. On a 2-core CPU the workers of a parallel configuration share the cores, so these
figures compare the executor paths' overheads; they are not what eight Gaudi cards measure.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# name -> (tensor-parallel, pipeline-parallel, Ray nodes; 1: the mp executor)
CONFIGS = {"tp1": (1, 1, 1), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "tp2xpp2": (2, 2, 1), "tp2xpp2-ray": (2, 2, 2)}
PROMPT = list(range(100, 164))
DECODE_TOKENS = 128


def _complete(server, served: str, max_tokens: int) -> float:
    body = json.dumps({"model": served, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(server.base_url + "/v1/completions", body, {"content-type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as answer:
        out = json.load(answer)
    if out["usage"]["completion_tokens"] != max_tokens:
        raise SystemExit(f"expected {max_tokens} tokens, got {out['usage']['completion_tokens']}; log {server.log}")
    return time.perf_counter() - start


def _served_model(server) -> str:
    with urllib.request.urlopen(server.base_url + "/v1/models", timeout=10) as answer:
        return json.load(answer)["data"][0]["id"]


def measure(server, started: float) -> dict:
    served = _served_model(server)
    _complete(server, served, 4)                          # first request: warm every worker's path
    one = _complete(server, served, 1)
    full = _complete(server, served, DECODE_TOKENS)
    streams = 8
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(lambda _: _complete(server, served, DECODE_TOKENS), range(streams)))
    batch = time.perf_counter() - start
    read = [float(size) * (1e9 if unit == "G" else 1e6) for size, unit in
            re.findall(r"Inkling loading, [^:]*: [0-9.]+ [MG]B of ([0-9.]+) ([MG])B \(100%\)", server.log.read_text())]
    return {"startup_s": started, "decode_tok_s": (DECODE_TOKENS - 1) / (full - one),
            "batch_tok_s": streams * DECODE_TOKENS / batch, "workers": len(read),
            "max_bytes_per_worker": max(read), "sum_bytes": sum(read)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--configs", default="tp1,tp2,pp2")
    parser.add_argument("--before", help="git ref whose port each configuration is also served with")
    args = parser.parse_args(argv)
    import tempfile

    from tools import cpu_server

    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}: expected some of {', '.join(CONFIGS)}")
    venv = cpu_server.server_venv()
    print(f"fix pack: {cpu_server.patch_vllm(venv)}", file=sys.stderr)
    plugin = cpu_server.port_install(venv)
    model = cpu_server.tiny_model(venv, plugin)
    plugins = {"": plugin}
    if args.before:
        with tempfile.TemporaryDirectory() as scratch:
            plugins[f"@{args.before}"] = cpu_server.port_install(venv, cpu_server.port_at(args.before, scratch))
    results = {name + suffix: [] for name in names for suffix in plugins}
    for run in range(args.runs):
        for name in names:
            for suffix, port in plugins.items():
                log = REPO / "build" / "cpu-server" / f"bench-parallel-{name}{suffix}-{run}.log"
                tp, pp, nodes = CONFIGS[name]
                server = cpu_server.CpuServer(venv, model, log, cpu_server.parallel_args(tp, pp) if nodes == 1 else [],
                                              plugin_path=port, nodes=nodes)
                print(f"running: {name}{suffix}, run {run + 1}/{args.runs} ...", file=sys.stderr, flush=True)
                start = time.perf_counter()
                with server:      # __enter__ starts it and waits for /v1/models
                    results[name + suffix].append(measure(server, time.perf_counter() - start))
    print(f"\nreal vLLM 0.30.0 CPU server (mp executor, gloo; -ray: Ray executor), tiny random Inkling (4 layers, hidden 128), "
          f"2 cores; medians of {args.runs} runs, configurations alternated\n")
    header = (f"{'config':<20}{'workers':>8}{'start-up s':>12}{'decode tok/s':>14}{'8 streams tok/s':>17}"
              f"{'MB per worker':>15}{'MB all workers':>16}")
    print(header + "\n" + "-" * len(header))
    medians = {}
    for name, runs in results.items():
        med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        medians[name] = med
        print(f"{name:<20}{med['workers']:>8.0f}{med['startup_s']:>12.1f}{med['decode_tok_s']:>14.1f}"
              f"{med['batch_tok_s']:>17.1f}{med['max_bytes_per_worker'] / 1e6:>15.2f}{med['sum_bytes'] / 1e6:>16.2f}")
    pairs = [(name, "tp1") for name in names if name != "tp1" and "tp1" in names]
    pairs += [("tp2xpp2-ray", "tp2xpp2")] if {"tp2xpp2", "tp2xpp2-ray"} <= set(names) else []
    pairs += [(name, f"{name}@{args.before}") for name in names] if args.before else []
    for name, other in pairs:
        med, base = medians[name], medians[other]
        print(f"{name} vs {other}: start-up {med['startup_s'] / base['startup_s']:.2f}x, decode "
              f"{med['decode_tok_s'] / base['decode_tok_s']:.2f}x, 8 streams "
              f"{med['batch_tok_s'] / base['batch_tok_s']:.2f}x, bytes per worker "
              f"{med['max_bytes_per_worker'] / base['max_bytes_per_worker']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
