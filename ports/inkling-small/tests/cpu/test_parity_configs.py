"""Port logits vs transformers 5.24.0 InklingForCausalLM on every shipped tiny config."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import model_helpers as helpers
from model_helpers import one_torch_thread  # noqa: F401  (autouse fixture)
from inkling_hpu import parity
from inkling_hpu.model.config import InklingPortConfig


@pytest.mark.timeout(300)
@pytest.mark.parametrize("config_name", helpers.SHIPPED_CONFIGS)
@pytest.mark.parametrize("knobs", [helpers.NO_BUDGET, helpers.BIAS_BUDGET], ids=["unbounded", "bias-budget"])
def test_fp32_parity_every_phase(config_name, knobs):
    result = parity.run_parity(helpers.load_config(config_name), seed=0, dtype_name="float32", knobs=knobs)
    phases = result["phases"]
    assert set(phases) == {"prefill_chunked", "decode", "mixed"}
    for name, phase in phases.items():
        assert phase["max_abs"] <= 1e-4, (config_name, name, phase)
    assert phases["mixed"]["steps_with_prefill_and_decode"] >= 1  # the mixed phase really mixes
    assert result["ok"]


def test_shipped_configs_cover_the_brief():
    """GQA ratios, local/global and dense/MoE mixes, sequences past window and rel_extent,
    chunk boundaries off the block grid, and the served block size 128."""
    ratios, kinds, mlps, block_sizes = set(), set(), set(), set()
    long_enough = unaligned = False
    for name in helpers.SHIPPED_CONFIGS:
        raw = helpers.load_config(name)
        config = InklingPortConfig.from_dict({k: v for k, v in raw.items() if k != "parity"})
        for layer in range(config.num_hidden_layers):
            heads, kv, _ = config.attention_shape(layer)
            ratios.add(heads // kv)
            kinds.add(config.is_local(layer))
            mlps.add(config.dense_layers[layer])
        settings = raw["parity"]
        prompt = sum(settings["prefill_chunks"])
        long_enough |= prompt > config.rel_extent and prompt > config.sliding_window_size
        bounds, total = [], 0
        for size in settings["prefill_chunks"][:-1]:
            total += size
            bounds.append(total)
        unaligned |= any(b % settings["block_size"] for b in bounds)
        block_sizes.add(settings["block_size"])
    assert {1, 2, 4} <= ratios
    assert kinds == {True, False} and mlps == {True, False}
    assert long_enough and unaligned and 128 in block_sizes


@pytest.mark.timeout(300)
@pytest.mark.parametrize("config_name", helpers.SHIPPED_CONFIGS)
def test_bf16_parity_within_tolerance(config_name):
    result = parity.run_parity(helpers.load_config(config_name), seed=1, dtype_name="bfloat16",
                               knobs=helpers.BIAS_BUDGET)
    assert result["ok"], result["phases"]


def test_parity_has_teeth():
    """A port with one wrong tensor (a global layer's relative-bias bank) fails the same comparison."""
    name = "tiny-gqa2-mix.json"
    model = helpers.port_model(name)
    with torch.no_grad():
        model.model.layers[3].self_attn.rel_logits_proj.proj.mul_(1.5)
    work = helpers.workload(name)
    ref = parity.run_reference(helpers.reference_model(name), work, model.config.vocab_out)
    phases = parity.compare(parity.run_port(model, work, seed=0), ref)
    assert phases["prefill_chunked"]["max_abs"] > 1e-2


@pytest.mark.timeout(300)
def test_cli_prints_json_and_exits_zero(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(helpers.PORT_ROOT)}
    config = helpers.CONFIG_DIR / "tiny-gqa2-mix.json"
    done = subprocess.run([sys.executable, "-m", "inkling_hpu.parity", "--config", str(config), "--seed", "3"],
                          capture_output=True, text=True, env=env, timeout=280)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["ok"] and result["seed"] == 3
    assert {"max_abs", "max_rel"} <= set(result["phases"]["decode"])

    bad = tmp_path / "bad.json"
    raw = helpers.load_config("tiny-gqa2-mix.json")
    del raw["local_layer_ids"]
    bad.write_text(json.dumps(raw))
    done = subprocess.run([sys.executable, "-m", "inkling_hpu.parity", "--config", str(bad)],
                          capture_output=True, text=True, env=env, timeout=280)
    assert done.returncode == 2
    assert "local_layer_ids" in done.stderr


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("config_name, experts_method", [("tiny-gqa2-mix.json", "vLLM's CPU experts"),
                                                         ("tiny-moe-window-unaligned.json", "SortedDispatchMoEMethod")])
def test_parity_holds_on_vllm_s_cpu_build(config_name, experts_method):
    """The parity CLI on vLLM's CPU build (the CPU server's venv: its platform, its kernels), outside a worker:
    the weights are prepared as its loader prepares them (else its MoE method has no kernel: `assert
    self.moe_kernel is not None`), and the 24-wide config's routed experts, whose hidden size its CPU experts
    refuse, run SortedDispatchMoEMethod (else `NotImplementedError: No Unquantized MoE backend supports the
    deployment configuration.` while building the model)."""
    from cpu_server_helpers import server_venv

    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    env.update(PYTHONPATH=str(helpers.PORT_ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([str(server_venv() / "bin" / "python"), "-m", "inkling_hpu.parity",
                           "--config", str(helpers.CONFIG_DIR / config_name)],
                          capture_output=True, text=True, env=env, timeout=1100)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout)["ok"], done.stdout
    fallbacks = done.stderr.count("Inkling's routed experts run SortedDispatchMoEMethod")
    assert fallbacks == (experts_method == "SortedDispatchMoEMethod"), done.stderr[-4000:]


def test_checkpoint_to_reference_reads_back_what_reference_to_checkpoint_wrote():
    """A checkpoint's tensors back into transformers' Inkling (how the served trained checkpoint gets its
    reference): every tensor of a random reference returns exactly."""
    raw = {k: v for k, v in helpers.load_config(helpers.SHIPPED_CONFIGS[0]).items() if k not in ("parity", "description")}
    reference = parity.build_reference(raw, seed=3, dtype=torch.float32)
    again = parity.checkpoint_to_reference(raw, parity.reference_to_checkpoint(reference))
    want, got = reference.state_dict(), again.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[name], want[name]) for name in want)
    assert not torch.equal(got[next(iter(want))], parity.build_reference(raw, 0, torch.float32).state_dict()[next(iter(want))])
