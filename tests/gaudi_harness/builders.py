"""Builders for vllm-gaudi's real InputBatch and HPUModelRunner on CPU (call bootstrap.install() first).

The runner is the real class, constructed as a worker would construct it, with device "cpu". What
cannot exist on CPU (model weights, KV cache, warm-up, HPU graphs) is never built; the harness
drivers replace the model forward by hand-made logits (see drivers.py).
"""
from __future__ import annotations

import json
import socket
import tempfile
from pathlib import Path

import torch

VOCAB_SIZE = 32  # small on purpose: logits rows are written by hand

# A tiny Llama: only config.json is needed (load_format="dummy", no tokenizer).
TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
}


def make_input_batch(max_num_reqs: int = 8, max_model_len: int = 256, vocab_size: int = VOCAB_SIZE,
                     logitsprocs=None):
    """vllm-gaudi's InputBatch on CPU, as the runner builds it (block size 128, no pinning)."""
    from vllm_gaudi.v1.worker.hpu_input_batch import InputBatch

    return InputBatch(max_num_reqs=max_num_reqs, max_model_len=max_model_len, max_num_batched_tokens=2048,
                      device=torch.device("cpu"), pin_memory=False, vocab_size=vocab_size, block_sizes=[128],
                      kernel_block_sizes=[128], logitsprocs=logitsprocs)


def write_model_dir(directory: Path | None = None, **overrides) -> Path:
    """A model folder holding only config.json (TINY_LLAMA_CONFIG + overrides)."""
    directory = Path(directory or tempfile.mkdtemp(prefix="gaudi_harness_model_"))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**TINY_LLAMA_CONFIG, **overrides}))
    return directory


def write_tokenizer(directory: Path, added_tokens=()) -> Path:
    """A word-level tokenizer in `directory` (tokens t0, t1, ...) for the model of its config.json: as many ids
    as the logits it keeps, at most its rows less one, so that every id vLLM admits has a row (vLLM counts a
    tokenizer's vocab_size as an admitted id, vllm/tokenizers/hf.py:132) and every id can be sampled, then
    `added_tokens`. make_vllm_config serves a folder that has one with it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = json.loads((directory / "config.json").read_text())
    rows = config.get("padded_vocab_size") or config["vocab_size"]
    kept = config.get("unpadded_vocab_size") or config["vocab_size"]
    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(min(rows - 1, kept))}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", eos_token="t1")
    tokenizer.add_tokens(list(added_tokens))
    tokenizer.save_pretrained(directory)
    return directory


def make_vllm_config(model_dir: Path | None = None, max_num_seqs: int = 8, max_model_len: int = 256,
                     max_num_batched_tokens: int = 2048, async_scheduling: bool = False, block_size: int = 128,
                     enable_prefix_caching: bool = False, structured_outputs: bool = False):
    """A real VllmConfig for the tiny model on the HPU platform (which must be current); with the folder's
    tokenizer when it has one (write_tokenizer), else none."""
    from vllm.config import (CacheConfig, DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                             VllmConfig)

    model_dir = model_dir or write_model_dir()
    model_config = ModelConfig(model=str(model_dir), tokenizer=str(model_dir),
                               skip_tokenizer_init=not (model_dir / "tokenizer.json").exists(),
                               dtype="float32", max_model_len=max_model_len, enforce_eager=True, seed=0)
    scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                       max_model_len=max_model_len, async_scheduling=async_scheduling,
                                       is_encoder_decoder=False)
    return VllmConfig(model_config=model_config,
                      cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
                      parallel_config=ParallelConfig(),
                      scheduler_config=scheduler_config,
                      device_config=DeviceConfig(device="cpu"),
                      load_config=LoadConfig(load_format="dummy"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process_distributed(vllm_config) -> None:
    """World size 1 over gloo on 127.0.0.1: the runner asks get_pp_group() in _update_states."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    if parallel_state._WORLD is not None:
        return
    with set_current_vllm_config(vllm_config):
        parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                                    distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                                                    backend="gloo")
        parallel_state.ensure_model_parallel_initialized(1, 1)


def initialize_kv_cache(runner, vllm_config, num_blocks: int):
    """The KV cache as a worker gets it (no stand-in): the runner's own get_kv_cache_spec, the layout its
    attention backends support (as EngineCore resolves it), vLLM 0.30.0's pool sizing for `num_blocks`
    (--num-gpu-blocks-override) and the runner's own initialize_kv_cache, which allocates the pool on
    the CPU device and binds it to the model's Attention modules. Returns the KVCacheConfig."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    with set_current_vllm_config(vllm_config):
        specs = runner.get_kv_cache_spec()
        backends = get_current_attn_backends(vllm_config)
        resolve_kv_cache_layout(vllm_config, [[layout.name for layout in get_supported_kv_cache_layouts(backends)]],
                                specs.values())
        vllm_config.cache_config.num_gpu_blocks_override = num_blocks
        memory = num_blocks * sum(spec.page_size_bytes for spec in specs.values())
        kv_cache_config = get_kv_cache_configs(vllm_config, [specs], [memory])[0]
        # The harness's device config is "cpu", for which vllm-gaudi's platform picks vLLM's CPU
        # attention backend; on a Gaudi the runner holds HPUAttentionBackendV1, whose KV shape the
        # allocation takes.
        from vllm_gaudi.v1.attention.backends.hpu_attn import HPUAttentionBackendV1

        runner.attn_backend = HPUAttentionBackendV1
        runner.initialize_kv_cache(per_layer_kv_cache_tensors(kv_cache_config, specs))
    return kv_cache_config


def per_layer_kv_cache_tensors(kv_cache_config, specs):
    """API drift: vllm-gaudi main's initialize_kv_cache reads the KVCacheTensor of vLLM before 0.30.0,
    one per layer (`size`: that layer's bytes, `shared_by`: its name); vLLM 0.30.0's describes
    placements (`layers`, strides, one backing `size`). The same pool, one entry per layer, as
    releases/v0.30.0 (not public) must read it."""
    import copy
    from types import SimpleNamespace

    per_layer = [SimpleNamespace(size=kv_cache_config.num_blocks * specs[name].page_size_bytes, shared_by=[name])
                 for tensor in kv_cache_config.kv_cache_tensors for name in tensor.layers]
    config = copy.copy(kv_cache_config)
    config.kv_cache_tensors = per_layer
    return config


def make_runner(vllm_config=None, **config_kwargs):
    """The real HPUModelRunner on CPU, constructed inside the config context like a worker does."""
    from vllm.config import set_current_vllm_config
    from vllm_gaudi.v1.worker.hpu_model_runner import HPUModelRunner

    vllm_config = vllm_config or make_vllm_config(**config_kwargs)
    init_single_process_distributed(vllm_config)
    with set_current_vllm_config(vllm_config):
        runner = HPUModelRunner(vllm_config, device=torch.device("cpu"), is_driver_worker=True)
    runner.vllm_config_context = vllm_config
    return runner
