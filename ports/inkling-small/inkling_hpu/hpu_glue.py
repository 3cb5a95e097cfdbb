"""The vllm-gaudi platform: the class vLLM builds for Inkling on HPU (HpuModelAdapter wraps it), which is
vllm_model.InklingVllmModel with this adapter.

`HpuPlatform` only translates vllm-gaudi's side:
- its runtime flags (contiguous PA, merged prefill) for the start-up guards, and its runner for the
  pipeline-parallel check;
- the pool vllm-gaudi's runner allocates: each layer's K and V bound on its holder, and the conv state
  per KV block in each page's padding, bound as `extra_block_state` (patch conv-snapshot-pages);
- vllm-gaudi's per-step attention metadata (HPUAttentionMetadataV1, prompt or decode) -> the model's
  StepMetadata, built on the device with tensor ops from bucketed shapes (model/device_metadata.py):
  prefill calls keep per-row block tables, decode calls keep vllm-gaudi's flat block list
  (FlatDecodeGroup).
The model's layers are vLLM's: on HPU vllm-gaudi's own implementations run them (HPURMSNorm, the fused MoE
method's op for the routed experts), with nothing wired here.
Importing it needs torch and vLLM, not Habana: nothing here calls a Habana API.

On CPU, tests/cpu/test_plugin.py and test_prefix_conv_state.py run this class inside vllm-gaudi's
real HPUModelRunner and HpuModelAdapter (the CPU harness; the latter with vLLM's real scheduler and
prefix caching), the pool allocated by the runner's own initialize_kv_cache: fp32 greedy tokens equal
transformers'. Not exercised there: Habana kernels and graphs, TP collectives. The shared start-up lines
and refusals run in a real server through the CPU platform (cpu_glue.py).
"""
from __future__ import annotations

import importlib
import json
import os

import torch

from inkling_hpu import guards
from inkling_hpu.model.device_metadata import check_context_blocks, decode_step_metadata, prefill_step_metadata
from inkling_hpu.model.metadata import StepMetadata
from inkling_hpu.model.modeling import InklingCaches, LayerCache
from inkling_hpu.vllm_model import InklingVllmModel, ModelCall, logger


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



