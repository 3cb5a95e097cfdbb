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
from pathlib import Path

import pytest

# The port as it was before per-block conv-state snapshots (conv state keyed by the first KV block).
PRISTINE_COMMIT = "e949425"
CONFIG = "tiny-block128-dense.json"   # local window 64: a local layer sees the hit boundary
NUM_BLOCKS = 64
SCONV_GAIN = 3.0


def _prompt(seed: int, length: int, vocab: int) -> list[int]:
    return [(seed * 31 + 7 * i + (i * i) % 13) % vocab for i in range(length)]


# The page's bias budget (recipe.yaml), scaled to the tiny model so that prefill attention is really split
# into chunks.
PAGE_BUDGET = {"INKLING_PREFILL_BIAS_BUDGET": "65536"}


def _serve(port_dir: str, float32: bool, max_num_seqs: int = 8, async_scheduling: bool = False):
    """The port in vllm-gaudi's real runner + vLLM's real scheduler; returns (engine, reference, raw)."""
    import tempfile

    import torch
    from safetensors.torch import save_file
    from vllm.config import set_current_vllm_config
    from vllm_gaudi.v1.worker.hpu_model_runner import HpuModelAdapter

    from gaudi_harness import builders
    from gaudi_harness.engine import EngineDriver
    from inkling_hpu import parity
    from inkling_hpu.hpu_glue import HpuInklingForCausalLM
    try:
        from inkling_hpu.vllm_model import load_text_checkpoint
    except ModuleNotFoundError:      # the pristine port: before the platform adapters
        from inkling_hpu.hpu_glue import load_text_checkpoint

    raw = json.loads((Path(port_dir) / "inkling_hpu" / "configs" / CONFIG).read_text())
    # written here, not by parity.write_checkpoint_config: this scenario also serves the pristine port
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
    vllm_config = builders.make_vllm_config(builders.write_tokenizer(model_dir), max_model_len=2048,
                                            enable_prefix_caching=True, max_num_seqs=max_num_seqs,
                                            async_scheduling=async_scheduling)
    runner = builders.make_runner(vllm_config)
    if float32:   # the KV cache too (vLLM's attention selector takes no fp32 KV dtype: set on the runner)
        vllm_config.model_config.dtype = runner.kv_cache_dtype = torch.float32
    with set_current_vllm_config(vllm_config):
        glue = HpuInklingForCausalLM(vllm_config=vllm_config)
        load_text_checkpoint(glue.inkling, model_dir)
        runner.model = HpuModelAdapter(glue, vllm_config)
    if getattr(glue.kv_holders[0], "extra_bytes_per_block", 0):
        # The conv state lives in vLLM's pool (the runner allocates it): never allocated anywhere else.
        def no_allocation(*args, **kwargs):
            raise AssertionError("conv state allocated outside vLLM's pool")

        glue.inkling.allocate_conv_state = no_allocation
    # The pool as a worker gets it: allocated and bound by the runner's own initialize_kv_cache.
    builders.initialize_kv_cache(runner, vllm_config, NUM_BLOCKS)
    bind = getattr(glue, "bind_test_kv_cache", None)      # the pristine port's own conv state
    if bind is not None:
        bind()
    engine = EngineDriver(runner, NUM_BLOCKS)
    # Spy (the real method still runs): every logits row the runner samples from.
    engine.logit_rows = []
    compute_logits = glue.compute_logits

    def recording(hidden_states):
        logits = compute_logits(hidden_states)
        engine.logit_rows.append(logits.detach().float().clone())
        return logits

    glue.compute_logits = recording
    # Spy: how many decode calls carried the local layers' decode-window lists (the pristine port,
    # which builds its metadata on the CPU, has no step_metadata).
    engine.window_decodes = 0
    adapter = getattr(glue, "platform", glue)       # the pristine port: the glue class itself
    step_metadata = getattr(adapter, "step_metadata", None)

    def recording_metadata(*args, **kwargs):
        meta = step_metadata(*args, **kwargs)
        engine.window_decodes += int(getattr(meta.groups[0], "window_block_list", None) is not None)
        return meta

    if step_metadata is not None:
        adapter.step_metadata = recording_metadata
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


