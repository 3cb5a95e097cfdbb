"""The glue's step metadata is built on the device from vllm-gaudi-shaped tensors: no read-back, and a
whole step (metadata + model) traces as one graph per call.

vllm-gaudi runs a step as separate forward calls: prefill [bs, L] (per-row context blocks in
block_list, context_lens; padding: position -1, slot -1, block -1) and decode [bs, 1] (a flat
block_list with block_groups; padding groups = bs after HpuModelAdapter). The tensors below have
exactly those layouts (tests/cpu/test_plugin.py and test_prefix_conv_state.py feed the real runner's).
`torch.compile(fullgraph=True)` refuses any graph break (a .item(), .tolist(), a branch on a tensor
value), so tracing prefill_step_metadata / decode_step_metadata together with the model shows the
step has no host sync. The results must equal the CPU metadata builder's (reference_step_metadata).
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import model_helpers as helpers
from model_helpers import one_torch_thread  # noqa: F401  (autouse fixture)
from inkling_hpu import parity
from inkling_hpu.model.device_metadata import decode_step_metadata, prefill_step_metadata
from inkling_hpu.model.metadata import RequestChunk, reference_step_metadata

CONFIG = "tiny-gqa2-mix.json"
BLOCK = 4
PAD = 23                      # vllm-gaudi's pad block: the block after the pool
TABLES = {"A": [3, 7, 1, 9, 12], "B": [5, 2, 8, 11, 14], "C": [4, 6, 10, 13, 15]}


def _tokens(n, seed):
    return torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = {"A": _tokens(6, 1), "B": _tokens(9, 2), "C": _tokens(11, 3)}


def _prefill_call(rows: list[tuple[str, int, int]], length: int, context_cols: int, pad_rows: int = 0):
    """vllm-gaudi prefill tensors for rows (request, context length, new tokens)."""
    bs = len(rows) + pad_rows
    ids = torch.full((bs, length), -1)
    pos = torch.full((bs, length), -1)
    slots = torch.full((bs, length), -1)
    ctx = torch.zeros(bs, dtype=torch.int32)
    blocks = torch.full((bs, context_cols), -1)
    for r, (name, start, n) in enumerate(rows):
        table = TABLES[name]
        ids[r, :n] = torch.tensor(PROMPTS[name][start:start + n])
        pos[r, :n] = torch.arange(start, start + n)
        slots[r, :n] = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)])
        ctx[r] = start
        used = -(-start // BLOCK)
        blocks[r, :used] = torch.tensor(table[:used])
    return ids, pos, slots, ctx, (blocks.flatten() if context_cols else None)


WINDOW_BLOCKS = 3             # window 8, block 4: ceil(7 / 4) + 1 (what the decode-window patch builds)


def _decode_call(rows: list[tuple[str, int, int]], pad_rows: int, pad_blocks: int):
    """vllm-gaudi decode tensors for rows (request, position, token): flat block_list, block_groups, and
    the local layers' window lists (each request's last blocks, padding group bs)."""
    bs = len(rows) + pad_rows
    ids = torch.zeros(bs, 1, dtype=torch.long)
    pos = torch.zeros(bs, 1, dtype=torch.long)
    slots = torch.full((bs, 1), PAD * BLOCK)
    block_list, groups, window_list, window_groups = [], [], [], []
    for r, (name, position, token) in enumerate(rows):
        table = TABLES[name][:position // BLOCK + 1]
        ids[r, 0], pos[r, 0] = token, position
        slots[r, 0] = table[-1] * BLOCK + position % BLOCK
        block_list += table
        groups += [r] * len(table)
        window_list += table[-WINDOW_BLOCKS:]
        window_groups += [r] * len(table[-WINDOW_BLOCKS:])
    block_list += [PAD] * pad_blocks
    groups += [bs] * pad_blocks               # HpuModelAdapter's padding group
    window_list += [PAD] * 2
    window_groups += [-1] * 2                 # as the runner builds them (not remapped by the adapter)
    return (ids, pos, slots, torch.tensor(block_list), torch.tensor(groups), torch.tensor(window_list),
            torch.tensor(window_groups))


def _step(model, caches, prefill, decode):
    """One engine step as vllm-gaudi runs it: the prefill call, then the decode call."""
    out = []
    for call, build in ((prefill, prefill_step_metadata), (decode, decode_step_metadata)):
        if call is None:
            continue
        if build is prefill_step_metadata:
            ids, pos, slots, ctx, blocks = call
            meta = build(ids, pos, slots, ctx, blocks, block_size=BLOCK, pad_block=PAD, taps=3)
        else:
            ids, pos, slots, blocks, groups, window, window_groups = call
            meta = build(ids, pos, slots, blocks, groups, window, window_groups, block_size=BLOCK, pad_block=PAD,
                         taps=3)
        out.append(model.compute_logits(model(meta, caches)).view(*call[0].shape, -1))
    return out


def _reference_step(model, caches, chunks):
    meta = reference_step_metadata(chunks, block_size=BLOCK, conv_kernel_size=4, pad_block_id=PAD)
    return model.compute_logits(model(meta, caches))


@pytest.mark.timeout(600)
def test_device_metadata_matches_the_cpu_builder_and_traces_as_one_graph():
    model = helpers.as_on_hpu(helpers.port_model(CONFIG, helpers.BIAS_BUDGET))
    caches = model.allocate_caches(PAD + 1, BLOCK)
    reference = model.allocate_caches(PAD + 1, BLOCK)
    with torch.no_grad():
        # step 1: A and B prefill from 0 in one padded call (rows 8 wide, one padding row)
        first = _step(model, caches, _prefill_call([("A", 0, 6), ("B", 0, 9)], 9, 0, pad_rows=1), None)[0]
        ref = _reference_step(model, reference, [RequestChunk(PROMPTS["A"], 0, TABLES["A"]),
                                                  RequestChunk(PROMPTS["B"], 0, TABLES["B"])])
        torch.testing.assert_close(first[0, 5], ref[5], atol=1e-5, rtol=0)
        torch.testing.assert_close(first[1, 8], ref[14], atol=1e-5, rtol=0)

        # step 2 (a mixed step): C prefills 7 tokens on a 4-token context it shares with nobody, after
        # a first chunk; A and B decode (A at a block boundary: it reads block 1's snapshot)
        _step(model, caches, _prefill_call([("C", 0, 4)], 4, 0), None)
        _reference_step(model, reference, [RequestChunk(PROMPTS["C"][:4], 0, TABLES["C"])])
        prefill = _prefill_call([("C", 4, 7)], 8, 2)
        decode = _decode_call([("A", 6, 17), ("B", 9, 29)], pad_rows=2, pad_blocks=3)
        compiled_caches = copy.deepcopy(caches)
        eager = _step(model, caches, prefill, decode)
        traced = torch.compile(_step, fullgraph=True, backend="eager")(model, compiled_caches, prefill, decode)
        ref = _reference_step(model, reference, [RequestChunk(PROMPTS["C"][4:], 4, TABLES["C"]),
                                                  RequestChunk([17], 6, TABLES["A"]), RequestChunk([29], 9, TABLES["B"])])
    for e, t in zip(eager, traced):
        torch.testing.assert_close(t, e, atol=0, rtol=0)
    torch.testing.assert_close(eager[0][0, :7], ref[:7], atol=1e-5, rtol=0)       # C's chunk
    torch.testing.assert_close(eager[1][:2, 0], ref[7:9], atol=1e-5, rtol=0)     # A and B decodes
    for layer, ref_layer in zip(caches.layers, reference.layers):               # same conv state per block
        for stream in layer.conv:
            blocks = TABLES["A"][:2] + TABLES["B"][:3] + TABLES["C"][:3]
            torch.testing.assert_close(layer.conv[stream][blocks], ref_layer.conv[stream][blocks], atol=1e-5, rtol=0)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", helpers.SHIPPED_CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flat_decode_attention_equals_the_per_request_tables(config, dtype):
    """Decode over vllm-gaudi's flat block list (a softmax across each request's blocks) gives the
    per-request-table attention's logits: within 1e-6 in fp32, and the same greedy tokens in bf16."""
    from dataclasses import replace

    from inkling_hpu.model.metadata import flat_decode_group

    # the fp32 checkpoint in a model of `dtype` (its weights rounded to bf16 as they load)
    model = parity.build_port(helpers.load_config(config), helpers.checkpoint(config), dtype, helpers.BIAS_BUDGET)
    kernel = model.config.conv_kernel_size
    caches = model.allocate_caches(40, BLOCK)
    prompts = [[t % 30 for t in _tokens(n, seed=n)] for n in (13, 22, 5)]
    tables = [list(range(1, 8)), list(range(8, 15)), list(range(15, 22))]
    with torch.no_grad():
        model(reference_step_metadata([RequestChunk(p, 0, t) for p, t in zip(prompts, tables)], block_size=BLOCK,
                                  conv_kernel_size=kernel, pad_block_id=39), caches)
        decode = reference_step_metadata([RequestChunk([7], len(p), t) for p, t in zip(prompts, tables)], block_size=BLOCK,
                                     conv_kernel_size=kernel, pad_block_id=39, pad_decode_requests_to=4,
                                     pad_blocks_to=8)
        flat = replace(decode, groups=[flat_decode_group(g, 39) for g in decode.groups])
        per_table = model.compute_logits(model(decode, copy.deepcopy(caches)))[:3].float()
        flat_logits = model.compute_logits(model(flat, copy.deepcopy(caches)))[:3].float()
    if dtype == torch.float32:
        torch.testing.assert_close(flat_logits, per_table, atol=1e-6, rtol=0)
    else:
        assert flat_logits.argmax(-1).tolist() == per_table.argmax(-1).tolist()


