"""Start-up guards: refuse the serving configurations the port cannot run exactly.

The port keeps Inkling's short-convolution state per 128-token KV block: a snapshot at every full
block's boundary, shared with the block through prefix caching, and the running state in each
request's own last block (docs/caches.md). Configurations that break this would not crash: they
would silently compute wrong logits. So they are refused before any weight is read, with the reason
and what to do instead.

Pure Python, no torch / vLLM / Habana import: the checks take plain values (`ServingSettings`) and
`settings_from_vllm_config` reads them from a real VllmConfig.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

logger = logging.getLogger("vllm.inkling_hpu")   # vLLM's handler prints it

REQUIRED_BLOCK_SIZE = 128

# vllm-gaudi's boolean env parser (vllm_gaudi/extension/config.py `boolean`): same spellings.
_TRUE_WORDS = frozenset({"true", "t", "1", "yes", "y", "on"})


class InklingConfigRefused(ValueError):
    """The serving configuration cannot run Inkling exactly; the message says why and what to do."""


@dataclass(frozen=True)
class ServingSettings:
    block_size: int | None
    contiguous_pa: bool
    merged_prefill: bool
    kv_cache_dtype: str
    speculative_method: str | None
    max_model_len: int
    # The KV pool in blocks when it is already known (--num-gpu-blocks-override), else None.
    num_blocks: int | None = None
    # vLLM's KV connector (--kv-transfer-config, KV offloading), if any.
    kv_connector: str | None = None


def _env_flag(environ: Mapping[str, str], name: str) -> bool | None:
    value = environ.get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip().lower() in _TRUE_WORDS


@dataclass(frozen=True)
class RuntimeFlags:
    """The two runtime flags vllm-gaudi resolves (`get_config()` has the same attribute names)."""

    use_contiguous_pa: bool
    merged_prefill: bool


# vLLM's own CPU worker (the CPU glue) has neither feature, whatever prefix caching is set to.
CPU_RUNTIME = RuntimeFlags(use_contiguous_pa=False, merged_prefill=False)


def settings_from_vllm_config(vllm_config: Any, environ: Mapping[str, str] | None = None,
                              gaudi_runtime_config: Any = None) -> ServingSettings:
    """Read the guarded settings from a vLLM VllmConfig and the vllm-gaudi environment.

    `gaudi_runtime_config` is vllm-gaudi's `get_config()` result when the caller runs inside the
    HPU worker (then its `use_contiguous_pa` / `merged_prefill` are authoritative). Without it the
    two flags are derived from the environment with vllm-gaudi's rules (extension/features.py):
    VLLM_CONTIGUOUS_PA when set, else on exactly when prefix caching is off; VLLM_MERGED_PREFILL
    when set, else off.
    """
    environ = os.environ if environ is None else environ
    cache = vllm_config.cache_config
    if gaudi_runtime_config is not None:
        contiguous_pa = bool(gaudi_runtime_config.use_contiguous_pa)
        merged_prefill = bool(gaudi_runtime_config.merged_prefill)
    else:
        contiguous_pa = _env_flag(environ, "VLLM_CONTIGUOUS_PA")
        if contiguous_pa is None:
            contiguous_pa = not bool(cache.enable_prefix_caching)
        merged_prefill = bool(_env_flag(environ, "VLLM_MERGED_PREFILL"))
    spec = vllm_config.speculative_config
    return ServingSettings(
        block_size=cache.block_size,
        contiguous_pa=contiguous_pa,
        merged_prefill=merged_prefill,
        kv_cache_dtype=str(cache.cache_dtype),
        speculative_method=None if spec is None else str(getattr(spec, "method", None) or "speculative"),
        max_model_len=int(vllm_config.model_config.max_model_len),
        num_blocks=cache.num_gpu_blocks_override or cache.num_gpu_blocks,
        kv_connector=_kv_connector(vllm_config),
    )


def _kv_connector(vllm_config: Any) -> str | None:
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is None:
        return None
    return str(getattr(transfer, "kv_connector", None) or "a KV connector")


def refusals(settings: ServingSettings) -> list[str]:
    """Every reason the settings cannot serve Inkling; empty when they can."""
    reasons = []
    if settings.block_size is not None and settings.block_size != REQUIRED_BLOCK_SIZE:
        reasons.append(
            f"block size: expected --block-size {REQUIRED_BLOCK_SIZE}, found {settings.block_size}. "
            "The conv-state snapshots are taken at 128-token block boundaries and the local layers' "
            "decode window is counted in 128-token blocks.")
    if settings.contiguous_pa:
        reasons.append(
            "contiguous PA: expected VLLM_CONTIGUOUS_PA=false, found contiguous PA on "
            "(VLLM_CONTIGUOUS_PA=true, or unset with prefix caching off). Contiguous PA fetches "
            "blocks by id range; the local layers' decode window and the conv-state snapshots "
            "address scattered block ids.")
    if settings.merged_prefill:
        reasons.append(
            "merged prefill: expected VLLM_MERGED_PREFILL unset or false, found it on. Merged "
            "prefill flattens several prompts into one sequence, and the short convolutions would "
            "read taps across request boundaries instead of each request's conv-state snapshot.")
    if settings.kv_cache_dtype.lower().startswith("fp8"):
        reasons.append(
            f"KV cache dtype: expected auto or bfloat16, found {settings.kv_cache_dtype}. The "
            "conv-state snapshots live with the KV blocks and must stay bf16 (vLLM's own Inkling "
            "forces its conv cache to the model dtype).")
    if settings.speculative_method is not None:
        reasons.append(
            f"speculative decoding: expected none, found {settings.speculative_method}. Verifying "
            "drafts needs the conv state at every draft position with rollback; the snapshots "
            "exist only at block boundaries and in each request's last block, with no rollback.")
    if settings.kv_connector is not None:
        reasons.append(
            f"KV connector: expected none, found {settings.kv_connector}. A connector (KV offloading, "
            "disaggregated prefill) loads and saves the K/V of blocks only; a request resumed on loaded "
            "blocks would find no conv-state snapshot for them. Remove --kv-transfer-config and "
            "--kv-offloading-size; prefix caching inside the pool is served exactly.")
    if settings.num_blocks is not None and settings.block_size is not None:
        pool_reason = kv_pool_refusal(settings.num_blocks, settings.block_size, settings.max_model_len)
        if pool_reason:
            reasons.append(pool_reason)
    return reasons


def check(settings: ServingSettings) -> None:
    """Raise InklingConfigRefused listing every reason, or return."""
    reasons = refusals(settings)
    if reasons:
        raise InklingConfigRefused(
            "Inkling-Small refuses to start: the conv-state snapshots cannot serve this "
            "configuration.\n- " + "\n- ".join(reasons))


def tensor_parallel_refusal(config: Any, tp_size: int) -> str | None:
    """What a tensor-parallel size cannot split, in the expected-vs-found form, or None. `config` is an
    InklingPortConfig. KV heads are never replicated (their conv state is per head), and the hidden
    streams, the expert and dense widths and the vocabulary rows split evenly."""
    layers = range(config.num_hidden_layers)
    dims = {"query heads": {config.attention_shape(i)[0] for i in layers},
            "KV heads": {config.attention_shape(i)[1] for i in layers},
            "hidden channels": {config.hidden_size}, "vocabulary rows": {config.vocab_rows}}
    if any(config.dense_layers):
        dims["dense MLP width"] = {config.dense_intermediate_size}
    if not all(config.dense_layers):
        dims["expert width"] = {config.moe_intermediate_size}
    uneven = {what: sorted(sizes) for what, sizes in dims.items() if any(size % tp_size for size in sizes)}
    if not uneven:
        return None
    fits = [n for n in range(1, max(min(s) for s in dims.values()) + 1)
            if all(size % n == 0 for sizes in dims.values() for size in sizes)]
    found = "; ".join(f"{what} {', '.join(map(str, sizes))}" for what, sizes in uneven.items())
    return (f"--tensor-parallel-size: expected a size that divides every split dimension, found {tp_size}, which "
            f"does not divide the {found}. Sizes this model splits over: {', '.join(map(str, fits))}.")


@dataclass(frozen=True)
class TokenizerIds:
    """What vLLM 0.30.0 knows of a tokenizer's ids when it checks a prompt."""

    # vLLM's `tokenizer.max_token_id`: the largest id of get_vocab(), or the tokenizer's `vocab_size` when
    # that is larger (vllm/tokenizers/hf.py:123-132: a size counted as an id, so a tokenizer of ids
    # 0..N-1 admits N)
    max_token_id: int
    vocab: Mapping[str, int]          # token -> id, added tokens included
    vocab_size: int | None            # the tokenizer's base vocabulary size (no added tokens)


