"""Start-up guards: the page's refusals, its memory guard and its start-up log line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest

from inkling_hpu import guards
from inkling_hpu.guards import InklingConfigRefused, ServingSettings

# The page's launch block: --block-size 128, VLLM_CONTIGUOUS_PA=false, BF16 KV, no speculative
# decoding, --max-model-len 262144, --num-gpu-blocks-override 2560.
PAGE = ServingSettings(block_size=128, contiguous_pa=False, merged_prefill=False, kv_cache_dtype="auto",
                       speculative_method=None, max_model_len=262144, num_blocks=2560)


def test_page_launch_settings_pass():
    assert guards.refusals(PAGE) == []
    guards.check(PAGE)


@pytest.mark.parametrize("change, expected", [
    (dict(block_size=16, num_blocks=None), "expected --block-size 128, found 16"),
    (dict(block_size=256, num_blocks=None), "expected --block-size 128, found 256"),
    (dict(contiguous_pa=True), "contiguous PA: expected VLLM_CONTIGUOUS_PA=false"),
    (dict(merged_prefill=True), "merged prefill: expected VLLM_MERGED_PREFILL unset or false"),
    (dict(kv_cache_dtype="fp8"), "expected auto or bfloat16, found fp8"),
    (dict(kv_cache_dtype="fp8_e4m3"), "expected auto or bfloat16, found fp8_e4m3"),
    (dict(speculative_method="ngram"), "speculative decoding: expected none, found ngram"),
    (dict(num_blocks=2048), "expected at least 2049 blocks (262144 tokens"),
    (dict(kv_connector="OffloadingConnector"), "KV connector: expected none, found OffloadingConnector"),
])
def test_each_forbidden_setting_is_refused_with_its_reason(change, expected):
    settings = replace(PAGE, **change)
    with pytest.raises(InklingConfigRefused) as err:
        guards.check(settings)
    message = str(err.value)
    assert "the conv-state snapshots cannot serve this configuration" in message
    assert expected in message
    assert len(guards.refusals(settings)) == 1


def test_all_reasons_are_listed_at_once():
    settings = replace(PAGE, block_size=64, contiguous_pa=True, merged_prefill=True, kv_cache_dtype="fp8",
                       speculative_method="eagle", num_blocks=10, kv_connector="LMCacheConnectorV1")
    assert len(guards.refusals(settings)) == 7


def test_conv_snapshot_arithmetic():
    """Per block and rank: 3 taps x (2 x kv heads x head dim + 2 x hidden channels of the rank) x 2 bytes
    per layer, next to 2 x 128 x kv heads x head dim x 2 bytes of K/V."""
    layers = [(1, 128)] * 42        # e.g. 8 kv heads over TP 8, head dim 128
    assert guards.conv_snapshot_bytes_per_block(layers, 4096 // 8, 4, 2) == 42 * 3 * (256 + 1024) * 2
    assert guards.kv_bytes_per_block(layers, 128, 2) == 42 * 2 * 128 * 128 * 2
    line = guards.conv_snapshot_line(layers, 4096 // 8, 4, 128, 2, 2560)
    assert line.startswith("conv-state snapshots: 322560 bytes per block per rank = 0.117 x the block's K/V (2752512 bytes)")


def test_memory_guard_boundary():
    # Block 0 is vLLM's null block: 2049 blocks hold exactly one 262144-token request.
    assert guards.kv_pool_refusal(2049, 128, 262144) is None
    assert guards.kv_pool_refusal(2048, 128, 262016) is None
    assert "expected at least 2049 blocks" in guards.kv_pool_refusal(2048, 128, 262144)
    assert "found 2048 blocks = 262144 tokens" in guards.kv_pool_refusal(2048, 128, 262144)


def test_pool_unknown_at_config_time_is_not_guessed():
    assert guards.refusals(replace(PAGE, num_blocks=None)) == []


def test_kv_pool_line_is_the_page_line():
    assert guards.kv_pool_line(2560, 128, 262144) == \
        "KV pool: 2560 blocks = 327680 tokens = 1.25 x max_model_len 262144"


@pytest.mark.parametrize("env, prefix_caching, expected", [
    ({"VLLM_CONTIGUOUS_PA": "false"}, False, False),
    ({"VLLM_CONTIGUOUS_PA": "true"}, True, True),
    ({"VLLM_CONTIGUOUS_PA": "1"}, True, True),
    ({}, True, False),          # vllm-gaudi default: contiguous PA only without prefix caching
    ({}, False, True),
])
def test_contiguous_pa_follows_vllm_gaudi_rules(env, prefix_caching, expected):
    class Cache:
        block_size, cache_dtype, num_gpu_blocks_override, num_gpu_blocks = 128, "auto", 2560, None
        enable_prefix_caching = prefix_caching

    class Model:
        max_model_len = 262144

    class Config:
        cache_config, model_config, speculative_config = Cache, Model, None

    assert guards.settings_from_vllm_config(Config, environ=env).contiguous_pa is expected
    # vLLM's own CPU worker has no contiguous PA: prefix caching off is then served, not refused
    cpu = guards.settings_from_vllm_config(Config, environ=env, gaudi_runtime_config=guards.CPU_RUNTIME)
    assert cpu.contiguous_pa is False and cpu.merged_prefill is False


def _run_with_vllm(vllm_src, port_dir, code: str, env_extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{port_dir}{os.pathsep}{vllm_src}", VLLM_TARGET_DEVICE="cpu",
               **(env_extra or {}))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_kv_cache_config_check_with_real_vllm_specs(vllm_src, port_dir):
    """One KV group of 42 FullAttentionSpec layers at block 128: the page's start-up line."""
    out = _run_with_vllm(vllm_src, port_dir, """
        import json, torch
        from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                                SlidingWindowSpec)
        from inkling_hpu import guards
        spec = FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=128, dtype=torch.bfloat16)
        layers = [f"model.layers.{i}.attn" for i in range(42)]
        good = KVCacheConfig(num_blocks=2560, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
        result = {"line": guards.check_kv_cache_config(good, 128, 262144, 42)}
        small = KVCacheConfig(num_blocks=1000, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
        swa = SlidingWindowSpec(block_size=128, num_kv_heads=1, head_size=128, dtype=torch.bfloat16,
                                sliding_window=512)
        split = KVCacheConfig(num_blocks=2560, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(layers[:7], spec), KVCacheGroupSpec(layers[7:], swa)])
        for key, cfg in (("small", small), ("split", split)):
            try:
                guards.check_kv_cache_config(cfg, 128, 262144, 42)
                result[key] = None
            except guards.InklingConfigRefused as exc:
                result[key] = str(exc)
        print(json.dumps(result))
    """)
    assert out["line"] == ("Inkling KV cache: 1 KV group (FullAttentionSpecx42); "
                           "KV pool: 2560 blocks = 327680 tokens = 1.25 x max_model_len 262144")
    assert "expected at least 2049 blocks (262144 tokens" in out["small"]
    assert "found 1000 blocks = 128000 tokens" in out["small"]
    assert ("KV groups: expected one group FullAttentionSpecx42, found 2 "
            "(FullAttentionSpecx7, SlidingWindowSpecx35)") in out["split"]