def scenario_flat_decode_through_vllm_gaudi_flat_pa(port_dir: str) -> dict:
    """In the harness (vllm-gaudi's platform): each shipped config built there, so its decode attention is
    vllm-gaudi's flat_pa (GaudiFlatPagedAttention); the flat decode's logits against the per-request tables'
    (the port's own chunked attention), in fp32 and bf16, and the calls flat_pa took."""
    import vllm_gaudi
    from vllm.config import set_current_vllm_config
    from vllm_gaudi.extension import ops

    from gaudi_harness import builders
    from inkling_hpu.model.modeling import process_weights_after_loading
    from inkling_hpu.model.metadata import flat_decode_group
    from dataclasses import replace

    model_helpers = helpers
    vllm_gaudi.register_ops()
    calls = []
    real_flat_pa = ops.flat_pa
    ops.flat_pa = lambda *args, **kwargs: calls.append(1) or real_flat_pa(*args, **kwargs)
    out = {}
    for config in model_helpers.SHIPPED_CONFIGS:
        for dtype in (torch.float32, torch.bfloat16):
            with set_current_vllm_config(builders.make_vllm_config()):
                model = parity.build_port(model_helpers.load_config(config), model_helpers.checkpoint(config), dtype,
                                          model_helpers.BIAS_BUDGET)
                process_weights_after_loading(model)      # vllm-gaudi's MoE method takes its experts
            kinds = {type(layer.self_attn.gaudi_flat_pa).__name__ for layer in model.model.layers}
            kernel = model.config.conv_kernel_size
            caches = model.allocate_caches(40, BLOCK)
            prompts = [[t % 30 for t in _tokens(n, seed=n)] for n in (13, 22, 5)]
            tables = [list(range(1, 8)), list(range(8, 15)), list(range(15, 22))]
            before = len(calls)
            with torch.no_grad():
                model(reference_step_metadata([RequestChunk(p, 0, t) for p, t in zip(prompts, tables)],
                                              block_size=BLOCK, conv_kernel_size=kernel, pad_block_id=39), caches)
                decode = reference_step_metadata([RequestChunk([7], len(p), t) for p, t in zip(prompts, tables)],
                                                 block_size=BLOCK, conv_kernel_size=kernel, pad_block_id=39,
                                                 pad_decode_requests_to=4, pad_blocks_to=8)
                flat = replace(decode, groups=[flat_decode_group(g, 39) for g in decode.groups])
                per_table = model.compute_logits(model(decode, copy.deepcopy(caches)))[:3].float()
                flat_logits = model.compute_logits(model(flat, copy.deepcopy(caches)))[:3].float()
            out[f"{config}/{str(dtype)[6:]}"] = {
                "kinds": sorted(kinds), "flat_pa_calls": len(calls) - before, "layers": len(model.model.layers),
                "max_abs": float((flat_logits - per_table).abs().max()),
                "same_tokens": flat_logits.argmax(-1).tolist() == per_table.argmax(-1).tolist()}
    ops.flat_pa = real_flat_pa
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_flat_decode_through_vllm_gaudi_s_flat_pa_equals_the_per_request_tables(served_vllm_gaudi, vllm_src, port_dir):
    """On vllm-gaudi's platform the decode attention is its own flat_pa (the relative logits as its position_bias,
    the masks as its block_bias), once per layer and decode step; the logits equal the port's per-request-table
    attention within 1e-6 in fp32, and give the same greedy tokens in bf16."""
    from gaudi_harness.subproc import run_scenario

    out = run_scenario(f"{__file__}::scenario_flat_decode_through_vllm_gaudi_flat_pa", served_vllm_gaudi, vllm_src,
                       timeout=800, python_path=[port_dir, Path(__file__).parent], port_dir=str(port_dir))
    assert len(out) == 2 * len(helpers.SHIPPED_CONFIGS), out
    for name, case in out.items():
        assert case["kinds"] == ["GaudiFlatPagedAttention"] and case["flat_pa_calls"] == case["layers"], (name, case)
        if name.endswith("float32"):
            assert case["max_abs"] <= 1e-6, (name, case)
        else:
            assert case["same_tokens"], (name, case)


def test_debug_check_refuses_a_prefill_without_its_context_blocks():
    """INKLING_GLUE_CHECKS=1: a context block vllm-gaudi left out (-1) is refused, with expected vs found."""
    from inkling_hpu.model.device_metadata import check_context_blocks

    check_context_blocks(torch.tensor([6, 0]), torch.tensor([3, 7, -1, -1]), BLOCK)      # 2 blocks for 6 tokens
    with pytest.raises(RuntimeError, match="position 6 came without the block ids of its context: expected 2 "
                                           "context blocks, found 1"):
        check_context_blocks(torch.tensor([6, 0]), torch.tensor([3, -1, -1, -1]), BLOCK)
    with pytest.raises(RuntimeError, match="expected 2 context blocks, found 0 \\(block_list absent\\)"):
        check_context_blocks(torch.tensor([6]), None, BLOCK)
