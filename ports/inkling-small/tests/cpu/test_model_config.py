"""Config reading: both naming schemes, and refusals that name the field, expected and found."""
from __future__ import annotations

import pytest

import model_helpers as helpers
from inkling_hpu.model.config import InklingConfigError, InklingPortConfig
from inkling_hpu.model.modeling import InklingForCausalLM, TensorParallel
from inkling_hpu.model.knobs import Knobs


def _raw(name: str = "tiny-gqa2-mix.json") -> dict:
    raw = helpers.load_config(name)
    raw.pop("parity")
    raw.pop("description")
    return raw


@pytest.mark.parametrize("config_name", helpers.SHIPPED_CONFIGS)
def test_checkpoint_and_transformers_naming_agree(config_name):
    """transformers' InklingTextConfig (moe_intermediate_size, layer_types, mlp_layer_types) reads the same."""
    ours = InklingPortConfig.from_dict(_raw(config_name))
    theirs = InklingPortConfig.from_object(helpers.reference_model(config_name).config)
    assert ours == theirs


def test_multimodal_config_uses_its_text_part():
    assert InklingPortConfig.from_dict({"text_config": _raw()}) == InklingPortConfig.from_dict(_raw())


@pytest.mark.parametrize("change, message", [
    ({"local_layer_ids": None}, "local_layer_ids"),
    ({"dense_mlp_idx": None}, "dense_mlp_idx"),
    ({"dense_intermediate_size": None}, "dense_intermediate_size"),
    ({"q_bias": True}, "'q_bias': the port implements False; found True"),
    ({"gate_activation": "softmax"}, "'gate_activation': the port implements 'sigmoid'; found 'softmax'"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"inference_moe_w13_interleaved": False}, "inference_moe_w13_interleaved"),
    ({"num_key_value_heads": 3}, "query heads \\(4\\) must be a multiple of kv heads \\(3\\)"),
    ({"local_layer_ids": [0, 9]}, "local_layer_ids must be in \\[0, 4\\); found \\[9\\]"),
    ({"n_shared_experts": 0}, "n_shared_experts > 0"),
    ({"unpadded_vocab_size": 500}, "unpadded_vocab_size must be in \\(0, 136\\]; found 500"),
])
def test_configs_the_port_cannot_serve_are_refused(change, message):
    raw = {**_raw(), **change}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(InklingConfigError, match=message):
        InklingPortConfig.from_dict(raw)


def test_kv_heads_are_never_replicated_across_ranks():
    config = InklingPortConfig.from_dict(_raw())           # global layer: 2 kv heads
    with pytest.raises(InklingConfigError, match="found 4, which does not divide the KV heads 2"):
        InklingForCausalLM(config, tp=TensorParallel(rank=0, size=4), knobs=Knobs())
