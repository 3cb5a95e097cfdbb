"""Reading the planned byte ranges, file by file (read_tensors): one _FileReader a file, which sends
the rank's own ranges down the O_DIRECT path (direct_io.py) or reads them buffered, with the
kernel's readahead stopped short of the skipped tensors and the rest prefetched exactly."""
from __future__ import annotations

import itertools
import math
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from inkling_hpu.loader import tuning
from inkling_hpu.loader.buffers import _concat, _empty, _pread_into
from inkling_hpu.loader.direct_io import _cached_share, _DirectQueue
from inkling_hpu.loader.header import SAFETENSORS_DTYPES, CheckpointError, TensorEntry
from inkling_hpu.loader.reads import _Read


def read_tensors(reads: list[_Read], direct: bool | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (checkpoint name, tensor) for each planned read, in the order given (grouped by file);
    direct as TextCheckpoint.load takes it. The O_DIRECT requests' thread pool lives as long as this."""
    pool = ThreadPoolExecutor(tuning.READ_THREADS, thread_name_prefix="inkling-load") if direct is not False else None
    try:
        for path, group in itertools.groupby(reads, key=lambda read: read.entry.file):
            file_reads = list(group)
            with _FileReader(path, file_reads, direct, pool) as reader:
                for read in file_reads:
                    yield read.entry.name, reader.read(read)
    finally:
        if pool is not None:
            pool.shutdown()


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

    O_DIRECT (direct=True, or the default where the file's own bytes are not mostly cached): the
    rank's own slabs (not the shared bytes, which still go through the page cache) are read in
    READ_CHUNK_BYTES requests straight into the tensors, READ_THREADS in flight and kept in flight
    across tensor boundaries (_DirectQueue). File systems without O_DIRECT (e.g. ramfs) are read
    buffered."""

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
            if (self.direct_fd is not None and direct is None
                    and _cached_share(self.fd, own) > tuning.CACHED_SHARE_BUFFERED):
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
        for start in range(0, len(out), tuning.READ_CHUNK_BYTES):
            end = min(start + tuning.READ_CHUNK_BYTES, len(out))
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
        cut = run[-1][0] + run[-1][1] - tuning.READAHEAD_TAIL_BYTES
        ends.update((offset, min(max(cut, offset), offset + length)) for offset, length in run)
    return ends


class _Prefetch:
    """Asks the kernel to start reading the exact ranges of one file up to PREFETCH_BYTES ahead of
    the copy. POSIX_FADV_WILLNEED only queues the reads (exactly those pages: no readahead); the
    kernel caps one call at the readahead size, hence calls of PREFETCH_CALL_BYTES."""

    def __init__(self, fd: int, ranges: list[tuple[int, int, int]]):
        """ranges: (position in the copy order, file offset, length), in copy order."""
        self.fd = fd
        self.calls = [(position + begin - offset, begin, min(tuning.PREFETCH_CALL_BYTES, offset + length - begin))
                      for position, offset, length in ranges
                      for begin in range(offset, offset + length, tuning.PREFETCH_CALL_BYTES)]
        self.next = 0

    def ahead_of(self, consumed: int) -> None:
        """`consumed`: bytes the copy has reached."""
        while self.next < len(self.calls) and self.calls[self.next][0] < consumed + tuning.PREFETCH_BYTES:
            _, begin, length = self.calls[self.next]
            _fadvise(self.fd, begin, length, os.POSIX_FADV_WILLNEED)
            self.next += 1
