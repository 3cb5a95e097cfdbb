"""Checkpoint (TML "OG" format, `model.llm.*`) -> port parameter names, with tensor-parallel splits.

`CHECKPOINT_TO_PORT` is the table the loader uses: one rule per checkpoint tensor kind. `{i}` is the
layer index; `{e}` the expert of a stacked tensor whose experts are modules of their own (the shared
experts). A rule's `dim` is the dimension split across TP ranks (contiguous equal slabs, rank r takes
slab r); the loader (inkling_hpu.loader, TensorSpec.shard_dim) reads only this rank's slab, and
`load_tensor` puts that piece into the port: into a vLLM linear through its weight's own weight_loader
with the shard id (vLLM's stacked-parameter mapping: q/k/v/r of qkvr_proj, gate/up of gate_up_proj),
anywhere else by a copy. The checkpoint's w13 rows are interleaved (g0, u0, g1, u1, ...), so a
contiguous slab holds whole (g, u) pairs; `load_tensor` splits the rank's piece once into rows
[gate | up] (the layout of vLLM's w13 and of vllm-gaudi's fused MoE op), never per step.

Tensors outside the text backbone (`model.visual.*`, `model.audio.*`, `model.mtp.*`) have no rule:
`is_text_weight` says so without looking at their bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
from vllm.model_executor.layers.linear import LinearBase

from inkling_hpu.checkpoint_names import is_skipped, template_regex
from inkling_hpu.model.config import InklingPortConfig
from inkling_hpu.model.modeling import PipelineStage


@dataclass(frozen=True)
class WeightRule:
    checkpoint: str            # checkpoint name template
    port: str                  # port parameter (or buffer) name template
    dim: int | None            # dimension split across TP ranks: the out rows of a column-parallel weight, the in
                               # columns of a row-parallel one (None: replicated)
    layers: str = "all"        # "all", "dense" (i < dense_mlp_idx), "moe"; not per layer: "first" / "last"
                               # (held by the first / last pipeline stage)
    fused_shard: str | None = None   # q/k/v/r: which slice of the fused qkvr_proj rows this fills
    optional: bool = False     # absent from some checkpoints; the port then keeps its default (1.0)
    gate_up_dim: int | None = None   # w13: the dim whose interleaved (gate, up) rows load as [gate | up]

    def names(self, layer: int | None) -> tuple[str, str]:
        """(checkpoint name, port name); a port name with `{e}` is one tensor per expert of a stack."""
        if layer is None:
            return self.checkpoint, self.port
        return self.checkpoint.format(i=layer), self.port.format(i=layer, e="{e}")


QKVR_SHARDS = "qkvr"   # the fused_shard ids, in qkvr_proj's row order

_L = "model.llm.layers.{i}."
_P = "model.layers.{i}."

CHECKPOINT_TO_PORT: tuple[WeightRule, ...] = (
    WeightRule("model.llm.embed.weight", "model.embed_tokens.weight", None, "first"),
    WeightRule("model.llm.embed_norm.weight", "model.embed_tokens.embed_norm.weight", None, "first"),
    WeightRule("model.llm.norm.weight", "model.norm.weight", None, "last"),
    WeightRule("model.llm.unembed.weight", "lm_head.weight", 0, "last"),
    WeightRule(_L + "attn_norm.weight", _P + "input_layernorm.weight", None),
    WeightRule(_L + "mlp_norm.weight", _P + "post_attention_layernorm.weight", None),
    WeightRule(_L + "attn.wq_du.weight", _P + "self_attn.qkvr_proj.weight", 0, fused_shard="q"),
    WeightRule(_L + "attn.wk_dv.weight", _P + "self_attn.qkvr_proj.weight", 0, fused_shard="k"),
    WeightRule(_L + "attn.wv_dv.weight", _P + "self_attn.qkvr_proj.weight", 0, fused_shard="v"),
    WeightRule(_L + "attn.wr_du.weight", _P + "self_attn.qkvr_proj.weight", 0, fused_shard="r"),
    WeightRule(_L + "attn.wo_ud.weight", _P + "self_attn.o_proj.weight", 1),
    WeightRule(_L + "attn.q_norm.weight", _P + "self_attn.q_norm.weight", None),
    WeightRule(_L + "attn.k_norm.weight", _P + "self_attn.k_norm.weight", None),
    WeightRule(_L + "attn.k_sconv.weight", _P + "self_attn.k_sconv.weight", 0),
    WeightRule(_L + "attn.v_sconv.weight", _P + "self_attn.v_sconv.weight", 0),
    WeightRule(_L + "attn.rel_logits_proj.proj", _P + "self_attn.rel_logits_proj.proj", None),
    # depthwise convs of the hidden streams: each rank keeps its channels (TensorParallel, modeling.py)
    WeightRule(_L + "attn_sconv.weight", _P + "attn_sconv.weight", 0),
    WeightRule(_L + "mlp_sconv.weight", _P + "mlp_sconv.weight", 0),
    # dense MLP (layers below dense_mlp_idx)
    WeightRule(_L + "mlp.w13_dn.weight", _P + "mlp.gate_up_proj.weight", 0, "dense", gate_up_dim=0),
    WeightRule(_L + "mlp.w2_md.weight", _P + "mlp.down_proj.weight", 1, "dense"),
    WeightRule(_L + "mlp.global_scale", _P + "mlp.global_scale", None, "dense", optional=True),
    # MoE
    WeightRule(_L + "mlp.gate.weight", _P + "mlp.gate.weight", None, "moe"),
    WeightRule(_L + "mlp.gate.bias", _P + "mlp.gate.e_score_correction_bias", None, "moe"),
    WeightRule(_L + "mlp.gate.global_scale", _P + "mlp.gate.global_scale", None, "moe", optional=True),
    # routed experts: vLLM's MoE layer's own w13 / w2, copied in as vLLM's Inkling copies them (load_expert_weight)
    WeightRule(_L + "mlp.experts.w13_weight", _P + "mlp.experts.routed_experts.w13_weight", 1, "moe", gate_up_dim=1),
    WeightRule(_L + "mlp.experts.w2_weight", _P + "mlp.experts.routed_experts.w2_weight", 2, "moe"),
    # shared experts: stacked [S, ...] in the checkpoint, expert {e} of the stack fills the port's module e
    WeightRule(_L + "mlp.shared_experts.shared_w13_weight", _P + "mlp.shared_experts.{e}.gate_up_proj.weight",
               1, "moe", gate_up_dim=1),
    WeightRule(_L + "mlp.shared_experts.shared_w2_weight", _P + "mlp.shared_experts.{e}.down_proj.weight",
               2, "moe"),
)


class WeightError(ValueError):
    """A checkpoint tensor that does not fit the port (unknown name, wrong shape, missing)."""


_RULE_PATTERNS = tuple((template_regex(rule.checkpoint), rule) for rule in CHECKPOINT_TO_PORT)


def is_text_weight(checkpoint_name: str) -> bool:
    """False for the vision/audio/MTP towers the text-only port never reads."""
    return not is_skipped(checkpoint_name)


_MODEL_LEVEL = ("first", "last")


def _applies(rule: WeightRule, layer: int | None, config: InklingPortConfig) -> bool:
    if rule.layers in _MODEL_LEVEL:
        return layer is None
    if layer is None or not 0 <= layer < config.num_hidden_layers:
        return False
    if rule.layers == "dense":
        return config.dense_layers[layer]
    if rule.layers == "moe":
        return not config.dense_layers[layer]
    return True


def resolve(checkpoint_name: str, config: InklingPortConfig) -> tuple[WeightRule, int | None]:
    """The rule and layer index for a text checkpoint tensor; WeightError if the port has no place for it."""
    for pattern, rule in _RULE_PATTERNS:
        match = pattern.match(checkpoint_name)
        if match:
            layer = int(match.group("i")) if "i" in match.groupdict() else None
            if not _applies(rule, layer, config):
                raise WeightError(f"{checkpoint_name}: no such tensor in this config "
                                  f"(layer kind {rule.layers!r}, {config.num_hidden_layers} layers)")
            if rule.checkpoint == "model.llm.embed_norm.weight" and not config.use_embed_norm:
                raise WeightError(f"{checkpoint_name}: present but the config has use_embed_norm=False")
            return rule, layer
    raise WeightError(f"{checkpoint_name}: not a text-backbone tensor the port knows")


def in_stage(rule: WeightRule, layer: int | None, stage: PipelineStage | None) -> bool:
    """Whether a pipeline stage holds the tensor (every stage holds everything when `stage` is None)."""
    if stage is None:
        return True
    if rule.layers in _MODEL_LEVEL:
        return stage.first if rule.layers == "first" else stage.last
    return layer in stage.layer_ids


def expected_checkpoint_names(config: InklingPortConfig, *, include_optional: bool = False,
                              stage: PipelineStage | None = None) -> list[str]:
    """Every text tensor a checkpoint of this config must hold (those a pipeline stage reads: `stage`)."""
    names = []
    for rule in CHECKPOINT_TO_PORT:
        if rule.optional and not include_optional:
            continue
        if rule.checkpoint == "model.llm.embed_norm.weight" and not config.use_embed_norm:
            continue
        layers = [None] if rule.layers in _MODEL_LEVEL else range(config.num_hidden_layers)
        names += [rule.names(layer)[0] for layer in layers
                  if _applies(rule, layer, config) and in_stage(rule, layer, stage)]
    return names


def split_gate_up(interleaved: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows g0, u0, g1, u1, ... along `dim` -> [g0, g1, ... | u0, u1, ...]."""
    pairs = interleaved.unflatten(dim, (-1, 2))
    return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim=dim)


