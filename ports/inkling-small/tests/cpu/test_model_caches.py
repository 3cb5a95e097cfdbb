"""Paged KV + conv state per KV block: chunking, padding, batching and prefix sharing never change a
request's result."""
from __future__ import annotations

import pytest
import torch

import model_helpers as helpers
from model_helpers import one_torch_thread  # noqa: F401  (autouse fixture)
from inkling_hpu.model import modeling
from inkling_hpu.model.metadata import MetadataError, RequestChunk, reference_step_metadata

CONFIG = "tiny-gqa2-mix.json"    # block 4, window 8, rel_extent 16, kernel 4
BLOCK = 4
NUM_BLOCKS = 24
PAD_BLOCK = NUM_BLOCKS - 1


def _step(model, caches, chunks, **pads):
    meta = reference_step_metadata(chunks, block_size=BLOCK, conv_kernel_size=model.config.conv_kernel_size,
                               pad_block_id=PAD_BLOCK, **pads)
    with torch.no_grad():
        return model.compute_logits(model(meta, caches))[: meta.num_real_tokens]


def _tokens(n, seed=0):
    return torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _request_state(caches, blocks, length):
    """Everything the caches hold for one request: its KV rows and its blocks' conv state."""
    rows = torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)])
    used = blocks[: -(-length // BLOCK)]
    state = []
    for layer in caches.layers:
        state.append(layer.key.flatten(0, 1)[rows])
        state.append(layer.value.flatten(0, 1)[rows])
        state += [layer.conv[s][used] for s in sorted(layer.conv)]
    return state


def test_chunked_prefill_leaves_the_same_caches_as_one_prefill():
    model = helpers.port_model(CONFIG)
    tokens, blocks = _tokens(14), [5, 2, 9, 7]
    whole = model.allocate_caches(NUM_BLOCKS, BLOCK)
    _step(model, whole, [RequestChunk(tokens, 0, blocks)])
    chunked = model.allocate_caches(NUM_BLOCKS, BLOCK)
    for start, end in ((0, 2), (2, 3), (3, 9), (9, 14)):    # includes a 1-token chunk
        _step(model, chunked, [RequestChunk(tokens[start:end], start, blocks)])
    for a, b in zip(_request_state(whole, blocks, 14), _request_state(chunked, blocks, 14)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)   # fp32 rounding of a different matmul split


def test_conv_state_holds_the_last_inputs_oldest_first():
    """After a step the request's last block holds the conv inputs at positions end-3 .. end-1, oldest
    first: a 2-token prefill leaves [zero, x0, x1]; one more token shifts them by one; a token in the
    next block leaves the full block's snapshot (positions 1..3) in place."""
    model = helpers.port_model(CONFIG)
    tokens, blocks = _tokens(10, seed=3), [1, 2, 3]
    caches = model.allocate_caches(NUM_BLOCKS, BLOCK)
    _step(model, caches, [RequestChunk(tokens[:2], 0, blocks)])
    state = caches.layers[0].conv["k"][1].clone()
    assert torch.count_nonzero(state[0]) == 0              # position -1 does not exist: zero
    assert torch.count_nonzero(state[1]) > 0 and torch.count_nonzero(state[2]) > 0
    _step(model, caches, [RequestChunk(tokens[2:3], 2, blocks)])
    torch.testing.assert_close(caches.layers[0].conv["k"][1][:2], state[1:], atol=0, rtol=0)   # shifted by one
    _step(model, caches, [RequestChunk(tokens[3:4], 3, blocks)])          # fills block 1 (positions 0..3)
    snapshot = caches.layers[0].conv["k"][1].clone()
    _step(model, caches, [RequestChunk(tokens[4:6], 4, blocks)])          # block 2: positions 4, 5
    torch.testing.assert_close(caches.layers[0].conv["k"][1], snapshot, atol=0, rtol=0)
    torch.testing.assert_close(caches.layers[0].conv["k"][2][0], snapshot[2], atol=0, rtol=0)   # position 3


def test_padding_and_other_requests_do_not_change_a_request():
    model = helpers.port_model(CONFIG)
    a_tokens, b_tokens = _tokens(9, seed=1), _tokens(6, seed=2)
    a_blocks, b_blocks = [3, 11, 6], [8, 1]

    alone = model.allocate_caches(NUM_BLOCKS, BLOCK)
    first = _step(model, alone, [RequestChunk(a_tokens[:7], 0, a_blocks)])
    second = _step(model, alone, [RequestChunk(a_tokens[7:8], 7, a_blocks)])

    batched = model.allocate_caches(NUM_BLOCKS, BLOCK)
    both = _step(model, batched, [RequestChunk(b_tokens[:5], 0, b_blocks),
                                  RequestChunk(a_tokens[:7], 0, a_blocks)],
                 pad_tokens_to=16, pad_prefill_rows_to=9, pad_prefill_requests_to=3, pad_decode_requests_to=2,
                 pad_requests_to=4, pad_blocks_to=5, pad_conv_writes_to=6)
    torch.testing.assert_close(both[5:], first, atol=1e-6, rtol=0)
    mixed = _step(model, batched, [RequestChunk(a_tokens[7:8], 7, a_blocks),   # decode
                                   RequestChunk(b_tokens[5:6], 5, b_blocks)],
                  pad_tokens_to=5, pad_decode_requests_to=4, pad_requests_to=3, pad_blocks_to=4, pad_conv_writes_to=4)
    torch.testing.assert_close(mixed[:1], second, atol=1e-6, rtol=0)

    # padding wrote only to the pad block (KV and conv state)
    used = set(a_blocks[:2] + b_blocks[:2]) | {PAD_BLOCK}
    for layer in batched.layers:
        for block in set(range(NUM_BLOCKS)) - used:
            assert torch.count_nonzero(layer.key[block]) == 0
            assert all(torch.count_nonzero(layer.conv[s][block]) == 0 for s in layer.conv)


def test_a_request_resumes_from_a_shared_block_snapshot():
    """Prefix caching: B shares A's first two (full) blocks and starts at position 8 from block 2's
    snapshot; its logits equal those of B computed alone from position 0. Same when A fills those blocks
    in the same step as B's hit (B's taps then come from A's rows of the step), and A's blocks are
    never written by B."""
    model = helpers.port_model(CONFIG)
    prefix = _tokens(8, seed=5)
    a_tokens, b_tokens = prefix + _tokens(3, seed=6), prefix + _tokens(5, seed=7)
    a_blocks, b_blocks = [3, 11, 6], [3, 11, 9, 14]
    cold = _step(model, model.allocate_caches(NUM_BLOCKS, BLOCK), [RequestChunk(b_tokens, 0, [1, 2, 4, 5])])

    caches = model.allocate_caches(NUM_BLOCKS, BLOCK)
    _step(model, caches, [RequestChunk(a_tokens, 0, a_blocks)])
    snapshot = [layer.conv["mlp"][11].clone() for layer in caches.layers]
    hit = _step(model, caches, [RequestChunk(b_tokens[8:], 8, b_blocks)])
    torch.testing.assert_close(hit, cold[8:], atol=1e-5, rtol=0)
    for layer, before in zip(caches.layers, snapshot):
        torch.testing.assert_close(layer.conv["mlp"][11], before, atol=0, rtol=0)

    same_step = model.allocate_caches(NUM_BLOCKS, BLOCK)
    both = _step(model, same_step, [RequestChunk(a_tokens, 0, a_blocks), RequestChunk(b_tokens[8:], 8, b_blocks)])
    torch.testing.assert_close(both[len(a_tokens):], cold[8:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk, message", [
    (RequestChunk([1, 2, 3], 2, [4]), "block table covers 4 tokens, needs 5"),
    (RequestChunk([1], 0, [PAD_BLOCK]), "pad block"),
    (RequestChunk([], 0, [4]), "at least one new token"),
    (RequestChunk([1], -1, [4]), "num_computed must be >= 0"),
])
def test_metadata_refuses_inexact_requests(chunk, message):
    with pytest.raises(MetadataError, match=message):
        reference_step_metadata([chunk], block_size=BLOCK, conv_kernel_size=4, pad_block_id=PAD_BLOCK)


def test_metadata_refuses_two_writers_of_a_block_and_too_small_buckets():
    chunks = [RequestChunk([1, 2], 0, [1]), RequestChunk([3], 0, [1])]
    with pytest.raises(MetadataError, match="block 1, which request 0 of the same step also computes into"):
        reference_step_metadata(chunks, block_size=BLOCK, conv_kernel_size=4, pad_block_id=PAD_BLOCK)
    with pytest.raises(MetadataError, match="pad_tokens_to=2 is smaller than the 3 tokens"):
        reference_step_metadata([chunks[0], RequestChunk([3], 0, [2])], block_size=BLOCK, conv_kernel_size=4,
                            pad_block_id=PAD_BLOCK, pad_tokens_to=2)
    with pytest.raises(MetadataError, match="pad_conv_writes_to=1 is smaller than the 2 blocks"):
        reference_step_metadata([chunks[0], RequestChunk([3], 0, [2])], block_size=BLOCK, conv_kernel_size=4,
                            pad_block_id=PAD_BLOCK, pad_conv_writes_to=1)


def test_conv_taps_come_from_the_step_or_the_state():
    meta = reference_step_metadata([RequestChunk([7, 8, 9], 2, [1, 3]), RequestChunk([5], 0, [2])],
                               block_size=BLOCK, conv_kernel_size=4, pad_block_id=PAD_BLOCK)
    tokens, state_rows = 4, 2 * 3
    zero = tokens + state_rows
    # request 0, token at position 2: taps at positions -1, 0, 1 -> zero row, then its state rows 1 and 2
    assert meta.conv_tap_index[0].tolist() == [zero, tokens + 1, tokens + 2]
    # token at position 4: taps at 1 (state), 2 and 3 (this step's tokens 0 and 1)
    assert meta.conv_tap_index[2].tolist() == [tokens + 2, 0, 1]
    # request 1 starts at position 0: every tap is zero; its new state is [0, 0, its token]
    assert meta.conv_tap_index[3].tolist() == [zero] * 3
    # request 0 reads block 1 (position 1) and writes block 1 (positions 1..3: state, 2, 3) and block 3
    # (positions 2..4); request 1 reads nothing (pad block) and writes block 2
    assert meta.conv_read_blocks.tolist() == [1, PAD_BLOCK]
    assert meta.conv_write_blocks.tolist() == [1, 3, 2]
    assert meta.conv_write_source.tolist() == [[tokens + 2, 0, 1], [0, 1, 2], [zero, zero, 3]]


def test_one_decoder_layer_class_and_one_class_per_attention_and_mlp_kind():
    model = helpers.port_model(CONFIG)
    layers = list(model.model.layers)
    assert all(type(layer).__name__.endswith("DecoderLayer") for layer in layers)   # vllm-gaudi hooks by suffix
    kinds = [(type(layer.self_attn).__name__, type(layer.mlp).__name__) for layer in layers]
    assert kinds == [("InklingSlidingAttention", "InklingMLP")] * 2 + [
        ("InklingSlidingAttention", "InklingMoE"), ("InklingFullAttention", "InklingMoE")]
    assert isinstance(layers[0].self_attn, modeling.InklingAttention)


def _caches_in_pages(model, num_blocks, padding=8):
    """The CPU glue's layout: one pool per layer, one page per block holding K, V and the conv state
    (and some padding, as vLLM's page may have), viewed by cpu_glue.page_views."""
    from inkling_hpu.cpu_glue import page_views

    taps, layers, pools = model.config.conv_kernel_size - 1, [], []
    for i, layer in enumerate(model.model.layers):
        heads, dim, channels = layer.self_attn.num_key_value_heads, layer.self_attn.head_dim, model.conv_channels(i)
        page = 2 * BLOCK * heads * dim + taps * sum(channels.values()) + padding
        pool = torch.zeros(num_blocks, page, dtype=model.dtype)    # vLLM's pool starts zeroed too
        pool[:, -padding:] = 7.0                                   # the page's tail: never written
        layers.append(page_views(pool, BLOCK, heads, dim, channels, taps, i))
        pools.append(pool)
    return modeling.InklingCaches(block_size=BLOCK, layers=layers), pools


def test_caches_inside_pages_compute_what_separate_caches_compute():
    """K, V and conv state living in each block's page (strided views: the KV rows are written by
    (block, offset), not as one run) give the same logits and the same per-request state."""
    model = helpers.port_model(CONFIG)
    separate = model.allocate_caches(NUM_BLOCKS, BLOCK)
    paged, pools = _caches_in_pages(model, NUM_BLOCKS)
    assert not any(layer.key.is_contiguous() for layer in paged.layers)
    a, b = _tokens(11, seed=1), _tokens(6, seed=2)
    steps = [[RequestChunk(a[:7], 0, [5, 2, 9]), RequestChunk(b[:6], 0, [3, 8])],
             [RequestChunk(a[7:11], 7, [5, 2, 9]), RequestChunk([b[5]], 6, [3, 8])],
             [RequestChunk([a[10]], 11, [5, 2, 9, 1]), RequestChunk([b[4]], 7, [3, 8])]]
    for chunks in steps:
        torch.testing.assert_close(_step(model, paged, chunks), _step(model, separate, chunks), atol=0, rtol=0)
    for blocks, length in (([5, 2, 9, 1], 12), ([3, 8], 8)):
        for x, y in zip(_request_state(paged, blocks, length), _request_state(separate, blocks, length)):
            torch.testing.assert_close(x, y, atol=0, rtol=0)
    assert all(bool((pool[:, -8:] == 7.0).all()) for pool in pools)
