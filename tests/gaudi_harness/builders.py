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


def make_vllm_config(model_dir: Path | None = None, max_num_seqs: int = 8, max_model_len: int = 256,
                     max_num_batched_tokens: int = 2048, async_scheduling: bool = False, block_size: int = 128,
                     enable_prefix_caching: bool = False, structured_outputs: bool = False):
    """A real VllmConfig for the tiny model on the HPU platform (which must be current)."""
    from vllm.config import (CacheConfig, DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                             VllmConfig)

    model_dir = model_dir or write_model_dir()
    model_config = ModelConfig(model=str(model_dir), tokenizer=str(model_dir), skip_tokenizer_init=True,
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
