"""The vllm-gaudi glue: the class vLLM builds for Inkling on HPU (HpuModelAdapter wraps it).

All math is in inkling_hpu.model. This module only translates between vLLM / vllm-gaudi and it:
- the vLLM config -> InklingPortConfig, the TP group's collectives, the start-up guards;
- the checkpoint -> parameters, through inkling_hpu.loader (text tensors only, this rank's slabs);
- vLLM's KV cache -> the model's paged KV: one vLLM `Attention` per decoder layer holds the layer's
  cache, so vllm-gaudi's get_kv_cache_spec gives every layer a FullAttentionSpec at block 128 (one
  KV group, FullAttentionSpecx<layers>); local layers apply their window inside attention;
- vllm-gaudi's per-step attention metadata (HPUAttentionMetadataV1, prompt or decode) -> the
  model's explicit StepMetadata (RequestChunk per request).
Importing it needs torch and vLLM, not Habana: nothing here calls a Habana API.

On CPU, tests/cpu/test_plugin.py runs this class inside vllm-gaudi's real HPUModelRunner and
HpuModelAdapter (the CPU harness): fp32 greedy tokens equal transformers'. Not exercised there:
Habana kernels and graphs, TP collectives, the KV allocation of initialize_kv_cache.
"""
from __future__ import annotations

import logging
import os
from typing import Iterable

import torch
from torch import nn

from inkling_hpu import guards
from inkling_hpu.loader import TensorSpec, TextCheckpoint
from inkling_hpu.model import InklingForCausalLM, InklingPortConfig, RequestChunk, TensorParallel, build_step_metadata
from inkling_hpu.model import weights as weight_table
from inkling_hpu.model.modeling import InklingCaches, LayerCache

logger = logging.getLogger("inkling_hpu")


def _rank_and_collectives() -> TensorParallel:
    from vllm.distributed import (get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size,
                                  tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce)

    size = get_tensor_model_parallel_world_size()
    if size == 1:
        return TensorParallel()
    return TensorParallel(rank=get_tensor_model_parallel_rank(), size=size,
                          all_reduce=tensor_model_parallel_all_reduce,
                          all_gather_last_dim=lambda t: tensor_model_parallel_all_gather(t, dim=-1))


def _gaudi_runtime_config():
    """vllm-gaudi's resolved runtime flags (contiguous PA, merged prefill), when installed."""
    try:
        from vllm_gaudi.extension.runtime import get_config
    except ImportError:
        return None
    return get_config()


def load_text_checkpoint(model: InklingForCausalLM, checkpoint_dir: str | os.PathLike) -> TextCheckpoint:
    """Fill `model` (this rank's shapes, model.tp) from the checkpoint's `model.llm.*` tensors.

    The loader reads only this rank's slab of each split tensor (the split dims come from the
    model's name table), which is then loaded as a one-rank tensor. Every required tensor must be
    present and every text tensor must be expected, or CheckpointError names what differs."""
    checkpoint = TextCheckpoint(checkpoint_dir)
    tp = model.tp
    specs = []
    for name in weight_table.expected_checkpoint_names(model.config, include_optional=True):
        rule, _ = weight_table.resolve(name, model.config)
        specs.append(TensorSpec(name, None, shard_dim=rule.dim if tp.size > 1 else None, optional=rule.optional))
    for name, piece in checkpoint.load(specs, rank=tp.rank, world_size=tp.size):
        weight_table.load_tensor(model, name, piece, tp_rank=0, tp_size=1)
    return checkpoint


