"""Prefix caching, shared prefixes and preemption served exactly: the port inside vllm-gaudi's real
HPUModelRunner and HpuModelAdapter on the CPU harness, driven by vLLM 0.30.0's real v1 Scheduler and
KV cache manager with prefix caching on (tests/gaudi_harness/engine.py), weights through the
text-only loader, tokens compared with transformers 5.24.0's greedy tokens.

`pristine_port` is the port as it was before per-block conv-state snapshots (the commit named
below, taken from git): the same scenario shows its failure there (fail-before).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# The port as it was before per-block conv-state snapshots (conv state keyed by the first KV block).
PRISTINE_COMMIT = "e949425"
CONFIG = "tiny-block128-dense.json"   # local window 64: a local layer sees the hit boundary
NUM_BLOCKS = 64
SCONV_GAIN = 3.0


def _prompt(seed: int, length: int, vocab: int) -> list[int]:
    return [(seed * 31 + 7 * i + (i * i) % 13) % vocab for i in range(length)]


def _serve(port_dir: str, float32: bool, max_num_seqs: int = 8):
    """The port in vllm-gaudi's real runner + vLLM's real scheduler; returns (engine, reference, raw)."""
    sys.path.insert(0, port_dir)
    import tempfile

    import torch
    from safetensors.torch import save_file
    from vllm.config import set_current_vllm_config
    from vllm_gaudi.v1.worker.hpu_model_runner import HpuModelAdapter

    from gaudi_harness import builders
    from gaudi_harness.engine import EngineDriver
    from inkling_hpu import parity
    from inkling_hpu.hpu_glue import HpuInklingForCausalLM, load_text_checkpoint

    raw = json.loads((Path(port_dir) / "inkling_hpu" / "configs" / CONFIG).read_text())
    model_dir = Path(tempfile.mkdtemp(prefix="inkling_prefix_"))
    config = {k: v for k, v in raw.items() if k not in parity.NON_MODEL_KEYS}
    config.update(architectures=["InklingForCausalLM"], model_type="inkling_model",
                  max_position_embeddings=4096, torch_dtype="float32", shared_expert_sink=True,
                  norm_after_topk=True, gate_activation="sigmoid", inference_moe_w13_interleaved=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    reference = parity.build_reference(raw, 0, torch.float32)
    with torch.no_grad():   # louder convolutions: a wrong conv state then shows in the greedy tokens
        for name, tensor in reference.named_parameters():
            if "sconv" in name or "conv1d" in name:
                tensor.mul_(SCONV_GAIN)
    save_file({k: v.contiguous() for k, v in parity.reference_to_checkpoint(reference).items()},
              model_dir / "model.safetensors")
    vllm_config = builders.make_vllm_config(model_dir, max_model_len=2048, enable_prefix_caching=True,
                                            max_num_seqs=max_num_seqs)
    runner = builders.make_runner(vllm_config)
    runner.bucketing_manager.num_hpu_blocks = NUM_BLOCKS     # what initialize_kv_cache sets
    if float32:
        vllm_config.model_config.dtype = torch.float32
    with set_current_vllm_config(vllm_config):
        glue = HpuInklingForCausalLM(vllm_config=vllm_config)
        load_text_checkpoint(glue.inkling, model_dir)
        bind = getattr(glue, "bind_test_kv_cache", None)
        for holder, layer in zip(glue.kv_holders, glue.inkling.model.layers):
            attn = layer.self_attn
            # vllm-gaudi's layout: NUM_BLOCKS blocks + its pad block, flattened to token rows
            shape = ((NUM_BLOCKS + 1) * runner.block_size, attn.num_key_value_heads, attn.head_dim)
            holder.kv_cache = [(torch.zeros(shape, dtype=glue.inkling.dtype),
                                torch.zeros(shape, dtype=glue.inkling.dtype), None, None)]
        if bind is not None:
            bind()
        runner.model = HpuModelAdapter(glue, vllm_config)
    runner.kv_caches = []
    engine = EngineDriver(runner, NUM_BLOCKS)
    # Spy (the real method still runs): every logits row the runner samples from.
    engine.logit_rows = []
    compute_logits = glue.compute_logits

    def recording(hidden_states):
        logits = compute_logits(hidden_states)
        engine.logit_rows.append(logits.detach().float().clone())
        return logits

    glue.compute_logits = recording
    return engine, reference, raw


def _reference_tokens(reference, prompt: list[int], count: int, vocab: int) -> list[int]:
    import torch

    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(count):
            token = int(reference(torch.tensor([ids])).logits[0, -1, :vocab].argmax())
            out.append(token)
            ids.append(token)
    return out


def _logits_error(engine, reference, prompt: list[int], tokens: list[int], vocab: int) -> float:
    """For each sampled position of the request (its greedy tokens `tokens`), the distance from
    transformers' logits to the nearest logits row the runner computed; the largest of these.
    About 1e-6 when the runner computed this request's logits exactly, large when it did not."""
    import torch

    ids = list(prompt) + list(tokens[:-1])
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0, len(prompt) - 1:, :vocab].float()
    rows = torch.cat([r.reshape(-1, r.shape[-1])[:, :vocab] for r in engine.logit_rows])
    return max(float((rows - e).abs().amax(dim=-1).min()) for e in expected)


