"""Inkling text backbone for HPU: PyTorch and vLLM's layers (math only; the vllm-gaudi glue lives elsewhere).

    config   = InklingPortConfig.from_dict(checkpoint_config)
    model    = InklingForCausalLM(config)                 # reads the INKLING_* knobs once
    weights.load_checkpoint(model, tensors)               # `model.llm.*` names, this rank's slabs
    caches   = model.allocate_caches(num_blocks, block_size)   # KV and conv state per block
    meta     = reference_step_metadata([RequestChunk(...), ...], block_size=..., ...)
    logits   = model.compute_logits(model(meta, caches)[meta.last_token_index])
"""
from inkling_hpu.model.config import InklingConfigError, InklingPortConfig
from inkling_hpu.model.knobs import KNOBS, Knobs, read_knobs
from inkling_hpu.model.metadata import RequestChunk, StepMetadata, reference_step_metadata
from inkling_hpu.model.modeling import (
    InklingCaches,
    InklingDecoderLayer,
    InklingForCausalLM,
    PipelineStage,
    TensorParallel,
)

__all__ = [
    "KNOBS", "Knobs", "read_knobs", "InklingConfigError", "InklingPortConfig", "RequestChunk", "StepMetadata",
    "reference_step_metadata", "InklingCaches", "InklingDecoderLayer", "InklingForCausalLM", "PipelineStage",
    "TensorParallel",
]
