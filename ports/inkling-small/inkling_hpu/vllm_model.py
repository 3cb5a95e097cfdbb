"""The class vLLM builds for Inkling, the same on every platform, and what it shares across them.

All math is in inkling_hpu.model. `InklingVllmModel` translates between vLLM and it:
- the vLLM config -> InklingPortConfig, the TP group's collectives, the pipeline stage, the start-up guards
  (settings, then the byte-level memory guard before any weight is read);
- the checkpoint -> parameters, through inkling_hpu.loader (text tensors only, this rank's slabs);
- vLLM's KV cache -> the model's paged KV: one vLLM `Attention` per decoder layer only holds the
  layer's cache (one KV group, FullAttentionSpecx<layers>; local layers apply their window inside
  attention), and declares the conv-state bytes the layer keeps per KV block, which the platform's
  pool carries in each page's padding (docs/caches.md);
- the KVCacheConfig the runner allocated -> the start-up refusals and lines (`kv_cache_config_ready`).
What differs by platform is a `Platform` adapter's (hpu_glue.HpuPlatform, cpu_glue.CpuPlatform): the
runner, the runtime flags, the holder class, the views of the pool (`caches`) and the translation of
its attention metadata into the model's calls and their StepMetadata (`model_calls`, built with tensor
ops by model/device_metadata.py on both). Each platform's
registered class is this one with its adapter named; neither overrides a method.
Importing it needs torch and vLLM, not Habana: nothing here calls a Habana API.
"""
from __future__ import annotations

import functools
import importlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn
from vllm.model_executor.models.interfaces import SupportsPP

from inkling_hpu import guards
from inkling_hpu.loader import TensorSpec, TextCheckpoint
from inkling_hpu.model import InklingForCausalLM, InklingPortConfig, PipelineStage, TensorParallel
from inkling_hpu.model import weights as weight_table
from inkling_hpu.model.metadata import StepMetadata

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
    """This worker's pipeline stage: the layers vLLM's make_layers builds on its PP rank."""
    from vllm.distributed import get_pp_group

    group = get_pp_group()
    return PipelineStage.of_rank(num_layers, group.rank_in_group, group.world_size)



def check_token_ids(tokenizer, config_vocab_size: int, rows: int, logits: int | None = None) -> str:
    """Refuse to start when a prompt token id vLLM admits (`tokenizer`: a vLLM tokenizer, None without one;
    the config's vocab_size) has no embedding row (`rows`): the IndexError in the worker would end the
    engine, every client's request with it; or when the head's `logits` width is not vLLM's vocabulary or
    leaves out an id of the tokenizer. Returns the start-up line saying which ids it admits."""
    ids = guards.tokenizer_ids(tokenizer)
    refusal = guards.token_id_refusal(ids, config_vocab_size, rows, logits)
    if refusal:
        raise guards.InklingConfigRefused("Inkling-Small refuses to start: " + refusal)
    return guards.token_id_line(ids, config_vocab_size, rows, logits)


def check_served_token_ids(model_config, rows: int, logits: int) -> str:
    """check_token_ids with the tokenizer vLLM's input processor checks prompts with (the same cached load)."""
    from vllm.tokenizers import cached_tokenizer_from_config

    return check_token_ids(cached_tokenizer_from_config(model_config), model_config.get_vocab_size(), rows, logits)


def check_checkpoint_token_ids(model_dir: str | os.PathLike) -> str:
    """check_token_ids on a checkpoint folder, its tokenizer and config read as vLLM reads them (the preflight,
    tools/tiny_model.py): the rows and the logits' width the port builds from that config."""
    from vllm.tokenizers import get_tokenizer
    from vllm.transformers_utils.config import get_config

    hf_config = get_config(str(model_dir), trust_remote_code=False)
    config = InklingPortConfig.from_object(hf_config)
    return check_token_ids(get_tokenizer(str(model_dir)), hf_config.get_text_config().vocab_size,
                           config.vocab_rows, config.vocab_out)


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


