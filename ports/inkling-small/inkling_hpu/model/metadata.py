"""Per-step metadata for the Inkling forward, and its reference builder: `reference_step_metadata` builds it
in plain Python from per-request facts, any mix of prefill chunks and decodes in one step. The served
paths (HPU and vLLM's CPU worker) build it with tensor ops in device_metadata.py; this builder is the
reference the tests, the parity harness and the benchmarks use.

The forward takes flattened tokens (several requests, each prefilling a chunk or decoding one
token, in any mix) and this metadata. Every index is computed here, so the forward itself has
static shapes for a given padding and no data-dependent Python control flow.

Caches (see docs/caches.md):
- paged KV, one group for every layer: key/value[layer] is [num_blocks, block_size, kv_heads, head_dim],
  addressed through each request's block table; slot = block_id * block_size + position % block_size;
- short-conv state per KV block: conv[layer][stream] is [num_blocks, W-1, channels]. Row b holds the conv
  *inputs* of the W-1 positions ending at the last token written into block b (oldest first): for a
  full block, the snapshot at its 128-token boundary, which lives and is shared with the block's KV
  (prefix caching); for a request's last, partial block, its running state. A step reads each
  request's state from the block holding its last computed token and writes every block its chunk
  touches.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

CONV_STREAMS = ("k", "v", "attn", "mlp")


class MetadataError(ValueError):
    """A request description the metadata builder cannot turn into an exact step."""


@dataclass(frozen=True)
class RequestChunk:
    """One request's share of a step: its new tokens and where they go."""

    token_ids: Sequence[int]   # tokens computed this step (a prefill chunk, or one decode token)
    num_computed: int          # tokens of this request already in the caches (= position of token_ids[0])
    block_ids: Sequence[int]   # the request's block table (must cover num_computed + len(token_ids))


@dataclass
class AttentionGroup:
    """Requests whose queries are laid out as [requests, rows] for attention.

    Prefill chunks form one group (rows = longest chunk, padded); single-token steps (decodes) form
    another (rows = 1). Padding rows have position -1 and read token 0; their output is discarded.
    """

    is_decode: bool
    token_index: torch.Tensor   # [G, L] long: flat token of each query row
    positions: torch.Tensor     # [G, L] long: absolute position of each query row, -1 = padding
    block_table: torch.Tensor   # [G, NB] long: block ids (padding entries = pad block)

    @property
    def num_requests(self) -> int:
        return self.token_index.shape[0]

    @property
    def num_rows(self) -> int:
        return self.token_index.shape[1]


@dataclass
class FlatDecodeGroup:
    """Single-token queries over a flat block list: vllm-gaudi's decode layout, read as its flat paged
    attention reads it. Entry i of `block_list` is a block of request `block_request[i]` (padding:
    num_requests) at column `block_column[i]` of that request's table. Static shapes whatever the
    requests' lengths, and each block is attended once (no per-request table padded to the longest).
    The window_* lists (optional) hold only the local layers' decode window."""

    token_index: torch.Tensor      # [G] long: flat token of each request's query
    positions: torch.Tensor        # [G] long: its position, -1 = padding
    block_list: torch.Tensor       # [NB] long
    block_request: torch.Tensor    # [NB] long, num_requests = padding
    block_column: torch.Tensor     # [NB] long
    window_block_list: torch.Tensor | None = None
    window_block_request: torch.Tensor | None = None
    window_block_column: torch.Tensor | None = None
    is_decode: bool = True

    @property
    def num_requests(self) -> int:
        return self.token_index.shape[0]

    @property
    def num_rows(self) -> int:
        return 1


def flat_decode_group(group: AttentionGroup, pad_block_id: int) -> FlatDecodeGroup:
    """The same decode group in the flat layout (every column of every request's table; columns past
    a request's last block hold later positions and are masked). For tests of the two layouts."""
    num_requests, cols = group.block_table.shape
    request = torch.arange(num_requests)[:, None].expand(num_requests, cols)
    column = torch.arange(cols)[None, :].expand(num_requests, cols)
    return FlatDecodeGroup(token_index=group.token_index[:, 0], positions=group.positions[:, 0],
                           block_list=group.block_table.reshape(-1), block_request=request.reshape(-1),
                           block_column=column.reshape(-1))


