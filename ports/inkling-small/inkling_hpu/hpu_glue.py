"""The vllm-gaudi glue: the class vLLM builds for Inkling on HPU (HpuModelAdapter wraps it).

All math is in inkling_hpu.model. This module only translates between vLLM / vllm-gaudi and it:
- the vLLM config -> InklingPortConfig, the TP group's collectives, the start-up guards;
- the checkpoint -> parameters, through inkling_hpu.loader (text tensors only, this rank's slabs);
- vLLM's KV cache -> the model's paged KV: one vLLM `Attention` per decoder layer holds the layer's
  cache, so vllm-gaudi's get_kv_cache_spec gives every layer a FullAttentionSpec at block 128 (one
  KV group, FullAttentionSpecx<layers>); local layers apply their window inside attention;
- vllm-gaudi's per-step attention metadata (HPUAttentionMetadataV1, prompt or decode) -> the
  model's StepMetadata, built on the device with tensor ops from bucketed shapes (no read-back):
  prefill calls keep per-row block tables, decode calls keep vllm-gaudi's flat block list
  (FlatDecodeGroup); the conv state lives per KV block in the pool vllm-gaudi's runner allocates
  (each page's padding, bound as `extra_block_state`: patch conv-snapshot-pages);
- each MoE layer's routed experts -> vllm-gaudi's fused MoE op (use_gaudi_moe_op);
- the device's memory -> the byte-level start-up guard (guards.MemoryPlan).
Importing it needs torch and vLLM, not Habana: nothing here calls a Habana API.

On CPU, tests/cpu/test_plugin.py and test_prefix_conv_state.py run this class inside vllm-gaudi's
real HPUModelRunner and HpuModelAdapter (the CPU harness; the latter with vLLM's real scheduler and
prefix caching), the pool allocated by the runner's own initialize_kv_cache: fp32 greedy tokens equal
transformers'. Not exercised there: Habana kernels and graphs, TP collectives. The start-up lines and refusals of
`kv_cache_config_ready` run in a real server through the CPU glue (cpu_glue.py, a subclass).
"""
from __future__ import annotations

import functools
import importlib
import json
import logging
import os
import time
from typing import Iterable

import torch
from torch import nn

from inkling_hpu import guards
from inkling_hpu.loader import TensorSpec, TextCheckpoint
from inkling_hpu.model import InklingForCausalLM, InklingPortConfig, PipelineStage, TensorParallel
from inkling_hpu.model.metadata import AttentionGroup, FlatDecodeGroup, StepMetadata
from inkling_hpu.model import weights as weight_table
from inkling_hpu.model.modeling import InklingCaches, LayerCache

# Under vLLM's logger hierarchy: vLLM's handler prints it in the server log, in every process.
logger = logging.getLogger("vllm.inkling_hpu")


def observe_kv_cache_config(module: str, runner: str) -> None:
    """After `runner.initialize_kv_cache(kv_cache_config)` allocates the pool, hand the model the
    KVCacheConfig the runner really used (vLLM gives models no such hook). Installed once per process,
    by the model class, on the runner class that builds it."""
    cls = getattr(importlib.import_module(module), runner)
    original = cls.initialize_kv_cache
    if getattr(original, "inkling_observer", False):
        return

    @functools.wraps(original)
    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        result = original(self, kv_cache_config, *args, **kwargs)
        # vLLM's runner takes is_profiling second, by position (the CPU runner passes it so) or by name
        if not kwargs.get("is_profiling", args[0] if args else False):
            model = self.get_model()
            while model is not None and not hasattr(model, "kv_cache_config_ready"):
                model = getattr(model, "model", None)     # HpuModelAdapter wraps the model class
            if model is not None:
                model.kv_cache_config_ready(kv_cache_config, runner=self)
        return result

    initialize_kv_cache.inkling_observer = True
    cls.initialize_kv_cache = initialize_kv_cache