def test_pages_patch_missing_names_expected_and_found():
    assert guards.pages_patch_missing(None) is None                      # no vllm_gaudi: nothing to say
    stamp = {"profiles": {"inkling-small-port": {"fixes": [{"name": "decode-window"}, {"name": "conv-snapshot-pages"}]}}}
    assert guards.pages_patch_missing(stamp) is None
    old = {"profiles": {"inkling-small-port": {"fixes": [{"name": "decode-window"}]}}}
    assert "expected the port's runner patch conv-snapshot-pages (profile inkling-small-port), found decode-window" \
        in guards.pages_patch_missing(old)
    assert "found no port patch" in guards.pages_patch_missing({})


def test_tensor_parallel_sizes_the_model_cannot_split_are_refused():
    import json

    from inkling_hpu import memory
    from inkling_hpu.model import InklingPortConfig

    real = InklingPortConfig.from_dict(json.loads(memory.REAL_CONFIG.read_text()))
    assert guards.tensor_parallel_refusal(real, 8) is None
    refusal = guards.tensor_parallel_refusal(real, 16)
    assert refusal == ("--tensor-parallel-size: expected a size that divides every split dimension, found 16, "
                       "which does not divide the KV heads 8. Sizes this model splits over: 1, 2, 4, 8.")
    assert "found 3, which does not divide the query heads 32; KV heads 8; hidden channels 4096" in \
        guards.tensor_parallel_refusal(real, 3)