@dataclass
class ModelCall:
    """One run of the model over some of a step's input rows. vllm-gaudi's runner calls the model once per
    kind (prefills, decodes): one call, every row. vLLM's CPU worker packs a step into one call, which the
    CPU platform splits the same way."""

    step: StepMetadata
    rows: torch.Tensor | None = None   # the flat input rows it computes, in its tokens' order (None: all)


class InklingVllmModel(nn.Module, SupportsPP):
    """vLLM model class for Inkling: forward(input_ids, positions) -> hidden states; under pipeline parallel
    (SupportsPP) a stage of layers, hidden states handed between stages. `Platform` (a class attribute set
    by each platform's registered class) adapts the runner's pool and attention metadata."""

    Platform: type = None   # hpu_glue.HpuPlatform or cpu_glue.CpuPlatform

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        self.platform = self.Platform()
        guards.check(guards.settings_from_vllm_config(vllm_config, gaudi_runtime_config=self.platform.runtime_config()))
        self.vllm_config = vllm_config
        self.config = InklingPortConfig.from_object(vllm_config.model_config.hf_config)
        self.platform.check_pipeline_runner(vllm_config.parallel_config.pipeline_parallel_size)
        self.tp = _rank_and_collectives()
        self.inkling = InklingForCausalLM(self.config, tp=self.tp, stage=_pipeline_stage(self.config.num_hidden_layers),
                                          dtype=vllm_config.model_config.dtype)
        self.stage = self.inkling.stage
        logger.info("Inkling %s", check_served_token_ids(vllm_config.model_config, self.inkling.embedding_rows,
                                                         self.config.vocab_out))
        self.block_size = vllm_config.cache_config.block_size
        # One vLLM Attention per layer: it only holds the layer's KV cache (never called). Each
        # declares the bytes of conv state the layer keeps per KV block, which the platform adds to
        # the layer's KV page (vLLM sizes the pool with them).
        self.kv_holders = nn.ModuleList()
        dtype_bytes = torch.empty(0, dtype=self.inkling.dtype).element_size()
        taps = self.config.conv_kernel_size - 1
        holder_class = self.platform.holder_class()
        for i in self.stage.layer_ids:     # this stage's layers, under their global names
            attn = self.inkling.model.layers[i].self_attn
            holder = holder_class(
                num_heads=attn.num_heads, head_size=attn.head_dim, scale=1.0 / attn.head_dim,
                num_kv_heads=attn.num_key_value_heads, cache_config=vllm_config.cache_config,
                prefix=f"{prefix}model.layers.{i}.self_attn.attn")
            holder.extra_bytes_per_block = taps * sum(self.inkling.conv_channels(i).values()) * dtype_bytes
            self.kv_holders.append(holder)
        if not self.stage.is_whole_model:
            # says who it is: vLLM writes its "(Worker_PP0 pid=…)" prefix apart from the line, so unbuffered
            # workers' prefixes can land on another's line
            logger.info("Inkling pipeline stage %d of %d: layers %d..%d of %d%s (TP rank %d of %d)", self.stage.rank,
                        self.stage.size, self.stage.start, self.stage.end - 1, self.config.num_hidden_layers,
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
        self.logged_kv_lines = False      # the KV group, pool and conv-snapshot lines, once
        try:
            observe_kv_cache_config(*self.Platform.RUNNER)
        except (ImportError, AttributeError):
            pass          # built outside that runner (tests): the lines come at the first forward

    def kv_cache_config_ready(self, kv_cache_config, runner=None) -> None:
        """The KVCacheConfig the runner allocated, at start-up: refuse what the port cannot serve (one
        full-attention group at block 128, a pool that holds one max-length request) and log the KV
        group, the pool line and the conv-snapshot line from it."""
        self.platform.prepare_runner(self, kv_cache_config, runner)
        guards.check_kv_cache_config(kv_cache_config, self.block_size, self.vllm_config.model_config.max_model_len,
                                     len(self.kv_holders))
        self.log_conv_snapshots(kv_cache_config.num_blocks)

    def log_conv_snapshots(self, usable_blocks: int) -> None:
        logger.info("Inkling %s", guards.conv_snapshot_line(
            kv_shapes(self.inkling), self.config.hidden_size // self.tp.size, self.config.conv_kernel_size, self.block_size,
            torch.empty(0, dtype=self.inkling.dtype).element_size(), usable_blocks))
        self.platform.log_pool_checks(self)
        self.logged_kv_lines = True

    # --- weights --------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the text tensors ourselves and leave vLLM's iterator unstarted.

        vLLM's DefaultModelLoader hands us a generator over every tensor of every file (vision,
        audio and MTP included); a generator that is never iterated reads nothing."""
        del weights
        checkpoint = load_text_checkpoint(self.inkling, self._checkpoint_dir())
        logger.info("Inkling: loaded %.1f GB of text tensors from %s; %d vision/audio/MTP tensors left unread",
                    checkpoint.text_bytes / 1e9, checkpoint.dir, len(checkpoint.skipped))
        methods = sorted({type(layer.mlp.experts.routed_experts.quant_method).__name__
                          for layer in self.inkling.model.stage_layers if hasattr(layer.mlp, "experts")})
        logger.info("Inkling MoE: routed experts on vLLM's MoE layer, method %s", ", ".join(methods) or "none")
        return {name for name, _ in self.named_parameters()}

    def _checkpoint_dir(self) -> str:
        model = self.vllm_config.model_config.model
        if os.path.isdir(model):
            return model
        from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf

        return download_weights_from_hf(model, self.vllm_config.load_config.download_dir, ["*.safetensors"],
                                        revision=self.vllm_config.model_config.revision,
                                        ignore_patterns=["mtp.safetensors"])

    # --- forward --------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds=None, **kwargs):
        """Hidden states, one row per input token in input order, shaped as input_ids; on a stage before the
        last, vLLM's IntermediateTensors holding them for the next stage (which passes them back in
        `intermediate_tensors`, the same shape)."""
        from vllm.forward_context import get_forward_context

        meta = get_forward_context().attn_metadata
        if not meta:   # a dummy run before the KV cache exists (vLLM's CPU profiling run): nothing to attend
            return self._stage_output(torch.zeros(*input_ids.shape, self.config.hidden_size, dtype=self.inkling.dtype))
        caches, pad_block = self.platform.caches(self)
        previous = None
        if intermediate_tensors is not None:
            previous = intermediate_tensors["hidden_states"].reshape(-1, self.config.hidden_size)
        calls = self.platform.model_calls(self, input_ids, positions, meta, pad_block)
        if len(calls) == 1 and calls[0].rows is None:
            hidden = self.inkling(calls[0].step, caches, previous)
        else:     # rows no call computes (the runner's padding) stay zero
            hidden = torch.zeros(input_ids.numel(), self.config.hidden_size, dtype=self.inkling.dtype,
                                 device=input_ids.device)
            for call in calls:
                hidden[call.rows] = self.inkling(call.step, caches, None if previous is None else previous[call.rows])
        return self._stage_output(hidden.view(*input_ids.shape, -1))

    def _stage_output(self, hidden: torch.Tensor):
        if self.stage.last:
            return hidden
        from vllm.sequence import IntermediateTensors

        return IntermediateTensors({"hidden_states": hidden})

    def make_empty_intermediate_tensors(self, batch_size: int, dtype: torch.dtype, device: torch.device):
        """What a stage after the first receives: [tokens, hidden] (vLLM's runners reshape to the input's shape)."""
        return self.inkling.model.make_empty_intermediate_tensors(batch_size, dtype, device)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.inkling.compute_logits(hidden_states)

    def embed_input_ids(self, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.inkling.model.embed_tokens(input_ids)
