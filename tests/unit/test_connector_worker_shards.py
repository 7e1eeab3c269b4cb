"""The worker side with parts cut into shards by KV head (:mod:`s3kv.shards`):
each rank stores and loads exactly the heads it owns, one object per head
slice whatever the TP size, so a TP 1 replica loads what the two ranks of a
TP 2 replica stored and the reverse; a head that two ranks hold (fewer KV
heads than ranks) is written once, by the first of them, and loaded by
both. Pages are vLLM's CPU layout, ``[blocks, heads, block_size,
2*head_size]``; the NVMe tier holds the objects (S3's are the same objects)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from s3kv.config import parse_config  # noqa: E402
from s3kv.connector.layout import EngineLayout  # noqa: E402
from s3kv.connector.metadata import S3KVMetadata  # noqa: E402
from s3kv.connector.worker import WorkerSide  # noqa: E402
from s3kv.identity import ModelSource  # noqa: E402
from s3kv.shards import choose  # noqa: E402
from s3kv.tiering.placement import Tier  # noqa: E402
from s3kv.tiering.plan import LoadChunk, LoadPlan, Place, StoreChunk  # noqa: E402
from s3kv.tiering.tiers.nvme.files import shard_path  # noqa: E402

BLOCKS, BLOCK_SIZE, CHUNK_TOKENS, HEAD = 10, 16, 64, 8  # 4 blocks a chunk
NAMES = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
KEY = b"\x07" * 16
STORE_IDS = (1, 2, 3, 4)
LOAD_IDS = (5, 6, 7, 8)


def head_page(heads: int) -> int:
    """Bytes of one block of one layer with ``heads`` KV heads (bf16 K and V)."""
    return heads * BLOCK_SIZE * 2 * HEAD * 2


def layout(total_heads: int, tp: int) -> EngineLayout:
    local = max(1, total_heads // tp)
    return EngineLayout(
        {"model": "unit"},
        ModelSource("unit", digest="unit-test-weights"),
        block_size=BLOCK_SIZE,
        layer_names=NAMES,
        tp_size=tp,
        world_size=tp,
        page_size_bytes=head_page(local),
        cut=choose(total_heads=total_heads, tp_size=tp, replicated=False, sliceable=True),
        total_kv_heads=total_heads,
        head_axis=1,
    )


def caches(heads: int, seed: int | None) -> dict[str, torch.Tensor]:
    """A rank's KV caches in vLLM's CPU layout: random (``seed``) or 0x5A everywhere."""
    gen = torch.Generator().manual_seed(seed or 0)
    out = {}
    for name in NAMES:
        t = torch.empty(BLOCKS, heads, BLOCK_SIZE, 2 * HEAD, dtype=torch.bfloat16)
        u8 = t.view(torch.uint8)
        if seed is None:
            u8.fill_(0x5A)
        else:
            u8.copy_(torch.randint(0, 256, u8.shape, dtype=torch.uint8, generator=gen))
        out[name] = t
    return out


def worker(config: dict, lay: EngineLayout, rank: int, kv: dict[str, torch.Tensor]) -> WorkerSide:
    w = WorkerSide(parse_config({"chunk_tokens": CHUNK_TOKENS, **config}), lay, rank, BLOCKS)
    w.register(kv)
    return w


def step(workers: list[WorkerSide], meta: S3KVMetadata) -> None:
    """One step of vLLM's on every rank: bind, load, save every layer."""
    for w in workers:
        w.bind(meta)
        w.start_load(meta)
        for name in NAMES:
            w.wait_for_layer(name)
            w.save_layer(meta, name)
        w.save(meta)
    for w in workers:
        assert w.drain(60)


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def whole(rank_caches: list[dict[str, torch.Tensor]], name: str) -> torch.Tensor:
    """A layer's pages with every rank's heads in order (a TP 1 replica's)."""
    return torch.cat([c[name] for c in rank_caches], dim=1)


def store_meta(target: Place) -> S3KVMetadata:
    return S3KVMetadata(stores=[StoreChunk(KEY, STORE_IDS, (target,))], namespace="ns1")


def load_meta(source: Place, sync: bool) -> S3KVMetadata:
    return S3KVMetadata(
        loads=[LoadPlan("r", (LoadChunk(KEY, LOAD_IDS, 0, 4, (source,)),), sync=sync)], namespace="ns1"
    )


def finish(workers: list[WorkerSide]) -> list:
    """Each rank's report of the step (its shards' combined), after the rank finished."""
    out = []
    for w in workers:
        w.get_finished(set())
        out.append(w.take_report())
    return out