def test_more_pipeline_stages_than_layers_are_refused():
    import json

    from inkling_hpu import memory
    from inkling_hpu.model import InklingPortConfig

    real = InklingPortConfig.from_dict(json.loads(memory.REAL_CONFIG.read_text()))
    assert guards.pipeline_parallel_refusal(real, 2) is None
    assert guards.pipeline_parallel_refusal(real, real.num_hidden_layers) is None
    assert guards.pipeline_parallel_refusal(real, real.num_hidden_layers + 1) == (
        f"--pipeline-parallel-size: expected at most one stage per decoder layer ({real.num_hidden_layers}), "
        f"found {real.num_hidden_layers + 1}")


def _tokenizer(base: int, added: tuple[str, ...] = ()) -> guards.TokenizerIds:
    """Ids 0..base-1 and `added` tokens after them, with max_token_id by vLLM's rule (its largest id, or its
    vocab_size if larger: test_token_id_guard_on_vllm_s_own_tokenizer checks the rule against vLLM's)."""
    vocab = {f"t{i}": i for i in range(base)} | {token: base + k for k, token in enumerate(added)}
    return guards.TokenizerIds(max_token_id=max(max(vocab.values()), base), vocab=vocab, vocab_size=base)


def test_token_id_guard_passes_the_page_s_checkpoint_shape():
    # Inkling-Small with the fix pack's inkling-unpadded-vocab: 201,024 embedding and head rows, vLLM's
    # vocab_size and the logits 200,058; a tokenizer whose special tokens are the top of the unpadded range
    # (ids 200,056 and 200,057) can sample every id it has
    tokenizer = _tokenizer(200056, ("<|content_tool_error|>", "<|content_xml|>"))
    assert guards.token_id_refusal(tokenizer, 200058, 201024, logits=200058) is None
    assert guards.token_id_line(tokenizer, 200058, 201024, logits=200058) == (
        "token ids: vLLM admits 0..200057 (tokenizer max_token_id 200057, config vocab_size 200058); "
        "the embedding holds 201024 rows; logits: 200058 ids of 201024 head rows (the padding trimmed)")
    # the tiny checkpoint: 1,023 ids, 1,024 rows
    assert guards.token_id_refusal(_tokenizer(1023), 1023, 1024, logits=1023) is None


def test_logits_that_are_not_vllm_s_vocabulary_are_refused():
    # the published config on a vLLM without inkling-unpadded-vocab would give 201,024 (vLLM's vocab_size) beside
    # a head trimmed to 200,058: the sampler's checks and the model would disagree
    refusal = guards.token_id_refusal(_tokenizer(200058), 201024, 201024, logits=200058)
    assert refusal.startswith("logits: expected the head's logits to be vLLM's vocabulary (the config's vocab_size "
                              "201024, which its sampler checks request ids against), found 200058"), refusal


def test_a_tokenizer_id_past_the_logits_is_refused():
    # special tokens added after 200,058 ids could never be sampled once the padding is trimmed
    refusal = guards.token_id_refusal(_tokenizer(200058, ("<|end_message|>", "<|content_xml|>")), 200058, 201024,
                                      logits=200058)
    assert refusal == ("logits: expected every id the tokenizer has to be one the model can sample (below the "
                       "logits' width 200058, the config's unpadded_vocab_size), found 2 past it: "
                       "'<|end_message|>' = 200058, '<|content_xml|>' = 200059. Give the checkpoint an "
                       "unpadded_vocab_size that holds the tokenizer's ids."), refusal