def scenario_shared_prefix(port_dir: str, float32: bool = True, new_tokens: int = 6,
                           async_scheduling: bool = False) -> dict:
    """A and B share their first 300 tokens (310-token prompts), concurrently and one after the other, at
    the page's bias budget. async_scheduling: vLLM 0.30.0's default (the page does not turn it off)."""
    import os

    os.environ.update(PAGE_BUDGET)
    engine, reference, raw = _serve(port_dir, float32, async_scheduling=async_scheduling)
    result = {"scheduler": type(engine.scheduler).__name__}
    result_window = getattr(engine.runner, "inkling_window", None)
    vocab = raw.get("unpadded_vocab_size", raw["vocab_size"])
    shared = _prompt(1, 300, vocab)
    prompts = {"A": shared + _prompt(2, 10, vocab), "B": shared + _prompt(3, 10, vocab)}
    expected = {name: _reference_tokens(reference, p, new_tokens, vocab) for name, p in prompts.items()}
    result.update(expected=expected, runner_inkling_window=result_window)
    # concurrently: both admitted in the same step
    for name, prompt in prompts.items():
        engine.add(f"c{name}", prompt, new_tokens)
    result["concurrent_error"] = _try_run(engine)
    result["concurrent"] = {n: engine.outputs(f"c{n}") for n in prompts}
    result["concurrent_logits_error"] = {n: _logits_error(engine, reference, p, expected[n], vocab)
                                         for n, p in prompts.items()}
    result["concurrent_admitted_at"] = {n: engine.admitted_at.get(f"c{n}") for n in prompts}
    result["window_decodes"] = engine.window_decodes
    # one after the other, on a fresh engine
    engine, _, _ = _serve(port_dir, float32, async_scheduling=async_scheduling)
    result["sequential_error"] = None
    for name, prompt in prompts.items():
        engine.add(f"s{name}", prompt, new_tokens)
        result["sequential_error"] = result["sequential_error"] or _try_run(engine)
    result["sequential"] = {n: engine.outputs(f"s{n}") for n in prompts}
    result["sequential_logits_error"] = {n: _logits_error(engine, reference, p, expected[n], vocab)
                                         for n, p in prompts.items()}
    result["sequential_admitted_at"] = {n: engine.admitted_at.get(f"s{n}") for n in prompts}
    return result


def _first_rows(engine, start: int) -> list:
    """The logits row of each runner call since `start` (one request at a time: row 0 is its row)."""
    return [rows.reshape(-1, rows.shape[-1])[0] for rows in engine.logit_rows[start:]]


def _near_tie(logits, token_a: int, token_b: int, tolerance: float) -> bool:
    return abs(float(logits[token_a]) - float(logits[token_b])) <= tolerance


def scenario_hit_vs_cold(port_dir: str, float32: bool = True, new_tokens: int = 4, num_prompts: int = 14,
                         tolerance: float = 0.0) -> dict:
    """Each prompt (3 blocks + 20 tokens) runs cold (prefix cache reset), then after a request that
    shares its first k blocks (k = 1, 2, 3) has run: a hit on k blocks. Returns, per prompt, the cold
    tokens, each hit's tokens and admission point, and for a hit that differs from the cold run whether
    the split is a near-tie of the cold run's logits (within `tolerance`)."""
    engine, _, raw = _serve(port_dir, float32)
    vocab = raw.get("unpadded_vocab_size", raw["vocab_size"])
    block = engine.runner.block_size
    results = []
    for p in range(num_prompts):
        prompt = _prompt(10 + p, 3 * block + 20, vocab)
        assert engine.scheduler.reset_prefix_cache()
        start = len(engine.logit_rows)
        engine.add(f"cold{p}", prompt, new_tokens)
        engine.run()
        cold = engine.outputs(f"cold{p}")
        cold_logits = _first_rows(engine, start)
        entry = {"cold": cold, "hits": {}}
        for k in (1, 2, 3):
            assert engine.scheduler.reset_prefix_cache()
            # a request sharing exactly the first k blocks, then different tokens
            engine.add(f"warm{p}.{k}", prompt[:k * block] + _prompt(99 + p, 7, vocab), 1)
            engine.run()
            engine.add(f"hit{p}.{k}", prompt, new_tokens)
            engine.run()
            tokens = engine.outputs(f"hit{p}.{k}")
            split = next((i for i, (a, b) in enumerate(zip(tokens, cold)) if a != b), None)
            entry["hits"][k] = {"tokens": tokens, "admitted_at": engine.admitted_at[f"hit{p}.{k}"],
                                "split_at": split,
                                "near_tie": None if split is None else _near_tie(cold_logits[split][:vocab],
                                                                                 cold[split], tokens[split],
                                                                                 tolerance)}
        results.append(entry)
    return {"prompts": results}


