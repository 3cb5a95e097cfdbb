"""Inkling text backbone, shaped for HPU graphs (no Triton, no CUDA), built from vLLM's layers where vLLM has
one that computes this model, as vLLM's own Inkling (vllm/models/inkling/amd/) is: `RMSNorm` (on HPU,
vllm-gaudi registers its fused kernel over it), parallel linears for the attention projections, the dense
MLP and the shared experts (each platform's GEMM: on vLLM's CPU build, its oneDNN or packed kernels), vLLM's
MoE layer for the routed experts with Inkling's gate as its routing function (on HPU, vllm-gaudi's fused MoE
method; on vLLM's CPU build, its CPU experts), the vocab-parallel head and its logits processor, and
make_layers / PPMissingLayer for the pipeline stages. The embedding is replicated on every rank, as vLLM's
Inkling keeps it. The port's own code is what vLLM has no layer for: the relative-logits attention over the
paged cache (its decode rows through vllm-gaudi's flat_pa on HPU, gaudi_attention.py), the short
convolutions with their per-block snapshots, and the channel split of the hidden streams under TP
(TensorParallel).

Names mirror transformers 5.24.0's `models/inkling/modeling_inkling.py` where the math is the same;
the differences are the fused `qkvr_proj`, SwiGLU weights as rows [gate | up] (the checkpoint's
interleaved w13, split once at load), routed experts on vLLM's MoE layer, and a forward over flattened tokens with paged KV and per-request conv state (see metadata.py and
docs/caches.md). Gathers use index_select; every shape follows from the step's padding.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from vllm.distributed import divide
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import LinearBase, MergedColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.utils import (PPMissingLayer, extract_layer_index, make_empty_intermediate_tensors_factory,
                                              make_layers)

from inkling_hpu.guards import tensor_parallel_refusal
from inkling_hpu.model.attention_plan import AttentionKind, ChunkPlan, plan_step
from inkling_hpu.model.config import InklingConfigError, InklingPortConfig
from inkling_hpu.model.gaudi_attention import GaudiFlatPagedAttention
from inkling_hpu.model.knobs import Knobs, read_knobs
from inkling_hpu.model.metadata import FlatDecodeGroup, StepMetadata

logger = init_logger("vllm.inkling_hpu")


def _default_vllm_config():
    """A new one per model built: vLLM's MoE layers register themselves by name in the config they are built
    under (a second model's layers of the same names would be refused)."""
    from vllm.config import DeviceConfig, VllmConfig

    return VllmConfig(device_config=DeviceConfig(device="cpu"))


_BUILDING = threading.Lock()   # vLLM's current config and groups are one per process, not per thread


def _one_process_group() -> None:
    """vLLM's parameters note the TP group's rank when they are made (each layer then sets the rank and size
    the port gives it). A worker has vLLM's groups; anywhere else, a world of this one process over gloo."""
    import socket

    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    with torch.device("cpu"):     # the group's own tensors, whatever device the model is built on (meta)
        if parallel_state._WORLD is None:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                        distributed_init_method=f"tcp://127.0.0.1:{port}")
        parallel_state.ensure_model_parallel_initialized(1, 1)


@dataclass(frozen=True)
class _RankPlace:
    """All vLLM's layers read of a TP or PP group while they are built: a rank's place in it."""

    rank_in_group: int
    world_size: int


@contextlib.contextmanager
def _rank_places(tp: "TensorParallel", stage: "PipelineStage"):
    """vLLM's parallel layers take their shard from the TP group, and make_layers its layers from the PP
    group, when they are built. A worker's groups are the model's own; a rank built without its groups (the
    memory arithmetic's meta build at TP 8, the tests' ranks and stages in one process) is built with
    stand-ins that hold only its places: the layers' forwards never reach them (the port's collectives are
    TensorParallel's)."""
    from vllm.distributed import parallel_state

    groups = {"_TP": (tp.rank, tp.size), "_PP": (stage.rank, stage.size)}
    saved = {name: getattr(parallel_state, name) for name in groups}
    for name, place in groups.items():
        if (saved[name].rank_in_group, saved[name].world_size) != place:
            setattr(parallel_state, name, _RankPlace(*place))
    try:
        yield
    finally:
        for name, group in saved.items():
            setattr(parallel_state, name, group)


