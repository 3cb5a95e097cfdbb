"""The INKLING_* settings: the bias budget parsed strictly, read once, changing the work and not the logits;
the page's four fixed flags accepted at 1 and refused otherwise. And the work the model's one path saves:
windowed local attention, one reduction per MoE layer, one attention plan per layer kind."""
from __future__ import annotations

import pytest
import torch

import model_helpers as helpers
from model_helpers import one_torch_thread  # noqa: F401  (autouse fixture)
from inkling_hpu import parity
from inkling_hpu.model import modeling
from inkling_hpu.model.attention_plan import AttentionKind, BIAS_BYTES_PER_ELEMENT, plan_group
from inkling_hpu.model.knobs import FIXED_FLAGS, KNOBS, KnobError, Knobs, read_knobs
from inkling_hpu.model.metadata import AttentionGroup

PAGE_ENV = {
    "INKLING_PREFILL_BIAS_BUDGET": "805306368",
    "INKLING_DECODE_WINDOW_PLUS1": "1",
    "INKLING_MOE_SINGLE_REDUCE": "1",
    "INKLING_LOCAL_WINDOW_PREFILL": "1",
    "INKLING_STEP_HOIST": "1",
}
EQUIVALENCE_CONFIGS = ["tiny-gqa2-mix.json", "tiny-moe-window-unaligned.json", "tiny-block128-dense.json"]


# --- parsing --------------------------------------------------------------------------------------
def test_the_page_s_variables_are_the_setting_and_the_fixed_flags():
    assert set(KNOBS) | set(FIXED_FLAGS) == set(PAGE_ENV)


def test_page_values_parse_and_the_default_is_unbounded():
    assert read_knobs({}) == Knobs()
    assert read_knobs(PAGE_ENV) == Knobs(prefill_bias_budget=805306368)
    assert read_knobs(read_knobs(PAGE_ENV).as_env()) == read_knobs(PAGE_ENV)


@pytest.mark.parametrize("name, value", [("INKLING_STEP_HOIST", "0"), ("INKLING_DECODE_WINDOW_PLUS1", "2"),
                                         ("INKLING_LOCAL_WINDOW_PREFILL", "yes"),
                                         ("INKLING_PREFILL_BIAS_BUDGET", "-1"),
                                         ("INKLING_PREFILL_BIAS_BUDGET", "768MiB")])
def test_bad_values_are_refused_with_name_and_value(name, value):
    with pytest.raises(KnobError) as error:
        read_knobs({name: value})
    assert name in str(error.value) and repr(value) in str(error.value)


def test_model_reads_the_budget_once_at_construction(monkeypatch):
    config = helpers.port_model("tiny-gqa2-mix.json").config
    monkeypatch.setenv("INKLING_PREFILL_BIAS_BUDGET", "4096")
    model = modeling.InklingForCausalLM(config)
    monkeypatch.setenv("INKLING_PREFILL_BIAS_BUDGET", "0")
    assert model.knobs.prefill_bias_budget == model.model.knobs.prefill_bias_budget == 4096


# --- the budget changes the work, not the logits ---------------------------------------------------
@pytest.mark.parametrize("config_name", EQUIVALENCE_CONFIGS)
def test_a_bias_budget_gives_the_same_logits(config_name):
    unbounded = parity.run_port(helpers.port_model(config_name), helpers.workload(config_name), 0)
    budget = parity.run_port(helpers.port_model(config_name, helpers.BIAS_BUDGET), helpers.workload(config_name), 0)
    assert helpers.max_abs_between(budget, unbounded) <= 1e-5


# --- the work the one path does -------------------------------------------------------------------
LOCAL = AttentionKind(num_heads=2, window=512, rel_extent=512, log_scaling_n_floor=None, log_scaling_alpha=0.1)
GLOBAL = AttentionKind(num_heads=2, window=None, rel_extent=1024, log_scaling_n_floor=128000, log_scaling_alpha=0.1)


