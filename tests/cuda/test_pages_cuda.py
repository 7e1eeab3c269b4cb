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
from s3kv.kvgroups import FULL, SLIDING, GroupLayout, KVGroup  # noqa: E402
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


@pytest.mark.parametrize("shape", LAYOUTS)
def test_copy_out_from_a_first_page_leaves_zeros_before_it(shape):
    """A store's pages before its first_block cross as zeros (made on the
    device, one D2H copy): their blocks, vLLM's null block here, are never read."""
    cache = torch.randint(1, 255, (*shape[:-1], 2 * shape[-1]), dtype=torch.uint8, device="cuda").view(
        torch.bfloat16
    )
    io = PageIO({"l0": cache}, ["l0"], BLOCKS)
    layer = io.layers[0]
    for ids, first in [([0, 0, 5, 9], 2), ([0, 0, 0], 3), ([7, 8, 30], 0), ([0, 12, 13, 14], 1)]:
        out = io.host_buffer(layer.page_bytes * len(ids), pinned=True).numpy()
        out[:] = 0xEE
        io.read_into(0, ids, out, first)
        io.synchronize()
        want = cache.view(torch.uint8).index_select(layer.axis, torch.tensor(ids, device="cuda"))
        want.narrow(layer.axis, 0, first).zero_()
        assert np.array_equal(out, want.cpu().numpy().reshape(-1)), (ids, first)


NAMES = ["model.layers.1.attn", "model.layers.2.attn", "model.layers.0.attn"]
GROUPS = GroupLayout((KVGroup(FULL, (0, 1)), KVGroup(SLIDING, (2,), 32)), 16)
"""A full group of two layers, a sliding group of one (its parts' second frame is padding)."""
SLOT = [0, 1, 0]
"""Layer -> its place in the backing buffer: the sliding layer's memory is the first full layer's."""


