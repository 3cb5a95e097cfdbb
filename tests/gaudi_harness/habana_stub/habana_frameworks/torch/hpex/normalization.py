"""Stand-in for habana_frameworks.torch.hpex.normalization: `FusedRMSNorm`, the kernel vllm-gaudi's
HPURMSNorm (ops/hpu_layernorm.py) calls, computed on CPU from its documented semantics (no Habana code).

FusedRMSNorm.apply(x, weight, eps) -> weight * x / sqrt(mean(x^2 over the last dim) + eps), the mean in fp32
and the result in x's dtype. Each call counts in stand_in_ops.CALLS["FusedRMSNorm"], so a test can tell that
the HPU norm, not vLLM's native one, ran.
"""
from __future__ import annotations

import torch

from habana_frameworks.torch.stand_in_ops import CALLS


class FusedRMSNorm:
    @staticmethod
    def apply(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        CALLS["FusedRMSNorm"] += 1
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
        return (x.to(weight.dtype) * weight).to(dtype)
