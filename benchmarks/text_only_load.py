"""Text-only loading of a sharded safetensors checkpoint: the port's loader vs safetensors' safe_open.

Builds (once, cached outside the repository) a synthetic checkpoint laid out like the TML Inkling one:
`model.llm.*` text tensors with `model.visual.*` and `model.audio.*` tensors in the same shards and
`model.mtp.*` in its own mtp.safetensors. Then, in one run, alternating, several times each:

  plain       each text tensor's byte range read sequentially (buffered) into a fresh tensor: the
              baseline, no header parsing, no skipping logic
  port        inkling_hpu.loader.TextCheckpoint(...).load(): headers, then text byte ranges only
  safe_open   safetensors.safe_open + get_tensor for every tensor (what a generic loader does)
  plain_reuse the same reads as plain into one reused 16 MiB buffer, for context: storage speed
              without the cost of touching fresh memory (large on VMs that fault pages in lazily)

Every method touches every page of every tensor it returns (a lazy mmap is not read until touched).

Before each run the files are dropped from the page cache (posix_fadvise DONTNEED), so the bytes
come from storage; "bytes read" is /proc/self/io read_bytes (storage reads, readahead included).
Prints medians and ratios: bytes read vs the text bytes (aim <= 1.02x) and throughput vs plain
(aim >= 0.8x).

    python benchmarks/text_only_load.py [--gib 2.5] [--runs 5] [--dir DIR] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "ports" / "inkling-small"))

from inkling_hpu.loader import TextCheckpoint  # noqa: E402

DEFAULT_DIR = Path(os.environ.get("COOKBOOK_CACHE", Path.home() / ".cache" / "gaudi-cookbook")) / "bench-text-only-load"
MIB = 1 << 20
HIDDEN = 2048


def _io_counters() -> dict[str, int]:
    counters = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        key, value = line.split(":")
        counters[key] = int(value)
    return counters


def _tensor(nbytes: int, seed: int) -> torch.Tensor:
    """bf16 tensor of about nbytes, rows of HIDDEN, filled with cheap pseudo-random bits."""
    rows = max(1, nbytes // (HIDDEN * 2))
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 15), 1 << 15, (rows, HIDDEN), dtype=torch.int16, generator=gen).view(torch.bfloat16)


def build_checkpoint(directory: Path, total_gib: float) -> None:
    """Text ~64% of the bytes, vision ~16%, audio ~8% (both inside the text shards), MTP ~12% (own file)."""
    stamp = directory / "built.json"
    wanted = {"total_gib": total_gib, "layout": 2}
    if stamp.is_file() and json.loads(stamp.read_text()) == wanted:
        return
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.safetensors"):
        old.unlink()
    total = int(total_gib * 1024 * MIB)
    num_shards, layers_per_shard = 4, 6
    text_per_layer = int(total * 0.64) // (num_shards * layers_per_shard)
    seed = 0
    weight_map = {}
    for s in range(num_shards):
        shard: dict[str, torch.Tensor] = {}
        for j in range(layers_per_shard):
            layer = s * layers_per_shard + j
            prefix = f"model.llm.layers.{layer}."
            # A few big tensors and a few tiny ones per layer, as in a real decoder layer.
            for name, share in (("attn.wq_du.weight", 0.2), ("attn.wo_ud.weight", 0.2),
                                ("mlp.experts.w13_weight", 0.4), ("mlp.experts.w2_weight", 0.2)):
                seed += 1
                shard[prefix + name] = _tensor(int(text_per_layer * share), seed)
            for name in ("attn_norm.weight", "mlp_norm.weight", "attn.q_norm.weight"):
                seed += 1
                shard[prefix + name] = _tensor(HIDDEN * 2, seed)[0]
            # Tower tensors between the text tensors of the same shard.
            seed += 1
            shard[f"model.visual.layers.linear_{layer}.weight"] = _tensor(int(total * 0.16) // 24, seed)
            if j % 2 == 0:
                seed += 1
                shard[f"model.audio.encoder.part_{layer}"] = _tensor(int(total * 0.08) // 12, seed)
        if s == 0:
            shard["model.llm.embed.weight"] = _tensor(8 * MIB, 99)
            shard["model.llm.norm.weight"] = _tensor(HIDDEN * 2, 98)[0]
        filename = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file(shard, directory / filename)
        weight_map.update({name: filename for name in shard})
        del shard
    mtp = {f"model.mtp.layers.0.part_{k}": _tensor(int(total * 0.12) // 4, 1000 + k) for k in range(4)}
    save_file(mtp, directory / "mtp.safetensors")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    stamp.write_text(json.dumps(wanted))


def drop_cache(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _text_ranges(ckpt: TextCheckpoint) -> dict[Path, list[tuple[int, int]]]:
    by_file: dict[Path, list[tuple[int, int]]] = {}
    for entry in ckpt.text.values():
        by_file.setdefault(entry.file, []).append((entry.begin, entry.nbytes))
    return {path: sorted(ranges) for path, ranges in sorted(by_file.items())}


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise RuntimeError("unexpected end of file")
        done += n


def run_plain(ckpt: TextCheckpoint) -> int:
    """The baseline: each text tensor's bytes read sequentially (buffered, file order) into a fresh
    tensor, as any loader must put them somewhere."""
    total = 0
    for path, ranges in _text_ranges(ckpt).items():
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset, length in ranges:
                buf = torch.empty(length, dtype=torch.uint8)
                _pread_all(fd, memoryview(buf.numpy()), offset)
                total += _consume(buf)
        finally:
            os.close(fd)
    return total


def run_plain_reused_buffer(ckpt: TextCheckpoint) -> int:
    """For context only: the same reads into one reused 16 MiB buffer (no tensor is kept, so no
    fresh memory is touched): the storage's own speed."""
    buf = bytearray(16 * MIB)
    view = memoryview(buf)
    total = 0
    for path, ranges in _text_ranges(ckpt).items():
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset, length in ranges:
                for start in range(offset, offset + length, len(buf)):
                    n = min(len(buf), offset + length - start)
                    _pread_all(fd, view[:n], start)
                    total += n
        finally:
            os.close(fd)
    return total


def _consume(tensor: torch.Tensor) -> int:
    """Touch one byte per 4 KiB page, as copying into a parameter would touch them all: a tensor
    backed by a lazy mmap (safe_open) is not read from storage until its pages are touched."""
    flat = tensor.reshape(-1).view(torch.uint8)
    flat[::4096].sum()
    return flat.numel()


def run_port(ckpt_dir: Path) -> int:
    return sum(_consume(tensor) for _, tensor in TextCheckpoint(ckpt_dir).load())


def run_safe_open(files: list[Path]) -> int:
    total = 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                total += _consume(f.get_tensor(name))
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.5, help="checkpoint size in GiB (default 2.5)")
    parser.add_argument("--runs", type=int, default=5, help="runs per method (default 5)")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"checkpoint directory (default {DEFAULT_DIR})")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)

    build_checkpoint(args.dir, args.gib)
    files = sorted(args.dir.glob("*.safetensors"))
    ckpt = TextCheckpoint(args.dir)
    text_bytes = ckpt.text_bytes
    all_bytes = sum(p.stat().st_size for p in files)

    methods = {"plain": lambda: run_plain(ckpt), "port": lambda: run_port(args.dir),
               "safe_open": lambda: run_safe_open(files), "plain_reuse": lambda: run_plain_reused_buffer(ckpt)}
    samples: dict[str, list[tuple[float, int]]] = {m: [] for m in methods}
    for _ in range(args.runs):
        for name, fn in methods.items():                     # alternate so drift hits all alike
            drop_cache(files)
            before, start = _io_counters(), time.perf_counter()
            produced = fn()
            seconds, after = time.perf_counter() - start, _io_counters()
            expected = all_bytes if name == "safe_open" else text_bytes
            if name != "safe_open" and produced != expected:
                raise RuntimeError(f"{name} produced {produced} bytes of tensors, expected {expected}")
            samples[name].append((seconds, after["read_bytes"] - before["read_bytes"]))

    results = {"text_bytes": text_bytes, "checkpoint_bytes": all_bytes, "runs": args.runs, "methods": {}}
    plain_time = statistics.median(s for s, _ in samples["plain"])
    for name, runs in samples.items():
        seconds = statistics.median(s for s, _ in runs)
        read = statistics.median(b for _, b in runs)
        results["methods"][name] = {
            "median_seconds": round(seconds, 3),
            "median_read_bytes": int(read),
            "read_vs_text": round(read / text_bytes, 4),
            "text_gb_per_s": round(text_bytes / seconds / 1e9, 3),
            "throughput_vs_plain": round(plain_time / seconds, 3),
            "samples": [{"seconds": round(s, 3), "read_bytes": b} for s, b in runs],
        }
    if results["methods"]["plain"]["median_read_bytes"] < text_bytes // 2:
        results["note"] = ("read_bytes stayed near 0: the page cache was not dropped on this filesystem, "
                           "so the runs are warm-cache reads")
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"checkpoint {args.dir}: {all_bytes / 1e9:.2f} GB in {len(files)} files, "
          f"text tensors {text_bytes / 1e9:.2f} GB ({len(ckpt.text)} tensors), "
          f"skipped {len(ckpt.skipped)} vision/audio/MTP tensors; medians of {args.runs} cold-cache runs")
    print(f"{'method':<10} {'time s':>8} {'read GB':>9} {'read/text':>10} {'text GB/s':>10} {'vs plain':>9}")
    for name, r in results["methods"].items():
        print(f"{name:<10} {r['median_seconds']:>8.2f} {r['median_read_bytes'] / 1e9:>9.3f} {r['read_vs_text']:>9.3f}x "
              f"{r['text_gb_per_s']:>10.2f} {r['throughput_vs_plain']:>8.2f}x")
    if "note" in results:
        print("note:", results["note"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
