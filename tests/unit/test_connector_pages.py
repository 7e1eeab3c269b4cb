"""Page copies between a (host) KV cache and host buffers, against torch's
index ops as the reference, for block axes in any position."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from s3kv.connector.pages import PageIO  # noqa: E402
from s3kv.errors import ConfigError  # noqa: E402
from s3kv.frame_sinks import scatter  # noqa: E402
from s3kv.kvgroups import FULL, SLIDING, GroupLayout, KVGroup  # noqa: E402

BLOCKS = 12


def _random_load(rng: random.Random) -> tuple[int, list[int], int, int]:
    """A chunk of n blocks (random or consecutive ids) whose pages first..last are loaded."""
    n = rng.randint(1, 6)
    ids = (
        rng.sample(range(BLOCKS), n)
        if rng.random() < 0.5
        else list(range(b := rng.randrange(BLOCKS - n + 1), b + n))
    )
    first = rng.randrange(n)
    return n, ids, first, rng.randint(first + 1, n)


@pytest.mark.parametrize("shape", [(BLOCKS, 2, 4, 8), (2, BLOCKS, 4, 8)])  # CPU layout; K/V split first
def test_write_and_read_pages_match_torch_index_ops(shape):
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    cache = torch.zeros(shape, dtype=torch.bfloat16)
    io = PageIO({"l0": cache}, ["l0"], BLOCKS)
    layer = io.layers[0]
    for _ in range(50):
        n, ids, first, last = _random_load(rng)
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


@pytest.mark.parametrize("shape", [(BLOCKS, 2, 4, 8), (2, BLOCKS, 4, 8), (2, 3, BLOCKS, 8)])
def test_a_target_is_the_pages_themselves_in_the_frames_order(shape):
    """Bytes scattered into a layer's target, in order, leave the cache as
    write() of the same frame does: the target's buffers are views of the
    pages of blocks first..last (one per run and index before the block
    axis), the frame's other pages go to buffers of their own."""
    rng = random.Random(2)
    gen = torch.Generator().manual_seed(2)
    cache = torch.zeros(shape, dtype=torch.bfloat16)
    io = PageIO({"l0": cache}, ["l0"], BLOCKS)
    layer = io.layers[0]
    outer = int(np.prod(cache.shape[: layer.axis]))
    by_write = torch.zeros_like(cache)
    io_w = PageIO({"l0": by_write}, ["l0"], BLOCKS)
    for _ in range(50):
        n, ids, first, last = _random_load(rng)
        frame = torch.randint(0, 255, (layer.page_bytes * n,), dtype=torch.uint8, generator=gen).numpy()
        target = io.target(0, ids, first, last)
        assert target is not None and not target.private  # the pages: a disk read that may stall bounces
        assert sum(b.nbytes for b in target.buffers) == frame.nbytes
        runs = sum(1 for i in range(first, last) if i == first or ids[i] != ids[i - 1] + 1)
        assert len(target.buffers) == outer * (runs + (first > 0) + (last < n))
        cache_bytes = cache.view(torch.uint8).numpy()
        into_pages = [b for b in target.buffers if np.shares_memory(b, cache_bytes)]
        assert sum(b.nbytes for b in into_pages) == frame.nbytes * (last - first) // n
        scatter(frame, target.buffers)
        target.commit()
        io_w.write(0, ids, first, last, frame)
        assert torch.equal(cache.view(torch.uint8), by_write.view(torch.uint8))