def test_token_id_guard_refuses_an_admitted_id_without_a_row():
    # a tokenizer of as many ids as rows: vLLM counts its vocab_size 1024 as an id, which has no row
    refusal = guards.token_id_refusal(_tokenizer(1024), 1024, 1024)
    assert refusal.startswith("token ids: expected every prompt token id vLLM admits to have an embedding row, "
                              "found ids up to 1024 admitted (the larger of the tokenizer's max_token_id 1024 and "
                              "the config's vocab_size 1024 - 1; "), refusal
    assert "1024 embedding rows (ids 0..1023). Admitted ids without a row: 1024 (the tokenizer's vocab_size" in refusal
    # added tokens past the rows are named, at most 8 of them
    extra = tuple(f"<|extra_{i}|>" for i in range(12))
    refusal = guards.token_id_refusal(_tokenizer(1020, extra), 1024, 1024)
    assert "found ids up to 1031 admitted" in refusal
    assert "without a row: '<|extra_4|>' = 1024, '<|extra_5|>' = 1025, " in refusal
    assert "'<|extra_11|>' = 1031. One request" in refusal and "and " not in refusal.split("without a row:")[1][:200]
    refusal = guards.token_id_refusal(_tokenizer(1000, tuple(f"<|x{i}|>" for i in range(40))), 1024, 1024)
    assert "'<|x31|>' = 1031, and 8 more. One request" in refusal, refusal
    # a config vocab_size past the rows admits ids no tokenizer has
    assert "1024..1099 (below the config's vocab_size 1100)" in guards.token_id_refusal(_tokenizer(1000), 1100, 1024)


def test_no_tokenizer_is_refused():
    refusal = guards.token_id_refusal(None, 1024, 1024)
    assert refusal.startswith("tokenizer: expected the checkpoint's tokenizer, found none (--skip-tokenizer-init or "
                              "--tokens-only). Without one vLLM checks no prompt token id"), refusal


@pytest.mark.timeout(300)
def test_token_id_guard_on_vllm_s_own_tokenizer(vllm_src, port_dir, tmp_path):
    """vLLM 0.30.0's own tokenizer loading (get_tokenizer, its cached max_token_id) on word-level tokenizers:
    1,023 ids beside 1,024 rows pass; 1,024 ids are refused (vLLM counts the vocab_size as an id); added
    tokens past the rows are refused by name."""
    out = _run_with_vllm(vllm_src, port_dir, f"""
        import json
        from pathlib import Path
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        from vllm.tokenizers import get_tokenizer
        from inkling_hpu import guards
        result = {{}}
        for name, base, added in (("fits", 1023, []), ("as_many_as_rows", 1024, []), ("added", 1023, ["<|a|>", "<|b|>"])):
            folder = Path({str(tmp_path)!r}) / name
            backend = Tokenizer(models.WordLevel({{f"t{{i}}": i for i in range(base)}}, unk_token="t0"))
            backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
            tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0")
            tok.add_tokens(added)
            tok.save_pretrained(folder)
            ids = guards.tokenizer_ids(get_tokenizer(str(folder)))
            result[name] = [ids.max_token_id, guards.token_id_refusal(ids, 1024, 1024)]
        print(json.dumps(result))
    """)
    assert out["fits"] == [1023, None]
    assert out["as_many_as_rows"][0] == 1024
    assert "Admitted ids without a row: 1024 (the tokenizer's vocab_size" in out["as_many_as_rows"][1]
    assert out["added"][0] == 1024 and "Admitted ids without a row: '<|b|>' = 1024." in out["added"][1]


@pytest.mark.slow
def test_the_hpu_glue_refuses_a_tokenizer_id_without_an_embedding_row(vllm_gaudi_src, vllm_src, port_dir):
    """The HPU glue built by vLLM's config in vllm-gaudi's harness (the CPU glue: test_gates_cpu_server_failing,
    on a real server): a tokenizer whose added tokens pass the model's 64 rows is refused, by name, when the
    model is built, before any weight is read."""
    from pathlib import Path

    from gaudi_harness.subproc import run_scenarios

    scenario = str(Path(__file__).with_name("test_memory.py"))
    out = {added: run_scenarios(scenario, ["scenario_glue_start_up"], vllm_gaudi_src, vllm_src, timeout=600,
                                python_path=[port_dir], kwargs={"port_dir": str(port_dir), "blocks": 64,
                                                                "added_tokens": list(added)})["scenario_glue_start_up"]
           for added in ((), ("<|a|>",), ("<|a|>", "<|b|>", "<|c|>"))}
    assert out[()] == {"refused": None}, out
    assert out[("<|a|>",)] == {"refused": None}, out          # id 63: the last row
    refused = out[("<|a|>", "<|b|>", "<|c|>")]["refused"]
    assert refused.startswith("Inkling-Small refuses to start: token ids: expected every prompt token id vLLM admits "
                              "to have an embedding row, found ids up to 65 admitted"), out
    assert "64 embedding rows (ids 0..63). Admitted ids without a row: '<|b|>' = 64, '<|c|>' = 65." in refused
