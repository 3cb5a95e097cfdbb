"""Drive the real HPUModelRunner step by step on CPU: scheduler outputs in, sampled tokens out.

Only the model is replaced: `BigramLogitsModel` (a test double, no weights) returns hand-made logits
chosen by the input token at each position. Everything else is vllm-gaudi's own code:
`_update_states` (via execute_model), `_ensure_decodes_first`, `ensure_multi_token_decodes_last`,
`_get_prompts_and_decodes`, `_prepare_inputs`, `_execute_model_generic`, `_run_sampling`,
`apply_grammar_bitmask`, `sample_tokens`, on vLLM 0.30.0's real Sampler.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


class BigramLogitsModel(torch.nn.Module):
    """Test double for the model: logits at a position = table[input token at that position].

    Hidden states are one-hot rows of the input ids, so the runner's own `logits_indices`
    selection and padding decide which rows reach the sampler, exactly as with a real model.
    """

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table.float()  # [vocab, vocab]

    def forward(self, input_ids: torch.Tensor, positions=None, **kwargs) -> torch.Tensor:
        ids = input_ids.long().clamp(min=0, max=self.table.shape[0] - 1)
        return torch.nn.functional.one_hot(ids, self.table.shape[0]).float()

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states @ self.table


def logits_table(vocab_size: int, preferences: dict[int, list[int]] | None = None,
                 default: list[int] | None = None) -> torch.Tensor:
    """table[t] ranks tokens: preferences[t] = [best, second, ...] get logits 10, 9, ...; others 0.
    Tokens without an entry use `default` (if given)."""
    table = torch.zeros(vocab_size, vocab_size)
    for t in range(vocab_size):
        ranked = (preferences or {}).get(t, default or [])
        for rank, tok in enumerate(ranked):
            table[t, tok] = 10.0 - rank
    return table


def install_model(runner, table: torch.Tensor) -> None:
    runner.model = BigramLogitsModel(table)
    runner.kv_caches = []


@dataclass
class _Req:
    req_id: str
    prompt: list[int]
    params: object
    block_ids: list[int]
    num_computed: int = 0
    outputs: list[int] = field(default_factory=list)
    sent: bool = False  # already sent to the runner as a new request

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.outputs)


class StepDriver:
    """A minimal stand-in for vLLM's scheduler bookkeeping (one process, no KV cache manager):
    builds real SchedulerOutput objects for the steps a test asks for and feeds sampled tokens back,
    keeping num_computed_tokens / output tokens as the v1 scheduler does (non-async)."""

    def __init__(self, runner, block_size: int = 128):
        self.runner = runner
        self.block_size = block_size
        self.reqs: dict[str, _Req] = {}
        self._next_block = 1
        self.last_output = None

    def add(self, req_id: str, prompt: list[int], params) -> None:
        blocks_needed = (len(prompt) + 64) // self.block_size + 1
        blocks = list(range(self._next_block, self._next_block + blocks_needed))
        self._next_block += blocks_needed
        self.reqs[req_id] = _Req(req_id, list(prompt), params, blocks)

    def scheduler_output(self, schedule: dict[str, int], finished: set[str] = frozenset()):
        """schedule: req_id -> tokens this step (a prefill chunk, or 1 for a decode)."""
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

        new, cached = [], CachedRequestData.make_empty()
        for req_id, n in schedule.items():
            r = self.reqs[req_id]
            if n <= 0 or r.num_computed + n > r.num_tokens:
                raise ValueError(f"{req_id}: cannot schedule {n} tokens at {r.num_computed}/{r.num_tokens}")
            if not r.sent:
                new.append(NewRequestData(req_id=req_id, prompt_token_ids=r.prompt, mm_features=[],
                                          sampling_params=r.params, pooling_params=None,
                                          block_ids=(list(r.block_ids), ), num_computed_tokens=r.num_computed,
                                          lora_request=None))
                r.sent = True
            else:
                cached.req_ids.append(req_id)
                cached.new_token_ids.append([])
                cached.new_block_ids.append(None)
                cached.num_computed_tokens.append(r.num_computed)
                cached.num_output_tokens.append(len(r.outputs))
        return SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                               num_scheduled_tokens=dict(schedule),
                               total_num_scheduled_tokens=sum(schedule.values()), scheduled_spec_decode_tokens={},
                               scheduled_encoder_inputs={}, num_common_prefix_blocks=[0],
                               finished_req_ids=set(finished), free_encoder_mm_hashes=[])

    def step(self, schedule: dict[str, int], grammar_output=None,
             finished: set[str] = frozenset()) -> dict[str, list[int]]:
        """One engine step through the real runner; returns the tokens kept per request."""
        so = self.scheduler_output(schedule, finished)
        for req_id in finished:
            self.reqs.pop(req_id, None)
        runner = self.runner
        with _config_context(runner):
            runner.execute_model(so)
            out = runner.sample_tokens(grammar_output)
        if hasattr(out, "get_output"):  # async scheduling: AsyncModelRunnerOutput
            out = out.get_output()
        self.last_output = out
        kept: dict[str, list[int]] = {}
        for req_id, n in schedule.items():
            r = self.reqs[req_id]
            r.num_computed += n
            if r.num_computed >= r.num_tokens:  # chunk reached the end: the sampled token is real
                tokens = list(out.sampled_token_ids[out.req_id_to_index[req_id]])
                r.outputs.extend(tokens)
                kept[req_id] = tokens
        return kept


def _config_context(runner):
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(runner.vllm_config)


# ---- lower-level drivers: the runner's own methods, one at a time -----------------------------

def update_states(runner, scheduler_output) -> bool:
    """The real `_update_states` (returns batch_changed)."""
    with _config_context(runner):
        return runner._update_states(scheduler_output)


def order_batch(runner, scheduler_output):
    """What sample_tokens does before preparing inputs: decodes first, multi-token decodes last,
    then the prompt/decode split. Returns the runner's PromptDecodeInfo."""
    from vllm_gaudi.v1.worker.hpu_model_runner import ensure_multi_token_decodes_last

    runner._ensure_decodes_first(scheduler_output)
    if not runner.vllm_config.speculative_config:
        ensure_multi_token_decodes_last(runner.input_batch, scheduler_output.num_scheduled_tokens)
    return runner._get_prompts_and_decodes(scheduler_output)


