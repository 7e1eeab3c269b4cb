"""Page copies between a (host) KV cache and host buffers, against torch's
index ops as the reference, for block axes in any position."""

from __future__ import annotations

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from s3kv.connector.pages import PageIO  # noqa: E402

BLOCKS = 12


@pytest.mark.parametrize("shape", [(BLOCKS, 2, 4, 8), (2, BLOCKS, 4, 8)])  # CPU layout; K/V split first
def test_write_and_read_pages_match_torch_index_ops(shape):
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    cache = torch.zeros(shape, dtype=torch.bfloat16)
    io = PageIO({"l0": cache}, ["l0"], BLOCKS)
    layer = io.layers[0]
    for _ in range(50):
        n = rng.randint(1, 6)
        ids = (
            rng.sample(range(BLOCKS), n)
            if rng.random() < 0.5
            else list(range(b := rng.randrange(BLOCKS - n + 1), b + n))
        )
        first = rng.randrange(n)
        last = rng.randint(first + 1, n)
        pages = torch.randint(0, 255, layer.shape_for(n), dtype=torch.uint8, generator=gen)
        expect = cache.view(torch.uint8).clone()
        idx = torch.tensor(ids[first:last])
        expect.index_copy_(layer.axis, idx, pages.narrow(layer.axis, first, last - first))
        io.write(0, ids, first, last, pages.numpy().reshape(-1))
        assert torch.equal(cache.view(torch.uint8), expect)
        out = np.empty(pages.numel(), dtype=np.uint8)
        io.read_into(0, ids, out)
        ref = cache.view(torch.uint8).index_select(layer.axis, torch.tensor(ids))
        assert np.array_equal(out, ref.numpy().reshape(-1))