@contextlib.contextmanager
def vllm_layers_buildable(tp: "TensorParallel", stage: "PipelineStage", dtype: torch.dtype):
    """vLLM's layers read the current vLLM config and the TP and PP groups when they are built (a CustomOp
    picks its platform's forward then), and make their parameters in the default dtype (vLLM's loader builds
    a model under its dtype). A worker builds the model inside vLLM's own; built anywhere else (parity, the
    memory arithmetic, the tests), a default CPU config and a one-process group stand in."""
    from vllm.config import get_current_vllm_config_or_none, set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    with _BUILDING, set_default_torch_dtype(dtype):
        config = get_current_vllm_config_or_none()
        with contextlib.nullcontext() if config is not None else set_current_vllm_config(_default_vllm_config()):
            _one_process_group()
            with _rank_places(tp, stage):
                yield


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass
class TensorParallel:
    """This rank's place in the tensor-parallel group and its collectives (identity for one rank).

    The hidden-width streams are sharded by channel between the attention/MLP and the next norm: each
    rank reduce-scatters the partial sums of o_proj and of the MLP/MoE (the same bytes as an
    all-reduce), runs the depthwise short convolution and the residual add on its own channels
    (so it keeps only its channels' conv snapshots), then all-gathers the full hidden state."""

    rank: int = 0
    size: int = 1
    all_gather_last_dim: Callable[[torch.Tensor], torch.Tensor] = _identity
    reduce_scatter_last_dim: Callable[[torch.Tensor], torch.Tensor] = _identity

    def own_channels(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """This rank's slab of the last dim (what reduce_scatter_last_dim leaves it)."""
        width = hidden_states.shape[-1] // self.size
        return hidden_states.narrow(-1, self.rank * width, width) if self.size > 1 else hidden_states


@dataclass(frozen=True)
class PipelineStage:
    """The layers [start, end) pipeline stage `rank` of `size` holds. The first stage embeds the tokens;
    the last holds the final norm and the head."""

    start: int
    end: int
    rank: int = 0
    size: int = 1

    @classmethod
    def of_rank(cls, num_layers: int, rank: int, size: int) -> "PipelineStage":
        """Stage `rank` of `size` as vLLM splits the layers (get_pp_indices, VLLM_PP_LAYER_PARTITION included):
        the layers make_layers builds on that rank."""
        from vllm.distributed.utils import get_pp_indices

        return cls(*get_pp_indices(num_layers, rank, size), rank=rank, size=size)

    @classmethod
    def whole(cls, num_layers: int) -> "PipelineStage":
        return cls(0, num_layers)

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def layer_ids(self) -> range:
        return range(self.start, self.end)

    @property
    def is_whole_model(self) -> bool:
        return self.first and self.last


def write_slots(cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """Write each token's row at its slot (block * block_size + offset) of a [blocks, block_size, ...] cache.

    A cache whose blocks are pages of a larger buffer (vLLM's CPU pool, where each block's page also
    holds the conv state) or whose blocks are heads-major is not one run of rows, so it is written by
    (block, offset)."""
    rows = rows.to(cache.dtype)
    if cache.is_contiguous():
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, rows)
    else:
        block_size = cache.shape[1]
        cache.index_put_((slot_mapping // block_size, slot_mapping % block_size), rows)


def block_heads(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The blocks' rows by kv head, [len(blocks), kv_heads, block_size, head_dim]: what the attention's matmuls
    take as they are (keys transposed by stride, not copied). A cache laid out heads-major in each block (the
    CPU pages, allocate_caches) gives them by a copy of whole runs; a slot-major one (vllm-gaudi's) by a
    strided gather, the one copy either way."""
    return cache.transpose(1, 2).index_select(0, blocks)


def request_keys(cache: torch.Tensor, block_index: torch.Tensor, num_requests: int) -> torch.Tensor:
    """Each request's rows by kv head, [num_requests, kv_heads, keys, head_dim] (block_index: its blocks in
    order, num_requests runs of the same length)."""
    rows = block_heads(cache, block_index).unflatten(0, (num_requests, -1))             # [G, nb, KV, B, D]
    return rows.transpose(1, 2).flatten(2, 3)


@dataclass
class LayerCache:
    key: torch.Tensor                    # [num_blocks, block_size, kv_heads, head_dim] (any strides)
    value: torch.Tensor                  # [num_blocks, block_size, kv_heads, head_dim]
    conv: dict[str, torch.Tensor] = field(default_factory=dict)   # stream -> [num_blocks, W-1, channels]


@dataclass
class InklingCaches:
    block_size: int
    layers: list[LayerCache]


# --------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------
class InklingNormedEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, eps: float, use_embed_norm: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        self.embed_norm = RMSNorm(embedding_dim, eps) if use_embed_norm else None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        embedded = self.weight.index_select(0, input_ids)
        return self.embed_norm(embedded) if self.embed_norm is not None else embedded


class InklingShortConvolution(nn.Module):
    """y[p] = x[p] + sum_k w[c, k] * x[p - (W-1) + k], causal per request, fp32, with per-block state.

    The W-1 taps before each token come from this step's tokens of the same request or from the
    conv state of the block holding the request's last computed token; the metadata says which
    (conv_tap_index). After the step, every block the step computed into holds the W-1 inputs ending
    at its last written token (conv_write_blocks / conv_write_source): the snapshot of a full block,
    the running state of a request's partial last block.
    """

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.channels = channels
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel_size, dtype=torch.float32))

    def forward(self, hidden_states: torch.Tensor, state: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        num_tokens, channels = hidden_states.shape
        taps = self.kernel_size - 1
        previous = state.index_select(0, meta.conv_read_blocks).reshape(-1, channels)
        source = torch.cat([hidden_states.to(state.dtype), previous, state.new_zeros(1, channels)])
        window = source.index_select(0, meta.conv_tap_index.reshape(-1)).view(num_tokens, taps, channels)
        new_state = source.index_select(0, meta.conv_write_source.reshape(-1)).view(-1, taps, channels)
        state.index_copy_(0, meta.conv_write_blocks, new_state)

        inputs = hidden_states.float()
        window = torch.cat([window.float(), inputs[:, None, :]], dim=1)             # [T, W, C]
        taps_weight = self.weight.view(channels, self.kernel_size).float().t()       # [W, C]
        convolved = (window * taps_weight[None]).sum(dim=1)
        return (convolved + inputs).to(hidden_states.dtype)


class InklingRelativeLogits(nn.Module):
    """Per token and head, a bias for each backward distance: relative_states @ proj."""

    def __init__(self, d_rel: int, rel_extent: int) -> None:
        super().__init__()
        self.rel_extent = rel_extent
        self.proj = nn.Parameter(torch.empty(d_rel, rel_extent))

    def forward(self, relative_states: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
        # relative_states: [G, Lc, H, d_rel] -> bias [G, H, Lc, S] gathered by distance
        rel_logits = relative_states @ self.proj                                     # [G, Lc, H, E]
        if plan.tau is not None:
            rel_logits = (rel_logits.float() * plan.tau[:, :, None, None]).to(rel_logits.dtype)
        num_requests, rows, heads, extent = rel_logits.shape
        by_distance = rel_logits.permute(0, 1, 3, 2).reshape(num_requests * rows * extent, heads)
        bias = by_distance.index_select(0, plan.bias_index.reshape(-1))              # [G*Lc*S, H]
        bias = bias.view(*plan.bias_index.shape, heads).permute(0, 3, 1, 2)          # [G, H, Lc, S]
        return bias.masked_fill(~plan.bias_valid, 0.0)


# --------------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------------
@dataclass
class FlatInputs:
    """Decode rows as flat paged attention takes them: the query [G, H, D] (the global layers' log scaling
    applied), the blocks read [NB] and their owners [NB] (G: padding), each block's slot mask [NB, B] (0, or the
    dtype's min for later positions, outside the window and padding) and the relative logits of each slot
    [NB, H, B] (0 beyond rel_extent): vllm-gaudi's block_list, block_groups, block_bias and position_bias."""

    query: torch.Tensor
    block_list: torch.Tensor
    block_groups: torch.Tensor
    block_bias: torch.Tensor
    position_bias: torch.Tensor


class InklingAttention(nn.Module):
    """Relative-position attention over the paged KV cache (base of the two layer kinds)."""

    is_sliding = False

    def __init__(self, config: InklingPortConfig, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        heads, kv_heads, head_dim = config.attention_shape(layer_idx)
        self.layer_idx = layer_idx
        self.tp = tp
        self.num_heads = divide(heads, tp.size)
        self.num_key_value_heads = divide(kv_heads, tp.size)   # never replicated: K/V conv state is per kv head
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.head_dim = head_dim
        self.d_rel = config.d_rel
        # q/k are RMS-normalised per head, hence 1/d rather than 1/sqrt(d)
        self.scaling = 1.0 / head_dim
        self.rel_extent = config.rel_extent_of(layer_idx)
        self.kind = AttentionKind(
            num_heads=self.num_heads,
            window=config.sliding_window_size if self.is_sliding else None,
            rel_extent=self.rel_extent,
            log_scaling_n_floor=None if self.is_sliding else config.log_scaling_n_floor,
            log_scaling_alpha=config.log_scaling_alpha,
        )
        q_size = self.num_heads * head_dim
        kv_size = self.num_key_value_heads * head_dim
        r_size = self.num_heads * config.d_rel
        self.split_sizes = (q_size, kv_size, kv_size, r_size)
        # fused projection, output rows [Q | K | V | R] (checkpoint wq_du, wk_dv, wv_dv, wr_du), each cut by head
        self.qkvr_proj = MergedColumnParallelLinear(
            config.hidden_size, [size * tp.size for size in self.split_sizes], bias=False)
        # partial sums: the layer reduce-scatters them to this rank's channels (TensorParallel)
        self.o_proj = RowParallelLinear(q_size * tp.size, config.hidden_size, bias=False, reduce_results=False)
        self.k_sconv = InklingShortConvolution(kv_size, config.conv_kernel_size)
        self.v_sconv = InklingShortConvolution(kv_size, config.conv_kernel_size)
        self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.rel_logits_proj = InklingRelativeLogits(config.d_rel, self.rel_extent)
        # decode on vllm-gaudi's platform: its flat paged attention (None elsewhere: the port's own)
        self.gaudi_flat_pa = GaudiFlatPagedAttention.where_available()

    def forward(self, hidden_states: torch.Tensor, meta: StepMetadata, cache: LayerCache,
                plans: list[list[ChunkPlan]] | None, knobs: Knobs) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        query, key, value, relative = self.qkvr_proj(hidden_states)[0].split(self.split_sizes, dim=-1)
        key = self.k_sconv(key, cache.conv["k"], meta)
        value = self.v_sconv(value, cache.conv["v"], meta)
        query = self.q_norm(query.reshape(num_tokens, self.num_heads, self.head_dim))
        key = self.k_norm(key.reshape(num_tokens, self.num_key_value_heads, self.head_dim))
        value = value.reshape(num_tokens, self.num_key_value_heads, self.head_dim)
        relative = relative.reshape(num_tokens, self.num_heads, self.d_rel)

        # write this step's keys/values first: every query then reads its keys from the cache
        write_slots(cache.key, meta.slot_mapping, key)
        write_slots(cache.value, meta.slot_mapping, value)

        if plans is None:
            plans = plan_step(meta.groups, self.kind, meta.block_size, knobs)
        outputs = []
        for group, group_plans in zip(meta.groups, plans):
            if isinstance(group, FlatDecodeGroup):
                outputs.append(self._attend_flat(query.index_select(0, group.token_index),
                                                 relative.index_select(0, group.token_index), cache, group))
                continue
            rows = group.token_index.reshape(-1)
            shape = (group.num_requests, group.num_rows)
            group_query = query.index_select(0, rows).view(*shape, self.num_heads, self.head_dim)
            group_relative = relative.index_select(0, rows).view(*shape, self.num_heads, self.d_rel)
            chunks = [self._attend_chunk(group_query[:, p.row_start:p.row_end],
                                         group_relative[:, p.row_start:p.row_end], cache, p)
                      for p in group_plans]
            outputs.append(torch.cat(chunks, dim=1).reshape(-1, self.num_heads * self.head_dim))
        attn_output = torch.cat(outputs).index_select(0, meta.output_index)
        return self.tp.reduce_scatter_last_dim(self.o_proj(attn_output)[0])     # this rank's channels

    def _attend_chunk(self, query: torch.Tensor, relative: torch.Tensor, cache: LayerCache,
                      plan: ChunkPlan) -> torch.Tensor:
        num_requests, rows = query.shape[:2]
        kv_heads, groups, head_dim = self.num_key_value_heads, self.num_key_value_groups, self.head_dim
        if plan.tau is not None:   # log scaling (global layers), applied in fp32 as the reference does
            query = (query.float() * plan.tau[:, :, None, None]).to(query.dtype)
        bias = self.rel_logits_proj(relative, plan)                                   # [G, H, Lc, S]

        keys = request_keys(cache.key, plan.block_index, num_requests)                 # [G, KV, S, D]
        values = request_keys(cache.value, plan.block_index, num_requests)
        # GQA without repeating K/V: head h = kv * groups + g uses kv head h // groups
        query = query.view(num_requests, rows, kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4)
        query = query.reshape(num_requests, kv_heads, groups * rows, head_dim)
        scores = torch.matmul(query, keys.transpose(-1, -2).to(query.dtype)) * self.scaling
        scores = scores.view(num_requests, self.num_heads, rows, plan.num_keys) + bias
        scores = scores.masked_fill(plan.masked, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        probs = probs.view(num_requests, kv_heads, groups * rows, plan.num_keys)
        out = torch.matmul(probs, values.to(query.dtype))                              # [G, KV, g*Lc, D]
        out = out.view(num_requests, kv_heads, groups, rows, head_dim).permute(0, 3, 1, 2, 4)
        return out.reshape(num_requests, rows, self.num_heads * head_dim)


    def _flat_inputs(self, query: torch.Tensor, relative: torch.Tensor, cache: LayerCache,
                     group: FlatDecodeGroup) -> "FlatInputs":
        """The decode rows as flat paged attention takes them (vllm-gaudi's layout). query [G, H, D],
        relative [G, H, d_rel]."""
        num_requests = query.shape[0]
        block_size = cache.key.shape[1]
        blocks, owner, column = group.block_list, group.block_request, group.block_column
        if self.kind.window is not None and group.window_block_list is not None:
            blocks, owner, column = group.window_block_list, group.window_block_request, group.window_block_column
        num_blocks = blocks.shape[0]
        positions = group.positions
        rel_logits = relative @ self.rel_logits_proj.proj                              # [G, H, E]
        if self.kind.log_scaling_n_floor is not None and self.kind.window is None:
            effective = (positions + 1).to(torch.float32)
            tau = 1.0 + self.kind.log_scaling_alpha * torch.log(
                (effective / self.kind.log_scaling_n_floor).clamp(min=1.0))
            query = (query.float() * tau[:, None, None]).to(query.dtype)
            rel_logits = (rel_logits.float() * tau[:, None, None]).to(rel_logits.dtype)
        owner_row = owner.clamp(max=num_requests - 1)       # padding blocks borrow row 0..G-1, masked below
        query_pos = positions.index_select(0, owner_row)
        key_pos = column[:, None] * block_size + torch.arange(block_size, device=column.device)[None, :]
        distance = query_pos[:, None] - key_pos                                          # [NB, B]
        padding = (owner >= num_requests)[:, None] | (query_pos < 0)[:, None]
        masked = (distance < 0) | padding
        if self.kind.window is not None:
            masked = masked | (distance >= self.kind.window)
        # slot 0 of a padding block stays open, as vllm-gaudi's padding does: no block's softmax is empty
        masked[:, 0] &= ~padding[:, 0]
        block_bias = torch.zeros(num_blocks, block_size, dtype=query.dtype, device=query.device).masked_fill(
            masked, torch.finfo(query.dtype).min)
        bias_valid = (distance >= 0) & (distance < self.rel_extent)
        position_bias = rel_logits.index_select(0, owner_row).gather(
            2, distance.clamp(0, self.rel_extent - 1)[:, None, :].expand(num_blocks, self.num_heads, block_size))
        return FlatInputs(query, blocks, owner, block_bias, position_bias.masked_fill(~bias_valid[:, None, :], 0.0))

    def _attend_flat(self, query: torch.Tensor, relative: torch.Tensor, cache: LayerCache,
                     group: FlatDecodeGroup) -> torch.Tensor:
        """Decode attention over a flat block list, as vllm-gaudi's flat paged attention reads it: each
        block is scored against its owner's query, and a softmax over the blocks of each request. On
        vllm-gaudi's platform, its own flat_pa (`gaudi_flat_pa`); elsewhere the same computation here (max
        and sum per request with scatter/index_add). query [G, H, D], relative [G, H, d_rel] -> [G, H*D]."""
        flat = self._flat_inputs(query, relative, cache, group)
        if self.gaudi_flat_pa is not None:
            return self.gaudi_flat_pa(flat, cache, self.scaling)
        num_requests = query.shape[0]
        kv_heads, groups, head_dim = self.num_key_value_heads, self.num_key_value_groups, self.head_dim
        block_size = cache.key.shape[1]
        owner = flat.block_groups
        num_blocks = flat.block_list.shape[0]
        keys = block_heads(cache.key, flat.block_list)                                   # [NB, KV, B, D]
        values = block_heads(cache.value, flat.block_list)
        block_query = flat.query.index_select(0, owner.clamp(max=num_requests - 1)).view(
            num_blocks, kv_heads, groups, head_dim)
        scores = torch.matmul(block_query, keys.transpose(-1, -2).to(query.dtype)) * self.scaling
        scores = scores.view(num_blocks, self.num_heads, block_size)                    # [NB, H, B]
        scores = (scores + flat.position_bias + flat.block_bias[:, None, :]).float()

        # softmax over all blocks of a request: its max, then its sum (row G collects padding blocks)
        segment = owner[:, None].expand(num_blocks, self.num_heads)
        peak = scores.new_full((num_requests + 1, self.num_heads), float("-inf")).scatter_reduce(
            0, segment, scores.amax(dim=-1), reduce="amax")
        weights = torch.exp(scores - peak.index_select(0, owner)[:, :, None])
        total = scores.new_zeros(num_requests + 1, self.num_heads).index_add(0, owner, weights.sum(dim=-1))
        probs = (weights / total.index_select(0, owner)[:, :, None]).to(query.dtype)
        probs = probs.view(num_blocks, kv_heads, groups, block_size).float()
        partial = torch.matmul(probs, values.float())                                    # [NB, KV, g, D]
        out = partial.new_zeros(num_requests + 1, kv_heads, groups, head_dim).index_add(0, owner, partial)
        return out[:num_requests].to(query.dtype).reshape(num_requests, self.num_heads * head_dim)


class InklingSlidingAttention(InklingAttention):
    """Local layers: window sliding_window_size, bias over the whole window, no log scaling."""

    is_sliding = True


class InklingFullAttention(InklingAttention):
    """Global layers: every earlier key, bias over the last rel_extent keys, log scaling tau."""

    is_sliding = False


# --------------------------------------------------------------------------------------------------
# MLP and MoE
# --------------------------------------------------------------------------------------------------
def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over the rows [gate | up] (the checkpoint's interleaved w13, split at load)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class InklingSwiGLU(nn.Module):
    """down(silu(gate) * up [* a per-token scale]) on vLLM's parallel linears, cut on the intermediate dim:
    the output is this rank's partial sum."""

    def __init__(self, hidden_size: int, width: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [width, width], bias=False)   # [gate | up]
        self.down_proj = RowParallelLinear(width, hidden_size, bias=False, reduce_results=False)

    def forward(self, hidden_states: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        activated = swiglu(self.gate_up_proj(hidden_states)[0])
        return self.down_proj(activated if scale is None else activated * scale)[0]


class InklingMLP(InklingSwiGLU):
    """Dense SwiGLU MLP (layers below dense_mlp_idx)."""

    def __init__(self, config: InklingPortConfig, tp: TensorParallel) -> None:
        super().__init__(config.hidden_size, config.dense_intermediate_size)
        self.tp = tp
        self.global_scale = nn.Parameter(torch.ones(1))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.tp.reduce_scatter_last_dim(super().forward(hidden_states)) * self.global_scale


class InklingTopkRouter(nn.Module):
    """sigmoid + bias selects top-k; weights = softmax(logsigmoid(logits of k routed + S sinks)) * scales."""

    def __init__(self, config: InklingPortConfig) -> None:
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.n_shared_experts = config.n_shared_experts
        self.top_k = config.num_experts_per_tok
        self.route_scale = config.route_scale
        self.weight = nn.Parameter(torch.empty(self.num_experts + self.n_shared_experts, config.hidden_size))
        self.global_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[tokens, routed + sinks], in fp32 so distinct scores do not round to ties before top-k."""
        return F.linear(hidden_states.float(), self.weight.float())

    def select(self, router_logits: torch.Tensor, dtype: torch.dtype):
        """(routed weights [tokens, k], routed ids [tokens, k], sink gammas [tokens, S]) in `dtype`."""
        routed_logits = router_logits[:, : self.num_experts]
        shared_logits = router_logits[:, self.num_experts:]
        choice = routed_logits.sigmoid() + self.e_score_correction_bias.float()
        topk_indices = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        topk_logits = torch.cat([routed_logits.gather(-1, topk_indices), shared_logits], dim=-1)
        log_probs = F.logsigmoid(topk_logits)
        weights = torch.exp(log_probs - torch.logsumexp(log_probs, dim=-1, keepdim=True))
        weights = (weights * self.route_scale * self.global_scale.float()).to(dtype)
        return weights[:, : self.top_k], topk_indices, weights[:, self.top_k:]

    def forward(self, hidden_states: torch.Tensor):
        return self.select(self.logits(hidden_states), hidden_states.dtype)


def routed_experts(hidden_states: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   topk_indices: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert_{topk_indices[t, k]}(x_t), computing each expert only on
    the tokens routed to it: the (token, k) pairs sorted by expert, one pass per expert that has any.

    Each token's contributions are added in expert order, as the all-experts loop adds them, so the
    result is that loop's up to the matmuls' own rounding. The per-expert counts are read on the host
    (one sync). With fewer (token, k) pairs than experts (a decode step), each pair runs alone instead
    (routed_pairs). What SortedDispatchMoEMethod computes; a vLLM worker runs its platform's MoE kernel."""
    num_tokens, top_k = topk_indices.shape
    if num_tokens * top_k <= gate_up.shape[0]:
        return routed_pairs(hidden_states, gate_up, down, topk_indices, topk_weights)
    flat = topk_indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    token_of = order // top_k
    weight_of = topk_weights.reshape(-1).index_select(0, order).to(hidden_states.dtype)
    out = torch.zeros_like(hidden_states)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        rows = token_of[start:start + count]
        activated = swiglu(F.linear(hidden_states.index_select(0, rows), gate_up[expert]))
        out.index_add_(0, rows, F.linear(activated, down[expert]) * weight_of[start:start + count, None])
        start += count
    return out


def routed_pairs(hidden_states: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 topk_indices: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """routed_experts as one batched matmul over the (token, k) pairs, each with its expert's weights gathered:
    a few ops whatever the experts, for the small batches where a pass per expert is mostly overhead. Each
    token's contributions are still added in expert order."""
    num_tokens, top_k = topk_indices.shape
    experts, order = topk_indices.sort(dim=-1)                       # each token's experts in ascending order
    weights = topk_weights.gather(1, order).to(hidden_states.dtype)
    flat = experts.reshape(-1)
    pairs = hidden_states.repeat_interleave(top_k, dim=0)[:, None, :]                  # [P, 1, H]
    activated = swiglu(torch.bmm(pairs, gate_up.index_select(0, flat).transpose(1, 2)))
    contributions = torch.bmm(activated, down.index_select(0, flat).transpose(1, 2))   # [P, 1, H]
    contributions = contributions.view(num_tokens, top_k, -1) * weights[..., None]
    out = torch.zeros_like(hidden_states)
    for k in range(top_k):
        out = out + contributions[:, k]
    return out


def all_experts_reference(hidden_states: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                          topk_indices: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, times a dense [tokens, experts] combine matrix (0 where a token did
    not route). Never served: the reference the tests and benchmarks/moe.py hold the routed paths to."""
    combine = hidden_states.new_zeros(hidden_states.shape[0], gate_up.shape[0])
    combine.scatter_add_(1, topk_indices.long(), topk_weights.to(combine.dtype))
    out = torch.zeros_like(hidden_states)
    for expert in range(gate_up.shape[0]):
        activated = swiglu(F.linear(hidden_states, gate_up[expert]))
        out = out + F.linear(activated, down[expert]) * combine[:, expert:expert + 1]
    return out


class SortedDispatchMoEMethod(FusedMoEMethodBase):
    """vLLM's MoE layer's method where vLLM has no MoE kernel for the layer (InklingRoutedExperts): the
    pure-Python vLLM sdist that parity, the memory arithmetic and the tests import (no platform, no compiled
    ops), and vLLM's CPU build on widths its CPU experts refuse (a hidden size not a multiple of 32: the
    smallest test configs). It keeps vLLM's unquantized weights (w13_weight [E, gate | up, hidden], w2_weight
    [E, hidden, width]) and computes routed_experts on them. The served configs never use it: vLLM's CPU
    build runs its CPU experts, vllm-gaudi its HPU method (the fused MoE op)."""

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        # the same parameters as vLLM's unquantized method makes (it reads nothing else of `self`)
        UnquantizedFusedMoEMethod.create_weights(self, layer, num_experts, hidden_size,
                                                 intermediate_size_per_partition, params_dtype, **extra_weight_attrs)

    def get_fused_moe_quant_config(self, layer):
        return FUSED_MOE_UNQUANTIZED_CONFIG

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        return routed_experts(x, layer.w13_weight, layer.w2_weight, topk_ids.long(), topk_weights)


class AllExpertsMethod(SortedDispatchMoEMethod):
    """all_experts_reference as the MoE layer's method: static shapes, as the fused op on HPU has. Never served
    (the tests' graph traces and benchmarks/moe.py)."""

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        return all_experts_reference(x, layer.w13_weight, layer.w2_weight, topk_ids.long(), topk_weights)


class InklingRoutedExperts(RoutedExperts):
    """vLLM's routed experts with the method vLLM picks for them (vllm-gaudi's on HPU, vLLM's CPU experts on
    its CPU build, a quantized checkpoint's), else SortedDispatchMoEMethod where vLLM has no MoE kernel for
    this layer: no platform (the pure-Python sdist), or none of the platform's kernels takes these widths
    (vLLM's oracle raises NotImplementedError; a backend the user asked for by name still raises)."""

    def _get_quant_method(self, prefix, quant_config, moe_config):
        from vllm.platforms import current_platform

        if current_platform.is_unspecified():
            return SortedDispatchMoEMethod(moe_config)
        try:
            return super()._get_quant_method(prefix, quant_config, moe_config)
        except NotImplementedError as none_fits:
            logger.info_once("Inkling's routed experts run SortedDispatchMoEMethod: %s", str(none_fits))
            return SortedDispatchMoEMethod(moe_config)


class InklingSharedExperts(nn.ModuleList):
    """Shared ("sink") experts, each weighted by its router gamma: one SwiGLU each, their outputs summed in
    fp32 (as transformers sums them, so bf16 rounds as it does)."""

    def __init__(self, config: InklingPortConfig) -> None:
        super().__init__(InklingSwiGLU(config.hidden_size, config.moe_intermediate_size)
                         for _ in range(config.n_shared_experts))

    def forward(self, hidden_states: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
        outs = [expert(hidden_states, gammas[:, e:e + 1]) for e, expert in enumerate(self)]
        return torch.stack(outs).float().sum(dim=0).to(hidden_states.dtype)


def process_weights_after_loading(model: nn.Module) -> None:
    """What vLLM's loader does once a worker's load_weights is done: each layer's method prepares its weights
    (vLLM's CPU build packs the linears and the routed experts for its kernels, vllm-gaudi hands its fused op
    the experts). For a model loaded outside a worker (parity, the benchmarks, the harness); in the sdist (no
    platform) the methods have nothing to prepare."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    with vllm_layers_buildable(model.tp, model.stage, model.dtype):
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, QuantizeMethodBase):
                method.process_weights_after_loading(module)


class InklingMoE(nn.Module):
    """Routed experts on vLLM's MoE layer (FusedMoEFactory; on HPU vllm-gaudi's fused MoE method), routed by
    Inkling's gate as its custom routing function, as vLLM's own Inkling builds them; the shared ("sink")
    experts on vLLM's parallel linears beside them. Both are cut on the intermediate dim: the layer
    reduce-scatters their sum once (skip_final_all_reduce), to this rank's channels."""

    def __init__(self, config: InklingPortConfig, tp: TensorParallel, prefix: str) -> None:
        super().__init__()
        self.tp = tp
        self.gate = InklingTopkRouter(config)
        self.experts = FusedMoEFactory(
            num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok, hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size, renormalize=False, reduce_results=False,
            custom_routing_function=self._select_routed, router_logits_dtype=torch.float32, activation="silu",
            prefix=f"{prefix}.experts",
            routed_experts_cls=InklingRoutedExperts)
        self.experts.moe_config.skip_final_all_reduce = True
        self.shared_experts = InklingSharedExperts(config)
        self._selection: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _select_routed(self, hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int,
                       renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The MoE layer's routing function: the routed top-k of the selection forward() made from these
        logits (the weights are normalised over the routed and the sink experts together, so the routed
        logits alone cannot give them)."""
        selection, self._selection = self._selection, None
        if selection is None or selection[0] is not gating_output:
            raise RuntimeError("Inkling's MoE routes only the logits its forward selected from")
        return selection[1], selection[2]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate.logits(hidden_states)
        topk_weights, topk_indices, shared_gammas = self.gate.select(router_logits, hidden_states.dtype)
        routed_logits = router_logits[:, : self.gate.num_experts]       # what the MoE layer routes over
        self._selection = (routed_logits, topk_weights, topk_indices)
        routed = self._routed(hidden_states, routed_logits)
        shared = self.shared_experts(hidden_states, shared_gammas)
        return self.tp.reduce_scatter_last_dim(routed + shared)   # one collective, to this rank's channels

    def _routed(self, hidden_states: torch.Tensor, routed_logits: torch.Tensor) -> torch.Tensor:
        from vllm.forward_context import is_forward_context_available

        if is_forward_context_available():      # in a worker's step: the layer as vLLM runs it
            return self.experts(hidden_states=hidden_states, router_logits=routed_logits)
        # Built and run outside a worker (parity, the tests' ranks in threads): vLLM's MoE layer finds itself
        # in the forward context by name, which only a worker sets; the same steps for one rank, directly.
        self.experts.routed_experts._ensure_moe_quant_config_init()
        return self.experts._apply_quant_method(hidden_states, routed_logits, None)[1]


# --------------------------------------------------------------------------------------------------
# Decoder layer and model
# --------------------------------------------------------------------------------------------------
class InklingDecoderLayer(nn.Module):
    """norm -> attention -> sconv + residual -> norm -> MLP/MoE -> sconv + residual."""

    def __init__(self, config: InklingPortConfig, layer_idx: int, tp: TensorParallel, knobs: Knobs,
                 prefix: str) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.knobs = knobs
        attention_class = InklingSlidingAttention if config.is_local(layer_idx) else InklingFullAttention
        self.self_attn = attention_class(config, layer_idx, tp)
        self.mlp = InklingMLP(config, tp) if config.dense_layers[layer_idx] else InklingMoE(config, tp, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tp = tp
        # depthwise: under tensor parallel each rank convolves its own channels of the hidden streams
        channels = divide(config.hidden_size, tp.size)
        self.attn_sconv = InklingShortConvolution(channels, config.conv_kernel_size)
        self.mlp_sconv = InklingShortConvolution(channels, config.conv_kernel_size)

    def forward(self, hidden_states: torch.Tensor, meta: StepMetadata, cache: LayerCache,
                plans: list[list[ChunkPlan]] | None = None) -> torch.Tensor:
        tp = self.tp
        residual = hidden_states
        attended = self.self_attn(self.input_layernorm(hidden_states), meta, cache, plans, self.knobs)
        hidden_states = tp.all_gather_last_dim(tp.own_channels(residual) + self.attn_sconv(attended, cache.conv["attn"], meta))

        residual = hidden_states
        mixed = self.mlp(self.post_attention_layernorm(hidden_states))
        return tp.all_gather_last_dim(tp.own_channels(residual) + self.mlp_sconv(mixed, cache.conv["mlp"], meta))


class InklingModel(nn.Module):
    def __init__(self, config: InklingPortConfig, tp: TensorParallel, knobs: Knobs, stage: PipelineStage,
                 prefix: str = "model") -> None:
        super().__init__()
        self.config = config
        self.knobs = knobs
        self.embed_tokens = InklingNormedEmbedding(config.vocab_rows, config.hidden_size, config.rms_norm_eps,
                                                   config.use_embed_norm) if stage.first else PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: InklingDecoderLayer(config, extract_layer_index(prefix), tp, knobs, prefix),
            prefix=f"{prefix}.layers")
        if (self.start_layer, self.end_layer) != (stage.start, stage.end):
            raise ValueError(f"pipeline stage {stage.rank} of {stage.size}: expected layers {stage.start}..{stage.end - 1}, "
                             f"vLLM's split builds {self.start_layer}..{self.end_layer - 1} (PipelineStage.of_rank)")
        self.stage = stage
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if stage.last else PPMissingLayer()
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(["hidden_states"],
                                                                                       config.hidden_size)

    @property
    def stage_layers(self) -> list["InklingDecoderLayer"]:
        """This stage's decoder layers, in order (caches.layers follows the same order)."""
        return [self.layers[i] for i in self.stage.layer_ids]

    def forward(self, meta: StepMetadata, caches: InklingCaches,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """`hidden_states`: the previous stage's output rows (one per token of meta.input_ids), on every
        stage but the first. Returns the next stage's input, or the normed hidden states on the last."""
        if caches.block_size != meta.block_size:
            raise ValueError(f"metadata block size {meta.block_size} != cache block size {caches.block_size}")
        if self.stage.first == (hidden_states is not None):
            raise ValueError("the first pipeline stage embeds the tokens; every other stage takes the previous "
                             f"stage's hidden states (stage of layers {self.stage.start}..{self.stage.end - 1})")
        if self.stage.first:
            hidden_states = self.embed_tokens(meta.input_ids)
        layers = self.stage_layers
        plans: dict[AttentionKind, list] = {}      # one plan per layer kind for the whole step
        for layer in layers:
            kind = layer.self_attn.kind
            if kind not in plans:
                plans[kind] = plan_step(meta.groups, kind, meta.block_size, self.knobs)
        for layer, cache in zip(layers, caches.layers, strict=True):
            hidden_states = layer(hidden_states, meta, cache, plans[layer.self_attn.kind])
        return self.norm(hidden_states) if self.stage.last else hidden_states


class InklingLogitsProcessor(LogitsProcessor):
    """vLLM's logits processor over the vocab-parallel head: the head's GEMM by its quant method, each rank's
    logits gathered, the padded rows trimmed (vocab_out). The gather is the port's TP all-gather: vLLM's own
    (tensor_model_parallel_all_gather) in a worker, the tests' ranks in one process their own."""

    def __init__(self, config: InklingPortConfig, tp: TensorParallel) -> None:
        super().__init__(config.vocab_rows, org_vocab_size=config.vocab_out)
        self.tp = tp

    def _gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last_dim(logits)


class InklingForCausalLM(nn.Module):
    """The text model: forward(meta, caches) -> hidden states; compute_logits(hidden) -> logits. Under
    pipeline parallel (`stage`), it holds its stage's layers only: the first stage the embedding, the
    last the final norm and the head. Its parameters are `dtype` (the default dtype when None), but for those
    transformers keeps in fp32 (the short convolutions, the router's bias and scale), made fp32."""

    def __init__(self, config: InklingPortConfig, *, tp: TensorParallel | None = None,
                 knobs: Knobs | None = None, stage: PipelineStage | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TensorParallel()
        self.stage = stage or PipelineStage.whole(config.num_hidden_layers)
        self.knobs = read_knobs() if knobs is None else knobs   # read once, at construction
        refusal = tensor_parallel_refusal(config, self.tp.size)
        if refusal:
            raise InklingConfigError(refusal)
        self.dtype = dtype or torch.get_default_dtype()
        with vllm_layers_buildable(self.tp, self.stage, self.dtype):
            self.model = InklingModel(config, self.tp, self.knobs, self.stage)
            if self.stage.last:
                # the checkpoint's rows are the padded vocabulary already (201,024 = 64 x 3141): the head pads
                # none of its own, so each rank's rows are the loader's equal slab
                self.lm_head = ParallelLMHead(config.vocab_rows, config.hidden_size, padding_size=1)
                self.logits_processor = InklingLogitsProcessor(config, self.tp)
            else:
                self.lm_head = PPMissingLayer()
        for module in self.modules():
            if isinstance(module, (LinearBase, VocabParallelEmbedding)):
                # vLLM's CPU build computes a linear with the kernel its loader picks once the weights are in
                # (process_weights_after_loading, which a worker's load ends with); a model loaded by the
                # port's own load_checkpoint (parity, the tests) computes with torch's linear meanwhile
                module.cpu_linear = F.linear

    def forward(self, meta: StepMetadata, caches: InklingCaches,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(meta, caches, hidden_states)

    @property
    def embedding_rows(self) -> int:
        """The token ids the embedding has rows for, the ranks together: the table is whole on every rank
        of the first stage (the config's rows on a stage without it)."""
        embed = self.model.embed_tokens
        return embed.weight.shape[0] if isinstance(embed, InklingNormedEmbedding) else self.config.vocab_rows

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # the μP divisor on the hidden states, before the head, as transformers applies it
        return self.logits_processor(self.lm_head, hidden_states / self.config.logits_mup_width_multiplier)

    # --- caches --------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def conv_channels(self, layer_idx: int) -> dict[str, int]:
        """Channels of each conv stream of a layer on this rank (K and V: this rank's kv heads; the
        attention- and MLP-output streams: this rank's channels of the hidden state)."""
        layer = self.model.layers[layer_idx]
        kv_channels = layer.self_attn.num_key_value_heads * layer.self_attn.head_dim
        return {"k": kv_channels, "v": kv_channels, "attn": layer.attn_sconv.channels, "mlp": layer.mlp_sconv.channels}

    def allocate_conv_state(self, num_blocks: int, device: torch.device | str | None = None
                            ) -> list[dict[str, torch.Tensor]]:
        """Zeroed conv state per layer and stream, one [W-1, channels] row per KV block."""
        device = device or self.device
        taps = self.config.conv_kernel_size - 1
        return [{s: torch.zeros(num_blocks, taps, c, dtype=self.dtype, device=device)
                 for s, c in self.conv_channels(i).items()} for i in self.stage.layer_ids]

    def allocate_caches(self, num_blocks: int, block_size: int,
                        device: torch.device | str | None = None) -> InklingCaches:
        """Zeroed caches: paged KV (one block table for every layer) and conv state per KV block."""
        device = device or self.device
        layers = []
        for layer, conv in zip(self.model.stage_layers, self.allocate_conv_state(num_blocks, device)):
            attn = layer.self_attn
            # heads-major in each block, as the CPU pages: a block's rows of one kv head are one run
            kv_shape = (num_blocks, attn.num_key_value_heads, block_size, attn.head_dim)
            layers.append(LayerCache(key=torch.zeros(kv_shape, dtype=self.dtype, device=device).transpose(1, 2),
                                     value=torch.zeros(kv_shape, dtype=self.dtype, device=device).transpose(1, 2),
                                     conv=conv))
        return InklingCaches(block_size=block_size, layers=layers)
