"""Read planning: the byte ranges each tensor, or a tensor-parallel rank's slab of it, needs
(one range, strided pieces, or the whole tensor to copy the slab out of), and its shape."""
from __future__ import annotations

import math
from dataclasses import dataclass

from inkling_hpu.loader import tuning
from inkling_hpu.loader.header import SAFETENSORS_DTYPES, CheckpointError, TensorEntry, TensorSpec


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
    if outer == 1 or piece >= tuning.MIN_STRIDED_PIECE_BYTES:
        return _Read(entry, tuple((first + i * stride, piece) for i in range(outer)), out_shape)
    return _Read(entry, ((entry.begin, entry.nbytes),), shape, narrow=(dim, rank * part, part), shared=True)
