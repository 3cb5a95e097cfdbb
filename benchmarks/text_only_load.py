"""Text-only loading of a sharded safetensors checkpoint: the port's loader vs a plain read and safe_open.

Builds (once, cached outside the repository) a synthetic checkpoint laid out like the TML Inkling one:
`model.llm.*` text tensors with `model.visual.*` and `model.audio.*` tensors in the same shards and
`model.mtp.*` in its own mtp.safetensors. Each layer has a q projection [Q, H] (split on dim 0 for
tensor parallelism), an output projection [H, Q] (split on dim 1), experts w13 [E, 2I, H] (dim 1)
and w2 [E, H, I] (dim 2), and small replicated norms; the split dims come from the port's own
name table (inkling_hpu.model.weights). Then, in one run, alternating, several times each:

  plain          each text tensor's byte range read sequentially (buffered) into a fresh tensor:
                 the baseline, no header parsing, no skipping logic
  port           inkling_hpu.loader.TextCheckpoint(...).load(): headers, then text byte ranges
                 only; the default: O_DIRECT, 8 requests of 8 MiB in flight from a thread pool
  port_buffered  the same with direct=False (buffered, readahead stopped short of skipped bytes)
  safe_open      safetensors.safe_open + get_tensor for every tensor (what a generic loader does)
  plain_reuse    the same reads as plain into one reused 16 MiB buffer, for context: storage speed
                 without the cost of touching fresh memory
  runai          runai-model-streamer's SafetensorsStreamer (vLLM's --load-format runai_streamer),
                 given the text tensors' names: it reads only their bytes, with its own threads
  fastsafetensors  fastsafetensors' SafeTensorsFileLoader on CPU (no GDS), a filter keeping the
                 text tensors (vLLM's --load-format fastsafetensors)
The peers run when installed (pip install -r requirements/benchmarks.txt torch==2.13.0).

With --tp 8, instead: 8 processes (one per rank, as the 8 workers on a node) load their rank's
slabs of the same checkpoint at once, vs one plain sequential read of the text bytes:

  tp_port          each rank: TextCheckpoint.load(specs, rank, 8) on the checkpoint as it is (the
                   default reads buffered there)
  tp_port_direct   the same with direct=True: the rank's own slabs by O_DIRECT
  tp_presharded    the default load, on a copy of the checkpoint (symlinks) that also holds the port's
                   pre-sharded layout (python -m inkling_hpu.loader presplit DIR --tp 8): each
                   rank reads its own file, which holds only its slabs
  tp_runai, tp_fastsafetensors   each rank reads the whole text tensors through the peer and keeps
                   its slab (neither reads a slab alone; vLLM narrows whole tensors the same way)

--throttle MBPS:IOPS caps reads from the checkpoint's disk for the whole run (a block-I/O cgroup,
root needed): storage that bounds both bandwidth and requests, like a network share.

Every method touches every page of every tensor it returns (a lazy mmap is not read until touched).
Before each run the files are dropped from the page cache (posix_fadvise DONTNEED), so the bytes
come from storage; "read" is /proc/<pid>/io read_bytes (storage reads, readahead included), summed
over the ranks with --tp. Prints min/median/max times, CPU seconds, throughput vs plain (ratio of
medians, and "paired": median over the rounds of each round's ratio), and the disk the files are on.

    PYTHONPATH=ports/inkling-small python -m benchmarks.text_only_load [--gib 2.5] [--runs 7] [--tp 8] [--throttle 400:2000]
        [--dir DIR] [--json]
"""
from __future__ import annotations

import argparse
import atexit
import json
import multiprocessing
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cookbook.upstream import CACHE_ROOT
from inkling_hpu import loader
from inkling_hpu.loader import (PRESHARDED_DIR, PRESHARDED_MANIFEST, TensorSpec, TextCheckpoint,
                                split_dims, verify_presharded, write_presharded)

DEFAULT_DIR = CACHE_ROOT / "bench-text-only-load"
MIB = 1 << 20
HIDDEN = 2048
EXPERTS = 2          # few, large experts: a TP 8 slab of w13 is then E pieces of 1.7 MiB, 13.5 MiB apart