def _overlaid(shape: tuple[int, ...]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The groups' layers as vLLM's hybrid KV cache manager lays them out:
    one buffer, each group's layers from its start."""
    buf = torch.zeros((2, *shape), dtype=torch.bfloat16, device="cuda")
    return buf, {name: buf[slot] for name, slot in zip(NAMES, SLOT)}


def _group_ids(rng: random.Random, group: int, n: int) -> list[int]:
    """Block ids of one group (a block is one group's at a time: the groups' are apart)."""
    return rng.sample(range(1, BLOCKS // 2) if group == 0 else range(BLOCKS // 2, BLOCKS), n)


@pytest.mark.parametrize("shape", LAYOUTS)
def test_group_frames_load_into_their_own_layers_through_targets_and_writes(shape):
    """A part's frame i goes to its group's layer i, pages first..last of
    the part's block ids, through a pinned target or a write; a padding
    frame goes nowhere. The reference: torch's index_copy_ of each layer."""
    from s3kv.tiering.plan import LoadChunk
    from s3kv.tiering.worker.gate import Gate

    rng = random.Random(6)
    gen = torch.Generator().manual_seed(6)
    buf, caches = _overlaid(shape)
    io = PageIO(caches, NAMES, BLOCKS, GROUPS)
    expect = buf.view(torch.uint8).clone()
    for round_ in range(30):
        group, n = rng.randrange(2), rng.randint(1, 6)
        ids = _group_ids(rng, group, n)
        first = rng.randrange(n)
        last = rng.randint(first + 1, n)
        chunk = LoadChunk(b"c" * 16, tuple(ids), first, last, (), group=group)
        gate = Gate(io.load_pages(io.forward_mark()), chunk)
        for frame in range(io.frames):
            layer = io.layer_of(group, frame)
            pages = torch.randint(0, 255, io.layers[0].shape_for(n), dtype=torch.uint8, generator=gen)
            data = pages.numpy().reshape(-1)
            if round_ % 2:
                gate.read_into(frame, data.nbytes, lambda out, d=data: scatter(d, out))
            else:
                gate.write(frame, data)
            if layer is not None:
                axis = io.layers[layer].axis
                idx = torch.tensor(ids[first:last], device="cuda")
                expect[SLOT[layer]].index_copy_(axis, idx, pages.cuda().narrow(axis, first, last - first))
        gate.close()
        io.fence()()
        assert torch.equal(buf.view(torch.uint8), expect), round_


class _MemoryFrames:
    """A chunk's stored frames (``data``, one array a frame) as the NVMe
    tier's file offers them (:class:`~s3kv.frame_sinks.ChunkFrames`): the
    page cache holds the first ``cached_bytes`` of them."""

    def __init__(self, data: list[np.ndarray], cached_bytes: int) -> None:
        self.data = data
        self.nbytes = [d.nbytes for d in data]
        self.cached_bytes = cached_bytes

    def cached(self, buffers):
        flat, at = np.concatenate(self.data)[: self.cached_bytes], 0
        for b in buffers:
            k = min(b.nbytes, flat.nbytes - at)
            if k <= 0:
                break
            b[:k] = flat[at : at + k]
            at += k
        return at

    def read(self, frame, out, start=0):
        scatter(self.data[frame][start:], out)

    def check(self, frame, parts):
        assert np.array_equal(np.concatenate([np.asarray(p).reshape(-1) for p in parts]), self.data[frame])


@pytest.mark.parametrize("shape", LAYOUTS)
def test_a_chunk_read_from_the_page_cache_then_aside_lands_in_its_groups_layers(shape):
    """Gate.read_chunk_into on a device (the NVMe tier's way for a chunk):
    the page cache's part of the chunk read in one pass into each frame's
    pinned staging buffer (a padding frame's into scratch), the rest from
    where it stopped; every frame committed into its group's layer, pages
    first..last of the part's block ids; a padding frame reaches no page.
    The reference: torch's index_copy_ of each layer."""
    from s3kv.tiering.worker.gate import Gate

    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    buf, caches = _overlaid(shape)
    io = PageIO(caches, NAMES, BLOCKS, GROUPS)
    expect = buf.view(torch.uint8).clone()
    for round_ in range(30):
        group, n = rng.randrange(2), rng.randint(1, 6)
        ids = _group_ids(rng, group, n)
        first = rng.randrange(n)
        last = rng.randint(first + 1, n)
        chunk = LoadChunk(b"c" * 16, tuple(ids), first, last, (), group=group)
        pages = [
            torch.randint(0, 255, io.layers[0].shape_for(n), dtype=torch.uint8, generator=gen)
            for _ in range(io.frames)
        ]
        data = [p.numpy().reshape(-1) for p in pages]
        total = sum(d.nbytes for d in data)
        cached = [total, 0, rng.randrange(1, total)][round_ % 3]  # all, none (EAGAIN), a short read
        gate = Gate(io.load_pages(io.forward_mark()), chunk)
        gate.read_chunk_into(_MemoryFrames(data, cached))
        gate.close()
        for frame, p in enumerate(pages):
            layer = io.layer_of(group, frame)
            if layer is not None:
                axis = io.layers[layer].axis
                idx = torch.tensor(ids[first:last], device="cuda")
                expect[SLOT[layer]].index_copy_(axis, idx, p.cuda().narrow(axis, first, last - first))
        io.fence()()
        assert torch.equal(buf.view(torch.uint8), expect), round_


def test_a_layerwise_load_of_group_parts_is_ordered_by_the_models_layers():
    """Each layer, once the forward waits for it, holds its group's frame
    in its group's blocks first..last; padding frames (filled 99 here)
    reach no page, and no block outside the parts' spans is written."""
    from s3kv.tiering.plan import LoadChunk

    buf, caches = _overlaid(LAYOUTS[0])
    io = PageIO(caches, NAMES, BLOCKS, GROUPS)
    assert io.order == [2, 0, 1]
    n = 3
    chunks = [
        LoadChunk(b"a" * 16, (3, 4, 5), 0, 3, (), group=0),
        LoadChunk(b"b" * 16, (0, 40, 41), 1, 3, (), group=1),  # its first page: the null block
    ]
    values = [[1, 2], [7, 99]]
    slots = []
    for c, vals in zip(chunks, values):
        frames = [io.host_buffer(io.layers[0].page_bytes * n, pinned=True) for _ in vals]
        for f, v in zip(frames, vals):
            f.fill_(v)
        slots.append((c, [f.numpy() for f in frames]))
    load = LayerwiseLoad(io, slots)
    for i in io.order:
        load.wait_layer(i)
        group, frame = io.frame_of[i]
        c = chunks[group]
        idx = torch.tensor(c.block_ids[c.first_block : c.last_block], device="cuda")
        got = caches[NAMES[i]].view(torch.uint8).index_select(io.layers[i].axis, idx)
        assert bool((got == values[group][frame]).all()), f"layer {i} not loaded when the forward reached it"
    load.wait_all()
    assert load.elapsed_s() is not None and load.elapsed_s() > 0
    u8 = buf.view(torch.uint8)
    assert not bool((u8 == 99).any())  # the padding frame
    written = {(0, 3), (0, 4), (0, 5), (1, 3), (1, 4), (1, 5), (0, 40), (0, 41)}  # (slot, block)
    for slot in (0, 1):
        for block in range(BLOCKS):
            page = u8[slot].select(1, block)
            assert bool(page.any()) == ((slot, block) in written), (slot, block)


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


def test_a_state_layers_padded_pages_cross_whole_with_zeros_past_the_state():
    # A Mamba layer as vLLM views it on a device: int8 [blocks, 1, 1, state
    # bytes] over pages padded to the attention layers' (the block stride).
    real, page = 1000, 1536
    backing = torch.randint(0, 255, (BLOCKS * page,), dtype=torch.uint8, device="cuda")
    state = backing.view(torch.int8).as_strided((BLOCKS, 1, 1, real), (page, real, real, 1))
    io = PageIO({"m0": state}, ["m0"], BLOCKS)
    assert (io.layers[0].page_bytes, io.layers[0].real_bytes) == (page, real)
    out = torch.empty(3 * page, dtype=torch.uint8, pin_memory=True).numpy()
    io.read_into(0, [7, 3, 40], out, first=1)
    io.synchronize()
    host = backing.cpu().numpy().reshape(BLOCKS, page)
    frames = out.reshape(3, page)
    assert not frames[0].any() and not frames[1:, real:].any()
    assert np.array_equal(frames[1, :real], host[3, :real]) and np.array_equal(
        frames[2, :real], host[40, :real]
    )
    data = np.random.default_rng(1).integers(0, 256, 3 * page, dtype=np.uint8)
    io.write(0, [10, 11, 12], 1, 3, data)
    io.synchronize()
    after = backing.cpu().numpy().reshape(BLOCKS, page)
    assert np.array_equal(after[11, :real], data[page : page + real])
    assert np.array_equal(after[12, :real], data[2 * page : 2 * page + real])
    assert np.array_equal(after[10], host[10])  # before ``first``: not written


HEAD_LAYOUTS = [((BLOCKS, 4, 16, 128), 1), ((2, BLOCKS, 16, 4, 64), 3)]
"""(shape, head axis): vLLM's CPU layout, and flash-attn's (K/V first, heads after tokens)."""


@pytest.mark.parametrize("shape,head_axis", HEAD_LAYOUTS)
def test_a_shards_heads_cross_alone_both_ways(shape, head_axis):
    """A shard of KV heads (1..2 of 4) copied out of the device pages and
    back into other blocks, through a write and through a pinned target:
    exactly those heads move, the others' bytes are left as they were."""
    rng = random.Random(7)
    cache = torch.randn(shape, dtype=torch.float32, device="cuda").to(torch.bfloat16)
    io = PageIO({"l0": cache}, ["l0"], BLOCKS, head_axis=head_axis)
    layer = io.layers[0]
    u8 = cache.view(torch.uint8)
    for first, n in ((1, 2), (3, 1)):
        src, dst = _ids(rng, 4), [60, 61, 62, 63]
        heads = (first, n)
        nbytes = int(np.prod(layer.shape_for(len(src), heads)))
        out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
        io.read_into(0, src, out, heads=heads)
        io.synchronize()
        idx = torch.tensor(src, device="cuda")
        want = u8.index_select(layer.axis, idx).narrow(head_axis, first, n).contiguous()
        assert np.array_equal(out, want.cpu().numpy().reshape(-1))
        before = u8.clone()
        io.write(0, dst, 1, 4, out, heads=heads)  # pages 1..3 only
        io.synchronize()
        expect = before.clone()
        got_pages = torch.from_numpy(out).cuda().view(layer.shape_for(len(src), heads))
        expect.narrow(head_axis, first, n).index_copy_(
            layer.axis, torch.tensor(dst[1:], device="cuda"), got_pages.narrow(layer.axis, 1, 3)
        )
        assert torch.equal(u8, expect)
        u8.copy_(before)
        target = io.target(0, dst, 0, 4, heads=heads)
        assert target is not None and target.private
        (buf,) = target.buffers
        buf[:] = out
        target.commit()
        io.synchronize()
        expect = before.clone()
        expect.narrow(head_axis, first, n).index_copy_(
            layer.axis, torch.tensor(dst, device="cuda"), got_pages
        )
        assert torch.equal(u8, expect)
