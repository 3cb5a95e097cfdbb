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

Modules, in the order a load runs through them:
  header       safetensors header -> TensorEntry; TensorSpec, CheckpointError
  checkpoint   TextCheckpoint: the directory's text tensors by header, load()
  reads        each tensor's (or rank slab's) byte ranges
  file_reader  read_tensors, file by file: buffered (readahead, then exact prefetch), or
  direct_io    O_DIRECT from a thread pool, requests kept in flight
  buffers      the memory reads land in, preadv, libc
  tuning       chunk, window and thread sizes: set them there (tests do) to change them everywhere
  presharded   the pre-sharded layout and `python -m inkling_hpu.loader presplit|verify`
The names of the checkpoint's text and skipped tensors: inkling_hpu.checkpoint_names.
"""
from inkling_hpu.checkpoint_names import SKIPPED_PREFIXES, TEXT_PREFIX, is_skipped
from inkling_hpu.loader.checkpoint import PRESHARDED_DIR, PRESHARDED_MANIFEST, TextCheckpoint
from inkling_hpu.loader.header import (MAX_HEADER_BYTES, SAFETENSORS_DTYPES, CheckpointError, TensorEntry,
                                       TensorSpec, read_header)
from inkling_hpu.loader.presharded import main, split_dims, verify_presharded, write_presharded

__all__ = [
    "TEXT_PREFIX", "SKIPPED_PREFIXES", "is_skipped", "SAFETENSORS_DTYPES", "MAX_HEADER_BYTES",
    "PRESHARDED_DIR", "PRESHARDED_MANIFEST", "CheckpointError", "TensorEntry", "TensorSpec", "read_header",
    "TextCheckpoint", "split_dims", "write_presharded", "verify_presharded", "main",
]