NO_TOKENIZER = ("tokenizer: expected the checkpoint's tokenizer, found none (--skip-tokenizer-init or --tokens-only). "
                "Without one vLLM checks no prompt token id against the vocabulary "
                "(vllm/v1/engine/input_processor.py:522), and one request naming an id past the embedding's rows "
                "would end the engine for every client. Serve with the tokenizer.")


def admitted_token_id_max(tokenizer: TokenizerIds, config_vocab_size: int) -> int:
    """The largest prompt token id vLLM's input processor lets through to the model
    (vllm/v1/engine/input_processor.py:546): max(tokenizer.max_token_id, the config's vocab_size - 1)."""
    return max(tokenizer.max_token_id, config_vocab_size - 1)


def token_id_refusal(tokenizer: TokenizerIds | None, config_vocab_size: int, rows: int,
                     logits: int | None = None) -> str | None:
    """Why a prompt token id vLLM admits can reach the embedding without a row (`rows`: the rows the
    ranks hold together), else None. Such an id is an IndexError in the worker: the engine dies and
    every client's request with it. With `logits` (the head's width after the padding is trimmed), also why
    the model and vLLM's sampler checks would disagree, or an id of the tokenizer could never be sampled."""
    if tokenizer is None:
        return NO_TOKENIZER
    admitted = admitted_token_id_max(tokenizer, config_vocab_size)
    if admitted < rows:
        return None if logits is None else logits_refusal(tokenizer, config_vocab_size, logits)
    without_row = sorted((i, t) for t, i in tokenizer.vocab.items() if i >= rows)
    named = [f"{t!r} = {i}" for i, t in without_row[:8]]
    if len(without_row) > 8:
        named.append(f"and {len(without_row) - 8} more")
    counted_size = tokenizer.vocab_size
    if counted_size is not None and counted_size >= rows and counted_size not in tokenizer.vocab.values():
        named.append(f"{counted_size} (the tokenizer's vocab_size, which vLLM counts as an id: "
                     "vllm/tokenizers/hf.py:132)")
    if config_vocab_size - 1 >= rows:
        named.append(f"{rows}..{config_vocab_size - 1} (below the config's vocab_size {config_vocab_size})")
    if not named:      # a tokenizer whose max_token_id comes from neither its ids nor its vocab_size
        named.append(f"{tokenizer.max_token_id} (the tokenizer's max_token_id)")
    return (f"token ids: expected every prompt token id vLLM admits to have an embedding row, found ids up to "
            f"{admitted} admitted (the larger of the tokenizer's max_token_id {tokenizer.max_token_id} and the "
            f"config's vocab_size {config_vocab_size} - 1; vllm/v1/engine/input_processor.py:546) and "
            f"{rows} embedding rows (ids 0..{rows - 1}). Admitted ids without a row: {', '.join(named)}. One "
            "request naming such an id would end the engine for every client. Give the checkpoint padded "
            f"embedding and head rows (padded_vocab_size {admitted + 1} or more, unpadded_vocab_size the "
            f"tokenizer's) or a tokenizer whose ids and vocab_size stay below {rows}.")