@pytest.mark.parametrize("read_in", [False, True], ids=["write", "read_into"])
def test_load_pages_put_each_chunks_layers_in_its_own_blocks(read_in):
    """The transfer engine's PageSink (PageIO.load_pages), through a load's
    Gate: each chunk's frame goes to pages first..last of its own block
    ids, by write() or read straight into the chunk's target, as
    PageIO.write puts it."""
    from s3kv.tiering.plan import LoadChunk
    from s3kv.tiering.worker.gate import Gate

    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    names = ["l0", "l1"]
    io = PageIO({n: torch.zeros(2, BLOCKS, 4, 8, dtype=torch.bfloat16) for n in names}, names, BLOCKS)
    io_w = PageIO({n: torch.zeros(2, BLOCKS, 4, 8, dtype=torch.bfloat16) for n in names}, names, BLOCKS)
    pages = io.load_pages(io.forward_mark())
    for _ in range(20):
        n, ids, first, last = _random_load(rng)
        c = LoadChunk(b"c" * 16, tuple(ids), first, last, ())
        gate = Gate(pages, c)
        for layer in range(2):
            size = io.layers[0].page_bytes * n
            frame = torch.randint(0, 255, (size,), dtype=torch.uint8, generator=gen).numpy()
            if read_in:
                gate.read_into(layer, size, lambda out, f=frame: scatter(f, out))
            else:
                gate.write(layer, frame)
            io_w.write(layer, ids, first, last, frame)
        gate.close()
    for got, want in zip(io.layers, io_w.layers):
        assert torch.equal(got.u8, want.u8)


@pytest.mark.parametrize("shape", [(BLOCKS, 2, 4, 8), (2, BLOCKS, 4, 8)])
def test_read_into_from_a_first_page_leaves_zeros_before_it(shape):
    """A store's pages before its first_block are zeros in its frame, and
    their blocks are never read (vLLM may have freed them: block 0 is its
    null block)."""
    rng = random.Random(4)
    cache = torch.randint(1, 255, shape, dtype=torch.uint8).view(torch.bfloat16)
    io = PageIO({"l0": cache}, ["l0"], BLOCKS)
    layer = io.layers[0]
    for _ in range(30):
        n = rng.randint(1, 6)
        first = rng.randint(0, n)
        ids = [0] * first + rng.sample(range(1, BLOCKS), n - first)
        out = np.full(layer.page_bytes * n, 0xEE, dtype=np.uint8)
        io.read_into(0, ids, out, first)
        want = cache.view(torch.uint8).index_select(layer.axis, torch.tensor(ids)).clone()
        want.narrow(layer.axis, 0, first).zero_()
        assert np.array_equal(out, want.numpy().reshape(-1))


GROUPS = GroupLayout((KVGroup(FULL, (0, 2)), KVGroup(SLIDING, (1,), 32)), 16)
"""Layers a0 and a1 (0 and 2), and b0 (1), whose parts have a padding frame."""


@pytest.mark.parametrize("read_in", [False, True], ids=["write", "read_into"])
def test_load_pages_put_each_groups_frames_in_its_own_layers(read_in):
    """A part's frame i goes to its group's layer i, pages first..last of
    the part's block ids; a padding frame goes to no layer, and still to
    the promotions (a CPU slot holds all frames)."""
    from s3kv.tiering.plan import LoadChunk
    from s3kv.tiering.worker.gate import Gate

    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    names = ["a0", "b0", "a1"]
    io = PageIO({n: torch.zeros(BLOCKS, 2, 4, 8, dtype=torch.bfloat16) for n in names}, names, BLOCKS, GROUPS)
    io_w = PageIO({n: torch.zeros(BLOCKS, 2, 4, 8, dtype=torch.bfloat16) for n in names}, names, BLOCKS)
    assert io.frames == 2 and io.frame_of == {0: (0, 0), 2: (0, 1), 1: (1, 0)}
    pages = io.load_pages(io.forward_mark())
    for _ in range(20):
        n, ids, first, last = _random_load(rng)
        group = rng.randrange(2)
        c = LoadChunk(b"c" * 16, tuple(ids), first, last, (), group=group)
        filled: dict[int, np.ndarray] = {}
        gate = Gate(pages, c, [lambda i, data, filled=filled: filled.__setitem__(i, data.copy())])
        frames = []
        for frame in range(2):
            size = io.layers[0].page_bytes * n
            data = torch.randint(0, 255, (size,), dtype=torch.uint8, generator=gen).numpy()
            frames.append(data)
            if read_in:
                gate.read_into(frame, size, lambda out, f=data: scatter(f, out))
            else:
                gate.write(frame, data)
            layer = GROUPS.groups[group].layers[frame] if frame < len(GROUPS.groups[group].layers) else None
            if layer is not None:
                io_w.write(layer, ids, first, last, data)
        gate.close()
        assert sorted(filled) == [0, 1] and all(np.array_equal(filled[i], frames[i]) for i in (0, 1))
    for got, want in zip(io.layers, io_w.layers):
        assert torch.equal(got.u8, want.u8), got.name
    with pytest.raises(ValueError, match="KV cache group 2: this engine has 2"):
        pages.write(LoadChunk(b"c" * 16, (1,), 0, 1, (), group=2), 0, frames[0])


