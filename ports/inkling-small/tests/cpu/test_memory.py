"""The real Inkling-Small's memory per rank (configs/inkling-small) and the byte-level start-up guard."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from inkling_hpu import guards, memory
from inkling_hpu.model import InklingPortConfig
from recipes.launch import load_recipe, serve_flags



def real_config() -> InklingPortConfig:
    return InklingPortConfig.from_dict(json.loads(memory.REAL_CONFIG.read_text()))


def test_the_published_config_reads_the_same_through_transformers_inkling_text_config():
    """Each field under transformers 5.24.0's InklingTextConfig names (its checkpoint-name mapping)."""
    from transformers.models.inkling.configuration_inkling import InklingTextConfig

    raw = json.loads(memory.REAL_CONFIG.read_text())
    ours = real_config()
    theirs = InklingTextConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
    assert (theirs.num_hidden_layers, theirs.hidden_size, theirs.head_dim) == (42, 4096, 128)
    assert (theirs.num_attention_heads, theirs.num_key_value_heads) == (32, 8)
    assert (theirs.swa_num_attention_heads, theirs.swa_num_key_value_heads) == (32, 8)
    assert [i for i, kind in enumerate(theirs.layer_types) if kind == "hybrid"] == [5, 11, 17, 23, 29, 35, 41]
    assert [kind == "hybrid_sliding" for kind in theirs.layer_types] == list(ours.local_layers)
    assert [kind == "dense" for kind in theirs.mlp_layer_types] == list(ours.dense_layers) == [True, True] + [False] * 40
    assert (theirs.intermediate_size, theirs.moe_intermediate_size) == (16384, 2048)
    assert (ours.dense_intermediate_size, ours.moe_intermediate_size) == (16384, 2048)
    assert (theirs.n_routed_experts, theirs.num_experts_per_tok, theirs.n_shared_experts) == (256, 6, 2)
    assert (theirs.sliding_window_size, theirs.d_rel, theirs.rel_extent, theirs.conv_kernel_size) == (512, 16, 1024, 4)
    assert (theirs.vocab_size, theirs.unpadded_vocab_size) == (ours.vocab_rows, ours.vocab_out) == (201024, 200058)
    assert theirs.logits_mup_width_multiplier == ours.logits_mup_width_multiplier == 16.0
    assert (theirs.log_scaling_n_floor, theirs.log_scaling_alpha) == (128000, 0.1)
    assert theirs.max_position_embeddings == 1048576


def test_weights_per_rank_from_a_meta_build_match_the_checkpoint_index():
    index = json.loads(memory.REAL_CONFIG.with_name("checkpoint.json").read_text())["index_total_size"]
    config = real_config()
    text = memory.weights_bytes(config, 1)
    per_rank = memory.rank_bytes(config, 8)
    # the index also holds the vision/audio towers and the MTP head: a few GB, about 1% of it
    assert 0 < index - text < 0.015 * index, (index, text)
    # 8 ranks hold the text model once, plus what every rank keeps whole (embeddings, norms, routers)
    assert text / 8 < per_rank.weights < text / 8 + 2.5e9
    assert 65e9 < per_rank.weights < 70e9
    assert per_rank.kv_per_block == 42 * 65536
    assert per_rank.conv_per_block == 42 * 7680                       # 0.12 x K/V: hidden streams split by channel
    assert per_rank.conv_per_block_unsharded == 42 * 50688            # 0.77 x K/V had each rank kept them whole


def _page_launch() -> dict:
    recipe = load_recipe()
    flags = serve_flags(recipe)
    return {"tp": int(flags["tensor-parallel-size"]), "blocks": int(flags["num-gpu-blocks-override"]),
            "max_model_len": int(flags["max-model-len"]),
            "gpu_memory_utilization": float(flags["gpu-memory-utilization"]),
            "graph_reserved_mem": float(recipe["env"]["VLLM_GRAPH_RESERVED_MEM"])}


def test_the_command_s_defaults_are_the_page_s_launch(capsys):
    assert memory.main([]) == 0
    printed = capsys.readouterr().out
    page = _page_launch()
    assert f"tensor parallel {page['tp']}" in printed
    assert f"KV pool: {page['blocks']} blocks = 327,680 tokens = 1.25 x max_model_len 262,144" in printed
    assert f"gpu_memory_utilization {page['gpu_memory_utilization']}" in printed
    assert f"VLLM_GRAPH_RESERVED_MEM {page['graph_reserved_mem']}" in printed
    assert "verdict                fits" in printed