def logits_refusal(tokenizer: TokenizerIds, config_vocab_size: int, logits: int) -> str | None:
    """The head's logits must be vLLM's vocabulary (its sampler checks logit_bias, allowed_token_ids and
    stop_token_ids against the config's vocab_size, and samples every column it is handed), and must hold
    every id the tokenizer has (an id past them, an end-of-message marker say, could never be generated)."""
    if logits != config_vocab_size:
        return (f"logits: expected the head's logits to be vLLM's vocabulary (the config's vocab_size "
                f"{config_vocab_size}, which its sampler checks request ids against), found {logits} "
                "(the config's unpadded_vocab_size). Apply the fix pack's inkling-unpadded-vocab fix, or state "
                "one vocabulary size in config.json.")
    beyond = sorted((i, t) for t, i in tokenizer.vocab.items() if i >= logits)
    if beyond:
        named = ", ".join(f"{t!r} = {i}" for i, t in beyond[:8]) + (f", and {len(beyond) - 8} more" if len(beyond) > 8 else "")
        return (f"logits: expected every id the tokenizer has to be one the model can sample (below the logits' "
                f"width {logits}, the config's unpadded_vocab_size), found {len(beyond)} past it: {named}. "
                "Give the checkpoint an unpadded_vocab_size that holds the tokenizer's ids.")
    return None


