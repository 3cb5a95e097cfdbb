"""vllm-gaudi's flat paged attention (`vllm_gaudi.extension.ops.flat_pa`) for the decode rows, where vllm-gaudi's
platform builds the model: the ALiBi-style `position_bias` [blocks, heads, block] carries Inkling's relative
logits, `block_bias` its masks, and vllm-gaudi runs its own softmax over each request's blocks (the fused
block-softmax kernels where its config enables them), with its matmul and KV-fetch modules, as its own
attention backend calls it. Importing this module needs neither vllm-gaudi nor Habana."""
from __future__ import annotations

import torch
from torch import nn


def on_gaudi_platform() -> bool:
    """Whether the process's vLLM platform is vllm-gaudi's (HPU)."""
    from vllm.platforms import current_platform

    return getattr(current_platform, "device_type", None) == "hpu"


class GaudiFlatPagedAttention(nn.Module):
    """flat_pa with the modules vllm-gaudi's attention backend hands it (HPUAttentionImpl: Matmul for Q.K and
    A.V, B2BMatmul for the block <-> batch maps, VLLMKVCache's fetch), registered here so vllm-gaudi's
    measurement and quantization hooks see them as they see its own."""

    def __init__(self) -> None:
        super().__init__()
        from vllm_gaudi.extension.utils import B2BMatmul, Matmul, VLLMKVCache

        self.matmul_qk, self.matmul_av = Matmul(), Matmul()
        self.batch2block_matmul, self.block2batch_matmul = B2BMatmul(), B2BMatmul()
        self.k_cache, self.v_cache = VLLMKVCache(), VLLMKVCache(is_v_cache=True)

    @classmethod
    def where_available(cls) -> "GaudiFlatPagedAttention | None":
        return cls() if on_gaudi_platform() else None

    def forward(self, flat, cache, scale: float) -> torch.Tensor:
        """[G, H*D] for the G decode rows of `flat` (modeling.FlatInputs) over `cache` (modeling.LayerCache). The
        types stay unimported: modeling imports this module."""
        from vllm_gaudi.extension.ops import flat_pa

        num_requests, heads, head_dim = flat.query.shape
        block_size = cache.key.shape[1]
        # one-hot block -> request map; padding blocks (owner G) map to no request
        block_mapping = torch.nn.functional.one_hot(flat.block_groups, num_requests + 1)[:, :num_requests]
        out = flat_pa(query=flat.query.reshape(num_requests, 1, heads * head_dim),
                      key_cache=cache.key.flatten(0, 1), value_cache=cache.value.flatten(0, 1),
                      block_list=flat.block_list, block_mapping=block_mapping.to(flat.query.dtype),
                      block_bias=flat.block_bias, block_groups=flat.block_groups, block_size=block_size,
                      scale=scale, matmul_qk_op=self.matmul_qk, position_bias=flat.position_bias,
                      matmul_av_op=self.matmul_av, batch2block_matmul_op=self.batch2block_matmul,
                      block2batch_matmul_op=self.block2batch_matmul, keys_fetch_func=self.k_cache.fetch_from_cache,
                      values_fetch_func=self.v_cache.fetch_from_cache, sinks=None, k_scales=None, v_scales=None)
        return out.reshape(num_requests, heads * head_dim)