class HpuPlatform:
    """vllm-gaudi's runner, pool and attention metadata for InklingVllmModel."""

    RUNNER = ("vllm_gaudi.v1.worker.hpu_model_runner", "HPUModelRunner")   # (module, class) that builds it

    def runtime_config(self):
        return _gaudi_runtime_config()

    def holder_class(self):
        from vllm.model_executor.layers.attention import Attention

        return Attention

    def check_pipeline_runner(self, pp_size: int) -> None:
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

    def prepare_runner(self, model: InklingVllmModel, kv_cache_config, runner) -> None:
        """Nothing to prepare: vllm-gaudi's runner sizes the pages (conv-snapshot-pages) and logs the decode
        window (patch decode-window)."""

    def log_pool_checks(self, model: InklingVllmModel) -> None:
        missing = guards.pages_patch_missing(_vllm_gaudi_stamp())
        if missing:
            logger.warning("Inkling: %s", missing)

    def caches(self, model: InklingVllmModel) -> tuple[InklingCaches, int]:
        """The model's views of the pool vllm-gaudi's runner allocated (initialize_kv_cache) and the pad
        block id: each layer's K and V bound on its holder, [(usable blocks + pad block) * block, kv heads,
        dim], and its conv state in the holder's `extra_block_state`, the bytes the layer's page was padded
        with (patch conv-snapshot-pages). Nothing is allocated here."""
        layers, usable_blocks = [], 0
        for i, holder in zip(model.stage.layer_ids, model.kv_holders):
            cache = holder.kv_cache[0] if isinstance(holder.kv_cache, list) else holder.kv_cache
            key, value = cache[0], cache[1]
            blocks_with_pad = key.shape[0] // model.block_size
            shape = (blocks_with_pad, model.block_size) + tuple(key.shape[1:])
            layers.append(LayerCache(key=key.view(shape), value=value.view(shape),
                                     conv=self._conv_views(model, i, holder, blocks_with_pad)))
            usable_blocks = blocks_with_pad - 1
        pad_block = usable_blocks      # vllm-gaudi's pad block is the last one
        if not model.logged_kv_lines:
            # The memory guard on the pool vLLM really allocated.
            max_model_len = model.vllm_config.model_config.max_model_len
            refusal = guards.kv_pool_refusal(usable_blocks, model.block_size, max_model_len)
            if refusal:
                raise guards.InklingConfigRefused("Inkling-Small refuses to start: " + refusal)
            # The runner's KVCacheConfig was not seen (a runner without the observer): say so, from the cache.
            logger.info("Inkling KV cache (from the bound cache, not a KVCacheConfig): %d layers; %s", len(layers),
                        guards.kv_pool_line(usable_blocks, model.block_size, max_model_len))
            model.log_conv_snapshots(usable_blocks)
        return InklingCaches(block_size=model.block_size, layers=layers), pad_block

    @staticmethod
    def _conv_views(model: InklingVllmModel, layer_idx: int, holder, blocks_with_pad: int) -> dict[str, torch.Tensor]:
        """Stream -> [blocks, kernel - 1, channels] views of the layer's `extra_block_state` rows."""
        state = getattr(holder, "extra_block_state", None)
        expected = (blocks_with_pad, holder.extra_bytes_per_block)
        if state is None or tuple(state.shape) != expected:
            found = "none" if state is None else f"{tuple(state.shape)}"
            raise guards.InklingConfigRefused(
                f"Inkling-Small refuses to run: layer {layer_idx}'s conv state: expected vllm-gaudi's runner to bind "
                f"{expected[0]} blocks x {expected[1]} bytes (its KV page padding) as extra_block_state, found {found}. "
                f"Apply the port's runner patch {guards.PAGES_PATCH} (ports/inkling-small/patches/port.yaml; install.sh does).")
        rows = state.view(model.inkling.dtype)
        taps, views, offset = model.config.conv_kernel_size - 1, {}, 0
        for stream, width in model.inkling.conv_channels(layer_idx).items():
            views[stream] = rows[:, offset:offset + taps * width].unflatten(1, (taps, width))
            offset += taps * width
        return views

    def model_calls(self, model: InklingVllmModel, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                    pad_block: int) -> list[ModelCall]:
        """vllm-gaudi's runner already calls the model once per kind (prefills, decodes): one call."""
        return [ModelCall(self.step_metadata(model, input_ids, positions, meta, pad_block))]

    def step_metadata(self, model: InklingVllmModel, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                      pad_block: int) -> StepMetadata:
        """The model's StepMetadata from vllm-gaudi's attention metadata, on the device, with tensor ops
        only: no read-back, every shape from the bucketed input shapes."""
        taps = model.config.conv_kernel_size - 1
        if meta.is_prompt:
            if os.environ.get("INKLING_GLUE_CHECKS", "0") == "1":
                check_context_blocks(meta.context_lens_tensor, meta.block_list, model.block_size)
            return prefill_step_metadata(input_ids, positions, meta.slot_mapping, meta.context_lens_tensor,
                                         meta.block_list, block_size=model.block_size, pad_block=pad_block, taps=taps)
        return decode_step_metadata(input_ids, positions, meta.slot_mapping, meta.block_list, meta.block_groups,
                                    getattr(meta, "window_block_list", None), getattr(meta, "window_block_groups", None),
                                    block_size=model.block_size, pad_block=pad_block, taps=taps)


class HpuInklingForCausalLM(InklingVllmModel):
    """The vLLM model class on HPU: InklingVllmModel on vllm-gaudi's runner."""

    Platform = HpuPlatform
