"""The page copies on a CUDA device, with torch alone (no vLLM): copy-out
ordered after the kernel that wrote the pages, loads from pinned memory
into device pages on the side stream, byte equality with torch's index ops
as the reference. Skipped without CUDA. On a device machine:

    python -m pytest -q -m cuda tests/cuda
    python -m benchmarks.gpu_pages      # H2D GB/s against torch's own pinned copy
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from s3kv.connector.layerwise import LayerwiseLoad  # noqa: E402
from s3kv.connector.pages import PageIO  # noqa: E402
from s3kv.frame_sinks import scatter  # noqa: E402
from s3kv.tiering.plan import LoadChunk  # noqa: E402

BLOCKS = 64
LAYOUTS = [(2, BLOCKS, 16, 4, 64), (BLOCKS, 2, 16, 4, 64)]  # K/V first (flash-attn), blocks first
SLEEP_CYCLES = 200_000_000
"""A producer kernel's delay (~0.1 s): a copy not ordered after it would read the old pages."""


def _ids(rng: random.Random, n: int) -> list[int]:
    if rng.random() < 0.5:
        return rng.sample(range(BLOCKS), n)
    b = rng.randrange(BLOCKS - n + 1)
    return list(range(b, b + n))


@pytest.mark.parametrize("shape", LAYOUTS)
def test_copy_out_waits_for_the_kernel_that_wrote_the_pages(shape):
    cache = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    io = PageIO({"l0": cache}, ["l0"], BLOCKS)
    ids = [5, 6, 7, 30]
    torch.cuda._sleep(SLEEP_CYCLES)  # the forward, still running ...
    cache.fill_(1.5)  # ... writes the pages after it
    out = torch.empty(io.layers[0].page_bytes * len(ids), dtype=torch.uint8, pin_memory=True).numpy()
    io.read_into(0, ids, out)
    io.synchronize()
    ref = cache.view(torch.uint8).index_select(io.layers[0].axis, torch.tensor(ids, device="cuda"))
    assert np.array_equal(out, ref.cpu().numpy().reshape(-1))
    assert out.view(np.uint16).min() == out.view(np.uint16).max() != 0  # all of it written after the sleep


@pytest.mark.parametrize("shape", LAYOUTS)
def test_loads_through_pinned_targets_and_writes_match_torch_index_copy(shape):
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    cache = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    io = PageIO({"l0": cache}, ["l0"], BLOCKS)
    layer = io.layers[0]
    expect = cache.view(torch.uint8).clone()
    for round_ in range(40):
        n = rng.randint(1, 8)
        ids = _ids(rng, n)
        first = rng.randrange(n)
        last = rng.randint(first + 1, n)
        pages = torch.randint(0, 255, layer.shape_for(n), dtype=torch.uint8, generator=gen)
        idx = torch.tensor(ids[first:last], device="cuda")
        expect.index_copy_(layer.axis, idx, pages.cuda().narrow(layer.axis, first, last - first))
        after = io.forward_mark()
        if round_ % 2:
            target = io.target(0, ids, first, last, after=after)
            assert target is not None and len(target.buffers) == 1
            assert torch.from_numpy(target.buffers[0]).is_pinned()  # the read's destination
            # Its own staging buffer (a disk read that may stall lands there, never in another's).
            other = io.target(0, ids, first, last, after=after)
            assert target.private and not np.shares_memory(other.buffers[0], target.buffers[0])
            scatter(pages.numpy().reshape(-1), target.buffers)
            target.commit()
        else:
            io.write(0, ids, first, last, pages.numpy().reshape(-1), after=after)  # pageable: staged
        io.fence()()
        assert torch.equal(cache.view(torch.uint8), expect)


def test_a_layerwise_load_from_pinned_slots_is_ordered_layer_by_layer():
    caches = {f"l{i}": torch.zeros(LAYOUTS[0], dtype=torch.bfloat16, device="cuda") for i in range(4)}
    io = PageIO(caches, list(caches), BLOCKS)
    n, ids = 3, [9, 10, 40]
    slots = [io.host_buffer(io.layers[0].page_bytes * n, pinned=True) for _ in caches]
    for i, s in enumerate(slots):
        s.fill_(i + 1)
    load = LayerwiseLoad(io, [(LoadChunk(b"k" * 16, tuple(ids), 0, n, ()), [s.numpy() for s in slots])])
    for i, name in enumerate(caches):
        load.wait_layer(i)
        got = caches[name].view(torch.uint8).index_select(1, torch.tensor(ids, device="cuda"))
        assert bool((got == i + 1).all()), f"layer {i} not loaded when the forward reached it"
    load.wait_all()
    assert load.elapsed_s() is not None and load.elapsed_s() > 0


def test_copies_never_make_the_host_wait_for_the_forward():
    """Copy-out (a store), pinned targets and writes (loads) and the fence
    only enqueue work: while the forward's stream is busy, the host gets
    back at once and can go on launching the forward's kernels. The
    control: ``torch.tensor(..., device=)``, which the block ids once went
    through, does wait for that stream."""
    cache = torch.zeros(LAYOUTS[0], dtype=torch.bfloat16, device="cuda")
    io = PageIO({"l0": cache}, ["l0"], BLOCKS)
    layer = io.layers[0]
    ids, n = [3, 9, 10, 11, 40], 5
    out = io.host_buffer(layer.page_bytes * n, pinned=True).numpy()
    pinned = io.host_buffer(layer.page_bytes * n, pinned=True).numpy()

    def issue() -> None:
        io.read_into(0, ids, out)
        after = io.forward_mark()
        target = io.target(0, ids, 1, n, after=after)
        target.buffers[0][:] = 9
        target.commit()
        io.write(0, [20, 21, 22, 23, 24], 0, n, pinned, after=after)
        io.fence()

    issue()  # warm: pinned and device allocations cached
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(5 * SLEEP_CYCLES)  # the forward, ~0.5 s
    issue()
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    device_s = time.perf_counter() - t0
    assert host_s < device_s / 5, (host_s, device_s)
    assert bool(
        (cache.view(torch.uint8).index_select(1, torch.tensor([9, 10, 11, 40], device="cuda")) == 9).all()
    )
    assert not bool(cache.view(torch.uint8)[:, 3].any())  # the target's page 0 was not asked for
    t0 = time.perf_counter()
    torch.cuda._sleep(5 * SLEEP_CYCLES)
    torch.tensor(ids, device="cuda")  # the control
    control_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert control_s > (time.perf_counter() - t0) / 2, control_s
