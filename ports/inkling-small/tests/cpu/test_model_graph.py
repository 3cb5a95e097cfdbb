"""The forward is one static graph per bucket: no data-dependent Python control flow, no host sync."""
from __future__ import annotations

import pytest
import torch

import model_helpers as helpers
from model_helpers import one_torch_thread  # noqa: F401  (autouse fixture)
from inkling_hpu.model.metadata import RequestChunk, reference_step_metadata


@pytest.mark.timeout(300)
def test_mixed_step_traces_as_one_graph():
    """torch.compile(fullgraph=True) refuses any graph break (a .item(), a branch on a tensor value),
    so a full trace of a padded mixed prefill + decode step shows the hot path is capturable."""
    model = helpers.as_on_hpu(helpers.port_model("tiny-gqa2-mix.json", helpers.BIAS_BUDGET))
    meta = reference_step_metadata(
        [RequestChunk([1, 2, 3, 4, 5], 3, [1, 2, 3]), RequestChunk([7], 9, [4, 5, 6])],
        block_size=4, conv_kernel_size=4, pad_block_id=23,
        pad_tokens_to=8, pad_prefill_rows_to=6, pad_decode_requests_to=2, pad_requests_to=3, pad_blocks_to=4,
        pad_conv_writes_to=5)

    def step(meta, caches):
        return model.compute_logits(model(meta, caches))

    with torch.no_grad():
        eager = step(meta, model.allocate_caches(24, 4))
        traced = torch.compile(step, fullgraph=True, backend="eager")(meta, model.allocate_caches(24, 4))
    torch.testing.assert_close(traced, eager, atol=0, rtol=0)
