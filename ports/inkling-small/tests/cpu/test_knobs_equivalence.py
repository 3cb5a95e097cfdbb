"""Each INKLING_* knob: parsed strictly, read once, changes the work done, and not the logits."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import model_helpers as helpers
from model_helpers import one_torch_thread  # noqa: F401  (autouse fixture)
from inkling_hpu import parity
from inkling_hpu.model import modeling
from inkling_hpu.model.attention_plan import AttentionKind, BIAS_BYTES_PER_ELEMENT, plan_group
from inkling_hpu.model.knobs import KNOBS, KnobError, Knobs, read_knobs
from inkling_hpu.model.metadata import AttentionGroup

PAGE_ENV = {
    "INKLING_PREFILL_BIAS_BUDGET": "805306368",
    "INKLING_DECODE_WINDOW_PLUS1": "1",
    "INKLING_MOE_SINGLE_REDUCE": "1",
    "INKLING_LOCAL_WINDOW_PREFILL": "1",
    "INKLING_STEP_HOIST": "1",
}
EQUIVALENCE_CONFIGS = ["tiny-gqa2-mix.json", "tiny-moe-window-unaligned.json", "tiny-block128-dense.json"]
ONE_KNOB_ON = {
    "prefill_bias_budget": Knobs(prefill_bias_budget=1500),
    "local_window_prefill": Knobs(local_window_prefill=True),
    "moe_single_reduce": Knobs(moe_single_reduce=True),
    "step_hoist": Knobs(step_hoist=True),
    "decode_window_plus1": Knobs(decode_window_plus1=True),
}


# --- parsing --------------------------------------------------------------------------------------
def test_knob_table_names_the_page_knobs():
    assert set(KNOBS) == set(PAGE_ENV)
    assert {field.name for field in dataclasses.fields(Knobs)} == set(ONE_KNOB_ON)


def test_page_values_parse_and_defaults_are_off():
    assert read_knobs({}) == Knobs()
    assert read_knobs(PAGE_ENV) == Knobs(prefill_bias_budget=805306368, local_window_prefill=True,
                                         moe_single_reduce=True, step_hoist=True, decode_window_plus1=True)
    assert read_knobs(read_knobs(PAGE_ENV).as_env()) == read_knobs(PAGE_ENV)


@pytest.mark.parametrize("name, value", [("INKLING_STEP_HOIST", "yes"), ("INKLING_DECODE_WINDOW_PLUS1", "2"),
                                         ("INKLING_PREFILL_BIAS_BUDGET", "-1"),
                                         ("INKLING_PREFILL_BIAS_BUDGET", "768MiB")])
def test_bad_values_are_refused_with_name_and_value(name, value):
    with pytest.raises(KnobError) as error:
        read_knobs({name: value})
    assert name in str(error.value) and repr(value) in str(error.value)


def test_model_reads_knobs_once_at_construction(monkeypatch):
    config = helpers.port_model("tiny-gqa2-mix.json").config
    monkeypatch.setenv("INKLING_STEP_HOIST", "1")
    model = modeling.InklingForCausalLM(config)
    monkeypatch.setenv("INKLING_STEP_HOIST", "0")
    assert model.knobs.step_hoist and model.model.knobs.step_hoist


# --- equivalence ----------------------------------------------------------------------------------
_baselines: dict[str, dict] = {}


def _baseline(config_name: str) -> dict:
    if config_name not in _baselines:
        _baselines[config_name] = parity.run_port(helpers.port_model(config_name), helpers.workload(config_name), 0)
    return _baselines[config_name]


@pytest.mark.parametrize("config_name", EQUIVALENCE_CONFIGS)
@pytest.mark.parametrize("knob", sorted(ONE_KNOB_ON))
def test_knob_on_gives_the_same_logits(config_name, knob):
    on = parity.run_port(helpers.port_model(config_name, ONE_KNOB_ON[knob]), helpers.workload(config_name), 0)
    difference = helpers.max_abs_between(on, _baseline(config_name))
    if knob == "step_hoist":
        assert difference == 0.0           # the very same plans, built once instead of per layer
    else:
        assert difference <= 1e-5, difference


# --- each knob changes the work -------------------------------------------------------------------
LOCAL = AttentionKind(num_heads=2, window=512, rel_extent=512, log_scaling_n_floor=None, log_scaling_alpha=0.1)
GLOBAL = AttentionKind(num_heads=2, window=None, rel_extent=1024, log_scaling_n_floor=128000, log_scaling_alpha=0.1)


def _decode_group(positions: list[int], block_size: int, table_cols: int) -> AttentionGroup:
    table = torch.arange(len(positions) * table_cols).view(len(positions), table_cols) + 1000
    return AttentionGroup(True, torch.arange(len(positions))[:, None], torch.tensor(positions)[:, None], table)


@pytest.mark.parametrize("position", [511, 1000, 1023, 1024, 262143])
def test_decode_window_plus1_reads_five_blocks_at_block_128(position):
    cols = 262144 // 128
    group = _decode_group([position], 128, cols)
    full = plan_group(group, LOCAL, 128, Knobs())[0]
    windowed = plan_group(group, LOCAL, 128, Knobs(decode_window_plus1=True))[0]
    assert full.num_keys == cols * 128
    assert windowed.num_keys == 5 * 128                      # the page's "decode window of 5 blocks"
    first = max(0, (position - 511) // 128)
    expected = group.block_table[0, first:first + 5]
    kept = ~windowed.masked[0, 0, 0].view(5, 128).all(dim=1)  # blocks holding an attended key
    assert torch.equal(windowed.block_index[kept], expected[: int(kept.sum())])
    # the keys it attends are exactly the window [position - 511, position]
    assert int((~windowed.masked).sum()) == min(512, position + 1)
    # global layers always read every block
    assert plan_group(group, GLOBAL, 128, Knobs(decode_window_plus1=True))[0].num_keys == cols * 128


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


def test_local_window_prefill_reads_only_the_window_blocks():
    group = _prefill_group(start=4000, rows=256, block_size=128, table_cols=40)
    full = plan_group(group, LOCAL, 128, Knobs())[0]
    windowed = plan_group(group, LOCAL, 128, Knobs(local_window_prefill=True))[0]
    assert full.num_keys == 40 * 128
    assert windowed.num_keys == 7 * 128    # ceil((256 + 512 - 2) / 128) + 1
    assert int((~full.masked).sum()) == int((~windowed.masked).sum())   # same keys attended
    # global layers are not windowed
    assert plan_group(group, GLOBAL, 128, Knobs(local_window_prefill=True))[0].num_keys == 40 * 128


def _count_reductions(knobs: Knobs) -> tuple[int, int]:
    calls = []
    tp = modeling.TensorParallel(reduce_scatter_last_dim=lambda t: calls.append(1) or t)
    config = helpers.port_model("tiny-gqa2-mix.json").config
    model = modeling.InklingForCausalLM(config, tp=tp, knobs=knobs)
    model.load_state_dict(helpers.port_model("tiny-gqa2-mix.json").state_dict())
    session = parity.PortSession(model, 4, 16, num_requests=1, seed=0)
    session.step([(0, [1, 2, 3, 4, 5], 0)])
    return len(calls), sum(not d for d in config.dense_layers)


def test_moe_single_reduce_saves_one_collective_per_moe_layer():
    two, moe_layers = _count_reductions(Knobs())
    one, _ = _count_reductions(Knobs(moe_single_reduce=True))
    assert moe_layers > 0 and two - one == moe_layers


def test_step_hoist_builds_one_plan_per_layer_kind(monkeypatch):
    calls = []
    real = modeling.plan_step
    monkeypatch.setattr(modeling, "plan_step", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    for knobs, expected in ((Knobs(), 4), (Knobs(step_hoist=True), 2)):   # 4 layers, 2 kinds
        calls.clear()
        model = helpers.port_model("tiny-gqa2-mix.json", knobs)
        parity.PortSession(model, 4, 16, num_requests=1, seed=0).step([(0, [1, 2, 3], 0)])
        assert len(calls) == expected
