"""Memory the reads land in (4 KiB aligned, 2 MiB pages when large), and the calls around it:
preadv until full, pieces joined by numpy, libc through ctypes."""
from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import torch

from inkling_hpu.loader import tuning


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


_LIBC = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def _empty(nbytes: int) -> torch.Tensor:
    """Fresh uint8 memory for a read, 4 KiB aligned, and when large in 2 MiB pages
    (MADV_HUGEPAGE): faulting it in costs 512x fewer page faults, and an O_DIRECT request to
    it needs fewer segments."""
    if nbytes < 2 * tuning.HUGE_PAGE:
        raw = torch.empty(nbytes + tuning.DIRECT_ALIGN, dtype=torch.uint8)
        shift = -raw.data_ptr() % tuning.DIRECT_ALIGN
        return raw[shift:shift + nbytes]
    raw = torch.empty(nbytes + tuning.HUGE_PAGE, dtype=torch.uint8)
    shift = -raw.data_ptr() % tuning.HUGE_PAGE
    _madvise_hugepage(raw.data_ptr() + shift, nbytes - nbytes % tuning.HUGE_PAGE)
    return raw[shift:shift + nbytes]


def _madvise_hugepage(address: int, length: int) -> None:
    """A hint only (the memory is not touched yet): kernels without THP just use 4 KiB pages."""
    try:
        _libc().madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass
