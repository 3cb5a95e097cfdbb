"""vLLM's CPU worker packs a step's decodes and prefill chunks into one call (query_start_loc, seq_lens,
block_table). The CPU platform runs them as vllm-gaudi's runner calls the model, with the same tensor-op
builders (model/device_metadata.py): the single-token requests together, each chunk alone, and a request
that reads a block another request of the step computes (a prefix-cache hit on a block scheduled in the
same step) after that request. Its logits must equal the reference builder's on the same packed steps,
whatever the batch order, the local layers decoding from their decode-window lists."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import model_helpers as helpers
from model_helpers import one_torch_thread  # noqa: F401  (autouse fixture)
from inkling_hpu import cpu_glue
from inkling_hpu.model.metadata import RequestChunk, reference_step_metadata

CONFIG = "tiny-gqa2-mix.json"
BLOCK = 4
NUM_BLOCKS = 24               # block 0 is vLLM's null block: the pad block, in no request's table
TABLES = {"A": [3, 7, 1, 9, 12], "B": [5, 2, 8, 11, 14], "C": [4, 6, 10, 13, 15],
          "E": [16, 17, 18, 19], "D": [16, 17, 20, 21], "F": [16, 17, 22, 23]}   # D, F share E's first two


def _tokens(n, seed):
    return torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = {name: _tokens(20, seed) for seed, name in enumerate(TABLES)}
PROMPTS["D"] = PROMPTS["E"][:8] + _tokens(3, 10)
PROMPTS["F"] = PROMPTS["E"][:8] + _tokens(1, 11)


def _packed(rows: list[tuple[str, int, int]]):
    """The CPU attention metadata of a step of rows (request, tokens computed before, new tokens), in
    that batch order, and its input ids and the reference's chunks."""
    starts, ids, chunks = [0], [], []
    table = torch.zeros(len(rows), 6, dtype=torch.int32)
    for r, (name, start, n) in enumerate(rows):
        ids += PROMPTS[name][start:start + n]
        starts.append(starts[-1] + n)
        table[r, :len(TABLES[name])] = torch.tensor(TABLES[name])
        chunks.append(RequestChunk(PROMPTS[name][start:start + n], start, TABLES[name]))
    meta = SimpleNamespace(query_start_loc=torch.tensor(starts), block_table=table,
                           seq_lens=torch.tensor([start + n for _, start, n in rows]))
    return meta, torch.tensor(ids), chunks


def _platform_logits(model, caches, rows):
    meta, ids, _ = _packed(rows)
    glue = SimpleNamespace(block_size=BLOCK, config=model.config, inkling=model)
    hidden = torch.zeros(ids.numel(), model.config.hidden_size)
    for call in cpu_glue.CpuPlatform().model_calls(glue, ids, None, meta, cpu_glue.PAD_BLOCK):
        hidden[call.rows] = model(call.step, caches)
    return model.compute_logits(hidden)


def _reference_logits(model, caches, rows):
    _, _, chunks = _packed(rows)
    meta = reference_step_metadata(chunks, block_size=BLOCK, conv_kernel_size=4, pad_block_id=cpu_glue.PAD_BLOCK)
    return model.compute_logits(model(meta, caches))


STEPS = [
    [("A", 0, 6), ("B", 0, 9), ("C", 0, 4)],
    [("A", 6, 1), ("B", 9, 1), ("C", 4, 7)],                   # decodes (A at a block boundary) and a chunk
    [("D", 8, 3), ("F", 8, 1), ("E", 0, 10), ("A", 7, 1)],     # D and F hit E's blocks E computes this step
    [("C", 11, 6), ("B", 10, 1)],
    [("C", 17, 1), ("A", 8, 1), ("B", 11, 1)],                 # C decodes over 5 blocks: its window is the last 3
]


@pytest.mark.timeout(600)
def test_packed_steps_equal_the_reference_builder():
    model = helpers.port_model(CONFIG, helpers.BIAS_BUDGET)
    caches, reference = model.allocate_caches(NUM_BLOCKS, BLOCK), model.allocate_caches(NUM_BLOCKS, BLOCK)
    with torch.no_grad():
        for rows in STEPS:
            torch.testing.assert_close(_platform_logits(model, caches, rows), _reference_logits(model, reference, rows),
                                       atol=1e-5, rtol=0)


def test_a_same_step_hit_read_before_its_writer_differs(monkeypatch):
    """Without the writers-first order, D and F (batch order before E) read E's blocks before E's call
    wrote them: their logits differ from the reference (the ordering test above can fail)."""
    monkeypatch.setattr(cpu_glue, "writer_layers", lambda requests: [requests])
    model = helpers.port_model(CONFIG)
    caches, reference = model.allocate_caches(NUM_BLOCKS, BLOCK), model.allocate_caches(NUM_BLOCKS, BLOCK)
    with torch.no_grad():
        for rows in STEPS[:2]:
            _platform_logits(model, caches, rows), _reference_logits(model, reference, rows)
        got, want = _platform_logits(model, caches, STEPS[2]), _reference_logits(model, reference, STEPS[2])
    assert (got[:4] - want[:4]).abs().max() > 1e-3        # D's three rows and F's
    torch.testing.assert_close(got[4:], want[4:], atol=1e-5, rtol=0)   # E and A do not depend on the order


def test_writer_layers_put_a_reader_after_the_writer():
    meta, _, _ = _packed(STEPS[2])
    requests = [cpu_glue.PackedRequest(s, e, n, TABLES[name][:-(-n // BLOCK)], BLOCK)
                for (name, *_), s, e, n in zip(STEPS[2], meta.query_start_loc.tolist(), meta.query_start_loc.tolist()[1:],
                                                meta.seq_lens.tolist())]
    layers = cpu_glue.writer_layers(requests)
    assert [[requests.index(r) for r in layer] for layer in layers] == [[2, 3], [0, 1]]