def load_tensor(model: torch.nn.Module, checkpoint_name: str, tensor: torch.Tensor) -> str:
    """Copy one checkpoint tensor into the port model; returns the port name. `tensor` is this rank's
    piece as the loader read it (the whole tensor when replicated or at TP 1), not split here."""
    rule, layer = resolve(checkpoint_name, model.config)
    _, port_name = rule.names(layer)
    if "{e}" not in port_name:
        _load_port_tensor(model, checkpoint_name, port_name, tensor, rule.gate_up_dim, rule.fused_shard)
        return port_name
    experts = model.config.n_shared_experts       # a stack of experts, one module each
    if tensor.shape[0] != experts:
        raise WeightError(f"{checkpoint_name}: expected a stack of {experts} experts; found {tuple(tensor.shape)}")
    gate_up_dim = None if rule.gate_up_dim is None else rule.gate_up_dim - 1
    for expert, piece in enumerate(tensor):
        _load_port_tensor(model, checkpoint_name, port_name.format(e=expert), piece, gate_up_dim, None)
    return port_name


def _load_port_tensor(model: torch.nn.Module, checkpoint_name: str, port_name: str, tensor: torch.Tensor,
                      gate_up_dim: int | None, fused_shard: str | None) -> None:
    owner_name, _, leaf = port_name.rpartition(".")
    owner = model.get_submodule(owner_name)
    target = _port_tensor(owner, leaf, port_name)
    expected = tuple(target.shape)
    if fused_shard is not None:     # this shard's rows of the fused projection
        expected = (owner.output_sizes[QKVR_SHARDS.index(fused_shard)] // owner.tp_size, expected[1])
    if tuple(tensor.shape) != expected:
        tp = getattr(model, "tp", None)
        where = f" on TP rank {tp.rank}/{tp.size}" if tp is not None and tp.size > 1 else ""
        raise WeightError(f"{checkpoint_name}: expected shape {expected}{where}; found {tuple(tensor.shape)}")
    if gate_up_dim is not None:
        tensor = split_gate_up(tensor, gate_up_dim)
    if isinstance(owner, LinearBase):
        _load_linear(owner, tensor, gate_up_dim is not None, fused_shard)
        return
    with torch.no_grad():
        target.copy_(tensor.to(target.dtype))


def _load_linear(linear: LinearBase, tensor: torch.Tensor, gate_up: bool, fused_shard: str | None) -> None:
    """vLLM's stacked-parameter loading: each piece through the weight's own weight_loader with its shard id
    (q, k, v, r of qkvr_proj; gate, up of gate_up_proj). The loader read only this rank's slab, which the
    weight takes as the one rank of one would (its rank set to 0 for the call, as vLLM's own loaders do
    with a slab they are handed whole)."""
    weight = linear.weight
    if fused_shard is not None:
        pieces = [(tensor, QKVR_SHARDS.index(fused_shard))]
    elif gate_up:
        pieces = list(zip(tensor.chunk(2, dim=0), (0, 1)))
    else:
        pieces = [(tensor, None)]
    rank, weight.tp_rank = weight.tp_rank, 0
    try:
        with torch.no_grad():
            for piece, shard in pieces:
                weight.weight_loader(weight, piece.to(weight.dtype), *(() if shard is None else (shard,)))
    finally:
        weight.tp_rank = rank


def _port_tensor(owner: torch.nn.Module, leaf: str, port_name: str) -> torch.Tensor:
    tensor = getattr(owner, leaf, None)
    if not isinstance(tensor, torch.Tensor):
        raise WeightError(f"port model has no tensor {port_name}")
    return tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor


def load_checkpoint(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                    ) -> list[str]:
    """Load every text tensor (this rank's pieces, as the loader yields them); skip tower/MTP
    tensors and those of other pipeline stages; refuse missing required ones. Returns loaded names."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    stage = getattr(model, "stage", None)
    loaded = []
    for name, tensor in items:
        if not is_text_weight(name) or not in_stage(*resolve(name, model.config), stage):
            continue
        load_tensor(model, name, tensor)
        loaded.append(name)
    missing = sorted(set(expected_checkpoint_names(model.config, stage=stage)) - set(loaded))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise WeightError(f"checkpoint is missing {len(missing)} text tensors: {shown}")
    return loaded
