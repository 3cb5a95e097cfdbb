"""Routed experts: each token computes only its top-k experts, on CPU (the model's sorted dispatch) and
on HPU (vllm-gaudi's fused MoE op, here through the harness's CPU stand-in of torch.ops.hpu), and
both equal the all-experts reference on random routings, edge cases included."""
from __future__ import annotations

import pytest
import torch

from inkling_hpu.model import modeling
from inkling_hpu.model.modeling import all_experts_reference, routed_experts
from inkling_hpu.model.weights import split_gate_up


def random_moe(num_tokens: int, num_experts: int, top_k: int, hidden: int, width: int, seed: int = 0):
    """Weights, inputs and a routing with the cases a router can and cannot produce: experts no token
    routed to, a top-k weight of exactly 0, and a token whose top-k names one expert twice."""
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * width, hidden, generator=g) / hidden ** 0.5
    down = torch.randn(num_experts, hidden, width, generator=g) / width ** 0.5
    x = torch.randn(num_tokens, hidden, generator=g)
    # only the first half of the experts are ever routed to: the rest get no token
    indices = torch.stack([torch.randperm(num_experts // 2, generator=g)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=g)
    weights[0, 0] = 0.0
    indices[-1, 1] = indices[-1, 0]
    return x, gate_up, down, indices, weights


@pytest.mark.parametrize("num_tokens", [1, 4, 16, 300])     # up to 4: fewer pairs than experts (routed_pairs)
def test_routed_experts_equal_the_all_experts_reference(num_tokens):
    x, gate_up, down, indices, weights = random_moe(num_tokens, 16, 4, 64, 32, seed=num_tokens)
    routed = routed_experts(x, gate_up, down, indices, weights)
    reference = all_experts_reference(x, gate_up, down, indices, weights)
    # fp32: the same sums in the same order; only the matmuls' rounding differs (fewer rows per call)
    torch.testing.assert_close(routed, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_tokens", [3, 64])
def test_routed_experts_in_bf16_stay_within_bf16_rounding_of_the_reference(num_tokens):
    x, gate_up, down, indices, weights = random_moe(num_tokens, 16, 4, 64, 32)
    cast = [t.to(torch.bfloat16) for t in (x, gate_up, down)]
    routed = routed_experts(*cast, indices, weights.to(torch.bfloat16)).float()
    reference = all_experts_reference(x, gate_up, down, indices, weights)
    torch.testing.assert_close(routed, reference, rtol=2e-2, atol=2e-2)


def test_each_token_goes_through_its_top_k_experts_only(monkeypatch):
    """Rows that reach an expert's gate/up matmul: one per (token, slot), none for the experts a token
    did not route to (the reference computes num_tokens rows for every expert)."""
    x, gate_up, down, indices, weights = random_moe(40, 16, 4, 64, 32)
    rows = []
    real_linear = modeling.F.linear

    def counting(inputs, weight, *args):
        if weight.shape == gate_up.shape[1:]:
            rows.append(inputs.shape[0])
        return real_linear(inputs, weight, *args)

    monkeypatch.setattr(modeling.F, "linear", counting)
    routed_experts(x, gate_up, down, indices, weights)
    assert sum(rows) == indices.numel() and len(rows) == len(set(indices.flatten().tolist()))
    rows.clear()
    all_experts_reference(x, gate_up, down, indices, weights)
    assert sum(rows) == 40 * 16


def test_the_checkpoint_s_interleaved_w13_splits_into_gate_then_up_rows():
    interleaved = torch.tensor([[10, 20, 11, 21, 12, 22]]).t()      # g0 u0 g1 u1 g2 u2 along dim 0
    assert split_gate_up(interleaved, 0).flatten().tolist() == [10, 11, 12, 20, 21, 22]
    experts = torch.arange(2 * 4 * 3).view(2, 4, 3)                # [experts, 2 * width, hidden]
    split = split_gate_up(experts, 1)
    assert torch.equal(split[:, :2], experts[:, 0::2]) and torch.equal(split[:, 2:], experts[:, 1::2])


def scenario_moe_paths(port_dir: str) -> dict:
    """In the harness: a tiny Inkling's MoE layer with its routed experts handed to vllm-gaudi's real
    VllmMixtureOfExpertsOp by the HPU glue (the op itself: the stand-in of torch.ops.hpu); the
    routed experts through it, through the model's sorted dispatch and through the reference."""
    import json
    from pathlib import Path

    from habana_frameworks.torch import stand_in_ops
    from vllm.config import set_current_vllm_config

    from gaudi_harness import builders
    from inkling_hpu import parity
    from inkling_hpu.hpu_glue import use_gaudi_moe_op
    from inkling_hpu.model import InklingForCausalLM, InklingPortConfig
    from inkling_hpu.model.knobs import Knobs

    raw = json.loads((Path(port_dir) / "inkling_hpu" / "configs" / "tiny-gqa2-mix.json").read_text())
    raw = {k: v for k, v in raw.items() if k not in parity.NON_MODEL_KEYS}
    raw.update(n_routed_experts=16, num_experts_per_tok=4)
    config = InklingPortConfig.from_dict(raw)
    model = InklingForCausalLM(config, knobs=Knobs())
    experts = next(layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    x, gate_up, down, indices, weights = random_moe(37, 16, 4, config.hidden_size, config.moe_intermediate_size)
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
    with set_current_vllm_config(builders.make_vllm_config()):
        layers = use_gaudi_moe_op(model)
    calls_before = stand_in_ops.CALLS["mixture_of_experts"]
    with torch.no_grad():
        through_op = experts(x, indices, weights)
    calls = stand_in_ops.CALLS["mixture_of_experts"] - calls_before
    sparse = routed_experts(x, gate_up, down, indices, weights)
    reference = all_experts_reference(x, gate_up, down, indices, weights)
    return {"layers": layers, "moe_layers": sum(1 for d in config.dense_layers if not d), "op_calls": calls,
            "op_vs_reference": float((through_op - reference).abs().max()),
            "sparse_vs_reference": float((sparse - reference).abs().max())}


@pytest.mark.slow
def test_gaudi_moe_op_sorted_dispatch_and_reference_agree(vllm_gaudi_src, vllm_src, port_dir):
    from gaudi_harness.subproc import run_scenario

    out = run_scenario(f"{__file__}::scenario_moe_paths", vllm_gaudi_src, vllm_src, timeout=600,
                       python_path=[port_dir], port_dir=str(port_dir))
    assert out["layers"] == out["moe_layers"] > 0 and out["op_calls"] == 1, out
    assert out["op_vs_reference"] <= 1e-5 and out["sparse_vs_reference"] <= 1e-5, out