def _rank_and_collectives() -> TensorParallel:
    from vllm.distributed import (get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size,
                                  tensor_model_parallel_all_gather, tensor_model_parallel_reduce_scatter)

    size = get_tensor_model_parallel_world_size()
    if size == 1:
        return TensorParallel()
    return TensorParallel(rank=get_tensor_model_parallel_rank(), size=size,
                          all_gather_last_dim=lambda t: tensor_model_parallel_all_gather(t, dim=-1),
                          reduce_scatter_last_dim=lambda t: tensor_model_parallel_reduce_scatter(t, dim=-1))


def _pipeline_stage(num_layers: int) -> PipelineStage:
    """This worker's pipeline stage: the layers vLLM's get_pp_indices gives its rank (VLLM_PP_LAYER_PARTITION
    included), as vLLM's own models split them."""
    from vllm.distributed import get_pp_group
    from vllm.distributed.utils import get_pp_indices

    group = get_pp_group()
    start, end = get_pp_indices(num_layers, group.rank_in_group, group.world_size)
    return PipelineStage(start, end, first=group.is_first_rank, last=group.is_last_rank)


def _gaudi_runtime_config():
    """vllm-gaudi's resolved runtime flags (contiguous PA, merged prefill), when installed."""
    try:
        from vllm_gaudi.extension.runtime import get_config
    except ImportError:
        return None
    return get_config()


def _vllm_gaudi_stamp() -> dict | None:
    """The fix-pack stamp of the installed vllm_gaudi (what install.sh applied), None without vllm_gaudi."""
    try:
        import vllm_gaudi
    except ImportError:
        return None
    stamp = os.path.join(os.path.dirname(vllm_gaudi.__file__), "cookbook-fixes.json")
    try:
        with open(stamp) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _device_memory_bytes() -> int | None:
    """The device's total memory (torch.hpu, which habana_frameworks registers), None without one."""
    hpu = getattr(torch, "hpu", None)
    return int(hpu.mem_get_info()[1]) if hpu is not None and hasattr(hpu, "mem_get_info") else None


def kv_shapes(model: InklingForCausalLM) -> list[tuple[int, int]]:
    """(KV heads on this rank, head dim) of each layer: what the guards' byte arithmetic takes."""
    return [(layer.self_attn.num_key_value_heads, layer.self_attn.head_dim) for layer in model.model.stage_layers]


def memory_plan(vllm_config, model: InklingForCausalLM, block_size: int, device_bytes: int,
                environ=os.environ) -> guards.MemoryPlan:
    """This rank's memory plan: the model's own parameter bytes, the pool of --num-gpu-blocks-override
    pages (none set: vllm-gaudi sizes the pool within its budget, so only the weights are checked), and
    vllm-gaudi's budget arithmetic (hpu_worker.determine_available_memory)."""
    dtype_bytes = torch.empty(0, dtype=model.dtype).element_size()
    shapes = kv_shapes(model)
    eager = vllm_config.model_config.enforce_eager
    return guards.MemoryPlan(
        device_bytes=device_bytes,
        weights_bytes=sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]),
        kv_bytes_per_block=guards.kv_bytes_per_block(shapes, block_size, dtype_bytes),
        conv_bytes_per_block=guards.conv_snapshot_bytes_per_block(
            shapes, model.config.hidden_size // model.tp.size, model.config.conv_kernel_size, dtype_bytes),
        blocks=vllm_config.cache_config.num_gpu_blocks_override or 0,
        utilization=vllm_config.cache_config.gpu_memory_utilization,
        graph_reserved=0.0 if eager else float(environ.get("VLLM_GRAPH_RESERVED_MEM", "0.1")))