@dataclass
class StepMetadata:
    block_size: int
    input_ids: torch.Tensor          # [T] long
    positions: torch.Tensor          # [T] long (padding tokens: -1)
    slot_mapping: torch.Tensor       # [T] long: KV slot of each token (padding: the pad block)
    conv_read_blocks: torch.Tensor   # [R] long: block holding each request's state (pad block: none)
    conv_tap_index: torch.Tensor     # [T, W-1] long into [x (T rows) | old state (R*(W-1) rows) | zero row]
    conv_write_blocks: torch.Tensor  # [Wr] long: blocks whose conv state this step writes (padding: pad block)
    conv_write_source: torch.Tensor  # [Wr, W-1] long into the same buffer: each written block's new state
    groups: list  # AttentionGroup or FlatDecodeGroup
    output_index: torch.Tensor       # [T] long into the concatenated, flattened group outputs
    last_token_index: torch.Tensor   # [R] long: flat index of each request's last new token (padding: 0)
    num_real_tokens: int = 0
    num_real_requests: int = 0
    chunks: list[RequestChunk] = field(default_factory=list, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device) -> "StepMetadata":
        """The same metadata with every tensor on `device`."""
        moved = {}
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device)
            elif name == "groups":
                moved[name] = [type(g)(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                                          for k, v in vars(g).items()}) for g in value]
            else:
                moved[name] = value
        return StepMetadata(**moved)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def reference_step_metadata(
    chunks: Sequence[RequestChunk],
    *,
    block_size: int,
    conv_kernel_size: int,
    pad_block_id: int,
    pad_tokens_to: int | None = None,
    pad_prefill_rows_to: int | None = None,
    pad_prefill_requests_to: int | None = None,
    pad_decode_requests_to: int | None = None,
    pad_blocks_to: int | None = None,
    pad_requests_to: int | None = None,
    pad_conv_writes_to: int | None = None,
) -> StepMetadata:
    """Flatten `chunks` (in the given order) into one step.

    pad_* give static shapes (the bucket): extra tokens, prefill rows, requests, block-table
    columns and conv-state writes are filled with padding that writes only to `pad_block_id`
    (reserve it: it holds garbage) and never reaches a real request's output.
    """
    if block_size <= 0:
        raise MetadataError(f"block_size must be > 0; found {block_size}")
    taps = conv_kernel_size - 1
    if not chunks:
        raise MetadataError("a step needs at least one request; found none")

    # --- tokens -------------------------------------------------------------------------------
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    owner: list[int] = []                 # request index of each token
    starts: list[int] = []                # flat index of each request's first token
    for r, chunk in enumerate(chunks):
        n = len(chunk.token_ids)
        if n == 0:
            raise MetadataError(f"request {r}: needs at least one new token; found 0")
        if chunk.num_computed < 0:
            raise MetadataError(f"request {r}: num_computed must be >= 0; found {chunk.num_computed}")
        end = chunk.num_computed + n
        if len(chunk.block_ids) * block_size < end:
            raise MetadataError(
                f"request {r}: block table covers {len(chunk.block_ids) * block_size} tokens, "
                f"needs {end} (num_computed {chunk.num_computed} + {n} new)")
        if pad_block_id in chunk.block_ids[: _ceil_div(end, block_size)]:
            raise MetadataError(f"request {r}: uses the pad block {pad_block_id}; it is reserved for padding")
        starts.append(len(input_ids))
        for i, token in enumerate(chunk.token_ids):
            pos = chunk.num_computed + i
            input_ids.append(int(token))
            positions.append(pos)
            slots.append(int(chunk.block_ids[pos // block_size]) * block_size + pos % block_size)
            owner.append(r)
    num_real = len(input_ids)
    num_tokens = num_real if pad_tokens_to is None else pad_tokens_to
    if num_tokens < num_real:
        raise MetadataError(f"pad_tokens_to={pad_tokens_to} is smaller than the {num_real} tokens of the step")
    pad_slot = pad_block_id * block_size
    for _ in range(num_tokens - num_real):
        input_ids.append(0)
        positions.append(-1)
        slots.append(pad_slot)
        owner.append(-1)

    # --- attention groups ---------------------------------------------------------------------
    prefill = [r for r, c in enumerate(chunks) if len(c.token_ids) > 1]
    decode = [r for r, c in enumerate(chunks) if len(c.token_ids) == 1]
    longest_table = max(_ceil_div(c.num_computed + len(c.token_ids), block_size) for c in chunks)
    num_table_cols = longest_table if pad_blocks_to is None else pad_blocks_to
    if num_table_cols < longest_table:
        raise MetadataError(f"pad_blocks_to={pad_blocks_to} is smaller than the longest block table ({longest_table})")

    def table_row(chunk: RequestChunk) -> list[int]:
        used = list(chunk.block_ids[: _ceil_div(chunk.num_computed + len(chunk.token_ids), block_size)])
        return used + [pad_block_id] * (num_table_cols - len(used))

    groups: list[AttentionGroup] = []
    output_index = [0] * num_tokens
    offset = 0
    for is_decode, members, pad_requests in (
        (False, prefill, pad_prefill_requests_to),
        (True, decode, pad_decode_requests_to),
    ):
        if not members and not pad_requests:
            continue
        rows = 1 if is_decode else max((len(chunks[r].token_ids) for r in members), default=1)
        if not is_decode and pad_prefill_rows_to is not None:
            if pad_prefill_rows_to < rows:
                raise MetadataError(f"pad_prefill_rows_to={pad_prefill_rows_to} is smaller than the longest chunk ({rows})")
            rows = pad_prefill_rows_to
        count = len(members) if pad_requests is None else pad_requests
        if count < len(members):
            kind = "decode" if is_decode else "prefill"
            raise MetadataError(f"pad_{kind}_requests_to={pad_requests} is smaller than the {len(members)} {kind} requests")
        token_index = torch.zeros(count, rows, dtype=torch.long)
        group_pos = torch.full((count, rows), -1, dtype=torch.long)
        table = torch.full((count, num_table_cols), pad_block_id, dtype=torch.long)
        for g, r in enumerate(members):
            n = len(chunks[r].token_ids)
            flat = torch.arange(starts[r], starts[r] + n)
            token_index[g, :n] = flat
            group_pos[g, :n] = torch.arange(chunks[r].num_computed, chunks[r].num_computed + n)
            table[g] = torch.tensor(table_row(chunks[r]), dtype=torch.long)
            for i in range(n):
                output_index[starts[r] + i] = offset + g * rows + i
        groups.append(AttentionGroup(is_decode, token_index, group_pos, table))
        offset += count * rows

    # --- conv taps and state ---------------------------------------------------------------------
    num_requests = len(chunks) if pad_requests_to is None else pad_requests_to
    if num_requests < len(chunks):
        raise MetadataError(f"pad_requests_to={pad_requests_to} is smaller than the {len(chunks)} requests")
    zero_row = num_tokens + num_requests * taps

    # Every block a chunk touches gets the W-1 conv inputs ending at its last written position. A block
    # is written by one request only: vLLM shares only full blocks, and nobody computes into those.
    writer: dict[int, tuple[int, int]] = {}         # block id -> (request, end position in the block)
    for r, chunk in enumerate(chunks):
        end = chunk.num_computed + len(chunk.token_ids)
        for column in range(chunk.num_computed // block_size, _ceil_div(end, block_size)):
            block = int(chunk.block_ids[column])
            if block in writer:
                raise MetadataError(f"request {r}: computes into block {block}, which request {writer[block][0]} "
                                    "of the same step also computes into; a block's conv state has one writer")
            writer[block] = (r, min(end, (column + 1) * block_size))
    read_blocks = []
    for chunk in chunks:
        c = chunk.num_computed
        read_blocks.append(int(chunk.block_ids[(c - 1) // block_size]) if c > 0 else pad_block_id)
    written: dict[int, list[int]] = {}

    def write_rows(block: int) -> list[int]:
        """The W-1 source rows that become `block`'s conv state."""
        if block not in written:
            r, block_end = writer[block]
            written[block] = [source_of(r, block_end - taps + k) for k in range(taps)]
        return written[block]

    def source_of(r: int, pos: int) -> int:
        """Where the conv input of request r at absolute position `pos` is found this step."""
        chunk = chunks[r]
        if pos < 0:
            return zero_row
        if pos >= chunk.num_computed:                       # computed in this step
            return starts[r] + pos - chunk.num_computed
        back = chunk.num_computed - pos                      # 1..taps tokens before the chunk
        if back > taps:
            raise AssertionError("tap older than the conv state")
        block = read_blocks[r]
        if block in writer and writer[block][0] != r:
            # Another request of this step fills this block (a prefix-cache hit on a block computed in
            # the same step): take its inputs straight from this step's rows, not the stale state.
            return write_rows(block)[taps - back]
        return num_tokens + r * taps + (taps - back)         # state rows are oldest first

    write_blocks = list(writer)
    write_rows_list = [write_rows(block) for block in write_blocks]
    tap_index = torch.full((num_tokens, taps), zero_row, dtype=torch.long)
    for t in range(num_real):
        r, pos = owner[t], positions[t]
        for k in range(taps):                                # tap k reads position pos - taps + k
            tap_index[t, k] = source_of(r, pos - taps + k)

    num_writes = len(write_blocks) if pad_conv_writes_to is None else pad_conv_writes_to
    if num_writes < len(write_blocks):
        raise MetadataError(f"pad_conv_writes_to={pad_conv_writes_to} is smaller than the {len(write_blocks)} "
                            "blocks this step writes")
    write_source = torch.full((num_writes, taps), zero_row, dtype=torch.long)
    for w, rows_of_block in enumerate(write_rows_list):
        write_source[w] = torch.tensor(rows_of_block, dtype=torch.long)
    write_blocks += [pad_block_id] * (num_writes - len(write_blocks))

    last = [starts[r] + len(c.token_ids) - 1 for r, c in enumerate(chunks)]
    last_token_index = torch.tensor(last + [0] * (num_requests - len(chunks)), dtype=torch.long)
    read_blocks += [pad_block_id] * (num_requests - len(chunks))
    return StepMetadata(
        block_size=block_size,
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        conv_read_blocks=torch.tensor(read_blocks, dtype=torch.long),
        conv_tap_index=tap_index,
        conv_write_blocks=torch.tensor(write_blocks, dtype=torch.long),
        conv_write_source=write_source,
        groups=groups,
        output_index=torch.tensor(output_index, dtype=torch.long),
        last_token_index=last_token_index,
        num_real_tokens=num_real,
        num_real_requests=len(chunks),
        chunks=list(chunks),
    )