def token_id_line(tokenizer: TokenizerIds, config_vocab_size: int, rows: int, logits: int | None = None) -> str:
    """The start-up line saying which ids vLLM admits and the rows that hold them (and the logits' width)."""
    line = (f"token ids: vLLM admits 0..{admitted_token_id_max(tokenizer, config_vocab_size)} (tokenizer "
            f"max_token_id {tokenizer.max_token_id}, config vocab_size {config_vocab_size}); the embedding "
            f"holds {rows} rows")
    return line if logits is None else line + f"; logits: {logits} ids of {rows} head rows (the padding trimmed)"


def tokenizer_ids(tokenizer: Any) -> TokenizerIds | None:
    """TokenizerIds of a vLLM tokenizer (vllm.tokenizers: get_tokenizer, cached_tokenizer_from_config), or
    None for no tokenizer."""
    if tokenizer is None:
        return None
    try:     # vLLM's wrapper allows a tokenizer without it (vllm/tokenizers/hf.py:131)
        vocab_size = getattr(tokenizer, "vocab_size", None)
    except NotImplementedError:
        vocab_size = None
    return TokenizerIds(max_token_id=int(tokenizer.max_token_id), vocab=tokenizer.get_vocab(),
                        vocab_size=None if vocab_size is None else int(vocab_size))


def pipeline_parallel_refusal(config: Any, pp_size: int) -> str | None:
    """A pipeline-parallel size that would leave a stage without a decoder layer, or None."""
    if pp_size <= config.num_hidden_layers:
        return None
    return (f"--pipeline-parallel-size: expected at most one stage per decoder layer ({config.num_hidden_layers}), "
            f"found {pp_size}")


def kv_pool_refusal(num_blocks: int, block_size: int, max_model_len: int) -> str | None:
    """The memory guard: the pool must hold one max-length request.

    vLLM's BlockPool keeps block 0 as its null block, so a request can use num_blocks - 1."""
    usable = (num_blocks - 1) * block_size
    if usable >= max_model_len:
        return None
    needed = math.ceil(max_model_len / block_size) + 1
    return (f"KV pool: expected at least {needed} blocks ({max_model_len} tokens for one request of "
            f"--max-model-len, plus vLLM's null block), found {num_blocks} blocks = "
            f"{num_blocks * block_size} tokens. Lower --max-model-len or give the pool {needed}+ blocks "
            "(--num-gpu-blocks-override); do not raise --gpu-memory-utilization or lower "
            "VLLM_GRAPH_RESERVED_MEM for it.")


def conv_snapshot_bytes_per_block(layers: list[tuple[int, int]], hidden_channels: int, kernel_size: int,
                                  dtype_bytes: int) -> int:
    """Bytes of conv state kept per KV block on one rank: for each layer (kv heads on this rank, head
    dim), the conv inputs of kernel - 1 tokens for K, V (kv heads x head dim each) and the attention
    and MLP outputs (this rank's channels of the hidden state each: hidden / tensor-parallel size)."""
    taps = kernel_size - 1
    return sum(taps * (2 * kv_heads * head_dim + 2 * hidden_channels) * dtype_bytes for kv_heads, head_dim in layers)


