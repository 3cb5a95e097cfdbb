"""The checkpoint name table: complete, TP splits (the loader's rank reads) that reproduce TP=1,
clear refusals."""
from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import save_file

import model_helpers as helpers
from model_helpers import one_torch_thread  # noqa: F401  (autouse fixture)
from inkling_hpu import parity
from inkling_hpu.loader import TensorSpec, TextCheckpoint
from inkling_hpu.model import modeling, weights
from inkling_hpu.model.config import InklingPortConfig


def _config(name: str) -> InklingPortConfig:
    return helpers.port_model(name).config


@pytest.mark.parametrize("config_name", helpers.SHIPPED_CONFIGS)
def test_table_maps_the_reference_checkpoint_onto_every_port_tensor(config_name):
    model = helpers.port_model(config_name)
    names = set(helpers.checkpoint(config_name))
    assert names == set(weights.expected_checkpoint_names(model.config, include_optional=True))
    targets = {weights.resolve(n, model.config)[0].names(weights.resolve(n, model.config)[1])[1] for n in names}
    per_expert = {t.format(e=e) for t in targets for e in range(model.config.n_shared_experts)}
    assert per_expert == set(model.state_dict())
    # the four fused shards tile qkvr_proj's rows exactly
    for layer in model.model.layers:
        attention = layer.self_attn
        assert sum(attention.split_sizes) == attention.qkvr_proj.weight.shape[0]


def test_every_rule_says_how_it_splits():
    for rule in weights.CHECKPOINT_TO_PORT:
        assert rule.checkpoint.startswith("model.llm.")
        assert rule.dim in (None, 0, 1, 2)


def test_towers_and_mtp_are_skipped_and_unknown_text_tensors_refused():
    name = "tiny-gqa2-mix.json"
    model = modeling.InklingForCausalLM(_config(name), knobs=helpers.NO_BUDGET)
    tensors = dict(helpers.checkpoint(name))
    tensors["model.visual.layers.linear_0.weight"] = torch.zeros(3)
    tensors["model.audio.encoder.weight"] = torch.zeros(3)
    tensors["model.mtp.layers.0.input_proj.weight"] = torch.zeros(3)
    loaded = weights.load_checkpoint(model, tensors)
    assert not any(n.startswith(("model.visual.", "model.audio.", "model.mtp.")) for n in loaded)
    with pytest.raises(weights.WeightError, match="not a text-backbone tensor"):
        weights.load_tensor(model, "model.llm.layers.0.attn.wz_du.weight", torch.zeros(3))
    with pytest.raises(weights.WeightError, match="layer kind 'moe'"):
        weights.load_tensor(model, "model.llm.layers.0.mlp.gate.weight", torch.zeros(10, 32))


def test_wrong_shape_and_missing_tensors_are_refused():
    name = "tiny-gqa2-mix.json"
    model = modeling.InklingForCausalLM(_config(name), knobs=helpers.NO_BUDGET)
    with pytest.raises(weights.WeightError, match=r"expected shape \(16, 32\).*found \(9, 32\)"):
        weights.load_tensor(model, "model.llm.layers.3.attn.wk_dv.weight", torch.zeros(9, 32))
    partial = {k: v for k, v in helpers.checkpoint(name).items() if "wo_ud" not in k}
    with pytest.raises(weights.WeightError, match="missing 4 text tensors: model.llm.layers.0.attn.wo_ud.weight"):
        weights.load_checkpoint(model, partial)


class ThreadGroup:
    """Collectives between ranks that run as threads of this process (sum and concat in rank order;
    `gather_reversed`: a broken all-gather that concatenates the ranks' slabs in reverse order)."""

    def __init__(self, size: int, gather_reversed: bool = False) -> None:
        self.size = size
        self.order = slice(None, None, -1 if gather_reversed else 1)
        self.barrier = threading.Barrier(size, timeout=120)
        self.slots: list[torch.Tensor | None] = [None] * size

    def _exchange(self, rank: int, tensor: torch.Tensor, combine) -> torch.Tensor:
        self.slots[rank] = tensor
        self.barrier.wait()
        result = combine(list(self.slots))
        self.barrier.wait()
        return result

    def parallel(self, rank: int) -> modeling.TensorParallel:
        def add(parts):
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            return total

        return modeling.TensorParallel(
            rank=rank, size=self.size,
            all_gather_last_dim=lambda t: self._exchange(rank, t, lambda parts: torch.cat(parts[self.order], dim=-1)),
            reduce_scatter_last_dim=lambda t: self._exchange(rank, t, lambda parts: add(parts).chunk(self.size, -1)[rank]))


