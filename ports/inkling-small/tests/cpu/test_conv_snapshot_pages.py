"""conv-snapshot-pages (ports/inkling-small/patches): the conv-state snapshots counted in the KV page.

The port's glue (HpuInklingForCausalLM, its Attention holders registered in vLLM's forward context)
inside vllm-gaudi's real HPUModelRunner on CPU: the runner's own get_kv_cache_spec, then vLLM
0.30.0's own get_kv_cache_configs sizing a pool from a memory budget. Pristine: each layer's page is
K and V only, so the pool would be sized without the snapshots. Patched: the page is K + V + the
layer's snapshot bytes (kernel - 1 tokens x (2 x kv heads x head dim + 2 x hidden) x dtype bytes),
and vLLM sizes the pool with them; the runner's own initialize_kv_cache then allocates that padding
with the pool, one row per block and the pad block, bound on each layer's Attention module as
`extra_block_state`, where the glue views its conv state. Not exercised on CPU: the HPU memory profile
and HPU allocations.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

# Compares the pristine vllm-gaudi with the patched one: needs an unpatched tree (not an image's).
pytestmark = pytest.mark.pristine

CONFIG = "tiny-block128-dense.json"
BUDGET = 64 * 2**20     # bytes of KV memory offered to vLLM's pool sizing


def scenario_pages(port_dir: str) -> dict:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    from gaudi_harness import builders
    from inkling_hpu import parity
    from inkling_hpu.hpu_glue import HpuInklingForCausalLM

    raw = json.loads((Path(port_dir) / "inkling_hpu" / "configs" / CONFIG).read_text())
    model_dir = parity.write_checkpoint_config(raw, Path(tempfile.mkdtemp(prefix="inkling_pages_")), "bfloat16")
    vllm_config = builders.make_vllm_config(builders.write_tokenizer(model_dir), max_model_len=2048,
                                            enable_prefix_caching=True)
    runner = builders.make_runner(vllm_config)
    from vllm_gaudi.v1.worker.hpu_model_runner import HpuModelAdapter

    with set_current_vllm_config(vllm_config):
        glue = HpuInklingForCausalLM(vllm_config=vllm_config)
        runner.model = HpuModelAdapter(glue, vllm_config)        # loaded before the KV cache, as a worker does
        specs = runner.get_kv_cache_spec()
        # What EngineCore does before sizing the pool: resolve the layout the workers' backends support.
        backends = get_current_attn_backends(vllm_config)
        resolve_kv_cache_layout(vllm_config, [[layout.name for layout in get_supported_kv_cache_layouts(backends)]],
                                specs.values())
        kv_config = get_kv_cache_configs(vllm_config, [specs], [BUDGET])[0]
    taps = glue.config.conv_kernel_size - 1
    layers = []
    for i, layer in enumerate(glue.inkling.model.layers):
        attn = layer.self_attn
        name = f"model.layers.{i}.self_attn.attn"
        dtype_bytes = torch.empty(0, dtype=glue.inkling.dtype).element_size()
        layers.append({
            "page": specs[name].page_size_bytes,
            "kv": 2 * 128 * attn.num_key_value_heads * attn.head_dim * dtype_bytes,
            "conv": taps * (2 * attn.num_key_value_heads * attn.head_dim + 2 * glue.config.hidden_size) * dtype_bytes,
        })
    builders.initialize_kv_cache(runner, vllm_config, kv_config.num_blocks)   # the runner allocates the pool
    for holder, layer in zip(glue.kv_holders, layers):
        state = getattr(holder, "extra_block_state", None)
        layer["extra_block_state"] = None if state is None else [list(state.shape), str(state.dtype)]
        cache = holder.kv_cache[0] if isinstance(holder.kv_cache, list) else holder.kv_cache   # (K, V, …)
        layer["kv_rows"] = cache[0].shape[0]
    return {"layers": layers, "num_blocks": kv_config.num_blocks}


def _patched_tree(vllm_gaudi_src: Path, dest: Path, port_dir: Path) -> Path:
    from cookbook import api

    shutil.copytree(vllm_gaudi_src / "vllm_gaudi", dest / "vllm_gaudi", symlinks=True)
    api.apply_unpinned(str(port_dir / "patches" / "port.yaml"), {"vllm-gaudi": dest},
                       ["decode-window", "conv-snapshot-pages"])
    return dest


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_snapshot_bytes_are_in_the_kv_page_and_the_pool_sizing(vllm_gaudi_src, vllm_src, port_dir, tmp_path):
    from gaudi_harness.subproc import run_scenario

    patched = _patched_tree(vllm_gaudi_src, tmp_path / "patched", port_dir)
    out = {name: run_scenario(f"{__file__}::scenario_pages", tree, vllm_src, timeout=600,
                              python_path=[port_dir], port_dir=str(port_dir))
           for name, tree in (("pristine", vllm_gaudi_src), ("patched", patched))}
    print(json.dumps(out))
    kv = sum(layer["kv"] for layer in out["pristine"]["layers"])
    conv = sum(layer["conv"] for layer in out["pristine"]["layers"])
    # Pristine: K/V only; the pool would take the whole budget for K/V and leave nothing for snapshots.
    assert [layer["page"] for layer in out["pristine"]["layers"]] == [layer["kv"] for layer in out["pristine"]["layers"]]
    assert out["pristine"]["num_blocks"] == BUDGET // kv
    # Patched: every page carries its layer's snapshot bytes, and vLLM sizes the pool with them.
    assert [layer["page"] for layer in out["patched"]["layers"]] == [
        layer["kv"] + layer["conv"] for layer in out["patched"]["layers"]]
    assert out["patched"]["num_blocks"] == BUDGET // (kv + conv)
    # ... and the runner allocates it with the pool: K/V rows and conv-state rows for the same blocks
    # (+ vllm-gaudi's pad block). Pristine: no place for the conv state.
    blocks = out["patched"]["num_blocks"] + 1
    for layer in out["patched"]["layers"]:
        assert layer["kv_rows"] == blocks * 128
        assert layer["extra_block_state"] == [[blocks, layer["conv"]], "torch.uint8"], layer
    assert all(layer["extra_block_state"] is None for layer in out["pristine"]["layers"])