def load_text_checkpoint(model: InklingForCausalLM, checkpoint_dir: str | os.PathLike) -> TextCheckpoint:
    """Fill `model` (this rank's shapes, model.tp) from the checkpoint's `model.llm.*` tensors.

    The loader reads only this rank's slab of each split tensor (the split dims come from the
    model's name table), which is then loaded as a one-rank tensor. Every required tensor must be
    present and every text tensor must be expected, or CheckpointError names what differs."""
    checkpoint = TextCheckpoint(checkpoint_dir)
    tp, stage = model.tp, model.stage
    # the whole model's tensors must match the checkpoint's, though a pipeline stage reads only its own
    checkpoint.refuse_unexpected(weight_table.expected_checkpoint_names(model.config, include_optional=True))
    specs = []
    for name in weight_table.expected_checkpoint_names(model.config, include_optional=True, stage=stage):
        rule, _ = weight_table.resolve(name, model.config)
        specs.append(TensorSpec(name, None, shard_dim=rule.dim if tp.size > 1 else None, optional=rule.optional))
    rank_bytes = sum(checkpoint.text[s.name].nbytes // (tp.size if s.shard_dim is not None else 1)
                     for s in specs if s.name in checkpoint.text)
    presharded = checkpoint.presharded(tp.size) if tp.size > 1 else None
    if presharded is not None:
        logger.info("Inkling: %s reads its own file of the pre-sharded layout %s", worker_name(model), presharded[0])
    progress = LoadProgress(worker_name(model), rank_bytes)
    for name, piece in checkpoint.load(specs, rank=tp.rank, world_size=tp.size, allow_unexpected=True):
        weight_table.load_tensor(model, name, piece)
        progress.add(piece.numel() * piece.element_size())
    return checkpoint


def worker_name(model: InklingForCausalLM) -> str:
    """"rank r of n" (tensor parallel), with the pipeline stage's layers when the model is split in stages."""
    stage, name = model.stage, f"rank {model.tp.rank} of {model.tp.size}"
    return name if stage.is_whole_model else f"{name}, stage of layers {stage.start}..{stage.end - 1}"