def test_tp2_stores_one_object_per_head_and_tp1_loads_them(tmp_path):
    config = {"write_policy": "local_only", "disk_path": str(tmp_path)}
    a = [caches(2, seed=r + 1) for r in range(2)]
    tp2 = [worker(config, layout(4, 2), r, a[r]) for r in range(2)]
    try:
        assert [[s.role.index for s in w.shards] for w in tp2] == [[0, 1], [2, 3]]
        step(tp2, store_meta(Place(Tier.DISK)))
        reports = finish(tp2)
        codec = tp2[0].engine.codec
        assert codec is not None
        for head in range(4):
            frames: dict[int, np.ndarray] = {}
            blob = shard_path(tmp_path, "ns1", KEY, head).read_bytes()
            tp2[head // 2].shards[head % 2].engine.codec.decode(
                KEY, blob, lambda i, d, into=frames: into.__setitem__(i, d.copy()), "test"
            )
            for f, name in enumerate(NAMES):  # shard h: head h of each page, nothing else
                want = u8(a[head // 2][name])[list(STORE_IDS), head % 2 : head % 2 + 1].contiguous()
                assert np.array_equal(frames[f], want.numpy().reshape(-1)), f"head {head} {name}"
        assert not shard_path(tmp_path, "ns1", KEY, 4).exists()
        # each rank reports the chunk once, written, after both its shards are
        for r in reports:
            assert r is not None and r.report.written == {(Tier.DISK, KEY): 1} and not r.report.failed
    finally:
        for w in tp2:
            w.shutdown()

    b = caches(4, seed=None)
    tp1 = worker(config, layout(4, 1), 0, b)
    try:
        assert [s.role.index for s in tp1.shards] == [0, 1, 2, 3]
        step([tp1], load_meta(Place(Tier.DISK), sync=False))
        _, recved = tp1.get_finished(set())
        assert recved == {"r"} and tp1.take_load_errors() == set()
    finally:
        tp1.shutdown()
    for name in NAMES:
        assert torch.equal(u8(b[name])[list(LOAD_IDS)], u8(whole(a, name))[list(STORE_IDS)]), name
        untouched = [i for i in range(BLOCKS) if i not in LOAD_IDS]
        assert bool((u8(b[name])[untouched] == 0x5A).all())


def test_tp1_stores_and_tp2_ranks_each_load_their_heads(tmp_path):
    config = {"write_policy": "local_only", "disk_path": str(tmp_path)}
    a = caches(4, seed=3)
    tp1 = worker(config, layout(4, 1), 0, a)
    try:
        step([tp1], store_meta(Place(Tier.DISK)))
        finish([tp1])
    finally:
        tp1.shutdown()
    assert sorted(p.name for p in shard_path(tmp_path, "ns1", KEY, 0).parent.iterdir()) == [
        f"{KEY.hex()}.r{h}" for h in range(4)
    ]
    b = [caches(2, seed=None) for _ in range(2)]
    tp2 = [worker(config, layout(4, 2), r, b[r]) for r in range(2)]
    try:
        step(tp2, load_meta(Place(Tier.DISK), sync=False))
        for w in tp2:
            _, recved = w.get_finished(set())
            assert recved == {"r"} and w.take_load_errors() == set()
    finally:
        for w in tp2:
            w.shutdown()
    for name in NAMES:
        assert torch.equal(u8(whole(b, name))[list(LOAD_IDS)], u8(a[name])[list(STORE_IDS)]), name


def test_cpu_slots_hold_every_shard_of_the_rank_and_load_layer_by_layer():
    """A rank's CPU slot holds each of its shards' frames (one pool each):
    stored, then loaded synchronously into other blocks."""
    config = {"write_policy": "local_only", "cpu_bytes": "64KiB"}
    kv = caches(4, seed=5)
    w = worker(config, layout(4, 1), 0, kv)
    try:
        step([w], store_meta(Place(Tier.CPU, 0)))
        finish([w])
        for shard in w.shards:
            assert shard.pool is not None and shard.pool.holds(0, KEY)
            h = shard.role.index
            for f, name in enumerate(NAMES):
                want = u8(kv[name])[list(STORE_IDS), h : h + 1].contiguous().numpy().reshape(-1)
                assert np.array_equal(shard.pool.layer_views(0)[f], want), f"head {h} {name}"
        step([w], load_meta(Place(Tier.CPU, 0), sync=True))
        report = w.take_report()
        assert w.take_load_errors() == set()
    finally:
        w.shutdown()
    assert report is not None and report.report.sync_loaded == {"r": 1}
    for name in NAMES:
        assert torch.equal(u8(kv[name])[list(LOAD_IDS)], u8(kv[name])[list(STORE_IDS)]), name


def test_a_head_two_ranks_hold_is_written_once_and_loaded_by_both(tmp_path):
    """One KV head at TP 2 (vLLM gives each rank a copy): rank 0 writes
    shard 0, rank 1 writes nothing and reports its part done; both load it."""
    config = {"write_policy": "local_only", "disk_path": str(tmp_path)}
    kv = caches(1, seed=7)
    twin = {n: t.clone() for n, t in kv.items()}
    twin_before = {n: t.clone() for n, t in twin.items()}
    ranks = [worker(config, layout(1, 2), r, c) for r, c in ((0, kv), (1, twin))]
    try:
        assert [(s.role.index, s.role.writer) for w in ranks for s in w.shards] == [(0, True), (0, False)]
        u8(twin[NAMES[0]])[list(STORE_IDS)] = 0  # what rank 1 holds never reaches the object
        step(ranks, store_meta(Place(Tier.DISK)))
        reports = finish(ranks)
        assert [p.name for p in shard_path(tmp_path, "ns1", KEY, 0).parent.iterdir()] == [f"{KEY.hex()}.r0"]
        for r in reports:
            assert r is not None and r.report.written == {(Tier.DISK, KEY): 1}
        for c in (kv, twin):
            for t in c.values():
                u8(t)[list(LOAD_IDS)] = 0x5A
        step(ranks, load_meta(Place(Tier.DISK), sync=False))
        for w in ranks:
            _, recved = w.get_finished(set())
            assert recved == {"r"} and w.take_load_errors() == set()
    finally:
        for w in ranks:
            w.shutdown()
    for c in (kv, twin):
        for name in NAMES:
            assert torch.equal(u8(c[name])[list(LOAD_IDS)], u8(twin_before[name])[list(STORE_IDS)]), name