def test_the_page_s_launch_fits_a_96_gib_gaudi2_and_more_blocks_are_refused_with_the_arithmetic(capsys):
    assert memory.main(["--json"]) == 0
    fits = json.loads(capsys.readouterr().out)
    assert fits["refusal"] is None and fits["pool_bytes"] < fits["budget_bytes"]
    assert memory.main(["--json", "--blocks", "6000"]) == 1
    refused = json.loads(capsys.readouterr().out)["refusal"]
    assert "expected the KV pool to fit what vllm-gaudi leaves for it" in refused
    assert "6000 + 1 blocks x 3,075,072 bytes (2,752,512 K/V + 322,560 conv state" in refused
    assert "Lower --num-gpu-blocks-override to 5215 or fewer" in refused


def test_weights_alone_over_the_device_are_refused():
    plan = guards.MemoryPlan(device_bytes=96 * guards.GiB, weights_bytes=100 * guards.GiB, kv_bytes_per_block=1,
                             conv_bytes_per_block=1, blocks=10, utilization=0.75, graph_reserved=0.4)
    assert "the weights take 100.00 GiB, the device has 96.00 GiB" in plan.refusal()


def scenario_glue_start_up(port_dir: str, blocks: int, added_tokens: tuple[str, ...] = ()) -> dict:
    """The HPU glue built by vLLM's config in the harness, whose torch.hpu stand-in reports a 1 GiB
    device: the guards' verdict for --num-gpu-blocks-override `blocks` and a tokenizer of the model's rows
    less one ids, then `added_tokens` (test_guards: the token-id guard)."""
    import tempfile

    from vllm.config import set_current_vllm_config

    from gaudi_harness import builders
    from inkling_hpu import parity
    from inkling_hpu.guards import InklingConfigRefused
    from inkling_hpu.hpu_glue import HpuInklingForCausalLM

    raw = json.loads((Path(port_dir) / "inkling_hpu" / "configs" / "tiny-block128-dense.json").read_text())
    model_dir = parity.write_checkpoint_config(raw, Path(tempfile.mkdtemp(prefix="inkling_memory_")), "bfloat16")
    vllm_config = builders.make_vllm_config(builders.write_tokenizer(model_dir, added_tokens), max_model_len=2048)
    vllm_config.cache_config.num_gpu_blocks_override = blocks
    builders.init_single_process_distributed(vllm_config)
    try:
        with set_current_vllm_config(vllm_config):
            HpuInklingForCausalLM(vllm_config=vllm_config)
    except InklingConfigRefused as exc:
        return {"refused": str(exc)}
    return {"refused": None}


@pytest.mark.slow
def test_the_glue_refuses_a_pool_the_device_cannot_hold_before_any_weight(vllm_gaudi_src, vllm_src, port_dir):
    from gaudi_harness.subproc import run_scenarios

    out = {blocks: run_scenarios(__file__, ["scenario_glue_start_up"], vllm_gaudi_src, vllm_src, timeout=600,
                                 python_path=[port_dir], kwargs={"port_dir": str(port_dir), "blocks": blocks})
           ["scenario_glue_start_up"] for blocks in (64, 200000)}
    assert out[64] == {"refused": None}, out
    refused = out[200000]["refused"]
    assert refused.startswith("Inkling-Small refuses to start: memory per rank: expected the KV pool to fit"), out
    assert "of 1.00 GiB" in refused and "200000 + 1 blocks" in refused, refused


def test_no_glue_allocates_conv_state_outside_vllm_s_pool():
    """The served paths take their conv state from vLLM's pool (HPU: the runner's extra_block_state; CPU:
    the padded pages); the model's own allocators are for tests and parity runs only. The harness
    tests also forbid the allocator at run time (test_plugin, test_prefix_conv_state)."""
    import ast

    glue = Path(memory.__file__).parent
    for module in ("vllm_model.py", "hpu_glue.py", "cpu_glue.py"):
        names = {node.attr for node in ast.walk(ast.parse((glue / module).read_text()))
                 if isinstance(node, ast.Attribute)}
        assert not names & {"allocate_conv_state", "allocate_caches"}, module
