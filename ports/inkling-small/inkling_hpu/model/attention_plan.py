"""Attention plans: which KV blocks each query chunk reads, and the masks and bias indices for them.

A plan depends only on the step metadata and the layer kind (heads, window, rel extent, log
scaling), so the model builds it once per forward and layer kind and every layer of that kind shares
it. A sliding-window layer's plan reads only the KV blocks that hold keys inside its queries' window.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from inkling_hpu.model.knobs import Knobs
from inkling_hpu.model.metadata import AttentionGroup

BIAS_BYTES_PER_ELEMENT = 4  # the bias block is accumulated in fp32 for the budget's purpose


@dataclass(frozen=True)
class AttentionKind:
    num_heads: int                 # query heads on this rank
    window: int | None             # sliding window (local layers) or None (global)
    rel_extent: int                # distances [0, rel_extent) get a bias
    log_scaling_n_floor: int | None
    log_scaling_alpha: float


@dataclass
class ChunkPlan:
    row_start: int                 # query rows [row_start, row_end) of the group
    row_end: int
    block_index: torch.Tensor      # [G * nb] block ids to gather from the cache
    num_keys: int                  # nb * block_size
    masked: torch.Tensor           # [G, 1, Lc, S] bool: True = not attended
    bias_index: torch.Tensor       # [G, Lc, S] long: row of rel logits viewed as [G*Lc*E, heads]
    bias_valid: torch.Tensor       # [G, 1, Lc, S] bool: distance in [0, rel_extent)
    tau: torch.Tensor | None       # [G, Lc] fp32 log-scaling factor (global layers), else None


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def blocks_for_rows(kind: AttentionKind, num_rows: int, block_size: int, table_cols: int) -> int:
    """Blocks a chunk of `num_rows` consecutive queries can touch inside a sliding window.

    Keys span positions [first - window + 1, last]: num_rows + window - 1 positions, which
    straddle at most ceil((num_rows + window - 2) / block_size) + 1 blocks. For a decode row and
    window 512, block 128: ceil(511/128) + 1 = 5.
    """
    assert kind.window is not None
    needed = _ceil_div(num_rows + kind.window - 2, block_size) + 1
    return min(needed, table_cols)


def _chunk_rows(group: AttentionGroup, kind: AttentionKind, block_size: int, knobs: Knobs,
                windowed: bool) -> int:
    """Query rows per chunk so the bias block stays under INKLING_PREFILL_BIAS_BUDGET."""
    rows, cols = group.num_rows, group.block_table.shape[1]
    budget = knobs.prefill_bias_budget
    if group.is_decode or budget <= 0:
        return rows

    def cost(lc: int) -> int:   # bytes of the bias block [G, H, Lc, S]
        nb = blocks_for_rows(kind, lc, block_size, cols) if windowed else cols
        return group.num_requests * kind.num_heads * lc * nb * block_size * BIAS_BYTES_PER_ELEMENT

    lo, hi = 1, rows                         # largest lc with cost(lc) <= budget (cost is monotone)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_group(group: AttentionGroup, kind: AttentionKind, block_size: int, knobs: Knobs) -> list[ChunkPlan]:
    windowed = kind.window is not None
    rows_per_chunk = _chunk_rows(group, kind, block_size, knobs, windowed)
    plans = []
    for start in range(0, group.num_rows, rows_per_chunk):
        end = min(start + rows_per_chunk, group.num_rows)
        plans.append(_plan_chunk(group, kind, block_size, start, end, windowed))
    return plans


def _plan_chunk(group: AttentionGroup, kind: AttentionKind, block_size: int, row_start: int,
                row_end: int, windowed: bool) -> ChunkPlan:
    device = group.positions.device
    num_requests, cols = group.block_table.shape
    q_pos = group.positions[:, row_start:row_end]                      # [G, Lc]
    lc = row_end - row_start

    nb = blocks_for_rows(kind, lc, block_size, cols) if windowed else cols
    if windowed and nb < cols:
        # first block holding a key inside the window of the chunk's first (valid) query
        first_query = q_pos[:, 0].clamp(min=0)
        base = torch.div(first_query - kind.window + 1, block_size, rounding_mode="floor").clamp(min=0)
    else:
        nb = cols
        base = torch.zeros(num_requests, dtype=torch.long, device=device)
    table_col = base[:, None] + torch.arange(nb, device=device)[None, :]            # [G, nb]
    flat_col = torch.arange(num_requests, device=device)[:, None] * cols + table_col.clamp(max=cols - 1)
    block_index = group.block_table.reshape(-1).index_select(0, flat_col.reshape(-1))
    # positions come from the unclamped column: a clamped duplicate lies past the query and is masked
    key_pos = (table_col[:, :, None] * block_size
               + torch.arange(block_size, device=device)[None, None, :]).reshape(num_requests, nb * block_size)

    distance = q_pos[:, :, None] - key_pos[:, None, :]                               # [G, Lc, S]
    masked = (distance < 0) | (q_pos < 0)[:, :, None]
    is_local = kind.window is not None
    if is_local:
        masked = masked | (distance >= kind.window)
    bias_valid = (distance >= 0) & (distance < kind.rel_extent)
    clamped = distance.clamp(0, kind.rel_extent - 1)
    # one index per (request, query row, key), shared by all heads: rows of rel logits [G*Lc*E, H]
    row_base = (torch.arange(num_requests, device=device)[:, None] * lc
                + torch.arange(lc, device=device)[None, :]) * kind.rel_extent            # [G, Lc]
    bias_index = row_base[:, :, None] + clamped

    tau = None
    if not is_local and kind.log_scaling_n_floor is not None:
        effective = (q_pos + 1).to(torch.float32)
        tau = 1.0 + kind.log_scaling_alpha * torch.log((effective / kind.log_scaling_n_floor).clamp(min=1.0))
    return ChunkPlan(row_start, row_end, block_index, nb * block_size, masked[:, None], bias_index,
                     bias_valid[:, None], tau)


def plan_step(groups: list[AttentionGroup], kind: AttentionKind, block_size: int,
              knobs: Knobs) -> list[list[ChunkPlan]]:
    """Plans for every attention group of a step, for one layer kind (flat decode groups need none)."""
    return [plan_group(group, kind, block_size, knobs) if isinstance(group, AttentionGroup) else None
            for group in groups]

