"""Plugin registration with the real vLLM 0.30.0 plugin loader and ModelRegistry, on CPU.

The package is really installed (pip, into a scratch target directory) so vLLM finds the entry point
through importlib.metadata exactly as in the image; vllm-gaudi is not installed here, so register()
skips its plugins (the image has them; that path needs Habana's torch).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

# The harness also loads this file in its scenario process (run_scenario puts the port on its sys.path).
import inkling_hpu
from inkling_hpu import registry_names


def test_entry_point_and_metadata_are_declared(port_dir):
    project = tomllib.loads((port_dir / "pyproject.toml").read_text())
    assert project["project"]["name"] == "inkling_hpu"
    assert project["project"]["version"] == "0.1.0"
    assert project["project"]["entry-points"]["vllm.general_plugins"] == {"inkling_hpu": "inkling_hpu:register"}
    # No torch / vllm dependency: pip must never pull a CUDA torch over Habana's.
    assert project["project"]["dependencies"] == []
    assert project["tool"]["setuptools"]["package-data"]["inkling_hpu"] == ["configs/*.json"]


def test_lazy_target_names_the_glue_class():
    assert registry_names.LAZY_TARGET == "inkling_hpu.hpu_glue:HpuInklingForCausalLM"
    assert registry_names.CPU_LAZY_TARGET == "inkling_hpu.cpu_glue:CpuInklingForCausalLM"
    assert inkling_hpu._model_target(with_gaudi=True) == registry_names.LAZY_TARGET   # vllm-gaudi installed: HPU
    assert "InklingForCausalLM" in registry_names.ARCHITECTURES


@pytest.fixture(scope="module")
def installed(port_dir, tmp_path_factory) -> Path:
    """`pip install --no-deps` of a copy of the port (pip writes build files next to the source)."""
    scratch = tmp_path_factory.mktemp("plugin")
    source = scratch / "src"
    shutil.copytree(port_dir, source, ignore=shutil.ignore_patterns("tests", "__pycache__", "*.egg-info", "build"))
    target = scratch / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                           "--no-index", "--target", str(target), str(source)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return target


def _run(installed: Path, vllm_src: Path, code: str, cwd: Path) -> dict:
    # the caller's PYTHONPATH stays behind them (where the preflight runs, it may hold the library's requirements)
    path = os.pathsep.join(filter(None, [str(installed), str(vllm_src), os.environ.get("PYTHONPATH")]))
    # vLLM's CPU platform with the port's plugin only (where vllm-gaudi is installed too, its plugins would
    # import Habana's modules)
    env = dict(os.environ, PYTHONPATH=path, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", VLLM_PLUGINS="inkling_hpu")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_plugin_loader_registers_lazy_class_guards_and_parsers(installed, vllm_src, tmp_path):
    out = _run(installed, vllm_src, """
        import json, sys
        from importlib.metadata import entry_points
        from vllm.plugins import load_general_plugins
        declared = [ep.value for ep in entry_points(group="vllm.general_plugins") if ep.name == "inkling_hpu"]
        load_general_plugins()
        from vllm import ModelRegistry
        from vllm.model_executor.models.config import MODELS_CONFIG_MAP
        from vllm.tool_parsers import ToolParserManager
        from vllm.reasoning import ReasoningParserManager
        import inkling_hpu
        entry = ModelRegistry.models["InklingForCausalLM"]
        result = {
            "declared": declared,
            "plugin_file": inkling_hpu.__file__,
            "registry_entry": type(entry).__name__,
            "target": f"{entry.module_name}:{entry.class_name}",
            "mm_target": "{0.module_name}:{0.class_name}".format(ModelRegistry.models["InklingForConditionalGeneration"]),
            "glue_imported_at_registration": any(m in sys.modules for m in ("inkling_hpu.hpu_glue", "inkling_hpu.cpu_glue")),
            "habana_imported": any(m.startswith("habana_frameworks") for m in sys.modules),
            "guard": getattr(MODELS_CONFIG_MAP.get("InklingForCausalLM"), "inkling_hpu_guard", False),
            "tool_parser": ToolParserManager.get_tool_parser("inkling_py").__module__,
            "reasoning_parser": ReasoningParserManager.get_reasoning_parser("inkling_py").__module__,
        }
        inkling_hpu.register()          # a second call (vLLM runs plugins once per process) is harmless
        result["guard_not_rewrapped"] = MODELS_CONFIG_MAP["InklingForCausalLM"]._previous is None
        cls = ModelRegistry._try_load_model_cls("InklingForCausalLM")
        result["resolved"] = f"{cls.__module__}:{cls.__name__}"
        result["habana_after_resolve"] = any(m.startswith("habana_frameworks") for m in sys.modules)
        print(json.dumps(result))
    """, tmp_path)
    assert out["declared"] == ["inkling_hpu:register"]
    assert out["plugin_file"].startswith(str(installed))
    assert out["registry_entry"] == "_LazyRegisteredModel"
    # vLLM's CPU platform without vllm-gaudi: the CPU glue (with vllm-gaudi: the HPU glue, below)
    assert out["target"] == out["mm_target"] == "inkling_hpu.cpu_glue:CpuInklingForCausalLM"
    assert out["glue_imported_at_registration"] is False
    assert out["habana_imported"] is False
    assert out["guard"] is True and out["guard_not_rewrapped"] is True
    assert out["tool_parser"].startswith("inkling_hpu.parsers")
    assert out["reasoning_parser"].startswith("inkling_hpu.parsers")
    assert out["resolved"] == "inkling_hpu.cpu_glue:CpuInklingForCausalLM"
    assert out["habana_after_resolve"] is False


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_preflight_resolves_the_parsers_through_vllms_plugin_loader(installed, vllm_src, port_dir):
    """The image preflight's parsers check, with the port pip-installed next to vLLM (cwd: the
    repository, whose cookbook library the preflight uses, as in the image)."""
    out = _run(installed, vllm_src, """
        import json
        from inkling_hpu import preflight
        print(json.dumps(preflight.check_parsers()))
    """, port_dir.parents[1])
    status, detail = out
    assert status == "pass", detail
    assert "tool inkling_py -> inkling_hpu.parsers" in detail and "reasoning inkling_py -> inkling_hpu.parsers" in detail


def test_preflight_checks_the_kv_layout_it_names(installed, vllm_src, port_dir):
    """The image preflight's KV-layout check: Inkling-Small's layers at the page's launch, grouped by
    vLLM's own code into one full-attention group at block 128 holding the page's pool, and the
    5-block decode window of the local layers."""
    out = _run(installed, vllm_src, """
        import json
        from inkling_hpu import preflight
        print(json.dumps(preflight.check_kv_layout()))
    """, port_dir.parents[1])
    assert out == ["pass", "1 KV group (FullAttentionSpecx42); KV pool: 2560 blocks = 327680 tokens = 1.25 x "
                           "max_model_len 262144; decode window 5 blocks"], out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_guard_refuses_in_vllm_config_before_any_weight(installed, vllm_src, tmp_path):
    """A real VllmConfig (EngineArgs -> create_engine_config) for an Inkling checkpoint folder holding
    only config.json: the page's forbidden settings, and serving it without a tokenizer, are refused while
    the config is built."""
    model_dir = tmp_path / "inkling"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["InklingForCausalLM"], "model_type": "inkling_model", "vocab_size": 256,
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "local_layer_ids": [0], "sliding_window_size": 512, "rel_extent": 64,
        "intermediate_size": 32, "dense_intermediate_size": 128, "dense_mlp_idx": 2,
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "shared_expert_sink": True,
        "norm_after_topk": True, "gate_activation": "sigmoid", "inference_moe_w13_interleaved": True}))
    out = _run(installed, vllm_src, f"""
        import json
        from vllm.engine.arg_utils import EngineArgs
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        results = {{}}
        cases = {{"block_64": dict(block_size=64),
                  "fp8_kv": dict(block_size=128, kv_cache_dtype="fp8"),
                  "small_pool": dict(block_size=128, num_gpu_blocks_override=16),
                  "tp_4": dict(block_size=128, tensor_parallel_size=4),
                  "no_tokenizer": dict(block_size=128)}}
        for name, kwargs in cases.items():
            args = EngineArgs(model={str(model_dir)!r}, skip_tokenizer_init=True, max_model_len=4096,
                              enforce_eager=True, **kwargs)
            try:
                args.create_engine_config()
                results[name] = "accepted"
            except Exception as exc:
                results[name] = type(exc).__name__ + ": " + str(exc)
        print(json.dumps(results))
    """, tmp_path)
    # VllmConfig is a pydantic dataclass: our ValueError reaches the user inside its ValidationError.
    assert "Inkling-Small refuses to start: the conv-state snapshots cannot serve" in out["block_64"], out
    assert "expected --block-size 128, found 64" in out["block_64"]
    assert "expected auto or bfloat16, found fp8" in out["fp8_kv"], out["fp8_kv"]
    assert "expected at least 33 blocks (4096 tokens" in out["small_pool"], out["small_pool"]
    # 2 KV heads cannot be split over 4 ranks: refused once, while the config is built, before any worker
    assert ("--tensor-parallel-size: expected a size that divides every split dimension, found 4, which does "
            "not divide the KV heads 2. Sizes this model splits over: 1, 2.") in out["tp_4"], out["tp_4"]
    # the folder has no tokenizer (skip_tokenizer_init): vLLM would then check no prompt token id
    assert ("Inkling-Small refuses to start: tokenizer: expected the checkpoint's tokenizer, found none "
            "(--skip-tokenizer-init or --tokens-only)") in out["no_tokenizer"], out["no_tokenizer"]


# --- hpu_glue on vllm-gaudi's real runner metadata -------------------------------------------------
GLUE_CONFIG = {
    "architectures": ["InklingForCausalLM"], "model_type": "inkling_model", "vocab_size": 32,
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "local_layer_ids": [0], "sliding_window_size": 512, "rel_extent": 64, "d_rel": 16,
    "intermediate_size": 32, "dense_intermediate_size": 128, "dense_mlp_idx": 2,
    "max_position_embeddings": 4096, "torch_dtype": "float32",
}


def scenario_glue_chunks(port_dir: str) -> list:
    """A: 300-token prompt in chunks of 200 and 100, then two decodes; B joins for the decodes.
    Every model call of the real runner (token ids, positions, trimmed attention metadata, exactly
    what the model receives) goes through hpu_glue's device-side step metadata; the real rows of
    each call are summarised (block tables, conv-state read and write blocks)."""
    import tempfile
    from types import SimpleNamespace

    from gaudi_harness import builders
    from gaudi_harness import drivers as d
    from vllm_gaudi.v1.worker.hpu_model_runner import trim_attn_metadata

    from inkling_hpu.hpu_glue import HpuPlatform
    from inkling_hpu.model.metadata import FlatDecodeGroup

    model_dir = Path(tempfile.mkdtemp(prefix="inkling_glue_"))
    (model_dir / "config.json").write_text(json.dumps(GLUE_CONFIG))
    # Prefix caching on, as on the page's server (and vLLM's default).
    runner = builders.make_runner(builders.make_vllm_config(model_dir, max_model_len=2048,
                                                            enable_prefix_caching=True))
    d.install_model(runner, d.logits_table(builders.VOCAB_SIZE, default=[3]))
    # What initialize_kv_cache sets (the harness allocates no KV cache): without it the prompt
    # fallback buckets drop the context blocks (bucketing/common.py generate_fallback_bucket).
    runner.bucketing_manager.num_hpu_blocks = 64
    glue = SimpleNamespace(block_size=runner.block_size, config=SimpleNamespace(conv_kernel_size=4))
    pad = 64
    calls = []
    execute = runner._execute_model_generic

    def recording(token_ids, position_ids, attn_metadata, *args, **kwargs):
        meta = HpuPlatform().step_metadata(glue, token_ids, position_ids, trim_attn_metadata(attn_metadata), pad)
        group = meta.groups[0]
        rows = []
        if isinstance(group, FlatDecodeGroup):
            for r, position in enumerate(group.positions.tolist()):
                if position < 0:
                    continue
                mine = (group.block_request == r).nonzero().flatten()
                order = group.block_column[mine].argsort()
                rows.append({"row": r, "tokens": [int(meta.input_ids[r])], "num_computed": position,
                             "blocks": group.block_list[mine][order].tolist(),
                             "read": int(meta.conv_read_blocks[r]), "writes": [int(meta.conv_write_blocks[r])]})
        else:
            bs, length = group.positions.shape
            writes = meta.conv_write_blocks.view(bs, -1)
            for r in range(bs):
                pos = group.positions[r]
                n = int((pos >= 0).sum())
                if n == 0:
                    continue
                start = int(pos[0])
                rows.append({"row": r, "tokens": meta.input_ids.view(bs, length)[r, :n].tolist(), "num_computed": start,
                             "blocks": group.block_table[r, :-(-(start + n) // runner.block_size)].tolist(),
                             "read": int(meta.conv_read_blocks[r]), "writes": [b for b in writes[r].tolist() if b != pad]})
        calls.append(rows)
        return execute(token_ids, position_ids, attn_metadata, *args, **kwargs)

    runner._execute_model_generic = recording
    steps = d.StepDriver(runner)
    prompt = [1 + i % 30 for i in range(300)]
    steps.add("A", prompt, d.greedy_params())
    steps.step({"A": 200})
    steps.step({"A": 100})
    steps.add("B", [5, 6, 7], d.greedy_params())
    steps.step({"A": 1, "B": 3})
    steps.step({"A": 1, "B": 1})
    return {"calls": calls, "blocks": {r: steps.reqs[r].block_ids for r in ("A", "B")},
            "outputs": {r: steps.reqs[r].outputs for r in ("A", "B")}, "pad": pad}


@pytest.mark.slow
@pytest.mark.timeout(900)
def scenario_pipeline_runner_check(port_dir: str) -> dict:
    """The HPU glue's pipeline-parallel check against vllm-gaudi's real HPUModelRunner class."""
    from vllm_gaudi.v1.worker.hpu_model_runner import HPUModelRunner

    from inkling_hpu import guards
    from inkling_hpu.hpu_glue import HpuPlatform

    HpuPlatform().check_pipeline_runner(1)
    try:
        HpuPlatform().check_pipeline_runner(2)
    except guards.InklingConfigRefused as refusal:
        return {"refusal": str(refusal), "runner_hands_off": hasattr(HPUModelRunner, "_pp_recv_intermediate_tensors")}
    return {"refusal": None, "runner_hands_off": hasattr(HPUModelRunner, "_pp_recv_intermediate_tensors")}


def test_pipeline_parallel_is_refused_on_a_runner_that_hands_nothing_between_stages(vllm_gaudi_src, vllm_src, port_dir):
    """vllm-gaudi main at 091bbadd has no PP send/recv in its HPU runner (it arrives with PR #1634): each
    stage would run as the whole model. The glue refuses at construction, in every worker."""
    from gaudi_harness.subproc import run_scenario

    out = run_scenario(f"{__file__}::scenario_pipeline_runner_check", vllm_gaudi_src, vllm_src, timeout=600,
                       python_path=[port_dir], port_dir=str(port_dir))
    if out["runner_hands_off"]:
        assert out["refusal"] is None, out
        return
    assert out["refusal"] == (
        "Inkling-Small refuses to start: --pipeline-parallel-size 2: expected a vllm-gaudi whose HPU model runner "
        "sends and receives the stages' activations (HPUModelRunner._pp_recv_intermediate_tensors, vllm-gaudi PR "
        "#1634), found vllm_gaudi.v1.worker.hpu_model_runner.HPUModelRunner without it. Serve at pipeline-parallel "
        "size 1 or on a vllm-gaudi that carries it."), out


def test_glue_reads_requests_from_real_runner_metadata(vllm_gaudi_src, vllm_src, port_dir):
    from gaudi_harness.subproc import run_scenario

    out = run_scenario(f"{__file__}::scenario_glue_chunks", vllm_gaudi_src, vllm_src, timeout=600,
                       python_path=[port_dir], port_dir=str(port_dir))
    a, b, pad = out["blocks"]["A"], out["blocks"]["B"], out["pad"]
    prompt = [1 + i % 30 for i in range(300)]
    flat = [chunk for call in out["calls"] for chunk in call]
    # prefill chunk 1 and 2 of A (the second reads its 200-token context through block_list, and its
    # conv state from block 1, which holds position 199); each writes the blocks it computes into
    assert flat[0] == {"row": 0, "tokens": prompt[:200], "num_computed": 0, "blocks": a[:2], "read": pad,
                       "writes": a[:2]}
    assert flat[1] == {"row": 0, "tokens": prompt[200:], "num_computed": 200, "blocks": a[:3], "read": a[1],
                       "writes": a[1:3]}
    # B's prompt (a prefill) and A's decodes, each with its own block table and conv-state blocks
    a_token = out["outputs"]["A"][0]
    b_prefill = [c for c in flat[2:] if c["num_computed"] == 0]
    a_decodes = [c for c in flat[2:] if c["blocks"][0] == a[0]]
    assert b_prefill == [{"row": 0, "tokens": [5, 6, 7], "num_computed": 0, "blocks": b[:1], "read": pad,
                          "writes": b[:1]}]
    assert [c["num_computed"] for c in a_decodes] == [300, 301]
    assert a_decodes[0]["tokens"] == [a_token]
    assert all(c["blocks"] == a[:3] and c["read"] == c["writes"][0] == a[2] for c in a_decodes)
    b_decode = [c for c in flat[2:] if c["blocks"][0] == b[0] and c["num_computed"] > 0]
    assert b_decode == [{"row": b_decode[0]["row"], "tokens": [out["outputs"]["B"][0]], "num_computed": 3,
                         "blocks": b[:1], "read": b[0], "writes": [b[0]]}]


def scenario_glue_end_to_end(port_dir: str, float32: bool = False) -> dict:
    """The port served by vllm-gaudi's real runner on CPU: HpuInklingForCausalLM inside vllm-gaudi's
    real HpuModelAdapter, KV tensors in vllm-gaudi's layout bound to its Attention holders, weights
    loaded by the text-only loader; a chunked prefill (7 + 13 tokens) and greedy decodes go through
    execute_model + sample_tokens. Returns the sampled tokens and the model's own greedy tokens for
    the same schedule without runner or glue."""
    import tempfile

    import torch
    from safetensors.torch import save_file
    from vllm.config import set_current_vllm_config
    from vllm_gaudi.v1.worker.hpu_model_runner import HpuModelAdapter

    import vllm_gaudi
    from gaudi_harness import builders
    from gaudi_harness import drivers as d
    from inkling_hpu import parity
    from inkling_hpu.hpu_glue import HpuInklingForCausalLM
    from vllm.model_executor.layers.layernorm import RMSNorm

    # vllm-gaudi's layers over vLLM's (its 02.hpu_custom_ops plugin, run in every worker of a Gaudi install;
    # its 03.hpu_custom_models needs torchvision, absent here)
    vllm_gaudi.register_ops()

    raw = json.loads((Path(port_dir) / "inkling_hpu" / "configs" / "tiny-gqa2-mix.json").read_text())
    model_dir = parity.write_checkpoint_config(raw, Path(tempfile.mkdtemp(prefix="inkling_e2e_")), "float32")
    reference = parity.build_reference(raw, 0, torch.float32)
    save_file({k: v.contiguous() for k, v in parity.reference_to_checkpoint(reference).items()},
              model_dir / "model.safetensors")

    vllm_config = builders.make_vllm_config(builders.write_tokenizer(model_dir), max_model_len=2048,
                                            enable_prefix_caching=True)
    runner = builders.make_runner(vllm_config)
    if float32:
        # The HPU platform serves bf16; fp32 makes the port comparable to transformers exactly, the KV
        # cache included (vLLM's attention selector takes no fp32 KV dtype: set on the runner).
        vllm_config.model_config.dtype = runner.kv_cache_dtype = torch.float32
    with set_current_vllm_config(vllm_config):
        glue = HpuInklingForCausalLM(vllm_config=vllm_config)
        # as vLLM's loader does: the text tensors, then each layer's method prepares its weights (vllm-gaudi's
        # MoE method hands the routed experts to its fused op)
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        glue.load_weights(iter(()))
        process_weights_after_loading(glue, vllm_config.model_config, torch.device("cpu"))
        runner.model = HpuModelAdapter(glue, vllm_config)
    # As a worker does next: the pool, conv state included, allocated and bound by the runner itself.
    # The conv state must never be allocated anywhere else.
    from inkling_hpu.model import InklingForCausalLM

    def no_allocation(*args, **kwargs):
        raise AssertionError("conv state allocated outside vLLM's pool")

    allocate_conv_state, InklingForCausalLM.allocate_conv_state = InklingForCausalLM.allocate_conv_state, no_allocation
    builders.initialize_kv_cache(runner, vllm_config, 64)
    prompt = [(7 * i + 3) % raw["unpadded_vocab_size"] for i in range(20)]
    from habana_frameworks.torch import stand_in_ops

    moe_calls, norm_calls = stand_in_ops.CALLS["mixture_of_experts"], stand_in_ops.CALLS["FusedRMSNorm"]
    steps = d.StepDriver(runner)
    steps.add("A", prompt, d.greedy_params())
    steps.step({"A": 7})
    steps.step({"A": 13})
    for _ in range(5):
        steps.step({"A": 1})
    sampled = steps.reqs["A"].outputs
    moe_calls = stand_in_ops.CALLS["mixture_of_experts"] - moe_calls
    norm_calls = stand_in_ops.CALLS["FusedRMSNorm"] - norm_calls
    InklingForCausalLM.allocate_conv_state = allocate_conv_state

    # The same schedule straight through the model (no runner, no glue), in the dtype vLLM chose
    # (the HPU platform serves bf16): the runner path must give exactly these tokens.
    from inkling_hpu.model import RequestChunk, reference_step_metadata

    model = glue.inkling
    caches = model.allocate_caches(2, runner.block_size)
    tokens, direct, schedule = list(prompt), [], [(0, 7), (7, 13)] + [(20 + i, 1) for i in range(5)]
    with torch.inference_mode():
        for start, size in schedule:
            step = reference_step_metadata([RequestChunk(tokens[start:start + size], start, [0])],
                                       block_size=runner.block_size, conv_kernel_size=4, pad_block_id=1)
            if start + size == len(tokens):
                direct.append(int(model.compute_logits(model(step, caches)[-1:]).argmax()))
                tokens.append(direct[-1])
            else:
                model(step, caches)
        reference_tokens, ref_ids = [], list(prompt)
        for _ in range(len(sampled)):       # transformers, fp32, for information
            logits = reference(torch.tensor([ref_ids])).logits[0, -1, : raw["unpadded_vocab_size"]]
            reference_tokens.append(int(logits.argmax()))
            ref_ids.append(reference_tokens[-1])
    moe_layers = sum(1 for dense in model.config.dense_layers if not dense)
    norms = [type(m).__name__ for m in model.modules() if isinstance(m, RMSNorm)]
    return {"sampled": sampled, "direct": direct, "dtype": str(model.dtype), "reference_fp32": reference_tokens,
            "moe_op_calls_per_step": moe_calls / 7 / moe_layers, "norm_classes": sorted(set(norms)),
            "moe_methods": sorted({type(layer.mlp.experts.routed_experts.quant_method).__name__
                                   for layer in model.model.layers if hasattr(layer.mlp, "experts")}),
            "decode_attention": sorted({type(layer.self_attn.gaudi_flat_pa).__name__ for layer in model.model.layers}),
            "fused_rms_norm_calls_per_step_and_norm": norm_calls / 7 / len(norms)}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_glue_through_the_real_runner_gives_the_model_s_own_tokens(served_vllm_gaudi, vllm_src, port_dir):
    from gaudi_harness.subproc import run_scenario

    out = run_scenario(f"{__file__}::scenario_glue_end_to_end", served_vllm_gaudi, vllm_src, timeout=600,
                       python_path=[port_dir], port_dir=str(port_dir))
    assert len(out["sampled"]) == 6
    assert out["dtype"] == "torch.bfloat16"          # vLLM's dtype on the HPU platform
    assert out["sampled"] == out["direct"], out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_glue_through_the_real_runner_in_fp32_gives_transformers_greedy_tokens(served_vllm_gaudi, vllm_src, port_dir):
    from gaudi_harness.subproc import run_scenario

    out = run_scenario(f"{__file__}::scenario_glue_end_to_end", served_vllm_gaudi, vllm_src, timeout=600,
                       python_path=[port_dir], port_dir=str(port_dir), float32=True)
    assert out["dtype"] == "torch.float32"
    # every MoE layer is vLLM's, with vllm-gaudi's method registered over vLLM's, and its routed experts went
    # through vllm-gaudi's fused op in every step (7)
    assert out["moe_methods"] == ["HPUUnquantizedFusedMoEMethod"], out
    # decode attention is vllm-gaudi's flat_pa (test_glue_graph.py proves it equal to the port's own)
    assert out["decode_attention"] == ["GaudiFlatPagedAttention"], out
    assert out["moe_op_calls_per_step"] == 1, out
    # every norm is vllm-gaudi's HPURMSNorm (registered over vLLM's RMSNorm), run as the fused kernel once a step
    assert out["norm_classes"] == ["HPURMSNorm"], out
    assert out["fused_rms_norm_calls_per_step_and_norm"] == 1, out
    assert out["sampled"] == out["direct"] == out["reference_fp32"], out