class LoadProgress:
    """The load's progress in the server log, per rank: at each tenth of the rank's bytes and at least
    every PERIOD_S seconds (a 532 GB cold start takes tens of minutes), bytes read, rate, time left."""

    PERIOD_S = 30.0

    def __init__(self, who: str, total: int) -> None:
        self.who, self.total, self.done = who, max(total, 1), 0
        self.start = self.last = time.perf_counter()
        self.next_tenth = 1

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.perf_counter()
        tenth = self.done * 10 // self.total
        if tenth < self.next_tenth and now - self.last < self.PERIOD_S:
            return
        self.next_tenth, self.last = tenth + 1, now
        rate = self.done / max(now - self.start, 1e-9)
        logger.info("Inkling loading, %s: %s of %s (%d%%), %s/s, about %.0f s left", self.who, _size(self.done),
                    _size(self.total), 100 * self.done // self.total, _size(rate), (self.total - self.done) / rate)


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def use_gaudi_moe_op(model: InklingForCausalLM) -> int:
    """Hand each MoE layer's routed experts to vllm-gaudi's fused MoE op (`VllmMixtureOfExpertsOp`,
    torch.ops.hpu.mixture_of_experts): per-expert views of the loaded weights (no copy; [gate | up] x
    hidden and hidden x width, the op's permuted layout), the router's top-k ids and weights as its
    routing table, all experts of this rank (experts_min 0, experts_max E-1; tensor parallel splits
    each expert's width). Static shapes, no host sync. Returns the layers handed over; 0 where
    vllm-gaudi is not installed (vLLM's CPU worker: the model's own routed dispatch)."""
    try:
        import vllm_gaudi  # noqa: F401
    except ModuleNotFoundError:
        return 0
    from vllm_gaudi.extension.ops import VllmMixtureOfExpertsOp

    layers = 0
    for layer in model.model.stage_layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        count = experts.num_experts
        op = VllmMixtureOfExpertsOp(count, count, experts_min=0, experts_max=count - 1)
        for expert in range(count):
            op.w13_list[expert].set_weight(experts.gate_up_proj.data[expert])
            op.w2_list[expert].set_weight(experts.down_proj.data[expert])
        experts.use_moe_op(functools.partial(_gaudi_moe, op))
        layers += 1
    return layers


def _gaudi_moe(op, hidden_states: torch.Tensor, topk_indices: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    return op(hidden_states, topk_indices, topk_weights.to(hidden_states.dtype), permuted_weights=True,
              activation="silu")


# --- step metadata on the device --------------------------------------------------------------------
# vllm-gaudi runs prefills and decodes as separate forward calls: prefill [bs, L] with each row's context
# blocks (block_list [bs * context bucket]) and context length; decode [bs, 1] with a flat block_list
# and block_groups (the request of each block; HpuModelAdapter turns padding into bs). A prefill row
# with context is always alone in its call (_can_merge_prefill_contents), so no row of a call reads a
# block another row of the same call writes (the CPU metadata builder handles that case too).

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


class HpuInklingForCausalLM(nn.Module):
    """vLLM model class for Inkling on HPU: forward(input_ids, positions) -> hidden states."""

    RUNNER = ("vllm_gaudi.v1.worker.hpu_model_runner", "HPUModelRunner")   # (module, class) that builds it
    supports_pp = True      # vLLM's SupportsPP: stages of layers, hidden states handed between them

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        guards.check(guards.settings_from_vllm_config(vllm_config, gaudi_runtime_config=self._runtime_config()))
        self.vllm_config = vllm_config
        self.config = InklingPortConfig.from_object(vllm_config.model_config.hf_config)
        self._check_pipeline_runner(vllm_config.parallel_config.pipeline_parallel_size)
        self.tp = _rank_and_collectives()
        self.inkling = InklingForCausalLM(self.config, tp=self.tp, stage=_pipeline_stage(self.config.num_hidden_layers))
        self.stage = self.inkling.stage
        self.inkling.cast(vllm_config.model_config.dtype)
        self.block_size = vllm_config.cache_config.block_size
        # One vLLM Attention per layer: it only holds the layer's KV cache (never called). Each
        # declares the bytes of conv state the layer keeps per KV block, which the runner patch
        # conv-snapshot-pages adds to the layer's KV page (vLLM sizes the pool with them).
        self.kv_holders = nn.ModuleList()
        dtype_bytes = torch.empty(0, dtype=self.inkling.dtype).element_size()
        taps = self.config.conv_kernel_size - 1
        for i in self.stage.layer_ids:     # this stage's layers, under their global names
            attn = self.inkling.model.layers[i].self_attn
            holder = self._holder_class()(
                num_heads=attn.num_heads, head_size=attn.head_dim, scale=1.0 / attn.head_dim,
                num_kv_heads=attn.num_key_value_heads, cache_config=vllm_config.cache_config,
                prefix=f"{prefix}model.layers.{i}.self_attn.attn")
            holder.extra_bytes_per_block = taps * sum(self.inkling.conv_channels(i).values()) * dtype_bytes
            self.kv_holders.append(holder)
        if not self.stage.is_whole_model:
            logger.info("Inkling pipeline stage: layers %d..%d of %d%s (TP rank %d of %d)", self.stage.start,
                        self.stage.end - 1, self.config.num_hidden_layers,
                        "".join(part for part, held in ((", the embedding", self.stage.first),
                                                        (", the final norm and the head", self.stage.last)) if held),
                        self.tp.rank, self.tp.size)
        device_bytes = _device_memory_bytes()
        if device_bytes is not None:      # the byte-level guard, before any weight is read
            plan = memory_plan(vllm_config, self.inkling, self.block_size, device_bytes)
            refusal = plan.refusal()
            if refusal:
                raise guards.InklingConfigRefused("Inkling-Small refuses to start: " + refusal)
            logger.info("Inkling memory per rank: %s", plan.arithmetic())
        self._layer_caches: list[LayerCache] | None = None     # the CPU glue's page views, built once
        self._logged_kv_line = False
        try:
            observe_kv_cache_config(*self.RUNNER)
        except (ImportError, AttributeError):
            pass          # built outside that runner (tests): the lines come at the first forward

    def _runtime_config(self):
        return _gaudi_runtime_config()

    def _check_pipeline_runner(self, pp_size: int) -> None:
        """vllm-gaudi's HPU runner hands activations between stages only from its PR #1634 on (absent at the
        page's 091bbadd): without it each stage would run as if it were the whole model."""
        if pp_size == 1:
            return
        runner = getattr(importlib.import_module(self.RUNNER[0]), self.RUNNER[1])
        if not hasattr(runner, "_pp_recv_intermediate_tensors"):
            raise guards.InklingConfigRefused(
                f"Inkling-Small refuses to start: --pipeline-parallel-size {pp_size}: expected a vllm-gaudi whose HPU "
                f"model runner sends and receives the stages' activations (HPUModelRunner._pp_recv_intermediate_tensors, "
                f"vllm-gaudi PR #1634), found {self.RUNNER[0]}.{self.RUNNER[1]} without it. Serve at pipeline-parallel "
                f"size 1 or on a vllm-gaudi that carries it.")

    def _holder_class(self):
        from vllm.model_executor.layers.attention import Attention

        return Attention

    def kv_cache_config_ready(self, kv_cache_config, runner=None) -> None:
        """The KVCacheConfig the runner allocated, at start-up: refuse what the port cannot serve (one
        full-attention group at block 128, a pool that holds one max-length request) and log the KV
        group, the pool line and the conv-snapshot line from it."""
        guards.check_kv_cache_config(kv_cache_config, self.block_size, self.vllm_config.model_config.max_model_len,
                                     len(self.kv_holders))
        self._log_conv_snapshots(kv_cache_config.num_blocks)
        self._logged_kv_line = True

    def _log_conv_snapshots(self, num_blocks: int) -> None:
        logger.info("Inkling %s", guards.conv_snapshot_line(
            kv_shapes(self.inkling), self.config.hidden_size // self.tp.size, self.config.conv_kernel_size, self.block_size,
            torch.empty(0, dtype=self.inkling.dtype).element_size(), num_blocks))
        missing = guards.pages_patch_missing(_vllm_gaudi_stamp())
        if missing:
            logger.warning("Inkling: %s", missing)

    # --- weights --------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the text tensors ourselves and leave vLLM's iterator unstarted.

        vLLM's DefaultModelLoader hands us a generator over every tensor of every file (vision,
        audio and MTP included); a generator that is never iterated reads nothing."""
        del weights
        checkpoint = load_text_checkpoint(self.inkling, self._checkpoint_dir())
        logger.info("Inkling: loaded %.1f GB of text tensors from %s; %d vision/audio/MTP tensors left unread",
                    checkpoint.text_bytes / 1e9, checkpoint.dir, len(checkpoint.skipped))
        fused = use_gaudi_moe_op(self.inkling)
        logger.info("Inkling MoE: %s", f"{fused} layers' routed experts through vllm-gaudi's fused MoE op" if fused
                    else "routed experts by sorted dispatch (each token through its top-k experts only)")
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
        """The model's views of the pool vllm-gaudi's runner allocated (initialize_kv_cache) and the pad
        block id: each layer's K and V bound on its holder, [(blocks + pad block) * block, kv heads, dim],
        and its conv state in the holder's `extra_block_state`, the bytes the layer's page was padded
        with (patch conv-snapshot-pages). Nothing is allocated here."""
        layers, pad_block = [], None
        for i, holder in zip(self.stage.layer_ids, self.kv_holders):
            cache = holder.kv_cache[0] if isinstance(holder.kv_cache, list) else holder.kv_cache
            key, value = cache[0], cache[1]
            blocks_with_pad = key.shape[0] // self.block_size     # vllm-gaudi's pad block is the last one
            shape = (blocks_with_pad, self.block_size) + tuple(key.shape[1:])
            layers.append(LayerCache(key=key.view(shape), value=value.view(shape),
                                     conv=self._conv_views(i, holder, blocks_with_pad)))
            pad_block = blocks_with_pad - 1
        if not self._logged_kv_line:
            # The memory guard on the pool vLLM really allocated (pad_block = the usable blocks).
            max_model_len = self.vllm_config.model_config.max_model_len
            refusal = guards.kv_pool_refusal(pad_block, self.block_size, max_model_len)
            if refusal:
                raise guards.InklingConfigRefused("Inkling-Small refuses to start: " + refusal)
            # The runner's KVCacheConfig was not seen (a runner without the observer): say so, from the cache.
            logger.info("Inkling KV cache (from the bound cache, not a KVCacheConfig): %d layers; %s", len(layers),
                        guards.kv_pool_line(pad_block, self.block_size, max_model_len))
            self._log_conv_snapshots(pad_block)
            self._logged_kv_line = True
        return InklingCaches(block_size=self.block_size, layers=layers), pad_block

    def _conv_views(self, layer_idx: int, holder, blocks_with_pad: int) -> dict[str, torch.Tensor]:
        """Stream -> [blocks, kernel - 1, channels] views of the layer's `extra_block_state` rows."""
        state = getattr(holder, "extra_block_state", None)
        expected = (blocks_with_pad, holder.extra_bytes_per_block)
        if state is None or tuple(state.shape) != expected:
            found = "none" if state is None else f"{tuple(state.shape)}"
            raise guards.InklingConfigRefused(
                f"Inkling-Small refuses to run: layer {layer_idx}'s conv state: expected vllm-gaudi's runner to bind "
                f"{expected[0]} blocks x {expected[1]} bytes (its KV page padding) as extra_block_state, found {found}. "
                f"Apply the port's runner patch {guards.PAGES_PATCH} (ports/inkling-small/patches/port.yaml; install.sh does).")
        rows = state.view(self.inkling.dtype)
        taps, views, offset = self.config.conv_kernel_size - 1, {}, 0
        for stream, width in self.inkling.conv_channels(layer_idx).items():
            views[stream] = rows[:, offset:offset + taps * width].unflatten(1, (taps, width))
            offset += taps * width
        return views

    # --- forward --------------------------------------------------------------------------------
    def step_metadata(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, pad_block: int) -> StepMetadata:
        """The model's StepMetadata from vllm-gaudi's attention metadata, on the device, with tensor ops
        only: no read-back, every shape from the bucketed input shapes."""
        taps = self.config.conv_kernel_size - 1
        if meta.is_prompt:
            if os.environ.get("INKLING_GLUE_CHECKS", "0") == "1":
                check_context_blocks(meta.context_lens_tensor, meta.block_list, self.block_size)
            return prefill_step_metadata(input_ids, positions, meta.slot_mapping, meta.context_lens_tensor,
                                         meta.block_list, block_size=self.block_size, pad_block=pad_block, taps=taps)
        return decode_step_metadata(input_ids, positions, meta.slot_mapping, meta.block_list, meta.block_groups,
                                    getattr(meta, "window_block_list", None), getattr(meta, "window_block_groups", None),
                                    block_size=self.block_size, pad_block=pad_block, taps=taps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds=None, **kwargs):
        """Hidden states, one row per input token in input order, shaped as input_ids; on a stage before the
        last, vLLM's IntermediateTensors holding them for the next stage (which passes them back in
        `intermediate_tensors`, the same shape)."""
        from vllm.forward_context import get_forward_context

        caches, pad_block = self._caches()
        step = self.step_metadata(input_ids, positions, get_forward_context().attn_metadata, pad_block)
        previous = None
        if intermediate_tensors is not None:
            previous = intermediate_tensors["hidden_states"].reshape(-1, self.config.hidden_size)
        hidden = self.inkling(step, caches, previous)
        return self._stage_output(hidden.view(*input_ids.shape, -1))

    def _stage_output(self, hidden: torch.Tensor):
        if self.stage.last:
            return hidden
        from vllm.sequence import IntermediateTensors

        return IntermediateTensors({"hidden_states": hidden})

    def make_empty_intermediate_tensors(self, batch_size: int, dtype: torch.dtype, device: torch.device):
        """What a stage after the first receives: [tokens, hidden] (vLLM's runners reshape to the input's shape)."""
        from vllm.sequence import IntermediateTensors

        return IntermediateTensors({"hidden_states": torch.zeros(batch_size, self.config.hidden_size, dtype=dtype,
                                                                 device=device)})

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.inkling.compute_logits(hidden_states)

    def embed_input_ids(self, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.inkling.model.embed_tokens(input_ids)
