"""One safetensors file's header: where each tensor lives (TensorEntry), beside what the model asks
for (TensorSpec) and the error both lead to (CheckpointError).

Safetensors layout: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}, then the data section; offsets are relative
to the data section, row-major, no padding.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

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
