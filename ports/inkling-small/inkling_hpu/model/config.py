"""The text backbone's dimensions, read from a checkpoint config (exact, or refuse).

Accepts the checkpoint's own field names (the "OG" TML format vLLM 0.30.0 reads: `intermediate_size`
is the MoE width, `dense_intermediate_size` the dense width, `dense_mlp_idx`, `sconv_kernel_size`) and
transformers' InklingTextConfig names (`moe_intermediate_size`, `mlp_layer_types`, `layer_types`,
`conv_kernel_size`). Anything the port does not implement is refused with the field, the expected
value and the value found.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


class InklingConfigError(ValueError):
    """A config field the port cannot serve exactly."""


@dataclass(frozen=True)
class InklingPortConfig:
    vocab_rows: int                 # rows of embed/unembed (padded vocab)
    vocab_out: int                  # logits kept (unpadded vocab)
    hidden_size: int
    num_hidden_layers: int
    # global ("full") attention layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    # local (sliding-window) attention layers
    swa_num_attention_heads: int
    swa_num_key_value_heads: int
    swa_head_dim: int
    sliding_window_size: int
    d_rel: int
    rel_extent: int
    log_scaling_n_floor: int | None
    log_scaling_alpha: float
    local_layers: tuple[bool, ...]   # per layer: sliding window?
    dense_layers: tuple[bool, ...]   # per layer: dense MLP (else MoE)?
    rms_norm_eps: float
    conv_kernel_size: int
    dense_intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    route_scale: float
    logits_mup_width_multiplier: float
    use_embed_norm: bool = True
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # --- per-layer views -------------------------------------------------------------------
    def is_local(self, layer_idx: int) -> bool:
        return self.local_layers[layer_idx]

    def attention_shape(self, layer_idx: int) -> tuple[int, int, int]:
        """(query heads, kv heads, head_dim) of a layer."""
        if self.is_local(layer_idx):
            return self.swa_num_attention_heads, self.swa_num_key_value_heads, self.swa_head_dim
        return self.num_attention_heads, self.num_key_value_heads, self.head_dim

    def rel_extent_of(self, layer_idx: int) -> int:
        """Local layers bias every key of their window; global layers the last rel_extent keys."""
        return self.sliding_window_size if self.is_local(layer_idx) else self.rel_extent

    # --- construction ----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "InklingPortConfig":
        raw = dict(raw)
        if "text_config" in raw and isinstance(raw["text_config"], Mapping):
            raw = dict(raw["text_config"])  # multimodal checkpoint config: the text part only

        def need(name: str):
            if name not in raw or raw[name] is None:
                raise InklingConfigError(f"config field {name!r} is required; found none")
            return raw[name]

        def optional(name: str, default):
            """A field a config may leave out or state as null (vLLM's config objects list every field)."""
            return default if raw.get(name) is None else raw[name]

        num_layers = int(need("num_hidden_layers"))
        num_heads = int(need("num_attention_heads"))
        num_kv = int(raw.get("num_key_value_heads") or num_heads)
        head_dim = int(raw.get("head_dim") or need("hidden_size") // num_heads)

        local_layers = _local_layers(raw, num_layers)
        dense_layers = _dense_layers(raw, num_layers)
        dense_width, moe_width = _mlp_widths(raw)

        rows = int(raw.get("padded_vocab_size") or need("vocab_size"))
        out = raw.get("unpadded_vocab_size")
        out = int(out) if out is not None else min(int(need("vocab_size")), rows)
        if not 0 < out <= rows:
            raise InklingConfigError(f"unpadded_vocab_size must be in (0, {rows}]; found {out}")

        _refuse(raw, "q_bias", expected=False)
        _refuse(raw, "o_bias", expected=False)
        _refuse(raw, "hidden_act", expected="silu")
        _refuse(raw, "gate_activation", expected="sigmoid")
        _refuse(raw, "norm_after_topk", expected=True)
        _refuse(raw, "shared_expert_sink", expected=True)
        _refuse(raw, "inference_moe_w13_interleaved", expected=True)
        _refuse(raw, "final_logit_softcapping", expected=None)
        _refuse(raw, "tie_word_embeddings", expected=False)

        config = cls(
            vocab_rows=rows,
            vocab_out=out,
            hidden_size=int(need("hidden_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv,
            head_dim=head_dim,
            swa_num_attention_heads=int(raw.get("swa_num_attention_heads") or num_heads),
            swa_num_key_value_heads=int(raw.get("swa_num_key_value_heads") or num_kv),
            swa_head_dim=int(raw.get("swa_head_dim") or head_dim),
            sliding_window_size=int(need("sliding_window_size")),
            d_rel=int(need("d_rel")),
            rel_extent=int(need("rel_extent")),
            log_scaling_n_floor=(None if raw.get("log_scaling_n_floor") is None
                                 else int(raw["log_scaling_n_floor"])),
            log_scaling_alpha=float(optional("log_scaling_alpha", 0.1)),
            local_layers=local_layers,
            dense_layers=dense_layers,
            rms_norm_eps=float(optional("rms_norm_eps", 1e-6)),
            conv_kernel_size=int(raw.get("sconv_kernel_size") or raw.get("conv_kernel_size") or 4),
            dense_intermediate_size=dense_width,
            moe_intermediate_size=moe_width,
            n_routed_experts=int(raw.get("n_routed_experts", 0) or 0),
            n_shared_experts=int(raw.get("n_shared_experts", 0) or 0),
            num_experts_per_tok=int(raw.get("num_experts_per_tok", 0) or 0),
            route_scale=float(optional("route_scale", 1.0)),
            logits_mup_width_multiplier=float(optional("logits_mup_width_multiplier", 1.0)),
            use_embed_norm=bool(optional("use_embed_norm", True)),
            extra=raw,
        )
        config._validate()
        return config

    @classmethod
    def from_object(cls, obj: Any) -> "InklingPortConfig":
        """From a config object (transformers' InklingTextConfig, vLLM's hf_config)."""
        if hasattr(obj, "to_dict"):
            raw = obj.to_dict()
        else:
            raw = dict(vars(obj))
        text = getattr(obj, "text_config", None)
        if text is not None and not isinstance(text, Mapping):
            raw = text.to_dict() if hasattr(text, "to_dict") else dict(vars(text))
        return cls.from_dict(raw)

    def _validate(self) -> None:
        for layer in range(self.num_hidden_layers):
            heads, kv, _ = self.attention_shape(layer)
            if heads % kv:
                raise InklingConfigError(
                    f"layer {layer}: query heads ({heads}) must be a multiple of kv heads ({kv})")
        if self.conv_kernel_size < 2:
            raise InklingConfigError(f"sconv_kernel_size must be >= 2; found {self.conv_kernel_size}")
        if not all(self.dense_layers):
            if self.n_routed_experts <= 0 or self.n_shared_experts <= 0:
                raise InklingConfigError(
                    "MoE layers need n_routed_experts > 0 and n_shared_experts > 0 (shared experts are the "
                    f"router's sink); found {self.n_routed_experts} and {self.n_shared_experts}")
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise InklingConfigError(
                    f"num_experts_per_tok must be in [1, {self.n_routed_experts}]; found {self.num_experts_per_tok}")


def _refuse(raw: Mapping[str, Any], name: str, *, expected: Any) -> None:
    if name in raw and raw[name] != expected:
        raise InklingConfigError(
            f"config field {name!r}: the port implements {expected!r}; found {raw[name]!r}")


def _local_layers(raw: Mapping[str, Any], num_layers: int) -> tuple[bool, ...]:
    # vLLM defaults local_layer_ids to [] and transformers to "local unless (i+1) % 6 == 0": the two
    # disagree, so an absent field is refused rather than guessed.
    if raw.get("local_layer_ids") is not None:
        ids = [int(i) for i in raw["local_layer_ids"]]
        bad = [i for i in ids if not 0 <= i < num_layers]
        if bad:
            raise InklingConfigError(f"local_layer_ids must be in [0, {num_layers}); found {bad}")
        return tuple(i in set(ids) for i in range(num_layers))
    if raw.get("layer_types") is not None:
        kinds = list(raw["layer_types"])
        if len(kinds) != num_layers or not set(kinds) <= {"hybrid", "hybrid_sliding"}:
            raise InklingConfigError(
                f"layer_types must list {num_layers} of 'hybrid'/'hybrid_sliding'; found {kinds}")
        return tuple(kind == "hybrid_sliding" for kind in kinds)
    raise InklingConfigError("config needs local_layer_ids (or layer_types); found neither")


def _dense_layers(raw: Mapping[str, Any], num_layers: int) -> tuple[bool, ...]:
    if raw.get("dense_mlp_idx") is not None:
        first_moe = int(raw["dense_mlp_idx"])
        return tuple(i < first_moe for i in range(num_layers))
    if raw.get("mlp_layer_types") is not None:
        kinds = list(raw["mlp_layer_types"])
        if len(kinds) != num_layers or not set(kinds) <= {"dense", "sparse"}:
            raise InklingConfigError(
                f"mlp_layer_types must list {num_layers} of 'dense'/'sparse'; found {kinds}")
        return tuple(kind == "dense" for kind in kinds)
    raise InklingConfigError("config needs dense_mlp_idx (or mlp_layer_types); found neither")


def _mlp_widths(raw: Mapping[str, Any]) -> tuple[int, int]:
    """(dense width, MoE expert width) under either naming."""
    if raw.get("dense_intermediate_size") is not None:   # checkpoint / vLLM naming
        return int(raw["dense_intermediate_size"]), int(raw["intermediate_size"])
    if raw.get("moe_intermediate_size") is not None:     # transformers naming
        return int(raw["intermediate_size"]), int(raw["moe_intermediate_size"])
    raise InklingConfigError(
        "config needs dense_intermediate_size (checkpoint naming) or moe_intermediate_size "
        "(transformers naming) to tell the dense width from the MoE width; found neither")