def run_sampling(runner, batch_changed: bool, logits: torch.Tensor, req_ids: list[str],
                 pad_to: int | None = None, logits_requests=None):
    """The real `_run_sampling` on hand-made logits; returns (sampled ids list, SamplingMetadata)."""
    with _config_context(runner):
        out, metadata = runner._run_sampling(batch_changed, logits, req_ids, pad_to or logits.shape[0],
                                             logits_requests)
    return out.sampled_token_ids.flatten().tolist(), metadata


def record_sampling(runner, n_rows: int | None = None) -> list[dict]:
    """Spy on the runner's real `_run_sampling` (it still runs): each call appends
    {"req_ids": [...], "rows": sampling_rows(metadata)} to the returned list."""
    calls: list[dict] = []
    real = runner._run_sampling

    def spy(batch_changed, logits_device, request_ids=None, pad_to=None, logits_requests=None):
        out, metadata = real(batch_changed, logits_device, request_ids, pad_to, logits_requests)
        ids = list(request_ids or [])
        calls.append({"req_ids": ids, "batch_changed": bool(batch_changed),
                      "rows": sampling_rows(metadata, n_rows or len(ids)),
                      "sampled": out.sampled_token_ids.flatten().tolist()})
        return out, metadata

    runner._run_sampling = spy
    return calls


def sampling_rows(metadata, n: int | None = None) -> dict[str, object]:
    """The per-row sampling parameters a SamplingMetadata carries (for observed-value reports)."""

    def rows(t):
        return None if t is None else [round(float(x), 4) for x in t[:n].tolist()]

    return {
        "temperature": rows(metadata.temperature),
        "top_k": rows(metadata.top_k),
        "top_p": rows(metadata.top_p),
        "repetition_penalties": rows(metadata.repetition_penalties),
        "prompt_token_ids": None if metadata.prompt_token_ids is None else metadata.prompt_token_ids[:n].tolist(),
        "bad_words_token_ids": {int(k): v for k, v in (metadata.bad_words_token_ids or {}).items()},
        "generators": sorted(int(k) for k in metadata.generators),
    }


def greedy_params(**kw):
    from vllm.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=64, **kw)


def random_params(**kw):
    from vllm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=64, **kw)


def with_bad_words(params, token_ids: list[list[int]]):
    """What SamplingParams.update_from_tokenizer stores for `bad_words` (no tokenizer here)."""
    params._bad_words_token_ids = [list(t) for t in token_ids]
    return params


def grammar_output(allowed: dict[str, list[int] | None], vocab_size: int):
    """A real GrammarOutput: per structured-output request (in the given order) the allowed
    tokens, None = all allowed. Bitmask layout as xgrammar's: bit t of word t // 32."""
    from vllm.v1.core.sched.output import GrammarOutput

    words = (vocab_size + 31) // 32
    bitmask = np.zeros((len(allowed), words), dtype=np.int32)
    for row, tokens in enumerate(allowed.values()):
        if tokens is None:
            bitmask[row] = -1
            continue
        for t in tokens:
            bitmask[row, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    return GrammarOutput(structured_output_request_ids=list(allowed), grammar_bitmask=bitmask)


def batch_order(runner) -> list[str]:
    return list(runner.input_batch.req_ids)


__all__ = ["BigramLogitsModel", "logits_table", "install_model", "StepDriver", "update_states", "order_batch",
           "run_sampling", "record_sampling", "sampling_rows", "greedy_params", "random_params", "with_bad_words", "grammar_output", "batch_order", "np"]