def scenario_preemption(port_dir: str, new_tokens: int = 8, async_scheduling: bool = False) -> dict:
    """A (300-token prompt) and B (200) decode together; A is preempted after 3 of its tokens, once
    resuming on its still-cached blocks (prefix hit at 256) and once with those blocks evicted
    (recompute from 0). Tokens are compared with an unpreempted run and with transformers."""
    engine, reference, raw = _serve(port_dir, True)
    vocab = raw.get("unpadded_vocab_size", raw["vocab_size"])
    prompts = {"A": _prompt(4, 300, vocab), "B": _prompt(5, 200, vocab)}
    result = {"expected": {n: _reference_tokens(reference, p, new_tokens, vocab) for n, p in prompts.items()}}
    for case in ("none", "cached", "recompute"):
        engine, _, _ = _serve(port_dir, True, async_scheduling=async_scheduling)
        for name, prompt in prompts.items():
            engine.add(name, prompt, new_tokens)
        while len(engine.outputs("A")) < 3:
            engine.step()
        if case != "none":
            engine.preempt("A", evict=case == "recompute")
        engine.run()
        result[case] = {"tokens": {n: engine.outputs(n) for n in prompts},
                        "admitted_at": {n: engine.admitted_at[n] for n in prompts}}
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
def test_shared_prefix_fails_before_snapshots(served_vllm_gaudi, vllm_src, pristine_port):
    """Fail-before: with conv state keyed by the first KV block, B (a prefix-cache hit on A's first
    two blocks) is refused or served A's conv state."""
    from gaudi_harness.subproc import run_scenario

    out = run_scenario(f"{__file__}::scenario_shared_prefix", served_vllm_gaudi, vllm_src, timeout=1100,
                       python_path=[pristine_port], port_dir=str(pristine_port), new_tokens=1)
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
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_shared_prefix_is_served_exactly(served_vllm_gaudi, vllm_src, port_dir, async_scheduling):
    """A and B share 300 tokens; B is a prefix-cache hit on A's first two blocks (256 tokens served
    from cache) and starts from block 1's conv snapshot. Concurrently (B's hit on blocks A fills in the
    same step) and one after the other: fp32 greedy tokens equal transformers', and every sampled
    position's logits equal transformers' to about 1e-6. The runner builds the decode-window lists
    (2 blocks for window 64) and the local layers decode from them."""
    from gaudi_harness.subproc import run_scenario

    out = run_scenario(f"{__file__}::scenario_shared_prefix", served_vllm_gaudi, vllm_src, timeout=1100,
                       python_path=[port_dir], port_dir=str(port_dir), async_scheduling=async_scheduling)
    print(json.dumps(out))
    assert out["scheduler"] == ("HPUAsyncScheduler" if async_scheduling else "Scheduler"), out
    assert out["runner_inkling_window"] == 64, out
    assert out["window_decodes"] > 0, out
    assert out["concurrent_admitted_at"]["B"] == out["sequential_admitted_at"]["B"] == [256], out
    for mode in ("concurrent", "sequential"):
        assert out[f"{mode}_error"] is None, out
        assert out[mode] == out["expected"], out
        assert max(out[f"{mode}_logits_error"].values()) < 1e-4, out


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_hit_vs_cold_fp32_identical(served_vllm_gaudi, vllm_src, port_dir):
    """14 prompts, each cold and with a prefix-cache hit on 1, 2 and 3 blocks: identical fp32 tokens."""
    from gaudi_harness.subproc import run_scenario

    out = run_scenario(f"{__file__}::scenario_hit_vs_cold", served_vllm_gaudi, vllm_src, timeout=1700,
                       python_path=[port_dir], port_dir=str(port_dir))
    assert len(out["prompts"]) == 14
    for entry in out["prompts"]:
        for k, hit in entry["hits"].items():
            assert hit["admitted_at"] == [int(k) * 128], (k, hit)
            assert hit["tokens"] == entry["cold"], (k, hit, entry["cold"])


# bf16 (the served dtype): a hit computes the same math in a different split (prefix chunk vs whole
# prompt), so logits may move by a few bf16 ulps. A split from the cold run is accepted only where
# the cold run's two tokens are within BF16_TIE logits of each other (about 4 bf16 ulps at |logit| 8).
BF16_TIE = 0.125


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_hit_vs_cold_bf16_identical_or_near_tie(served_vllm_gaudi, vllm_src, port_dir):
    from gaudi_harness.subproc import run_scenario

    out = run_scenario(f"{__file__}::scenario_hit_vs_cold", served_vllm_gaudi, vllm_src, timeout=1700,
                       python_path=[port_dir], port_dir=str(port_dir), float32=False, tolerance=BF16_TIE)
    print(json.dumps({"splits": [[h["split_at"] for h in e["hits"].values()] for e in out["prompts"]]}))
    for entry in out["prompts"]:
        for k, hit in entry["hits"].items():
            assert hit["admitted_at"] == [int(k) * 128], (k, hit)
            assert hit["split_at"] is None or hit["near_tie"], (k, hit, entry["cold"])


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preempted_request_gives_the_unpreempted_tokens(served_vllm_gaudi, vllm_src, port_dir, async_scheduling):
    from gaudi_harness.subproc import run_scenario

    out = run_scenario(f"{__file__}::scenario_preemption", served_vllm_gaudi, vllm_src, timeout=1100,
                       python_path=[port_dir], port_dir=str(port_dir), async_scheduling=async_scheduling)
    print(json.dumps(out))
    assert out["none"]["tokens"] == out["expected"], out
    # resumed on its cached blocks: admitted again at 256 (prompt 300 + 3 tokens, 2 full blocks)
    assert out["cached"]["admitted_at"]["A"] == [0, 256], out
    assert out["cached"]["tokens"] == out["expected"], out
    # recomputed from position 0 (its cached blocks evicted)
    assert out["recompute"]["admitted_at"]["A"] == [0, 0], out
    assert out["recompute"]["tokens"] == out["expected"], out
