"""Stand-ins for the custom ops Intel's habana_frameworks registers under `torch.ops.hpu`, computed
on CPU from each op's documented semantics (no Habana code): only the ops vllm-gaudi calls for the
port. `CALLS` counts the calls, so a test can tell the op really ran.

torch.ops.hpu.mixture_of_experts(hidden_states [T, H], expert_routing_table [T, k] (expert ids),
router_weights [T, k], w12: one tensor per expert of [w1 | w2] (permuted_weights: [2I, H], else
[H, 2I]), w3: one per expert (permuted: [H, I], else [I, H]), activation, experts_min, experts_max,
chunk_size, total_experts) -> [T, H]: for every (t, j) whose expert e = table[t, j] lies in
[experts_min, experts_max], router_weights[t, j] * w3_e(act(x_t w1_e) * (x_t w2_e)), summed; expert
ids outside the range contribute nothing (expert-parallel slices). chunk_size and total_experts tune
the kernel and do not change the result.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CALLS = {"mixture_of_experts": 0, "FusedRMSNorm": 0}   # FusedRMSNorm: hpex/normalization.py

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}

_LIB = torch.library.Library("hpu", "DEF")
_LIB.define("mixture_of_experts(Tensor hidden_states, Tensor expert_routing_table, Tensor router_weights, "
            "Tensor[] w12, Tensor[] w3, bool permuted_weights=True, str activation='silu', "
            "int experts_min=0, int experts_max=0, int chunk_size=0, int total_experts=0) -> Tensor")


def mixture_of_experts(hidden_states, expert_routing_table, router_weights, w12, w3, permuted_weights=True,
                       activation="silu", experts_min=0, experts_max=0, chunk_size=0, total_experts=0):
    CALLS["mixture_of_experts"] += 1
    act = _ACTIVATIONS[activation]
    out = torch.zeros_like(hidden_states)
    for local, (w_in, w_out) in enumerate(zip(w12, w3)):
        expert = experts_min + local
        if expert > experts_max:
            break
        routed = expert_routing_table == expert                              # [T, k]
        tokens = routed.any(dim=-1).nonzero().flatten()
        if tokens.numel() == 0:
            continue
        weight = torch.where(routed, router_weights, torch.zeros_like(router_weights)).sum(dim=-1)
        x = hidden_states.index_select(0, tokens)
        projected = x @ (w_in.t() if permuted_weights else w_in)            # [n, 2I]
        gate, up = projected.chunk(2, dim=-1)
        y = (act(gate) * up) @ (w_out.t() if permuted_weights else w_out)   # [n, H]
        out.index_add_(0, tokens, y * weight.index_select(0, tokens)[:, None].to(y.dtype))
    return out


_LIB.impl("mixture_of_experts", mixture_of_experts, "CompositeExplicitAutograd")