def kv_bytes_per_block(layers: list[tuple[int, int]], block_size: int, dtype_bytes: int) -> int:
    """K and V bytes of one block on one rank, over all layers."""
    return sum(2 * block_size * kv_heads * head_dim * dtype_bytes for kv_heads, head_dim in layers)


def conv_snapshot_line(layers: list[tuple[int, int]], hidden_channels: int, kernel_size: int, block_size: int,
                       dtype_bytes: int, num_blocks: int) -> str:
    """The start-up line stating what the conv snapshots cost next to the KV cache."""
    conv = conv_snapshot_bytes_per_block(layers, hidden_channels, kernel_size, dtype_bytes)
    kv = kv_bytes_per_block(layers, block_size, dtype_bytes)
    return (f"conv-state snapshots: {conv} bytes per block per rank = {conv / kv:.3f} x the block's K/V "
            f"({kv} bytes); {num_blocks} blocks: {num_blocks * (kv + conv) / 2**30:.2f} GiB per rank "
            f"({num_blocks * conv / 2**30:.2f} GiB of it conv state)")


GiB = 2**30


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's device memory at start-up, as vllm-gaudi spends it: the weights, then a KV pool of
    `blocks` (+ vllm-gaudi's pad block) pages of `page_bytes` (K/V plus conv snapshots, every layer),
    inside what vllm-gaudi leaves for the KV cache: the memory free after the weights, times
    --gpu-memory-utilization, less the VLLM_GRAPH_RESERVED_MEM share kept for HPU graphs. The
    profile run's activation peak also comes out of the free memory; it is not known before the
    run, so the guard's budget is an upper bound and a plan it passes can still be too tight."""

    device_bytes: int
    weights_bytes: int
    kv_bytes_per_block: int          # K and V, every layer, this rank
    conv_bytes_per_block: int        # conv-state snapshots, every layer, this rank
    blocks: int                      # usable blocks (--num-gpu-blocks-override)
    utilization: float               # --gpu-memory-utilization
    graph_reserved: float            # VLLM_GRAPH_RESERVED_MEM (0 under --enforce-eager)

    @property
    def pool_bytes(self) -> int:
        return (self.blocks + 1) * (self.kv_bytes_per_block + self.conv_bytes_per_block)

    @property
    def budget_bytes(self) -> int:
        free = max(self.device_bytes - self.weights_bytes, 0)
        return int(free * self.utilization * (1 - self.graph_reserved))

    def arithmetic(self) -> str:
        page = self.kv_bytes_per_block + self.conv_bytes_per_block
        return (f"weights {self.weights_bytes / GiB:.2f} GiB of {self.device_bytes / GiB:.2f} GiB leave "
                f"{(self.device_bytes - self.weights_bytes) / GiB:.2f} GiB; x gpu_memory_utilization "
                f"{self.utilization} x (1 - VLLM_GRAPH_RESERVED_MEM {self.graph_reserved}) = "
                f"{self.budget_bytes / GiB:.2f} GiB for the KV pool; the pool of {self.blocks} + 1 blocks x "
                f"{page:,} bytes ({self.kv_bytes_per_block:,} K/V + {self.conv_bytes_per_block:,} conv state, "
                f"every layer) = {self.pool_bytes / GiB:.2f} GiB")

    def refusal(self) -> str | None:
        if self.weights_bytes >= self.device_bytes:
            return (f"memory per rank: the weights take {self.weights_bytes / GiB:.2f} GiB, the device has "
                    f"{self.device_bytes / GiB:.2f} GiB; raise --tensor-parallel-size (or the pipeline stages)")
        if self.pool_bytes <= self.budget_bytes:
            return None
        page = self.kv_bytes_per_block + self.conv_bytes_per_block
        fits = max(self.budget_bytes // page - 1, 0)
        return (f"memory per rank: expected the KV pool to fit what vllm-gaudi leaves for it, found "
                f"{self.arithmetic()}, {(self.pool_bytes - self.budget_bytes) / GiB:.2f} GiB over. "
                f"Lower --num-gpu-blocks-override to {fits} or fewer, or give the KV cache more "
                "(--gpu-memory-utilization, VLLM_GRAPH_RESERVED_MEM, more ranks).")


PORT_PROFILE = "inkling-small-port"
PAGES_PATCH = "conv-snapshot-pages"


def pages_patch_missing(stamp: dict | None) -> str | None:
    """What is wrong when vllm-gaudi (its fix-pack stamp, {} without one; None: not installed) does not
    carry the port's runner patch that puts the conv snapshots in the KV page, else None."""
    if stamp is None:
        return None
    entry = (stamp.get("profiles") or {}).get(PORT_PROFILE) or {}
    applied = [fix.get("name") for fix in entry.get("fixes", []) if isinstance(fix, dict)]
    if PAGES_PATCH in applied:
        return None
    return (f"vllm-gaudi's stamp: expected the port's runner patch {PAGES_PATCH} (profile {PORT_PROFILE}), found "
            f"{', '.join(applied) or 'no port patch'}. The conv-state snapshots are then allocated outside "
            "vLLM's KV pool sizing; apply ports/inkling-small/patches/port.yaml (install.sh does).")


def _layer_specs(group: Any) -> list[Any]:
    """A group's per-layer specs: vLLM groups layers whose K/V shapes differ (a config whose local and
    global layers have other head counts) under one UniformTypeKVCacheSpecs, one spec per layer."""
    per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", None)
    return list(per_layer.values()) if per_layer is not None else [group.kv_cache_spec]


def kv_groups_summary(kv_cache_groups: list[Any]) -> str:
    """'FullAttentionSpecx42' for one group of 42 full-attention layers (vLLM KVCacheGroupSpec), with
    ' in N K/V shapes' when its layers' shapes differ."""
    parts = []
    for group in kv_cache_groups:
        specs = _layer_specs(group)
        kinds = "/".join(sorted({type(spec).__name__ for spec in specs}))
        shapes = {(getattr(spec, "num_kv_heads", None), getattr(spec, "head_size", None)) for spec in specs}
        parts.append(f"{kinds}x{len(group.layer_names)}" + (f" in {len(shapes)} K/V shapes" if len(shapes) > 1 else ""))
    return ", ".join(parts)


def kv_pool_line(num_blocks: int, block_size: int, max_model_len: int) -> str:
    tokens = num_blocks * block_size
    return (f"KV pool: {num_blocks} blocks = {tokens} tokens = "
            f"{tokens / max_model_len:.2f} x max_model_len {max_model_len}")


def check_kv_cache_config(kv_cache_config: Any, block_size: int, max_model_len: int,
                          num_layers: int) -> str:
    """Check the allocated KV cache (a vLLM KVCacheConfig) and return the start-up log line.

    Expected: one KV group, every one of the model's `num_layers` layers a FullAttentionSpec at
    `block_size`, and a pool that holds one max-length request.
    """
    groups = list(kv_cache_config.kv_cache_groups)
    summary = kv_groups_summary(groups)
    expected = f"FullAttentionSpecx{num_layers}"
    one_full_attention_group = (len(groups) == 1 and len(groups[0].layer_names) == num_layers
                                and all(type(spec).__name__ == "FullAttentionSpec" for spec in _layer_specs(groups[0])))
    if not one_full_attention_group:
        raise InklingConfigRefused(
            f"Inkling-Small refuses to start: KV groups: expected one group {expected}, found "
            f"{len(groups)} ({summary}). Every layer keeps a full-attention spec at block size "
            f"{block_size}; local layers apply their window inside attention.")
    spec_block = groups[0].kv_cache_spec.block_size
    if spec_block != block_size:
        raise InklingConfigRefused(
            f"Inkling-Small refuses to start: KV block size: expected {block_size}, found {spec_block} "
            "in the KV cache spec.")
    pool_reason = kv_pool_refusal(kv_cache_config.num_blocks, block_size, max_model_len)
    if pool_reason:
        raise InklingConfigRefused("Inkling-Small refuses to start: " + pool_reason)
    line = (f"Inkling KV cache: {len(groups)} KV group ({summary}); "
            f"{kv_pool_line(kv_cache_config.num_blocks, block_size, max_model_len)}")
    logger.info(line)
    return line