def test_groups_must_hold_every_layer_once_and_copies_follow_the_models_order():
    names = ["model.layers.1.attn", "model.layers.10.attn", "model.layers.0.attn"]
    caches = {n: torch.zeros(BLOCKS, 2, 4, 8, dtype=torch.bfloat16) for n in names}
    io = PageIO(caches, names, BLOCKS, GroupLayout((KVGroup(FULL, (0, 1)), KVGroup(SLIDING, (2,), 32)), 16))
    assert io.order == [2, 0, 1]  # layers 0, 1, 10: the groups' layers interleave in the forward
    plain = {n: torch.zeros(BLOCKS, 2, 4, 8, dtype=torch.bfloat16) for n in ["l1", "l0"]}
    assert PageIO(plain, ["l1", "l0"], BLOCKS).order == [0, 1]  # names without numbers: as given
    for bad in [((0, 1), (1,)), ((0,), (2,)), ((0, 1), (2, 3))]:
        groups = GroupLayout(tuple(KVGroup(FULL, layers) for layers in bad), 16)
        with pytest.raises(ConfigError, match="KV cache group"):
            PageIO(caches, names, BLOCKS, groups)


def test_no_target_where_a_run_of_blocks_is_not_contiguous():
    """A cache whose block axis is not outermost among the contiguous ones
    (a transposed view) has no target: its frames go through write()."""
    cache = torch.zeros(8, BLOCKS, 4, dtype=torch.bfloat16).transpose(0, 1)  # blocks first, strided
    io = PageIO({"l0": cache}, ["l0"], BLOCKS)
    assert io.target(0, [3, 4], 0, 2) is None
    frame = np.arange(io.layers[0].page_bytes * 2, dtype=np.uint8)
    io.write(0, [3, 4], 0, 2, frame)
    assert np.array_equal(cache.view(torch.uint8)[3:5].contiguous().numpy().reshape(-1), frame)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc")
def test_a_resident_host_buffer_is_mapped_before_any_write():
    """The CPU tier's memory is mapped at start-up, not a page fault at a
    time by the loads that first fill each slot; other buffers are not
    touched (the control: what the check would see without it)."""
    io = PageIO({"l0": torch.zeros(BLOCKS, 2, 4, 8, dtype=torch.bfloat16)}, ["l0"], BLOCKS)
    nbytes = 256 << 20
    grew = {}
    for resident in (False, True):
        before = _resident_bytes()
        buf = io.host_buffer(nbytes, pinned=True, resident=resident)
        grew[resident] = _resident_bytes() - before
        assert buf.numel() == nbytes and not buf.is_pinned()  # no device: plain memory
        del buf
    assert grew[True] >= nbytes * 0.9 and grew[False] < nbytes * 0.25, grew


