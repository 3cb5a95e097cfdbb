"""Pipeline parallel in the model: stages of layers (the first embeds, the last holds the final norm and
the head), each loading only its tensors and keeping caches for its layers only, handing hidden states
on in order, reproduce the whole model's logits. A broken hand-off between stages is caught.
(Through vLLM's executor, with real worker processes: test_cpu_server_pipeline_parallel.py.)"""
from __future__ import annotations

import contextlib

import pytest
import torch

import model_helpers as helpers
from model_helpers import one_torch_thread  # noqa: F401  (autouse fixture)
from inkling_hpu import parity
from inkling_hpu.model import InklingCaches, modeling, weights
from inkling_hpu.model.modeling import PipelineStage


class StagedPipeline:
    """Stage models run one after another as vLLM's pipeline runs them, with `hand_off` between stages
    (what the previous stage's hidden states become on the way; vLLM sends them as they are)."""

    def __init__(self, stages: list[modeling.InklingForCausalLM], hand_off=lambda hidden: hidden):
        self.stages, self.hand_off = stages, hand_off
        self.config = stages[0].config

    def allocate_caches(self, num_blocks: int, block_size: int) -> InklingCaches:
        layers = [layer for stage in self.stages for layer in stage.allocate_caches(num_blocks, block_size).layers]
        return InklingCaches(block_size=block_size, layers=layers)

    def __call__(self, meta, caches: InklingCaches) -> torch.Tensor:
        hidden, done = None, 0
        for stage in self.stages:
            count = len(stage.stage.layer_ids)
            own = InklingCaches(block_size=caches.block_size, layers=caches.layers[done:done + count])
            hidden = stage(meta, own, None if hidden is None else self.hand_off(hidden))
            done += count
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.stages[-1].compute_logits(hidden)


@contextlib.contextmanager
def _partition(bounds: list[int]):
    """vLLM's split of the layers set to `bounds`' widths (VLLM_PP_LAYER_PARTITION), as a user sets it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_PP_LAYER_PARTITION", ",".join(str(end - start) for start, end in zip(bounds, bounds[1:])))
        yield


def _stages(bounds: list[int]) -> list[PipelineStage]:
    with _partition(bounds):
        stages = [PipelineStage.of_rank(bounds[-1], rank, len(bounds) - 1) for rank in range(len(bounds) - 1)]
    assert [(s.start, s.end) for s in stages] == list(zip(bounds, bounds[1:]))
    return stages


def _staged_models(config_name: str, bounds: list[int]) -> list[modeling.InklingForCausalLM]:
    config, tensors = helpers.port_model(config_name).config, helpers.checkpoint(config_name)
    models = []
    for stage in _stages(bounds):
        with _partition(bounds):     # make_layers reads the split again when it builds the stage
            model = modeling.InklingForCausalLM(config, knobs=helpers.BIAS_BUDGET, stage=stage)
        weights.load_checkpoint(model, tensors)     # every tensor offered: the stage takes its own
        models.append(model.eval())
    return models


@pytest.mark.parametrize("config_name, bounds", [
    ("tiny-gqa2-mix.json", [0, 2, 4]),          # vLLM's get_pp_indices(4, r, 2)
    ("tiny-gqa4-long.json", [0, 2, 4, 6]),      # three stages: one in the middle has neither end
    ("tiny-moe-window-unaligned.json", [0, 1, 3]),
])
def test_stages_reproduce_the_whole_model(config_name, bounds):
    whole = parity.run_port(helpers.port_model(config_name, helpers.BIAS_BUDGET), helpers.workload(config_name), 0)
    staged = parity.run_port(StagedPipeline(_staged_models(config_name, bounds)), helpers.workload(config_name), 0)
    assert helpers.max_abs_between(whole, staged) == 0.0


def test_a_broken_hand_off_between_stages_is_caught():
    """The same comparison fails when the hidden states reach the next stage one row off."""
    name = "tiny-gqa2-mix.json"
    whole = parity.run_port(helpers.port_model(name, helpers.BIAS_BUDGET), helpers.workload(name), 0)
    shifted = StagedPipeline(_staged_models(name, [0, 2, 4]), hand_off=lambda hidden: hidden.roll(1, dims=0))
    assert helpers.max_abs_between(whole, parity.run_port(shifted, helpers.workload(name), 0)) > 1e-3


def test_each_stage_holds_and_reads_only_its_tensors():
    """The stages' checkpoint names partition the whole model's: the embedding on the first stage, the final
    norm and the head on the last, each layer on exactly one; parameters match."""
    name = "tiny-gqa4-long.json"
    config = helpers.port_model(name).config
    every = set(weights.expected_checkpoint_names(config, include_optional=True))
    per_stage = [set(weights.expected_checkpoint_names(config, include_optional=True, stage=s))
                 for s in _stages([0, 2, 4, 6])]
    assert set().union(*per_stage) == every and sum(map(len, per_stage)) == len(every)
    assert "model.llm.embed.weight" in per_stage[0] and "model.llm.unembed.weight" in per_stage[-1]
    assert not any(n.startswith("model.llm.layers.1.") for n in per_stage[1] | per_stage[2])
    for model in _staged_models(name, [0, 2, 4, 6]):
        assert all(name.startswith(tuple(f"model.layers.{i}." for i in model.stage.layer_ids))
                   or name.startswith(("model.embed_tokens.", "model.norm.", "lm_head."))
                   for name in model.state_dict())
        assert len(model.allocate_caches(4, 16).layers) == len(model.stage.layer_ids)


def test_a_stage_without_its_previous_stage_refuses():
    later = _staged_models("tiny-gqa2-mix.json", [0, 2, 4])[1]
    with pytest.raises(ValueError, match="every other stage takes the previous stage's hidden states"):
        later(_step(later), later.allocate_caches(4, 16))


def _step(model):
    from inkling_hpu.model import RequestChunk, reference_step_metadata

    return reference_step_metadata([RequestChunk(token_ids=[5, 6, 7], num_computed=0, block_ids=[1])], block_size=16,
                               conv_kernel_size=model.config.conv_kernel_size, pad_block_id=0)


def test_a_stage_other_than_vllms_split_is_refused():
    """make_layers builds the layers vLLM's split gives the rank; a stage that names others cannot be built."""
    config = helpers.port_model("tiny-gqa2-mix.json").config     # 4 layers: vLLM gives rank 0 of 2 layers 0..1
    with pytest.raises(ValueError, match=r"expected layers 0\.\.0, vLLM's split builds 0\.\.1"):
        modeling.InklingForCausalLM(config, knobs=helpers.BIAS_BUDGET, stage=PipelineStage(0, 1, rank=0, size=2))
