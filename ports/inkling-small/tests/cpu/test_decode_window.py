"""decode-window (ports/inkling-small/patches): the decode block list of Inkling's local layers.

Drives vllm-gaudi's real HPUModelRunner on CPU through tests/gaudi_harness: an Inkling config
(vLLM 0.30.0's own InklingModelConfig, or transformers 5.24.0's layout with layer_types), one
request prefilled to a length whose 512-token window does not start on a block boundary, then one
decode step through execute_model + sample_tokens. The runner's real `_create_decode_input_data`
output is recorded; only the model forward is a hand-made logits table (no weights on CPU).

Observed on pristine 091bbadd:
- vLLM's config: no window list at all (window_block_list None): local layers get every block;
- transformers' config: a window list of 512 // 128 = 4 blocks, one short of the window.
Patched: 5 blocks, exactly the blocks holding the window's keys; another model's runner is unchanged.
Not exercised on CPU: the HPU attention kernels that read the list.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

# Compares the pristine vllm-gaudi with the patched one: needs an unpatched tree (not an image's).
pytestmark = pytest.mark.pristine

BLOCK = 128
WINDOW = 512
PROMPT_LEN = 700          # decode position 700: window keys 189..700 span blocks 1..5

# A tiny Inkling text config in vLLM 0.30.0's field names (vllm/models/inkling/configs.py).
INKLING_CONFIG = {
    "architectures": ["InklingForCausalLM"],
    "model_type": "inkling_model",
    "vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "local_layer_ids": [0], "sliding_window_size": WINDOW, "rel_extent": 64, "d_rel": 16,
    "intermediate_size": 32, "dense_intermediate_size": 128, "dense_mlp_idx": 2,
    "max_position_embeddings": 4096, "torch_dtype": "float32",
}


# Inkling in vLLM's and in transformers' config layout, and another model (the harness' tiny Llama).
CASES = ["vllm", "transformers", "llama"]


def scenario_all_cases() -> dict:
    """Every case in one process."""
    return {style: decode_block_lists(style) for style in CASES}


def decode_block_lists(config_style: str) -> dict:
    """One request of PROMPT_LEN tokens, prefilled, then one decode step; the decode block lists."""
    from gaudi_harness import builders
    from gaudi_harness import drivers as d

    config = dict(INKLING_CONFIG)
    if config_style == "transformers":
        # transformers' InklingTextConfig layout: layer_types + `sliding_window` alias.
        config.update(layer_types=["hybrid_sliding", "hybrid"], sliding_window=WINDOW)
        del config["local_layer_ids"]
    if config_style == "llama":
        model_dir = builders.write_model_dir(max_position_embeddings=4096)
    else:
        model_dir = Path(tempfile.mkdtemp(prefix="inkling_decode_window_"))
        (model_dir / "config.json").write_text(json.dumps(config))
    runner = builders.make_runner(builders.make_vllm_config(model_dir, max_model_len=2048))
    d.install_model(runner, d.logits_table(builders.VOCAB_SIZE, default=[3]))
    recorded = {}
    create = runner._create_decode_input_data

    def recording(*args, **kwargs):
        out = create(*args, **kwargs)
        recorded["metadata"] = out.attn_metadata
        recorded["num_decodes"] = out.num_decodes
        return out

    runner._create_decode_input_data = recording
    steps = d.StepDriver(runner)
    steps.add("A", [1] * PROMPT_LEN, d.greedy_params())
    steps.step({"A": PROMPT_LEN})
    steps.step({"A": 1})
    meta = recorded["metadata"]

    def real_blocks(block_list, groups):
        if block_list is None:
            return None
        return [int(b) for b, g in zip(block_list.tolist(), groups.tolist()) if g == 0]

    return {
        "model_type": runner._get_model_type(),
        "runner_window": getattr(runner, "sliding_window", None),
        "block_table": steps.reqs["A"].block_ids,
        "block_list": real_blocks(meta.block_list, meta.block_groups),
        "window_block_list": real_blocks(meta.window_block_list, meta.window_block_groups),
    }


def _patched_tree(vllm_gaudi_src: Path, dest: Path, port_dir: Path) -> Path:
    """dest/vllm_gaudi with the port's decode-window fix applied by the fix-pack library."""
    from cookbook import api

    shutil.copytree(vllm_gaudi_src / "vllm_gaudi", dest / "vllm_gaudi", symlinks=True)
    api.apply_unpinned(str(port_dir / "patches" / "port.yaml"), {"vllm-gaudi": dest}, ["decode-window"])
    return dest


@pytest.fixture(scope="module")
def results(vllm_gaudi_src, vllm_src, port_dir, tmp_path_factory) -> dict:
    """{"pristine"|"patched": {config style: block lists}}: one scenario process per tree."""
    from gaudi_harness.subproc import run_scenario

    patched = _patched_tree(vllm_gaudi_src, tmp_path_factory.mktemp("decode-window"), port_dir)
    return {name: run_scenario(f"{__file__}::scenario_all_cases", tree, vllm_src, timeout=600)
            for name, tree in (("pristine", vllm_gaudi_src), ("patched", patched))}


def _window_blocks(block_table: list[int], position: int) -> list[int]:
    """The blocks holding keys [position - WINDOW + 1, position] (the local layers' window)."""
    first = max(position - WINDOW + 1, 0) // BLOCK
    return block_table[first:position // BLOCK + 1]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_vllm_inkling_config_gets_a_five_block_decode_window(results):
    pristine, patched = results["pristine"]["vllm"], results["patched"]["vllm"]
    table = pristine["block_table"]
    window = _window_blocks(table, PROMPT_LEN)
    assert len(window) == 5
    # Pristine: no window list; the local layers would read every block of the request.
    assert pristine["model_type"] == "inkling_model"
    assert pristine["window_block_list"] is None, pristine
    assert pristine["block_list"] == table[:PROMPT_LEN // BLOCK + 1]
    # Patched: exactly the 5 blocks of the window; the global layers' list is unchanged.
    assert patched["runner_window"] == WINDOW
    assert patched["window_block_list"] == window, patched
    assert patched["block_list"] == pristine["block_list"]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_transformers_inkling_config_window_is_one_block_longer(results):
    pristine, patched = results["pristine"]["transformers"], results["patched"]["transformers"]
    window = _window_blocks(pristine["block_table"], PROMPT_LEN)
    # Pristine: 512 // 128 = 4 blocks, missing the block that holds the window's oldest keys.
    assert pristine["window_block_list"] == window[1:], pristine
    assert patched["window_block_list"] == window, patched


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_another_model_s_runner_is_unchanged(results):
    pristine, patched = results["pristine"]["llama"], results["patched"]["llama"]
    assert patched == pristine
    assert patched["window_block_list"] is None