def test_a_state_layers_padded_pages_are_its_block_stride_with_zeros_past_the_state():
    # vLLM's view of a Mamba layer: int8 [num_blocks, 1, 1, state bytes] over
    # pages padded to the attention layers' (the block stride), in one buffer.
    real, page = 40, 64
    backing = torch.zeros(BLOCKS * page, dtype=torch.int8)
    state = backing.as_strided((BLOCKS, 1, 1, real), (page, real, real, 1))
    io = PageIO({"m0": state}, ["m0"], BLOCKS)
    layer = io.layers[0]
    assert (layer.page_bytes, layer.real_bytes) == (page, real)
    backing.view(torch.uint8).copy_(
        torch.arange(BLOCKS * page, dtype=torch.int64).remainder(251).to(torch.uint8)
    )
    out = np.full(3 * page, 7, dtype=np.uint8)
    io.read_into(0, [5, 2, 9], out, first=1)
    frames = out.reshape(3, page)
    assert not frames[0].any()  # before ``first``: zeros
    for row, block in zip(frames[1:], [2, 9], strict=True):
        assert np.array_equal(
            row[:real], backing.view(torch.uint8)[block * page : block * page + real].numpy()
        )
        assert not row[real:].any()  # the padding is not the layer's: zeros, whatever the buffer held
    data = np.random.default_rng(3).integers(0, 256, 3 * page, dtype=np.uint8)
    io.write(0, [4, 6, 8], 1, 3, data)
    got = backing.view(torch.uint8).numpy().reshape(BLOCKS, page)
    assert np.array_equal(got[6], data[page : 2 * page]) and np.array_equal(got[8], data[2 * page :])
    assert got[4][0] == (4 * page) % 251  # page 0 of the chunk was not written


@pytest.mark.parametrize("shape,head_axis", [((12, 4, 16, 32), 1), ((2, 12, 16, 4, 16), 3)])
def test_a_shards_heads_are_copied_alone_both_ways(shape, head_axis):
    """A shard of KV heads of each page (vLLM's CPU layout; flash-attn's,
    heads after tokens): out of the pages, then into other blocks; exactly
    those heads move, the other heads' bytes stay; no target straight into
    the pages for part of a page's heads (not one run of bytes)."""
    cache = torch.randint(-100, 100, shape, dtype=torch.int16).to(torch.bfloat16)
    io = PageIO({"l0": cache}, ["l0"], 12, head_axis=head_axis)
    layer = io.layers[0]
    assert layer.num_heads == 4
    u8 = cache.view(torch.uint8)
    src, dst, heads = [3, 7, 8, 1], [9, 10, 11, 0], (1, 2)
    out = np.empty(int(np.prod(layer.shape_for(4, heads))), np.uint8)
    io.read_into(0, src, out, heads=heads)
    want = u8.index_select(layer.axis, torch.tensor(src)).narrow(head_axis, 1, 2).contiguous()
    assert np.array_equal(out, want.numpy().reshape(-1))
    before = u8.clone()
    io.write(0, dst, 1, 4, out, heads=heads)
    expect = before.clone()
    pages = torch.from_numpy(out).view(layer.shape_for(4, heads))
    expect.narrow(head_axis, 1, 2).index_copy_(
        layer.axis, torch.tensor(dst[1:]), pages.narrow(layer.axis, 1, 3)
    )
    assert torch.equal(u8, expect)
    assert io.target(0, dst, 0, 4, heads=heads) is None
    assert io.target(0, dst, 0, 4, heads=(0, 4)) is not None  # every head: the pages themselves


def test_heads_on_the_block_axis_are_refused():
    with pytest.raises(ConfigError, match="KV heads on axis 0"):
        PageIO({"l0": torch.zeros(12, 4, 16, 32)}, ["l0"], 12, head_axis=0)


@pytest.mark.parametrize(
    "shape,axis",
    [((256, 2, 32, 128), 0), ((2, 64, 16, 4, 32), 1), ((32, 4, 32, 16), 0)],
)
def test_the_block_axis_is_found_where_another_axis_is_as_long(shape, axis):
    """vLLM's CPU layout with 256 blocks of 256-byte rows (a 64-wide bf16
    K and V), flash-attn's with as many blocks as bytes in a head, and as
    many blocks as tokens a block: the block axis is the one of the longest
    stride, and its pages copy as torch's index ops do."""
    num_blocks = shape[axis]
    cache = torch.randint(-100, 100, shape, dtype=torch.int16).to(torch.bfloat16)
    io = PageIO({"l0": cache}, ["l0"], num_blocks)
    assert io.layers[0].axis == axis
    ids = [3, 1, 2]
    out = np.empty(io.layers[0].page_bytes * len(ids), np.uint8)
    io.read_into(0, ids, out)
    want = cache.view(torch.uint8).index_select(axis, torch.tensor(ids))
    assert np.array_equal(out, want.numpy().reshape(-1))