def _rank_pieces(checkpoint_dir, config: InklingPortConfig, rank: int, world_size: int):
    """This rank's slabs, read by the loader from safetensors files (split dims from the name table)."""
    specs = []
    for name in weights.expected_checkpoint_names(config, include_optional=True):
        rule, _ = weights.resolve(name, config)
        specs.append(TensorSpec(name, None, shard_dim=rule.dim, optional=rule.optional))
    return list(TextCheckpoint(checkpoint_dir).load(specs, rank=rank, world_size=world_size))


def _two_ranks(config_name: str, checkpoint_dir, group: ThreadGroup) -> list[dict]:
    """run_port on two thread ranks of `group`, each loading its own slabs (the loader's rank reads of a
    safetensors checkpoint) through the table."""
    config, tensors, work = _config(config_name), helpers.checkpoint(config_name), helpers.workload(config_name)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, checkpoint_dir / "model.safetensors")
    results, errors = [None, None], []

    def rank_main(rank: int) -> None:
        try:
            with parity.single_thread():
                model = modeling.InklingForCausalLM(config, tp=group.parallel(rank), knobs=helpers.BIAS_BUDGET)
                weights.load_checkpoint(model, _rank_pieces(checkpoint_dir, config, rank, 2))
                results[rank] = parity.run_port(model.eval(), work, 0)
        except BaseException as error:   # surface a rank's failure instead of a barrier timeout
            errors.append(error)
            group.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("config_name", ["tiny-gqa2-mix.json", "tiny-gqa4-long.json"])
def test_tensor_parallel_two_ranks_match_one(config_name, tmp_path):
    single = parity.run_port(helpers.port_model(config_name, helpers.BIAS_BUDGET), helpers.workload(config_name), 0)
    results = _two_ranks(config_name, tmp_path, ThreadGroup(2))
    assert helpers.max_abs_between(results[0], results[1]) == 0.0
    assert helpers.max_abs_between(results[0], single) <= 1e-5


@pytest.mark.timeout(300)
def test_a_broken_collective_is_caught(tmp_path):
    """The same comparison fails when the all-gather puts the ranks' slabs in the wrong order."""
    name = "tiny-gqa2-mix.json"
    single = parity.run_port(helpers.port_model(name, helpers.BIAS_BUDGET), helpers.workload(name), 0)
    results = _two_ranks(name, tmp_path, ThreadGroup(2, gather_reversed=True))
    assert helpers.max_abs_between(results[0], single) > 1e-3


@pytest.mark.timeout(300)
def test_the_vocab_parallel_head_at_tp_8_gives_the_unpadded_logits():
    """The head at the page's TP 8: each rank holds its eighth of the padded rows (the real 201,024 rows split
    8 ways as 1,024 do here), the ranks' logits are gathered in order and the padding past the unpadded
    vocabulary is trimmed (1,000 kept of 1,024: the last rank's slab holds real and padding rows)."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    rows, kept, hidden, size = 1024, 1000, 32, 8
    full = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(0))
    states = torch.randn(5, hidden, generator=torch.Generator().manual_seed(1))
    group, stage = ThreadGroup(size), modeling.PipelineStage.whole(1)
    heads = []
    for rank in range(size):
        tp = group.parallel(rank)
        with modeling.vllm_layers_buildable(tp, stage, torch.float32):
            head = ParallelLMHead(rows, hidden, padding_size=1)
            head.weight.data.copy_(full.chunk(size)[rank])
            heads.append((head, modeling.InklingLogitsProcessor(SimpleNamespace(vocab_rows=rows, vocab_out=kept), tp)))
    assert [tuple(head.weight.shape) for head, _ in heads] == [(rows // size, hidden)] * size
    logits = [None] * size

    def rank_main(rank: int) -> None:
        head, processor = heads[rank]
        logits[rank] = processor(head, states)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for rank_logits in logits:
        assert rank_logits.shape == (5, kept)
        torch.testing.assert_close(rank_logits, states @ full[:kept].T)
