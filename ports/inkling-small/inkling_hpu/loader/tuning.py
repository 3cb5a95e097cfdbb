"""Sizes, counts and thresholds of the loader's read paths.

The read paths read them from this module when they run (`tuning.READ_CHUNK_BYTES`), so setting
one here (a test's monkeypatch.setattr(tuning, ...)) takes effect in every module that uses it.
"""

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