class HpuInklingForCausalLM(nn.Module):
    """vLLM model class for Inkling on HPU: forward(input_ids, positions) -> hidden states."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        from vllm.model_executor.layers.attention import Attention

        guards.check(guards.settings_from_vllm_config(vllm_config, gaudi_runtime_config=_gaudi_runtime_config()))
        self.vllm_config = vllm_config
        self.config = InklingPortConfig.from_object(vllm_config.model_config.hf_config)
        self.tp = _rank_and_collectives()
        self.inkling = InklingForCausalLM(self.config, tp=self.tp)
        self.inkling.cast(vllm_config.model_config.dtype)
        self.block_size = vllm_config.cache_config.block_size
        # One vLLM Attention per layer: it only holds the layer's KV cache (never called). Each
        # declares the bytes of conv state the layer keeps per KV block, which the runner patch
        # conv-snapshot-pages adds to the layer's KV page (vLLM sizes the pool with them).
        self.kv_holders = nn.ModuleList()
        dtype_bytes = torch.empty(0, dtype=self.inkling.dtype).element_size()
        taps = self.config.conv_kernel_size - 1
        for i, layer in enumerate(self.inkling.model.layers):
            attn = layer.self_attn
            holder = Attention(
                num_heads=attn.num_heads, head_size=attn.head_dim, scale=1.0 / attn.head_dim,
                num_kv_heads=attn.num_key_value_heads, cache_config=vllm_config.cache_config,
                prefix=f"{prefix}model.layers.{i}.self_attn.attn")
            holder.extra_bytes_per_block = taps * sum(self.inkling.conv_channels(i).values()) * dtype_bytes
            self.kv_holders.append(holder)
        # Conv state per KV block (docs/caches.md), allocated next to the bound KV cache.
        self._conv_state: list[dict[str, torch.Tensor]] | None = None
        self._logged_kv_line = False

    # --- weights --------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the text tensors ourselves and leave vLLM's iterator unstarted.

        vLLM's DefaultModelLoader hands us a generator over every tensor of every file (vision,
        audio and MTP included); a generator that is never iterated reads nothing."""
        del weights
        checkpoint = load_text_checkpoint(self.inkling, self._checkpoint_dir())
        logger.info("Inkling: loaded %.1f GB of text tensors from %s; %d vision/audio/MTP tensors left unread",
                    checkpoint.text_bytes / 1e9, checkpoint.dir, len(checkpoint.skipped))
        return {name for name, _ in self.named_parameters()}

    def _checkpoint_dir(self) -> str:
        model = self.vllm_config.model_config.model
        if os.path.isdir(model):
            return model
        from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf

        return download_weights_from_hf(model, self.vllm_config.load_config.download_dir, ["*.safetensors"],
                                        revision=self.vllm_config.model_config.revision,
                                        ignore_patterns=["mtp.safetensors"])

    # --- caches ---------------------------------------------------------------------------------
    def _caches(self) -> tuple[InklingCaches, int]:
        """The model's view of vLLM's KV cache (bound by the runner) and the pad block id."""
        layers, pad_block = [], None
        for i, holder in enumerate(self.kv_holders):
            cache = holder.kv_cache[0] if isinstance(holder.kv_cache, list) else holder.kv_cache
            # vllm-gaudi binds (key, value, key_scales, value_scales), each cache
            # [(num_blocks + 1) * block, kv_heads, dim]: the extra last block is its pad block.
            key, value = cache[0], cache[1]
            num_blocks = key.shape[0] // self.block_size
            if self._conv_state is None or self._conv_state[0]["k"].shape[0] != num_blocks:
                self._conv_state = self.inkling.allocate_conv_state(num_blocks, device=key.device)
            shape = (num_blocks, self.block_size) + tuple(key.shape[1:])
            layers.append(LayerCache(key=key.view(shape), value=value.view(shape), conv=self._conv_state[i]))
            pad_block = num_blocks - 1                     # vllm-gaudi's _PAD_BLOCK_ID: the last block
        if not self._logged_kv_line:
            # The memory guard on the pool vLLM really allocated (vllm-gaudi adds one pad block).
            max_model_len = self.vllm_config.model_config.max_model_len
            refusal = guards.kv_pool_refusal(pad_block, self.block_size, max_model_len)
            if refusal:
                raise guards.InklingConfigRefused("Inkling-Small refuses to start: " + refusal)
            logger.info("Inkling KV cache: 1 KV group (FullAttentionSpecx%d); %s", len(layers),
                        guards.kv_pool_line(pad_block, self.block_size, max_model_len))
            shapes = [(layer.self_attn.num_key_value_heads, layer.self_attn.head_dim)
                      for layer in self.inkling.model.layers]
            logger.info("Inkling %s", guards.conv_snapshot_line(
                shapes, self.config.hidden_size, self.config.conv_kernel_size, self.block_size,
                torch.empty(0, dtype=self.inkling.dtype).element_size(), pad_block))
            self._logged_kv_line = True
        return InklingCaches(block_size=self.block_size, layers=layers), pad_block

    # --- forward --------------------------------------------------------------------------------
    def _chunks(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> list[tuple[int, RequestChunk]]:
        """(row, RequestChunk) per real request of the step, from vllm-gaudi's metadata (on CPU)."""
        ids, pos = input_ids.cpu(), positions.cpu()
        block = self.block_size
        chunks = []
        if meta.is_prompt:
            query_lens = meta.seq_lens_tensor.cpu().tolist()
            context_lens = meta.context_lens_tensor.cpu().tolist()
            slots = meta.slot_mapping.view(len(query_lens), -1).cpu()
            context = (meta.block_list.view(len(query_lens), -1).cpu() if meta.block_list is not None
                       else torch.empty(len(query_lens), 0, dtype=torch.long))
            for row, (q, ctx) in enumerate(zip(query_lens, context_lens)):
                if q <= 0:
                    continue
                table = context[row, :-(-ctx // block)].tolist() if ctx else []
                if len(table) * block < ctx or -1 in table:
                    raise RuntimeError(
                        f"Inkling: a prefill chunk at position {ctx} came without the block ids of its context "
                        f"(block_list {'absent' if meta.block_list is None else 'short'}): the prompt bucket "
                        "vllm-gaudi chose has no room for them, and attention would miss the context.")
                for b in (slots[row, :q] // block).tolist():
                    if b not in table[-1:]:
                        table.append(int(b))
                chunks.append((row, RequestChunk(ids[row, :q].tolist(), ctx, table)))
            return chunks
        groups = meta.block_groups.cpu().tolist()
        blocks = meta.block_list.cpu().tolist()
        tables: dict[int, list[int]] = {}
        for b, g in zip(blocks, groups):
            # HpuModelAdapter turns the padding groups (-1) into the batch size.
            if 0 <= g < ids.shape[0]:
                tables.setdefault(g, []).append(int(b))
        for row, table in sorted(tables.items()):
            chunks.append((row, RequestChunk([int(ids[row, 0])], int(pos[row, 0]), table)))
        return chunks

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds=None, **kwargs) -> torch.Tensor:
        from vllm.forward_context import get_forward_context

        meta = get_forward_context().attn_metadata
        caches, pad_block = self._caches()
        rows = self._chunks(input_ids, positions, meta)
        step = build_step_metadata([c for _, c in rows], block_size=self.block_size,
                                   conv_kernel_size=self.config.conv_kernel_size,
                                   pad_block_id=pad_block).to(input_ids.device)
        hidden = self.inkling(step, caches)                # [real tokens, hidden]
        # Back to the runner's [batch, seq] layout; padding rows stay zero.
        out = hidden.new_zeros(input_ids.numel(), hidden.shape[-1])
        seq = input_ids.shape[1] if input_ids.dim() == 2 else 1
        flat_rows = [row * seq + i for row, chunk in rows for i in range(len(chunk.token_ids))]
        out.index_copy_(0, torch.tensor(flat_rows, device=out.device), hidden[: len(flat_rows)])
        return out.view(*input_ids.shape, -1)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.inkling.compute_logits(hidden_states)

    def embed_input_ids(self, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.inkling.model.embed_tokens(input_ids)
