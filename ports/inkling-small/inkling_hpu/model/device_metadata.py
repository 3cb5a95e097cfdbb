"""StepMetadata built on the device with tensor ops from vllm-gaudi's bucketed inputs: no read-back, every
shape from the bucketed input shapes, so HPU graphs see static shapes.

vllm-gaudi runs prefills and decodes as separate forward calls: prefill [bs, L] with each row's context
blocks (block_list [bs * context bucket]) and context length; decode [bs, 1] with a flat block_list
and block_groups (the request of each block; HpuModelAdapter turns padding into bs). A prefill row
with context is always alone in its call (_can_merge_prefill_contents), so no row of a call reads a
block another row of the same call writes (the host builder, metadata.reference_step_metadata, handles
that case too: vLLM's CPU worker mixes prefills and decodes in one packed call).
"""
from __future__ import annotations

import torch

from inkling_hpu.model.metadata import AttentionGroup, FlatDecodeGroup, StepMetadata


def prefill_step_metadata(input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                          context_lens: torch.Tensor, block_list: torch.Tensor | None, *, block_size: int,
                          pad_block: int, taps: int) -> StepMetadata:
    # shapes from positions, which vllm-gaudi never flattens (input_ids are, for some models)
    bs, length = positions.shape[0], positions.numel() // positions.shape[0]
    device, num_tokens = input_ids.device, input_ids.numel()
    pos = positions.reshape(bs, length).long()
    valid = pos >= 0
    ctx = context_lens.reshape(bs).long()
    context_cols = 0 if block_list is None else block_list.numel() // bs
    cols = context_cols + -(-length // block_size) + 1      # the last column is never real: a dump
    table = torch.full((bs, cols), pad_block, dtype=torch.long, device=device)
    if context_cols:
        context = block_list.reshape(bs, context_cols).long()
        table[:, :context_cols] = torch.where(context >= 0, context, pad_block)
    slots = slot_mapping.reshape(bs, length).long()
    table.scatter_(1, torch.where(valid, pos // block_size, cols - 1), torch.where(valid, slots // block_size, pad_block))
    row = torch.arange(bs, device=device)

    zero = num_tokens + bs * taps
    tap = torch.arange(taps, device=device)

    def source(r, position, start):
        """Row of the conv input at `position` for row r whose chunk starts at `start`."""
        offset = position - start
        state = num_tokens + r * taps + offset + taps       # state rows hold start-taps .. start-1
        return torch.where(offset >= 0, r * length + offset, torch.where(position < 0, zero, state))

    chunk_pos = ctx[:, None, None] + torch.arange(length, device=device)[None, :, None] - taps + tap   # [bs, L, taps]
    tap_index = torch.where(valid[:, :, None], source(row[:, None, None], chunk_pos, ctx[:, None, None]), zero)
    read_blocks = torch.where(ctx > 0, table.gather(1, ((ctx - 1).clamp(min=0) // block_size)[:, None])[:, 0],
                              pad_block)
    # every block the chunk touches: at most ceil(L / block) + 1 per row
    num_new = valid.sum(dim=1)
    end = ctx + num_new
    column = ctx[:, None] // block_size + torch.arange(-(-length // block_size) + 1, device=device)[None, :]
    written = (num_new[:, None] > 0) & (column * block_size < end[:, None])
    block_end = torch.minimum(end[:, None], (column + 1) * block_size)
    write_blocks = torch.where(written, table.gather(1, column.clamp(max=cols - 1)), pad_block)
    write_pos = block_end[:, :, None] - taps + tap
    write_source = torch.where(written[:, :, None], source(row[:, None, None], write_pos, ctx[:, None, None]), zero)
    group = AttentionGroup(False, torch.arange(num_tokens, device=device).view(bs, length), pos, table)
    return StepMetadata(
        block_size=block_size, input_ids=torch.where(valid, input_ids.reshape(bs, length).long(), 0).reshape(-1),
        positions=pos.reshape(-1), slot_mapping=torch.where(valid, slots, pad_block * block_size).reshape(-1),
        conv_read_blocks=read_blocks, conv_tap_index=tap_index.reshape(num_tokens, taps),
        conv_write_blocks=write_blocks.reshape(-1), conv_write_source=write_source.reshape(-1, taps),
        groups=[group], output_index=torch.arange(num_tokens, device=device),
        last_token_index=torch.zeros(bs, dtype=torch.long, device=device), num_real_tokens=num_tokens,
        num_real_requests=bs)


def check_context_blocks(context_lens: torch.Tensor, block_list: torch.Tensor | None, block_size: int) -> None:
    """INKLING_GLUE_CHECKS=1 (debugging; reads the metadata back, one sync per prefill call): refuse a
    prefill chunk whose context blocks vllm-gaudi left out (a prompt bucket with no room for them),
    which attention would otherwise read from the pad block."""
    lens = context_lens.cpu().tolist()
    context = (block_list.view(len(lens), -1).cpu() if block_list is not None
               else torch.empty(len(lens), 0, dtype=torch.long))
    for row, ctx in enumerate(lens):
        needed = -(-ctx // block_size)
        if needed > context.shape[1] or (needed and (context[row, :needed] < 0).any()):
            raise RuntimeError(
                f"Inkling: a prefill chunk at position {ctx} came without the block ids of its context: expected "
                f"{needed} context blocks, found {min(int((context[row] >= 0).sum()), needed)} (block_list "
                f"{'absent' if block_list is None else 'short'}); the prompt bucket vllm-gaudi chose has no room.")


def _flat_columns(owner: torch.Tensor, last_column: torch.Tensor, num_requests: int) -> torch.Tensor:
    """Column in its request's block table of each entry of a flat block list whose entries are each
    request's last blocks, in order (the full table, or the decode window's tail)."""
    index = torch.arange(owner.shape[0], device=owner.device)
    count = torch.zeros(num_requests + 1, dtype=torch.long, device=owner.device).index_add(0, owner, torch.ones_like(owner))
    first = torch.full((num_requests + 1,), owner.shape[0], dtype=torch.long, device=owner.device).scatter_reduce(
        0, owner, index, reduce="amin")
    within = index - first.index_select(0, owner)
    return last_column.index_select(0, owner) - (count.index_select(0, owner) - 1 - within)


def decode_step_metadata(input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                         block_list: torch.Tensor, block_groups: torch.Tensor, window_block_list: torch.Tensor | None,
                         window_block_groups: torch.Tensor | None, *, block_size: int, pad_block: int,
                         taps: int) -> StepMetadata:
    bs = positions.shape[0]
    device = input_ids.device

    def owners(groups: torch.Tensor) -> torch.Tensor:
        groups = groups.long()
        return torch.where((groups >= 0) & (groups < bs), groups, bs)   # bs = padding

    owner = owners(block_groups)
    has_blocks = torch.zeros(bs + 1, dtype=torch.long, device=device).index_add(0, owner, torch.ones_like(owner))[:bs] > 0
    pos = torch.where(has_blocks, positions.reshape(bs, -1)[:, 0].long(), -1)
    last_column = torch.cat([pos.clamp(min=0) // block_size, pos.new_zeros(1)])
    column = _flat_columns(owner, last_column, bs)
    blocks = torch.where(owner < bs, block_list.long(), pad_block)
    window = (None, None, None)
    if window_block_list is not None:
        window_owner = owners(window_block_groups)
        window = (torch.where(window_owner < bs, window_block_list.long(), pad_block), window_owner,
                  _flat_columns(window_owner, last_column, bs))
    slot = torch.where(has_blocks, slot_mapping.reshape(bs, -1)[:, 0].long(), pad_block * block_size)
    current = slot // block_size
    # the block before the current one (a request at a block boundary reads its state there)
    is_previous = (owner < bs) & (column == last_column.index_select(0, owner) - 1)
    previous = torch.full((bs + 1,), pad_block, dtype=torch.long, device=device).scatter(
        0, torch.where(is_previous, owner, bs), blocks)[:bs]
    read_blocks = torch.where(pos % block_size != 0, current, previous)
    read_blocks = torch.where(pos > 0, read_blocks, pad_block)

    zero = bs + bs * taps
    row = torch.arange(bs, device=device)[:, None]
    tap = torch.arange(taps, device=device)[None, :]
    state = bs + row * taps + tap                        # state rows hold positions p-taps .. p-1
    tap_index = torch.where(pos[:, None] - taps + tap >= 0, state, zero)
    # new state: positions p-taps+1 .. p = state rows 1.. and the token itself
    shifted = torch.cat([state[:, 1:], row], dim=1)
    write_source = torch.where(pos[:, None] - taps + 1 + tap >= 0, shifted, zero)
    write_source = torch.where(has_blocks[:, None], write_source, zero)
    group = FlatDecodeGroup(token_index=torch.arange(bs, device=device), positions=pos, block_list=blocks,
                            block_request=owner, block_column=column, window_block_list=window[0],
                            window_block_request=window[1], window_block_column=window[2])
    return StepMetadata(
        block_size=block_size, input_ids=torch.where(has_blocks, input_ids.reshape(bs, -1)[:, 0].long(), 0),
        positions=pos, slot_mapping=slot, conv_read_blocks=read_blocks,
        conv_tap_index=torch.where(has_blocks[:, None], tap_index, zero), conv_write_blocks=torch.where(has_blocks, current, pad_block),
        conv_write_source=write_source, groups=[group], output_index=torch.arange(bs, device=device),
        last_token_index=torch.zeros(bs, dtype=torch.long, device=device), num_real_tokens=bs, num_real_requests=bs)
