"""Routed experts: each token computes only its top-k experts, in the sdist (the sorted dispatch of
SortedDispatchMoEMethod) and on HPU (vLLM's MoE layer with vllm-gaudi's method and fused op, here through the
harness's CPU stand-in of torch.ops.hpu), and both equal the all-experts reference on random routings, edge
cases included. vLLM's CPU experts serve them in the CPU server (test_cpu_server_*)."""
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
    """In the harness: a tiny Inkling built on the HPU platform, so its MoE layers are vLLM's with vllm-gaudi's
    own method (HPUUnquantizedFusedMoEMethod, registered over vLLM's) and its fused op (the stand-in of
    torch.ops.hpu); random experts loaded and processed as a worker's loader does; the routed experts through
    that op, through the sdist's sorted dispatch and through the reference."""
    import json
    from pathlib import Path

    import vllm_gaudi
    from habana_frameworks.torch import stand_in_ops
    from vllm.config import set_current_vllm_config

    from gaudi_harness import builders
    from inkling_hpu import parity

    vllm_gaudi.register_ops()      # as a worker's platform does: its layers over vLLM's
    from inkling_hpu.model import InklingForCausalLM, InklingPortConfig
    from inkling_hpu.model.knobs import Knobs

    raw = json.loads((Path(port_dir) / "inkling_hpu" / "configs" / "tiny-gqa2-mix.json").read_text())
    raw = {k: v for k, v in raw.items() if k not in parity.NON_MODEL_KEYS}
    raw.update(n_routed_experts=16, num_experts_per_tok=4)
    config = InklingPortConfig.from_dict(raw)
    vllm_config = builders.make_vllm_config()
    with set_current_vllm_config(vllm_config):
        model = InklingForCausalLM(config, knobs=Knobs())
    moe_layers = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, modeling.InklingMoE)]
    moe = moe_layers[0]
    experts = moe.experts.routed_experts
    x, gate_up, down, indices, weights = random_moe(37, 16, 4, config.hidden_size, config.moe_intermediate_size)
    with torch.no_grad():
        experts.w13_weight.copy_(gate_up)
        experts.w2_weight.copy_(down)
    with set_current_vllm_config(vllm_config):
        experts.quant_method.process_weights_after_loading(experts)
    logits = torch.zeros(37, 16)          # the selection is the one forward() made from these logits
    moe._selection = (logits, weights, indices)
    calls_before = stand_in_ops.CALLS["mixture_of_experts"]
    with torch.no_grad():
        through_op = moe._routed(x, logits)
    calls = stand_in_ops.CALLS["mixture_of_experts"] - calls_before
    sparse = routed_experts(x, gate_up, down, indices, weights)
    reference = all_experts_reference(x, gate_up, down, indices, weights)
    return {"methods": sorted({type(m.experts.routed_experts.quant_method).__name__ for m in moe_layers}),
            "moe_layers": sum(1 for d in config.dense_layers if not d), "built": len(moe_layers), "op_calls": calls,
            "op_vs_reference": float((through_op - reference).abs().max()),
            "sparse_vs_reference": float((sparse - reference).abs().max())}


@pytest.mark.slow
def test_gaudi_moe_op_sorted_dispatch_and_reference_agree(served_vllm_gaudi, vllm_src, port_dir):
    from gaudi_harness.subproc import run_scenario

    out = run_scenario(f"{__file__}::scenario_moe_paths", served_vllm_gaudi, vllm_src, timeout=600,
                       python_path=[port_dir], port_dir=str(port_dir))
    assert out["methods"] == ["HPUUnquantizedFusedMoEMethod"], out
    assert out["built"] == out["moe_layers"] > 0 and out["op_calls"] == 1, out
    assert out["op_vs_reference"] <= 1e-5 and out["sparse_vs_reference"] <= 1e-5, out


@pytest.mark.slow
@pytest.mark.pristine     # the image's vllm-gaudi carries the patch: the in-image preflight skips it
def test_pristine_vllm_gaudi_cannot_build_vllm_0_30_s_moe_layer(vllm_gaudi_src, vllm_src, port_dir):
    """Patch moe-routing-api: without it, vllm-gaudi's router factory refuses the arguments vLLM 0.30.0's
    FusedMoEFactory passes, so no MoE layer is built."""
    from gaudi_harness.subproc import run_scenario

    with pytest.raises(RuntimeError, match=r"TypeError: create_fused_moe_router\(\) got an unexpected keyword "
                                           r"argument 'bias_vl'"):
        run_scenario(f"{__file__}::scenario_moe_paths", vllm_gaudi_src, vllm_src, timeout=600,
                     python_path=[port_dir], port_dir=str(port_dir))