def _io_counters() -> dict[str, int]:
    counters = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        key, value = line.split(":")
        counters[key] = int(value)
    return counters


def _tensor(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """bf16 tensor filled with cheap pseudo-random bits."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, generator=gen).view(torch.bfloat16)


def _rows(nbytes: int, per_row: int, multiple: int = 64) -> int:
    return max(multiple, nbytes // per_row // multiple * multiple)


def build_checkpoint(directory: Path, total_gib: float) -> None:
    """Text ~64% of the bytes, vision ~16%, audio ~8% (both inside the text shards), MTP ~12% (own file).
    Per layer: q 20%, o 20% (row-split), experts w13 40%, w2 20% (row-split) of the text bytes."""
    stamp = directory / "built.json"
    wanted = {"total_gib": total_gib, "layout": 3}
    if stamp.is_file() and json.loads(stamp.read_text()) == wanted:
        return
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.safetensors"):
        old.unlink()
    total = int(total_gib * 1024 * MIB)
    num_shards, layers_per_shard = 4, 6
    per_layer = int(total * 0.64) // (num_shards * layers_per_shard)
    q = _rows(int(per_layer * 0.2), HIDDEN * 2)
    inter = _rows(int(per_layer * 0.2), EXPERTS * HIDDEN * 2)
    seed = 0
    weight_map = {}
    for s in range(num_shards):
        shard: dict[str, torch.Tensor] = {}
        for j in range(layers_per_shard):
            layer = s * layers_per_shard + j
            prefix = f"model.llm.layers.{layer}."
            for name, shape in (("attn.wq_du.weight", (q, HIDDEN)), ("attn.wo_ud.weight", (HIDDEN, q)),
                                ("mlp.experts.w13_weight", (EXPERTS, 2 * inter, HIDDEN)),
                                ("mlp.experts.w2_weight", (EXPERTS, HIDDEN, inter)),
                                ("attn_norm.weight", (HIDDEN,)), ("mlp_norm.weight", (HIDDEN,)),
                                ("attn.q_norm.weight", (HIDDEN,))):
                seed += 1
                shard[prefix + name] = _tensor(shape, seed)
            # Tower tensors between the text tensors of the same shard.
            seed += 1
            shard[f"model.visual.layers.linear_{layer}.weight"] = _tensor((int(total * 0.16) // 24 // 2,), seed)
            if j % 2 == 0:
                seed += 1
                shard[f"model.audio.encoder.part_{layer}"] = _tensor((int(total * 0.08) // 12 // 2,), seed)
        if s == 0:
            shard["model.llm.embed.weight"] = _tensor((2048, HIDDEN), 99)
            shard["model.llm.norm.weight"] = _tensor((HIDDEN,), 98)
        filename = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file(shard, directory / filename)
        weight_map.update({name: filename for name in shard})
        del shard
    mtp = {f"model.mtp.layers.0.part_{k}": _tensor((int(total * 0.12) // 4 // 2,), 1000 + k) for k in range(4)}
    save_file(mtp, directory / "mtp.safetensors")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    stamp.write_text(json.dumps(wanted))


def tp_specs(ckpt: TextCheckpoint) -> list[TensorSpec]:
    """Each text tensor with its split dim from the port's name table (None: replicated)."""
    return [TensorSpec(name, None, shard_dim=dim) for name, dim in split_dims(ckpt).items()]


def build_presharded(directory: Path, world_size: int) -> Path:
    """A second view of the checkpoint (symlinks to its files) that also holds the port's
    pre-sharded layout (write_presharded, as `python -m inkling_hpu.loader presplit` makes it), so
    the same rank load reads it instead of the slabs in place."""
    linked = directory.parent / f"{directory.name}-presharded"
    linked.mkdir(exist_ok=True)
    for source in [*directory.glob("*.safetensors"), directory / "model.safetensors.index.json"]:
        if not (linked / source.name).is_symlink():
            (linked / source.name).symlink_to(source.resolve())
    manifest = linked / PRESHARDED_DIR.format(world_size=world_size) / PRESHARDED_MANIFEST
    if not manifest.is_file() or json.loads(manifest.read_text())["source"] != TextCheckpoint(linked).fingerprint():
        write_presharded(linked, world_size)
        verify_presharded(manifest.parent)
    return linked


def drop_cache(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _disk_sysdir(path: Path) -> Path:
    """The sysfs directory of the disk the path is on (a partition's parent: the disk has the queue
    attributes, and block throttling takes disks)."""
    dev = os.stat(path.resolve()).st_dev
    sysdir = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
    return sysdir.parent if (sysdir / "partition").is_file() else sysdir


def disk_info(path: Path) -> str:
    """The mount and block device the checkpoint is on, so figures from different disks are not mixed."""
    real = str(path.resolve())
    best = ("?", "?", "?")
    for line in Path("/proc/mounts").read_text().splitlines():
        device, mount, fstype = line.split()[:3]
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best[1]):
            best = (device, mount, fstype)
    dev = os.stat(real).st_dev
    queue = _disk_sysdir(path) / "queue"

    def attr(name: str) -> str:
        try:
            value = (queue / name).read_text().strip()
        except OSError:
            return "?"
        chosen = re.search(r"\[(\w[\w-]*)\]", value)       # "none [mq-deadline] kyber": the one in use
        return chosen.group(1) if chosen else value
    return (f"{best[0]} ({best[2]} on {best[1]}, block {os.major(dev)}:{os.minor(dev)}, "
            f"rotational {attr('rotational')}, read_ahead_kb {attr('read_ahead_kb')}, "
            f"scheduler {attr('scheduler')})")




def _leave_group(group: Path) -> None:
    (group.parent / "cgroup.procs").write_text(str(os.getpid()))
    group.rmdir()


def throttle_reads(path: Path, mb_per_s: float, iops: int) -> str:
    """Move this process (and the ranks it starts later) into a block-I/O cgroup that caps reads from
    the checkpoint's disk at `mb_per_s` MB/s and `iops` requests/s: storage that behaves like a
    network share (bandwidth and requests both bounded). cgroup v1 blkio or v2 io; needs root."""
    disk, rate = (_disk_sysdir(path) / "dev").read_text().strip(), int(mb_per_s * 1e6)
    v1 = Path("/sys/fs/cgroup/blkio")
    group = (v1 if v1.is_dir() else Path("/sys/fs/cgroup")) / f"text-only-load-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        if v1.is_dir():
            (group / "blkio.throttle.read_bps_device").write_text(f"{disk} {rate}")
            (group / "blkio.throttle.read_iops_device").write_text(f"{disk} {iops}")
        else:
            (group / "io.max").write_text(f"{disk} rbps={rate} riops={iops}")
        (group / "cgroup.procs").write_text(str(os.getpid()))
        atexit.register(_leave_group, group)
    except OSError as exc:
        raise SystemExit(f"--throttle: cannot cap reads through {group} ({exc}): needs root and a "
                         f"block-I/O cgroup controller") from None
    return f"reads from disk {disk} capped at {mb_per_s:g} MB/s and {iops} requests/s ({group})"


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


# The peers vLLM users pick for large checkpoints (--load-format runai_streamer / fastsafetensors):
# method name -> distribution.
PEERS = {"runai": "runai-model-streamer", "fastsafetensors": "fastsafetensors"}

# How each port method loads: its `direct` argument.
PORT_METHODS = {"port": None, "port_buffered": False, "tp_port": None, "tp_port_direct": True, "tp_presharded": None}


def _load(ckpt: TextCheckpoint, method: str, *args, **kwargs):
    return ckpt.load(*args, direct=PORT_METHODS[method], **kwargs)


def run_port(ckpt_dir: Path, method: str = "port") -> int:
    return sum(_consume(tensor) for _, tensor in _load(TextCheckpoint(ckpt_dir), method))


def run_safe_open(files: list[Path]) -> int:
    total = 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                total += _consume(f.get_tensor(name))
    return total


def _text_files(ckpt: TextCheckpoint) -> list[Path]:
    return sorted({entry.file for entry in ckpt.text.values()})


def peer_tensors(ckpt: TextCheckpoint, peer: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's text tensors, whole, as a peer loader reads them: runai-model-streamer
    (SafetensorsStreamer, told the text tensors' names: it reads only their bytes, concurrently) or
    fastsafetensors (SafeTensorsFileLoader on CPU without GDS, a filter keeping the text tensors:
    it skips the others' bytes). Neither reads a rank's slab alone: a rank narrows whole tensors."""
    names = set(ckpt.text)
    files = [str(path) for path in _text_files(ckpt)]
    if peer == "runai":
        from runai_model_streamer import SafetensorsStreamer

        with SafetensorsStreamer() as streamer:
            streamer.stream_files(files, tensor_names=names)
            yield from streamer.get_tensors()
        return
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    reader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)
    try:
        reader.set_tensor_filter(lambda name: name in names)
        reader.add_filenames({0: files})
        buffers = reader.copy_files_to_device()
        try:
            for name in reader.get_keys():
                yield name, buffers.get_tensor(name)
        finally:
            buffers.close()
    finally:
        reader.close()


def peers_installed() -> dict[str, str]:
    """The peers importable here, with their versions (requirements/benchmarks.txt pins them)."""
    from importlib import metadata

    found = {}
    for peer, package in PEERS.items():
        try:
            found[peer] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return found


def run_peer(ckpt: TextCheckpoint, peer: str) -> int:
    return sum(_consume(tensor) for _, tensor in peer_tensors(ckpt, peer))


def rank_slab(tensor: torch.Tensor, dim: int | None, rank: int, world_size: int) -> torch.Tensor:
    if dim is None:
        return tensor
    size = tensor.shape[dim] // world_size
    return tensor.narrow(dim, rank * size, size).contiguous()


def _rank_worker(rank: int, world_size: int, directory: str, presharded: str, commands, barrier, results) -> None:
    """One rank, kept alive across runs: waits for a method, then loads its slabs when all ranks
    (and the parent's clock) pass the barrier. Reports seconds, storage bytes, bytes asked of the
    file system (rchar), the bytes of the tensors it got and CPU seconds."""
    specs = tp_specs(TextCheckpoint(directory))
    dims = {spec.name: spec.shard_dim for spec in specs}
    while (method := commands.get()) is not None:
        barrier.wait()
        before, cpu, start = _io_counters(), _cpu_seconds(), time.perf_counter()
        ckpt = TextCheckpoint(presharded if method == "tp_presharded" else directory)
        if method.startswith("tp_") and method[3:] in PEERS:      # whole tensors, then the rank's slab
            loaded = ((name, rank_slab(t, dims[name], rank, world_size)) for name, t in peer_tensors(ckpt, method[3:]))
        else:
            loaded = _load(ckpt, method, specs, rank=rank, world_size=world_size)
        produced = sum(_consume(tensor) for _, tensor in loaded)
        seconds, after = time.perf_counter() - start, _io_counters()
        results.put((rank, seconds, after["read_bytes"] - before["read_bytes"], after["rchar"] - before["rchar"],
                     produced, _cpu_seconds() - cpu))


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def _summary(runs: list[tuple], text_bytes: int, plain: list[tuple]) -> dict:
    """runs: (wall seconds, storage bytes, CPU seconds, ...) per run; plain: the baseline's runs.
    "paired" is the median of plain/method over the rounds (each round runs every method once,
    back to back), which cancels load that drifts between rounds."""
    times = [r[0] for r in runs]
    base_time = statistics.median(r[0] for r in plain)
    median = statistics.median(times)
    read = statistics.median(r[1] for r in runs)
    return {"min_seconds": round(min(times), 3), "median_seconds": round(median, 3),
            "max_seconds": round(max(times), 3), "median_cpu_seconds": round(statistics.median(r[2] for r in runs), 3),
            "median_read_bytes": int(read),
            "read_vs_text": round(read / text_bytes, 4), "text_gb_per_s": round(text_bytes / median / 1e9, 3),
            "throughput_vs_plain": round(base_time / median, 3),
            "paired_vs_plain": round(statistics.median(p[0] / r[0] for p, r in zip(plain, runs)), 3)}


def run_tp(args, ckpt: TextCheckpoint, files: list[Path]) -> dict:
    world = args.tp
    presharded = build_presharded(args.dir, world)
    files = files + sorted((presharded / PRESHARDED_DIR.format(world_size=world)).glob("rank-*/*.safetensors"))
    text_bytes = ckpt.text_bytes
    ctx = multiprocessing.get_context("spawn")
    commands = [ctx.Queue() for _ in range(world)]
    barrier, results = ctx.Barrier(world + 1), ctx.Queue()
    workers = [ctx.Process(target=_rank_worker, args=(r, world, str(args.dir), str(presharded), commands[r],
                                                      barrier, results)) for r in range(world)]
    for w in workers:
        w.start()
    methods = ["plain", "tp_port", "tp_port_direct", "tp_presharded",
               *(f"tp_{peer}" for peer in peers_installed())]
    samples: dict[str, list] = {m: [] for m in methods}
    try:
        for _ in range(args.runs):
            for method in methods:                          # alternate so drift hits all alike
                drop_cache(files)
                if method == "plain":
                    before, cpu, start = _io_counters(), _cpu_seconds(), time.perf_counter()
                    if run_plain(ckpt) != text_bytes:
                        raise RuntimeError("plain read the wrong number of bytes")
                    samples[method].append((time.perf_counter() - start,
                                            _io_counters()["read_bytes"] - before["read_bytes"],
                                            _cpu_seconds() - cpu, []))
                    continue
                for q in commands:
                    q.put(method)
                barrier.wait()
                start = time.perf_counter()
                ranks = sorted(results.get(timeout=600) for _ in range(world))
                samples[method].append((time.perf_counter() - start, sum(r[2] for r in ranks),
                                        sum(r[5] for r in ranks), ranks))
    finally:
        for q in commands:
            q.put(None)
        for w in workers:
            w.join()
    slab_bytes = [r[4] for r in samples["tp_presharded"][0][3]]
    out = {"world_size": world, "text_bytes": text_bytes, "rank_slab_bytes": slab_bytes, "methods": {}}
    for method, runs in samples.items():
        r = _summary(runs, text_bytes, samples["plain"])
        if method != "plain":
            def per_rank(field: int) -> list[float]:             # median over the runs, per rank
                return [statistics.median(x) for x in zip(*[[rank[field] for rank in s[3]] for s in runs])]
            r["rank_read_bytes_median"] = [int(x) for x in per_rank(2)]
            r["rank_asked_bytes_median"] = [int(x) for x in per_rank(3)]
            r["rank_seconds_median"] = [round(x, 3) for x in per_rank(1)]
            r["produced_bytes"] = sum(rank[4] for rank in runs[0][3])
        out["methods"][method] = r
    return out


def run_single(args, ckpt: TextCheckpoint, files: list[Path]) -> dict:
    text_bytes = ckpt.text_bytes
    methods = {"plain": lambda: run_plain(ckpt), "port": lambda: run_port(args.dir),
               "port_buffered": lambda: run_port(args.dir, "port_buffered"),
               "safe_open": lambda: run_safe_open(files), "plain_reuse": lambda: run_plain_reused_buffer(ckpt),
               **{peer: (lambda peer=peer: run_peer(ckpt, peer)) for peer in peers_installed()}}
    samples: dict[str, list[tuple[float, int]]] = {m: [] for m in methods}
    for _ in range(args.runs):
        for name, fn in methods.items():                     # alternate so drift hits all alike
            drop_cache(files)
            before, cpu, start = _io_counters(), _cpu_seconds(), time.perf_counter()
            produced = fn()
            seconds, after = time.perf_counter() - start, _io_counters()
            if name != "safe_open" and produced != text_bytes:     # safe_open returns every tensor
                raise RuntimeError(f"{name} produced {produced} bytes of tensors, expected {text_bytes}")
            samples[name].append((seconds, after["read_bytes"] - before["read_bytes"], _cpu_seconds() - cpu))
    return {"methods": {name: _summary(runs, text_bytes, samples["plain"]) for name, runs in samples.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.5, help="checkpoint size in GiB (default 2.5)")
    parser.add_argument("--runs", type=int, default=7, help="runs per method (default 7)")
    parser.add_argument("--tp", type=int, default=0, help="tensor-parallel size: that many processes load their "
                                                          "slabs at once (default: one process, whole tensors)")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"checkpoint directory (default {DEFAULT_DIR})")
    parser.add_argument("--throttle", metavar="MBPS:IOPS",
                        help="cap reads from the checkpoint's disk (e.g. 400:2000): network-like storage")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)

    build_checkpoint(args.dir, args.gib)
    storage = "as it is"
    if args.throttle:
        mb_per_s, _, iops = args.throttle.partition(":")
        storage = throttle_reads(args.dir, float(mb_per_s), int(iops or 100_000))
    files = sorted(args.dir.glob("*.safetensors"))
    ckpt = TextCheckpoint(args.dir)
    load_before = os.getloadavg()[0]
    results = run_tp(args, ckpt, files) if args.tp else run_single(args, ckpt, files)
    results.update(text_bytes=ckpt.text_bytes, checkpoint_bytes=sum(p.stat().st_size for p in files),
                   runs=args.runs, disk=disk_info(args.dir), storage=storage, peers=peers_installed(),
                   cpus=os.cpu_count(),
                   load_average=[round(load_before, 2), round(os.getloadavg()[0], 2)])
    if results["methods"]["plain"]["median_read_bytes"] < ckpt.text_bytes // 2:
        results["note"] = ("read_bytes stayed near 0: the page cache was not dropped on this filesystem, "
                           "so the runs are warm-cache reads")
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"checkpoint {args.dir}: {results['checkpoint_bytes'] / 1e9:.2f} GB in {len(files)} files, "
          f"text tensors {ckpt.text_bytes / 1e9:.2f} GB ({len(ckpt.text)} tensors), "
          f"skipped {len(ckpt.skipped)} vision/audio/MTP tensors")
    print(f"disk: {results['disk']}; {results['cpus']} CPUs, load average {results['load_average'][0]} before, "
          f"{results['load_average'][1]} after")
    print(f"storage: {results['storage']}")
    print("peers: " + (", ".join(f"{PEERS[p]} {v}" for p, v in results["peers"].items()) or "none installed")
          + " (pip install -r requirements/benchmarks.txt)")
    what = f"{args.tp} ranks at once vs one plain read" if args.tp else "one process"
    print(f"{what}; cold cache; {args.runs} runs per method, methods interleaved")
    print(f"{'method':<16} {'min s':>6} {'median':>7} {'max s':>6} {'CPU s':>6} {'read GB':>8} {'read/text':>10} "
          f"{'text GB/s':>10} {'vs plain':>9} {'paired':>7}")
    for name, r in results["methods"].items():
        print(f"{name:<16} {r['min_seconds']:>6.2f} {r['median_seconds']:>7.2f} {r['max_seconds']:>6.2f} "
              f"{r['median_cpu_seconds']:>6.2f} {r['median_read_bytes'] / 1e9:>8.3f} {r['read_vs_text']:>9.4f}x "
              f"{r['text_gb_per_s']:>10.2f} {r['throughput_vs_plain']:>8.2f}x {r['paired_vs_plain']:>6.2f}x")
    if args.tp:
        slabs = results["rank_slab_bytes"]
        print(f"per rank (GB, medians): own slab {slabs[0] / 1e9:.3f} each ({sum(slabs) / ckpt.text_bytes:.3f}x "
              f"text in all); asked = bytes read() from the file system, "
              f"storage = /proc io read_bytes")
        for name, r in results["methods"].items():
            if name == "plain":
                continue
            asked = r["rank_asked_bytes_median"]
            print(f"  {name:<16} asked {min(asked) / 1e9:.3f}-{max(asked) / 1e9:.3f} "
                  f"({sum(asked) / ckpt.text_bytes:.2f}x text in all), storage "
                  + " ".join(f"{b / 1e9:.3f}" for b in r["rank_read_bytes_median"])
                  + f"; rank seconds {min(r['rank_seconds_median']):.2f}-{max(r['rank_seconds_median']):.2f}")
    if "note" in results:
        print("note:", results["note"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