def _decode_group(positions: list[int], block_size: int, table_cols: int) -> AttentionGroup:
    table = torch.arange(len(positions) * table_cols).view(len(positions), table_cols) + 1000
    return AttentionGroup(True, torch.arange(len(positions))[:, None], torch.tensor(positions)[:, None], table)


@pytest.mark.parametrize("position", [511, 1000, 1023, 1024, 262143])
def test_local_decode_reads_five_blocks_at_block_128(position):
    cols = 262144 // 128
    group = _decode_group([position], 128, cols)
    windowed = plan_group(group, LOCAL, 128, Knobs())[0]
    assert windowed.num_keys == 5 * 128                      # the page's "decode window of 5 blocks"
    first = max(0, (position - 511) // 128)
    expected = group.block_table[0, first:first + 5]
    kept = ~windowed.masked[0, 0, 0].view(5, 128).all(dim=1)  # blocks holding an attended key
    assert torch.equal(windowed.block_index[kept], expected[: int(kept.sum())])
    # the keys it attends are exactly the window [position - 511, position]
    assert int((~windowed.masked).sum()) == min(512, position + 1)
    # global layers always read every block
    assert plan_group(group, GLOBAL, 128, Knobs())[0].num_keys == cols * 128


def _prefill_group(start: int, rows: int, block_size: int, table_cols: int) -> AttentionGroup:
    table = torch.arange(table_cols)[None] + 1
    return AttentionGroup(False, torch.arange(rows)[None], torch.arange(start, start + rows)[None], table)


def test_bias_budget_chunks_prefill_under_the_budget():
    group = _prefill_group(start=3000, rows=2048, block_size=128, table_cols=40)
    budget = 64 * 2**20
    unbounded = plan_group(group, GLOBAL, 128, Knobs())
    bounded = plan_group(group, GLOBAL, 128, Knobs(prefill_bias_budget=budget))
    assert len(unbounded) == 1
    assert len(bounded) > 1
    assert sum(p.row_end - p.row_start for p in bounded) == 2048
    for plan in bounded:
        requests, _, rows, keys = plan.masked.shape
        assert requests * GLOBAL.num_heads * rows * keys * BIAS_BYTES_PER_ELEMENT <= budget


def test_local_prefill_reads_only_the_window_blocks():
    group = _prefill_group(start=4000, rows=256, block_size=128, table_cols=40)
    windowed = plan_group(group, LOCAL, 128, Knobs())[0]
    assert windowed.num_keys == 7 * 128    # ceil((256 + 512 - 2) / 128) + 1, of the table's 40
    assert int((~windowed.masked).sum()) == 256 * 512   # each row attends its whole window
    # global layers are not windowed
    assert plan_group(group, GLOBAL, 128, Knobs())[0].num_keys == 40 * 128


def test_one_reduction_per_attention_and_per_mlp_or_moe():
    """The routed and shared experts' partial sums are added before the MoE layer's one reduce-scatter."""
    calls = []
    tp = modeling.TensorParallel(reduce_scatter_last_dim=lambda t: calls.append(1) or t)
    config = helpers.port_model("tiny-gqa2-mix.json").config
    model = modeling.InklingForCausalLM(config, tp=tp, knobs=Knobs())
    model.load_state_dict(helpers.port_model("tiny-gqa2-mix.json").state_dict())
    parity.PortSession(model, 4, 16, num_requests=1, seed=0).step([(0, [1, 2, 3, 4, 5], 0)])
    assert any(not dense for dense in config.dense_layers)
    assert len(calls) == 2 * config.num_hidden_layers


def test_one_plan_per_layer_kind(monkeypatch):
    calls = []
    real = modeling.plan_step
    monkeypatch.setattr(modeling, "plan_step", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    model = helpers.port_model("tiny-gqa2-mix.json")
    parity.PortSession(model, 4, 16, num_requests=1, seed=0).step([(0, [1, 2, 3], 0)])
    assert model.config.num_hidden_layers == 4 and len(calls) == 2      # 4 layers of 2 kinds
