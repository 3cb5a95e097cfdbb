"""Text-only loader for the TML Inkling checkpoint (`model.llm.*`).

The checkpoint also carries the vision tower (`model.visual.*`), the audio tower (`model.audio.*`)
and the MTP draft head (`model.mtp.*`). The port serves text only, so their bytes are never read:
the loader parses each safetensors header (8-byte length + JSON), then reads only the byte ranges
of the tensors it needs, and for a tensor-parallel rank only that rank's slice where the slice is
contiguous (or a few large contiguous pieces). By default the bytes are read with O_DIRECT
by a few threads (a fixed number of requests kept in flight, straight into the tensors) where the
file system has O_DIRECT and the file is not already in the page cache, except by tensor-parallel
ranks reading the checkpoint in place; otherwise they are read buffered, with the kernel's
readahead stopped short of the skipped tensors and the rest prefetched exactly. direct=True forces
O_DIRECT; direct=False forces buffered reads.
benchmarks/text_only_load.py measures bytes read and throughput against a plain read, in one
process and with 8 ranks at once.

Safetensors layout: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}, then the data section; offsets are relative
to the data section, row-major, no padding.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import itertools
import json
import math
import mmap
import os
import re
import struct
import sys
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

TEXT_PREFIX = "model.llm."
# The towers and the MTP head: never read (also model.weights' is_text_weight, which imports this).
SKIPPED_PREFIXES = ("model.visual.", "model.audio.", "model.mtp.")

SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

# Strided shards (sharded on a dim > 0) are read piece by piece when each piece is at least this
# big; for smaller pieces the rank copies its slice out of a mapping of the whole tensor.
MIN_STRIDED_PIECE_BYTES = 1 << 20
# Large ranges are read in chunks of READ_CHUNK_BYTES. Buffered reads go through the kernel's
# readahead except the last READAHEAD_TAIL_BYTES of each contiguous run, and the ranges read
# exactly are asked for PREFETCH_BYTES ahead of the copy, in calls of PREFETCH_CALL_BYTES; the
# window must exceed how far readahead runs ahead (16.8 MiB measured at read_ahead_kb 8192), yet
# stays small so storage sees one near-sequential stream (32 MiB measured best of 24-128 MiB).
# O_DIRECT (offsets, lengths and buffers aligned to DIRECT_ALIGN) keeps READ_THREADS chunks in
# flight, across tensor boundaries, by as many threads (measured faster than io_uring driven from
# Python on the machines tried: benchmarks/text_only_load.py).
READ_CHUNK_BYTES = 8 << 20
PREFETCH_BYTES = 32 << 20
PREFETCH_CALL_BYTES = 2 << 20
READAHEAD_TAIL_BYTES = 64 << 20
DIRECT_ALIGN = 4096
READ_THREADS = 8
# By default (direct=None) a file more than this share of whose own bytes is in the page cache
# already is read buffered: O_DIRECT would read them from storage again.
CACHED_SHARE_BUFFERED = 0.5
HUGE_PAGE = 2 << 20
# write_presharded's layout: <checkpoint>/presharded-tp<N>/rank-<r>/model.safetensors + manifest.
PRESHARDED_DIR = "presharded-tp{world_size}"
PRESHARDED_MANIFEST = "presharded.json"
# Upper bound on a sane header (safetensors itself refuses more than 100 MB).
MAX_HEADER_BYTES = 100_000_000


class CheckpointError(ValueError):
    """The checkpoint does not hold what the model needs; the message names expected vs found."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: file and absolute byte range [begin, end)."""
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class TensorSpec:
    """What the model expects for one checkpoint tensor (full, unsharded shape).

    shape None leaves the shape check to the caller; shard_dim None means every rank loads the
    whole tensor (replicated); optional tensors may be absent (they are then not yielded)."""
    name: str
    shape: tuple[int, ...] | None
    dtype: str | None = None
    shard_dim: int | None = None
    optional: bool = False


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Parse one safetensors file's header; reads 8 + N bytes, never the data section."""
    path = Path(path)
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise CheckpointError(f"{path}: expected a safetensors file (8-byte header length), "
                                  f"found only {len(prefix)} bytes")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
            raise CheckpointError(f"{path}: header length {header_len} does not fit the file "
                                  f"({file_size} bytes): truncated or not safetensors")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"{path}: header is not valid JSON ({exc})") from None
    data_start = 8 + header_len
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            dtype, shape = info["dtype"], tuple(int(d) for d in info["shape"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: header entry for {name!r} lacks dtype/shape/data_offsets: "
                                  f"{info!r}") from None
        entries[name] = TensorEntry(name, path, dtype, shape, data_start + begin, data_start + end)
    return entries


def _index_files(checkpoint_dir: Path) -> list[Path]:
    """The checkpoint's shard files: those named by model.safetensors.index.json, else all."""
    index = checkpoint_dir / "model.safetensors.index.json"
    files: set[Path] = set()
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files.update(checkpoint_dir / f for f in weight_map.values())
    # Files outside the index (e.g. mtp.safetensors) are still listed so their names are known.
    files.update(checkpoint_dir.glob("*.safetensors"))
    missing = sorted(str(f) for f in files if not f.is_file())
    if missing:
        raise CheckpointError(f"{checkpoint_dir}: the index names shard files that do not exist: {missing}")
    if not files:
        raise CheckpointError(f"{checkpoint_dir}: expected *.safetensors files, found none")
    return sorted(files)


def is_skipped(name: str) -> bool:
    """A vision/audio tower or MTP tensor: the text-only port never reads its bytes."""
    return name.startswith(SKIPPED_PREFIXES)


class TextCheckpoint:
    """The text tensors of a sharded safetensors checkpoint, located by header only."""

    def __init__(self, checkpoint_dir: str | os.PathLike):
        self.dir = Path(checkpoint_dir)
        self.files = _index_files(self.dir)
        self.text: dict[str, TensorEntry] = {}
        self.skipped: dict[str, TensorEntry] = {}
        unknown = []
        for path in self.files:
            for name, entry in read_header(path).items():
                if name.startswith(TEXT_PREFIX):
                    self.text[name] = entry
                elif is_skipped(name):
                    self.skipped[name] = entry
                else:
                    unknown.append(f"{name} ({path.name})")
        if unknown:
            raise CheckpointError(
                f"{self.dir}: expected only {TEXT_PREFIX}* (text) and {', '.join(SKIPPED_PREFIXES)}* "
                f"(skipped) tensors, found {len(unknown)} others, e.g. {unknown[:5]}")
        for entry in self.text.values():
            self._check_entry(entry)

    def _check_entry(self, entry: TensorEntry) -> None:
        if entry.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{entry.name} ({entry.file.name}): dtype {entry.dtype} is not one of "
                                  f"{sorted(SAFETENSORS_DTYPES)}")
        itemsize = SAFETENSORS_DTYPES[entry.dtype].itemsize
        expected = math.prod(entry.shape) * itemsize
        if entry.nbytes != expected:
            raise CheckpointError(f"{entry.name} ({entry.file.name}): shape {list(entry.shape)} {entry.dtype} "
                                  f"needs {expected} bytes, the header gives {entry.nbytes}")
        size = entry.file.stat().st_size
        if entry.end > size:
            raise CheckpointError(f"{entry.file}: truncated: {entry.name} needs bytes up to {entry.end}, "
                                  f"the file has {size}")

    @property
    def text_bytes(self) -> int:
        return sum(e.nbytes for e in self.text.values())

    def entry(self, spec: TensorSpec) -> TensorEntry:
        entry = self.text.get(spec.name)
        if entry is None:
            shape = "any shape" if spec.shape is None else f"expected shape {list(spec.shape)}"
            raise CheckpointError(f"missing tensor {spec.name} ({shape}): not in "
                                  f"any of the {len(self.files)} files under {self.dir}")
        if spec.shape is not None and entry.shape != tuple(spec.shape):
            raise CheckpointError(f"misshapen tensor {spec.name} in {entry.file.name}: expected shape "
                                  f"{list(spec.shape)}, found {list(entry.shape)}")
        if spec.dtype is not None and entry.dtype != spec.dtype:
            raise CheckpointError(f"tensor {spec.name} in {entry.file.name}: expected dtype {spec.dtype}, "
                                  f"found {entry.dtype}")
        return entry

    def fingerprint(self) -> str:
        """sha256 of where every text tensor is (name, dtype, shape, file, byte range): what a
        pre-sharded layout was made from."""
        items = sorted((e.name, e.dtype, list(e.shape), e.file.name, e.begin, e.end) for e in self.text.values())
        return hashlib.sha256(json.dumps(items).encode()).hexdigest()

    def presharded(self, world_size: int) -> tuple[Path, dict] | None:
        """This checkpoint's pre-sharded layout for world_size (write_presharded), if there is one."""
        directory = self.dir / PRESHARDED_DIR.format(world_size=world_size)
        if not (directory / PRESHARDED_MANIFEST).is_file():
            return None
        manifest = json.loads((directory / PRESHARDED_MANIFEST).read_text())
        if manifest.get("source") != self.fingerprint():
            raise CheckpointError(f"{directory}: made from a checkpoint with fingerprint {manifest.get('source')}, "
                                  f"this one has {self.fingerprint()}: remake it (python -m inkling_hpu.loader "
                                  f"presplit {self.dir} --tp {world_size}) or remove it")
        return directory, manifest

    def _load_presharded(self, presharded: tuple[Path, dict], plan: list, rank: int, world_size: int,
                         direct: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """The rank's own file: its slabs, contiguous, nothing of the other ranks'."""
        directory, manifest = presharded
        rank_specs = []
        for entry, spec in plan:
            made = manifest["shard_dims"].get(entry.name, "absent")
            if made != spec.shard_dim:
                raise CheckpointError(f"{directory}: {entry.name} split on dim {made} there, the model splits it "
                                      f"on dim {spec.shard_dim}: remake it or remove it")
            shape = tuple(size // world_size if d == spec.shard_dim else size for d, size in enumerate(entry.shape))
            rank_specs.append(TensorSpec(entry.name, shape, entry.dtype))
        rank_file = TextCheckpoint(directory / f"rank-{rank}")
        yield from rank_file.load(rank_specs, allow_unexpected=True, direct=direct)

    def refuse_unexpected(self, expected: Iterable[str]) -> None:
        """CheckpointError when the checkpoint holds a text tensor the model does not expect."""
        extra = sorted(set(self.text) - set(expected))
        if extra:
            raise CheckpointError(f"{self.dir}: {len(extra)} text tensors the model does not expect, "
                                  f"e.g. {extra[:5]}: the config does not match the checkpoint")

    def load(self, specs: Iterable[TensorSpec] | None = None, rank: int = 0, world_size: int = 1,
             allow_unexpected: bool = False, direct: bool | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (checkpoint name, tensor) for the rank, in file order.

        specs None loads every text tensor whole (no sharding checks). With specs, every spec
        must be present with its shape, and (unless allow_unexpected) every text tensor of the
        checkpoint must be asked for, so a config that does not match the checkpoint is refused
        rather than half-loaded. direct=None (the default) reads with O_DIRECT where the file system
        has it and the file is not mostly in the page cache, else buffered; ranks of world_size > 1
        reading the checkpoint in place read buffered; direct=True reads them with O_DIRECT where
        the file system has it; direct=False reads buffered (see _FileReader). With specs and
        world_size > 1, a pre-sharded layout of this checkpoint for world_size (write_presharded)
        is read instead when present."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        if specs is None:
            plan = [(e, None) for e in self.text.values()]
        else:
            specs = list(specs)
            plan = [(self.entry(s), s) for s in specs if not (s.optional and s.name not in self.text)]
            if not allow_unexpected:
                self.refuse_unexpected(s.name for s in specs)
        if specs is not None and world_size > 1:
            presharded = self.presharded(world_size)
            if presharded is not None:
                yield from self._load_presharded(presharded, plan, rank, world_size, direct)
                return
        if direct is None and world_size > 1:
            # Ranks reading in place share bytes through the page cache; with 8 ranks buffered reads
            # measured as fast as or faster than their own slabs by O_DIRECT (the pre-sharded
            # layout above is a rank file of its own: the default applies there).
            direct = False
        plan.sort(key=lambda item: (str(item[0].file), item[0].begin))
        reads = [_plan_read(entry, spec, rank, world_size) for entry, spec in plan]
        pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="inkling-load") if direct is not False else None
        try:
            for path, group in itertools.groupby(reads, key=lambda read: read.entry.file):
                file_reads = list(group)
                with _FileReader(path, file_reads, direct, pool) as reader:
                    for read in file_reads:
                        yield read.entry.name, reader.read(read)
        finally:
            if pool is not None:
                pool.shutdown()


@dataclass(frozen=True)
class _Read:
    """The byte ranges one tensor (or its rank's shard) needs, and how to shape them."""
    entry: TensorEntry
    ranges: tuple[tuple[int, int], ...]          # (absolute offset, length), in file order
    shape: tuple[int, ...]                       # shape of the bytes read
    narrow: tuple[int, int, int] | None = None   # (dim, start, length) to take from the whole tensor
    shared: bool = False                         # other ranks read these bytes too

    @property
    def nbytes(self) -> int:
        return sum(length for _, length in self.ranges)


def _plan_read(entry: TensorEntry, spec: TensorSpec | None, rank: int, world_size: int) -> _Read:
    if spec is None or spec.shard_dim is None or world_size == 1:
        return _Read(entry, ((entry.begin, entry.nbytes),), entry.shape, shared=world_size > 1)
    shape, dim = entry.shape, spec.shard_dim
    if not 0 <= dim < len(shape):
        raise CheckpointError(f"{entry.name}: shard dim {dim} is out of range for shape {list(shape)}")
    if shape[dim] % world_size:
        raise CheckpointError(f"{entry.name}: dim {dim} of shape {list(shape)} is not divisible by the "
                              f"tensor-parallel size {world_size}")
    part = shape[dim] // world_size
    inner = math.prod(shape[dim + 1:]) * SAFETENSORS_DTYPES[entry.dtype].itemsize   # bytes per index of dim
    outer = math.prod(shape[:dim])                                                   # pieces in the shard
    piece, stride = part * inner, shape[dim] * inner
    out_shape = shape[:dim] + (part,) + shape[dim + 1:]
    first = entry.begin + rank * piece
    if outer == 1 or piece >= MIN_STRIDED_PIECE_BYTES:
        return _Read(entry, tuple((first + i * stride, piece) for i in range(outer)), out_shape)
    return _Read(entry, ((entry.begin, entry.nbytes),), shape, narrow=(dim, rank * part, part), shared=True)


def _fadvise(fd: int, offset: int, length: int, advice: int) -> None:
    """A hint only: file systems (and platforms) that refuse it are read all the same."""
    try:
        os.posix_fadvise(fd, offset, length, advice)
    except (AttributeError, OSError):
        pass


class _FileReader:
    """Reads the planned byte ranges of one file, and (within a 4 KiB page) only those.

    Buffered (the default): the body of each long contiguous run goes through the kernel's
    readahead (one sequential stream, large folios); everything else, including the tail of each
    run, through a descriptor with readahead off (POSIX_FADV_RANDOM) whose exact pages are asked
    for ahead of the copy (POSIX_FADV_WILLNEED), so no read runs past a text range into the
    skipped tower tensors. Ranks of a tensor-parallel group share what they all read (replicated
    tensors, tensors split in pieces too small to read one by one) in the page cache, so storage
    sees those bytes once. The small-piece slabs are taken through a mapping of the file: a rank
    copies only its own elements, not the whole tensor.

    O_DIRECT (direct=True, or the default where the file's own bytes are not mostly cached): the rank's own slabs (not the shared bytes, which still go through the
    page cache) are read in READ_CHUNK_BYTES requests straight into the tensors, READ_THREADS in
    flight and kept in flight across tensor boundaries (_DirectQueue). File systems without
    O_DIRECT (e.g. ramfs) are read buffered."""

    def __init__(self, path: Path, reads: list[_Read], direct: bool | None, pool: ThreadPoolExecutor | None):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        self.readahead_fd = self.direct_fd = None
        self.queue: _DirectQueue | None = None
        self.map: mmap.mmap | None = None
        try:
            self._setup(reads, direct, pool)
        except BaseException:
            self.__exit__()
            raise

    def _setup(self, reads: list[_Read], direct: bool | None, pool: ThreadPoolExecutor | None) -> None:
        _fadvise(self.fd, 0, 0, getattr(os, "POSIX_FADV_RANDOM", 0))
        self.readahead_fd = os.open(self.path, os.O_RDONLY)
        own = [read for read in reads if not read.shared and read.narrow is None]
        if own and direct is not False:
            try:
                self.direct_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                pass
            if self.direct_fd is not None and direct is None and _cached_share(self.fd, own) > CACHED_SHARE_BUFFERED:
                os.close(self.direct_fd)
                self.direct_fd = None
        if self.direct_fd is not None:
            self.queue = _DirectQueue(self.path, self.direct_fd, [r for r in reads if self._direct(r)], pool)
        buffered = [read for read in reads if not self._direct(read)]
        self.readahead_end = _readahead_ends(buffered)
        # The exact parts, with their place in the order of the copy, for the prefetch.
        exact, position = [], 0
        for read in buffered:
            for offset, length in read.ranges:
                cut = self.readahead_end.get(offset, offset)
                if cut < offset + length:
                    exact.append((position + cut - offset, cut, offset + length - cut))
                position += length
        self.prefetch = _Prefetch(self.fd, exact)
        self.consumed = 0          # buffered bytes copied so far, in the same order

    def __enter__(self) -> "_FileReader":
        return self

    def __exit__(self, *exc) -> None:
        if self.queue is not None:
            self.queue.close()         # no request may still write into memory once it is freed
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:        # a failed read's traceback still holds a view: unmapped later
                pass
        for fd in (self.direct_fd, self.readahead_fd):
            if fd is not None:
                os.close(fd)
        os.close(self.fd)

    def _direct(self, read: _Read) -> bool:
        return self.direct_fd is not None and not read.shared and read.narrow is None

    def read(self, read: _Read) -> torch.Tensor:
        entry, dtype = read.entry, SAFETENSORS_DTYPES[read.entry.dtype]
        if read.narrow is not None:
            return self._read_narrow(read)
        if self._direct(read):
            bufs = self.queue.take(read)
            buf = bufs[0] if len(bufs) == 1 else _concat(bufs)
        else:
            buf = _empty(read.nbytes)
            out, pos = memoryview(buf.numpy()), 0
            for offset, length in read.ranges:
                self._read_buffered(entry, out[pos:pos + length], offset)
                pos += length
        return buf.view(dtype).view(read.shape)

    def _check(self, entry: TensorEntry, got: int, needed: int, offset: int) -> None:
        if got < needed:
            raise CheckpointError(f"{entry.file}: truncated while reading {entry.name}: got {got} of "
                                  f"{needed} bytes at offset {offset}")

    def _read_buffered(self, entry: TensorEntry, out: memoryview, offset: int) -> None:
        cut = self.readahead_end.get(offset, offset) - offset     # bytes before it: kernel readahead
        for start in range(0, len(out), READ_CHUNK_BYTES):
            end = min(start + READ_CHUNK_BYTES, len(out))
            self.consumed += end - start
            self.prefetch.ahead_of(self.consumed)
            for fd, begin, stop in ((self.readahead_fd, start, min(end, cut)), (self.fd, max(start, cut), end)):
                if begin < stop:
                    got = _pread_into(fd, out[begin:stop], offset + begin)
                    if got < stop - begin:
                        self._check(entry, begin + got, len(out), offset)

    def _read_narrow(self, read: _Read) -> torch.Tensor:
        """The rank's slice of a tensor split in small pieces, copied out of a (shared) mapping of
        the file, whose pages the prefetch has asked for."""
        entry = read.entry
        self.consumed += entry.nbytes
        self.prefetch.ahead_of(self.consumed)
        size = len(self.map) if self.map is not None else os.fstat(self.fd).st_size
        self._check(entry, max(0, min(size, entry.end) - entry.begin), entry.nbytes, entry.begin)
        if self.map is None:
            # Copy-on-write: writable for torch, yet reading shares the page cache's pages.
            self.map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_COPY)
            if hasattr(mmap, "MADV_RANDOM"):
                self.map.madvise(mmap.MADV_RANDOM)       # no fault-time readahead either
        # As bytes (outer, split dim, inner), copied by numpy: torch's multi-threaded strided copy
        # of short rows was 4-20x slower here, more so with 8 ranks on the cores.
        dim, start, length = read.narrow
        outer, inner = math.prod(read.shape[:dim]), entry.nbytes // math.prod(read.shape[:dim + 1])
        whole = np.frombuffer(self.map, dtype=np.uint8, count=entry.nbytes, offset=entry.begin)
        part = whole.reshape(outer, read.shape[dim], inner)[:, start:start + length]
        out = _empty(part.size)
        np.copyto(out.numpy().reshape(part.shape), part)
        del whole, part                                   # release the mapping before it is closed
        shape = read.shape[:dim] + (length,) + read.shape[dim + 1:]
        return out.view(SAFETENSORS_DTYPES[entry.dtype]).view(shape)


def _concat(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat of uint8 pieces, copied by numpy (one thread): torch's parallel copy took 50 ms
    for 3.4 MB on the 2 shared cores, 4x the read."""
    out = _empty(sum(p.numel() for p in parts))
    flat, pos = out.numpy(), 0
    for part in parts:
        np.copyto(flat[pos:pos + part.numel()], part.numpy())
        pos += part.numel()
    return out


def _pread_into(fd: int, out: memoryview, offset: int) -> int:
    """preadv until `out` is full or EOF; returns the bytes read."""
    done = 0
    while done < len(out):
        n = os.preadv(fd, [out[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


class _DirectQueue:
    """O_DIRECT reads of one file's own ranges, READ_CHUNK_BYTES requests of which READ_THREADS are
    kept in flight ahead of the copy, across tensor boundaries (waiting for one tensor's last
    request before asking for the next tensor's left storage idle), through a thread pool (preadv
    releases the GIL), straight into the tensors. Each range is read into its own buffer, the range
    rounded out to DIRECT_ALIGN (offset, length and address aligned); EOF may cut that padding, never
    the range."""

    def __init__(self, path: Path, fd: int, reads: list[_Read], pool: ThreadPoolExecutor):
        self.path, self.fd, self.pool = path, fd, pool
        self.ranges = [(read.entry, offset, length) for read in reads for offset, length in read.ranges]
        self.buffers: dict[int, list] = {}     # range index: [aligned buffer, file start, requests left]
        self.jobs = self._jobs()
        self.short: dict[int, int] = {}        # range index: bytes before EOF, for a range it cuts
        self.inflight: dict = {}               # Future: job
        self.taken = 0                         # ranges handed out so far

    def _jobs(self) -> Iterator[tuple[int, int, int, int]]:
        """(range index, offset into its buffer, file offset, length), in file order; a range's
        buffer is allocated when its first request is asked for."""
        for index, (_, offset, length) in enumerate(self.ranges):
            start = offset - offset % DIRECT_ALIGN
            span = -(-(offset + length - start) // DIRECT_ALIGN) * DIRECT_ALIGN
            pieces = range(0, span, READ_CHUNK_BYTES)
            self.buffers[index] = [_empty(span), start, len(pieces)]
            for begin in pieces:
                yield index, begin, start + begin, min(READ_CHUNK_BYTES, span - begin)

    def take(self, read: _Read) -> list[torch.Tensor]:
        """The read's ranges, in order (reads are taken in the order they were given)."""
        out = []
        for _ in read.ranges:
            index, self.taken = self.taken, self.taken + 1
            while index not in self.buffers or self.buffers[index][2]:
                self._pump()
            buf, start, _ = self.buffers.pop(index)
            entry, offset, length = self.ranges[index]
            if index in self.short:
                raise CheckpointError(f"{entry.file}: truncated while reading {entry.name}: got {self.short[index]} "
                                      f"of {length} bytes at offset {offset}")
            out.append(buf[offset - start:offset - start + length])
        return out

    def _submit(self, job: tuple) -> None:
        index, begin, offset, length = job
        out = memoryview(self.buffers[index][0].numpy())[begin:begin + length]
        self.inflight[self.pool.submit(_pread_into, self.fd, out, offset)] = job

    def _pump(self) -> None:
        """Fill the queue to READ_THREADS requests, then wait for at least one to complete."""
        while len(self.inflight) < READ_THREADS:
            job = next(self.jobs, None)
            if job is None:
                break
            self._submit(job)
        if not self.inflight:
            raise RuntimeError("direct read queue: nothing in flight for a range not yet read")
        finished, _ = wait(list(self.inflight), return_when=FIRST_COMPLETED)
        for future in finished:
            self._complete(self.inflight.pop(future), future.result())

    def _complete(self, job: tuple, res: int) -> None:
        index, begin, offset, length = job
        if res < length:                                  # EOF: an error once this range is taken
            _, range_offset, range_length = self.ranges[index]
            if offset + res < range_offset + range_length:
                got = max(0, offset + res - range_offset)
                self.short[index] = min(got, self.short.get(index, got))
        self.buffers[index][2] -= 1

    def close(self) -> None:
        """Wait out the requests still in flight (a load stopped early, or failed)."""
        wait(list(self.inflight))
        self.inflight.clear()
        self.buffers.clear()


def _cached_share(fd: int, reads: list[_Read]) -> float:
    """Share of the reads' pages in the page cache (mincore on a mapping of the file); 0 when it
    cannot be told."""
    size = os.fstat(fd).st_size
    page = mmap.PAGESIZE
    total = cached = 0
    libc = _libc()
    try:
        libc.mmap.restype = ctypes.c_void_p
        address = libc.mmap(None, ctypes.c_size_t(size), mmap.PROT_READ, mmap.MAP_SHARED, fd, ctypes.c_long(0))
        if address in (None, ctypes.c_void_p(-1).value):
            return 0.0
    except (AttributeError, OSError):
        return 0.0
    try:
        for read in reads:
            for offset, length in read.ranges:
                start = offset - offset % page
                pages = -(-(offset + length - start) // page)
                vector = (ctypes.c_ubyte * pages)()
                if libc.mincore(ctypes.c_void_p(address + start), ctypes.c_size_t(pages * page), vector):
                    return 0.0
                total += pages
                cached += int(np.count_nonzero(np.frombuffer(vector, dtype=np.uint8) & 1))
    finally:
        libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(size))
    return cached / total if total else 0.0


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def _empty(nbytes: int) -> torch.Tensor:
    """Fresh uint8 memory for a read, 4 KiB aligned, and when large in 2 MiB pages
    (MADV_HUGEPAGE): faulting it in costs 512x fewer page faults, and an O_DIRECT request to
    it needs fewer segments."""
    if nbytes < 2 * HUGE_PAGE:
        raw = torch.empty(nbytes + DIRECT_ALIGN, dtype=torch.uint8)
        shift = -raw.data_ptr() % DIRECT_ALIGN
        return raw[shift:shift + nbytes]
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    shift = -raw.data_ptr() % HUGE_PAGE
    _madvise_hugepage(raw.data_ptr() + shift, nbytes - nbytes % HUGE_PAGE)
    return raw[shift:shift + nbytes]


def _madvise_hugepage(address: int, length: int) -> None:
    """A hint only (the memory is not touched yet): kernels without THP just use 4 KiB pages."""
    try:
        _libc().madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass


_LIBC = None


def _readahead_ends(reads: list[_Read]) -> dict[int, int]:
    """{range offset: where its kernel-readahead part ends} for ranges in long contiguous runs.

    Readahead is cheaper than asking for each page (large folios, no extra calls) but runs ahead
    of the read, up to about twice read_ahead_kb (16.8 MiB measured at 8 MiB); so each run of
    adjacent ranges ends with READAHEAD_TAIL_BYTES read exactly, prefetched before the readahead
    gets there (the readahead then stops at the cached pages). Mapped slabs are never in a run."""
    runs: list[list[tuple[int, int]]] = []                # adjacent (offset, length) ranges
    for read in reads:
        for offset, length in (read.ranges if read.narrow is None else ()):
            if runs and runs[-1][-1][0] + runs[-1][-1][1] == offset:
                runs[-1].append((offset, length))
            else:
                runs.append([(offset, length)])
    ends = {}
    for run in runs:
        cut = run[-1][0] + run[-1][1] - READAHEAD_TAIL_BYTES
        ends.update((offset, min(max(cut, offset), offset + length)) for offset, length in run)
    return ends


class _Prefetch:
    """Asks the kernel to start reading the exact ranges of one file up to PREFETCH_BYTES ahead of
    the copy. POSIX_FADV_WILLNEED only queues the reads (exactly those pages: no readahead); the
    kernel caps one call at the readahead size, hence calls of PREFETCH_CALL_BYTES."""

    def __init__(self, fd: int, ranges: list[tuple[int, int, int]]):
        """ranges: (position in the copy order, file offset, length), in copy order."""
        self.fd = fd
        self.calls = [(position + begin - offset, begin, min(PREFETCH_CALL_BYTES, offset + length - begin))
                      for position, offset, length in ranges
                      for begin in range(offset, offset + length, PREFETCH_CALL_BYTES)]
        self.next = 0

    def ahead_of(self, consumed: int) -> None:
        """`consumed`: bytes the copy has reached."""
        while self.next < len(self.calls) and self.calls[self.next][0] < consumed + PREFETCH_BYTES:
            _, begin, length = self.calls[self.next]
            _fadvise(self.fd, begin, length, os.POSIX_FADV_WILLNEED)
            self.next += 1


def split_dims(checkpoint: TextCheckpoint) -> dict[str, int | None]:
    """Each text tensor's tensor-parallel split dim from the model's name table (None: replicated)."""
    from inkling_hpu.model.weights import CHECKPOINT_TO_PORT      # the model package only for this

    rules = [(re.compile("^" + re.escape(r.checkpoint).replace(re.escape("{i}"), r"\d+") + "$"), r.dim)
             for r in CHECKPOINT_TO_PORT]
    dims = {}
    for name in checkpoint.text:
        matched = [dim for pattern, dim in rules if pattern.match(name)]
        if len(matched) != 1:
            raise CheckpointError(f"{name}: expected one rule of the port's name table to match, found {len(matched)}")
        dims[name] = matched[0]
    return dims


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_presharded(checkpoint_dir: str | os.PathLike, world_size: int) -> Path:
    """Write <checkpoint>/presharded-tp<N>/: per rank one file with only its slabs (read by this
    loader's own rank reads), then a manifest with each file's sha256, the split dims and the
    source checkpoint's fingerprint. The manifest comes last, so a layout without one is unused."""
    from safetensors.torch import save_file

    checkpoint = TextCheckpoint(checkpoint_dir)
    directory = checkpoint.dir / PRESHARDED_DIR.format(world_size=world_size)
    (directory / PRESHARDED_MANIFEST).unlink(missing_ok=True)
    dims = split_dims(checkpoint)
    specs = [TensorSpec(name, None, shard_dim=dim) for name, dim in dims.items()]
    hashes = {}
    for rank in range(world_size):
        rank_dir = directory / f"rank-{rank}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        tensors = dict(checkpoint.load(specs, rank=rank, world_size=world_size))
        save_file(tensors, rank_dir / "model.safetensors.partial", metadata={"rank": str(rank)})
        del tensors
        os.replace(rank_dir / "model.safetensors.partial", rank_dir / "model.safetensors")
        hashes[f"rank-{rank}/model.safetensors"] = _sha256(rank_dir / "model.safetensors")
    manifest = {"world_size": world_size, "source": checkpoint.fingerprint(), "shard_dims": dims, "sha256": hashes}
    (directory / (PRESHARDED_MANIFEST + ".partial")).write_text(json.dumps(manifest, indent=1))
    os.replace(directory / (PRESHARDED_MANIFEST + ".partial"), directory / PRESHARDED_MANIFEST)
    return directory


def verify_presharded(directory: str | os.PathLike) -> None:
    """Each rank file's sha256 against the manifest; CheckpointError names the file, expected and found."""
    directory = Path(directory)
    manifest = json.loads((directory / PRESHARDED_MANIFEST).read_text())
    for name, expected in manifest["sha256"].items():
        found = _sha256(directory / name)
        if found != expected:
            raise CheckpointError(f"{directory / name}: sha256 expected {expected} (manifest), found {found}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inkling_hpu.loader",
                                     description="Pre-sharded layout of a checkpoint's text tensors, one file per TP rank.")
    sub = parser.add_subparsers(dest="command", required=True)
    presplit = sub.add_parser("presplit", help="write <checkpoint>/presharded-tp<N>/ and verify it")
    presplit.add_argument("checkpoint", type=Path)
    presplit.add_argument("--tp", type=int, required=True, help="tensor-parallel size")
    verify = sub.add_parser("verify", help="check a pre-sharded layout's files against its manifest")
    verify.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    try:
        directory = write_presharded(args.checkpoint, args.tp) if args.command == "presplit" else args.directory
        verify_presharded(directory)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{directory}: verified against {PRESHARDED_MANIFEST}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
