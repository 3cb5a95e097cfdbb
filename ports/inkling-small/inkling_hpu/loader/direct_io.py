"""The O_DIRECT path: a file's own ranges read by a thread pool, a fixed number of requests in
flight, straight into the tensors (_DirectQueue); and the share of a file's ranges the page cache
holds already (_cached_share), above which the default reads the file buffered instead."""
from __future__ import annotations

import ctypes
import mmap
import os
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from inkling_hpu.loader import tuning
from inkling_hpu.loader.buffers import _empty, _libc, _pread_into
from inkling_hpu.loader.header import CheckpointError
from inkling_hpu.loader.reads import _Read


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
            start = offset - offset % tuning.DIRECT_ALIGN
            span = -(-(offset + length - start) // tuning.DIRECT_ALIGN) * tuning.DIRECT_ALIGN
            pieces = range(0, span, tuning.READ_CHUNK_BYTES)
            self.buffers[index] = [_empty(span), start, len(pieces)]
            for begin in pieces:
                yield index, begin, start + begin, min(tuning.READ_CHUNK_BYTES, span - begin)

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
        while len(self.inflight) < tuning.READ_THREADS:
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