def _try_run(engine) -> str | None:
    try:
        engine.run()
    except Exception as exc:   # the scenario reports it; the test decides
        import traceback
        return f"{type(exc).__name__}: {exc} at " + " <- ".join(
            f"{f.name}:{f.lineno}" for f in traceback.extract_tb(exc.__traceback__)[-3:])
    return None


def scenario_shared_prefix(port_dir: str, float32: bool = True, new_tokens: int = 6) -> dict:
    """A and B share their first 300 tokens (310-token prompts), concurrently and one after the other."""
    engine, reference, raw = _serve(port_dir, float32)
    vocab = raw.get("unpadded_vocab_size", raw["vocab_size"])
    shared = _prompt(1, 300, vocab)
    prompts = {"A": shared + _prompt(2, 10, vocab), "B": shared + _prompt(3, 10, vocab)}
    expected = {name: _reference_tokens(reference, p, new_tokens, vocab) for name, p in prompts.items()}
    result = {"expected": expected}
    # concurrently: both admitted in the same step
    for name, prompt in prompts.items():
        engine.add(f"c{name}", prompt, new_tokens)
    result["concurrent_error"] = _try_run(engine)
    result["concurrent"] = {n: engine.outputs(f"c{n}") for n in prompts}
    result["concurrent_logits_error"] = {n: _logits_error(engine, reference, p, expected[n], vocab)
                                         for n, p in prompts.items()}
    result["concurrent_admitted_at"] = {n: engine.admitted_at.get(f"c{n}") for n in prompts}
    # one after the other, on a fresh engine
    engine, _, _ = _serve(port_dir, float32)
    result["sequential_error"] = None
    for name, prompt in prompts.items():
        engine.add(f"s{name}", prompt, new_tokens)
        result["sequential_error"] = result["sequential_error"] or _try_run(engine)
    result["sequential"] = {n: engine.outputs(f"s{n}") for n in prompts}
    result["sequential_logits_error"] = {n: _logits_error(engine, reference, p, expected[n], vocab)
                                         for n, p in prompts.items()}
    result["sequential_admitted_at"] = {n: engine.admitted_at.get(f"s{n}") for n in prompts}
    return result


@pytest.fixture(scope="module")
def pristine_port(tmp_path_factory) -> Path:
    """The port at PRISTINE_COMMIT, from this repository's git history."""
    repo = Path(__file__).resolve().parents[4]
    target = tmp_path_factory.mktemp("pristine_port")
    archive = subprocess.run(["git", "-C", str(repo), "archive", PRISTINE_COMMIT, "ports/inkling-small"],
                             capture_output=True, timeout=120)
    if archive.returncode != 0:
        pytest.skip(f"no git history for {PRISTINE_COMMIT} here: {archive.stderr.decode()[-300:]}")
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True, timeout=120)
    return target / "ports" / "inkling-small"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_shared_prefix_fails_before_snapshots(vllm_gaudi_src, vllm_src, pristine_port):
    """Fail-before: with conv state keyed by the first KV block, B (a prefix-cache hit on A's first
    two blocks) is refused or served A's conv state."""
    from gaudi_harness.subproc import run_scenario

    out = run_scenario(f"{__file__}::scenario_shared_prefix", vllm_gaudi_src, vllm_src, timeout=1100,
                       port_dir=str(pristine_port), new_tokens=1)
    # B is admitted on A's two cached blocks (prefix hit at 256) in both runs.
    assert out["concurrent_admitted_at"]["B"] == out["sequential_admitted_at"]["B"] == [256], out
    # A is exact; B starts from A's conv slot (same first block), i.e. from A's last three conv
    # inputs instead of those at positions 253..255: its logits are off by about 0.13.
    for mode in ("concurrent", "sequential"):
        assert out[f"{mode}_error"] is None, out
        assert out[f"{mode}_logits_error"]["A"] < 1e-5, out
        assert out[f"{mode}_logits_error"]["B"] > 1e-2, out


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_shared_prefix_is_served_exactly(vllm_gaudi_src, vllm_src, port_dir):
    """A and B share 300 tokens; B is a prefix-cache hit on A's first two blocks (256 tokens served
    from cache) and starts from block 1's conv snapshot. Concurrently (B's hit on blocks A fills in the
    same step) and one after the other: fp32 greedy tokens equal transformers', and every sampled
    position's logits equal transformers' to about 1e-6."""
    from gaudi_harness.subproc import run_scenario

    out = run_scenario(f"{__file__}::scenario_shared_prefix", vllm_gaudi_src, vllm_src, timeout=1100,
                       port_dir=str(port_dir))
    print(json.dumps(out))
    assert out["concurrent_admitted_at"]["B"] == out["sequential_admitted_at"]["B"] == [256], out
    for mode in ("concurrent", "sequential"):
        assert out[f"{mode}_error"] is None, out
        assert out[mode] == out["expected"], out
        assert max(out[f"{mode}_logits_error"].values()) < 1e-4, out
