"""The worker side with several KV cache groups (vLLM's hybrid KV cache
manager): a chunk is one part per group, each part's frame i is its group's
layer i, written and read with that group's block ids; a group with fewer
layers than the parts have frames stores zeros there and drops them on
load; a part's pages before its ``first_block`` are stored as zeros, never
read out of blocks vLLM may have freed. The KV caches are vLLM's own
allocation (CPU build, its default layer-outer layout), where the groups'
layers overlay one another in one buffer: a page written with another
group's block ids would land in this group's blocks. Stores then loads into
a fresh worker's cache, from the CPU tier (layer by layer, synchronously)
and from the NVMe tier (in the background)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from s3kv.config import parse_config  # noqa: E402
from s3kv.connector.layout import EngineLayout  # noqa: E402
from s3kv.connector.metadata import S3KVMetadata  # noqa: E402
from s3kv.connector.worker import WorkerSide  # noqa: E402
from s3kv.identity import ModelSource  # noqa: E402
from s3kv.kvgroups import FULL, SLIDING, GroupLayout, KVGroup, part_key  # noqa: E402
from s3kv.tiering.placement import Tier  # noqa: E402
from s3kv.tiering.plan import LoadChunk, LoadPlan, Place, StoreChunk  # noqa: E402
from s3kv.tiering.tiers.nvme.files import shard_path  # noqa: E402

BLOCKS, BLOCK_SIZE, CHUNK_TOKENS, WINDOW = 12, 16, 64, 32  # 4 blocks a chunk
FULL_LAYERS = ("model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn")
SLIDING_LAYERS = ("model.layers.0.self_attn.attn",)
NAMES = FULL_LAYERS + SLIDING_LAYERS  # group after group, as EngineLayout orders them
MODEL_ORDER = sorted(NAMES, key=lambda n: int(n.split(".")[2]))  # the forward's
SPEC = {"block_size": BLOCK_SIZE, "num_kv_heads": 2, "head_size": 8, "dtype": torch.bfloat16}
PAGE = FullAttentionSpec(**SPEC).page_size_bytes
LAYOUT = EngineLayout(
    {"model": "unit"},
    ModelSource("unit", digest="unit-test-weights"),
    block_size=BLOCK_SIZE,
    layer_names=NAMES,
    tp_size=1,
    world_size=1,
    page_size_bytes=PAGE,
    groups=GroupLayout((KVGroup(FULL, (0, 1)), KVGroup(SLIDING, (2,), WINDOW)), BLOCK_SIZE),
)
KEY = b"\x01" * 16
PARTS = (KEY, part_key(KEY, 1))

# What replica A stores: group 0 (full) holds the chunk in blocks 1-4; group
# 1 (sliding) only its last two pages (7, 8), the first two are vLLM's null block.
STORE_IDS = ((1, 2, 3, 4), (0, 0, 7, 8))
STORE_FIRST = (0, 2)
# What replica B loads: pages 1-2 of group 0's part, 2-3 of group 1's.
LOAD_IDS = ((2, 3, 4, 5), (0, 0, 9, 10))
LOAD_SPAN = ((1, 3), (2, 4))


def kv_caches() -> dict[str, torch.Tensor]:
    """vLLM's KV caches for the two groups, as its CPU build allocates them:
    one buffer, each group's layers laid out from its start (the sliding
    layer shares the first full layer's memory)."""
    full, sliding = FullAttentionSpec(**SPEC), SlidingWindowSpec(**SPEC, sliding_window=WINDOW)
    size = 2 * BLOCKS * PAGE
    config = KVCacheConfig(
        num_blocks=BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(size, list(FULL_LAYERS), layer_stride=BLOCKS * PAGE, block_stride=PAGE),
            KVCacheTensor(size, list(SLIDING_LAYERS), layer_stride=BLOCKS * PAGE, block_stride=PAGE),
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(list(FULL_LAYERS), full),
            KVCacheGroupSpec(list(SLIDING_LAYERS), sliding),
        ],
    )
    caches = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC)
    assert caches[SLIDING_LAYERS[0]].data_ptr() == caches[FULL_LAYERS[0]].data_ptr()  # overlaid
    return caches


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def filled(caches: dict[str, torch.Tensor], seed: int | None) -> dict[str, torch.Tensor]:
    """``caches`` with random bytes (``seed``), or 0x5A everywhere (None)."""
    gen = torch.Generator().manual_seed(seed or 0)
    for t in caches.values():
        if seed is None:
            u8(t).fill_(0x5A)
        else:
            u8(t).copy_(torch.randint(0, 256, u8(t).shape, dtype=torch.uint8, generator=gen))
    return caches


def expected_part(caches: dict[str, torch.Tensor], g: int) -> list[np.ndarray]:
    """Group ``g``'s part as replica A must store it: its layers' pages of
    its blocks from ``first_block`` on, zeros before and in padding frames."""
    ids, first = STORE_IDS[g], STORE_FIRST[g]
    frames = []
    for layer in LAYOUT.kv_groups.groups[g].layers:
        frame = u8(caches[NAMES[layer]])[list(ids)].clone()
        frame[:first] = 0
        frames.append(frame.numpy().reshape(-1))
    pad = LAYOUT.kv_groups.frames - len(frames)
    return frames + [np.zeros_like(frames[0])] * pad


def expected_load(source: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replica B's cache after the load: the 0x5A cache with each group's
    layers' pages first..last of its part in its blocks, nothing else."""
    want = filled(kv_caches(), None)
    for g, group in enumerate(LAYOUT.kv_groups.groups):
        first, last = LOAD_SPAN[g]
        for layer in group.layers:
            src = u8(source[NAMES[layer]])[list(STORE_IDS[g][first:last])]
            if g == 1:  # A stored zeros before its first_block: none of those is loaded here
                assert first >= STORE_FIRST[g]
            u8(want[NAMES[layer]])[list(LOAD_IDS[g][first:last])] = src
    return want


def assert_caches_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for name in NAMES:
        assert torch.equal(u8(got[name]), u8(want[name])), f"layer {name}"


def worker(config: dict) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    w = WorkerSide(parse_config({"chunk_tokens": CHUNK_TOKENS, **config}), LAYOUT, 0, BLOCKS)
    caches = kv_caches()
    w.register(caches)
    return w, caches


def run_step(w: WorkerSide, meta: S3KVMetadata, on_layer=None) -> None:
    """A step of vLLM's: the forward waits for each layer's load and saves
    it, in the model's order; ``on_layer(name)`` right after its wait."""
    w.bind(meta)
    w.start_load(meta)
    for name in MODEL_ORDER:
        w.wait_for_layer(name)
        if on_layer is not None:
            on_layer(name)
        w.save_layer(meta, name)
    w.save(meta)


def decoded(codec, key: bytes, blob: bytes) -> dict[int, np.ndarray]:
    """Frame index -> its bytes, of a checked object."""
    frames: dict[int, np.ndarray] = {}
    codec.decode(key, blob, lambda i, data: frames.__setitem__(i, data.copy()), "test")
    return frames


def stores(*targets: Place) -> list[StoreChunk]:
    return [
        StoreChunk(PARTS[g], STORE_IDS[g], (targets[g],), group=g, first_block=STORE_FIRST[g]) for g in (0, 1)
    ]


def test_parts_store_to_and_load_from_cpu_slots_layer_by_layer():
    """Stores copied into CPU slots that held other bytes; a fresh replica's
    synchronous load from such slots, each layer complete when the forward
    waits for it."""
    config = {"write_policy": "local_only", "cpu_bytes": "64KiB"}
    a, a_caches = worker(config)
    try:
        assert a.pool is not None and a.pool.num_layers == 2  # frames, not the model's 3 layers
        filled(a_caches, seed=1)
        a.pool.buffer[:] = 0xAB  # slots reused: a padding frame not zeroed would keep these
        run_step(a, S3KVMetadata(stores=stores(Place(Tier.CPU, 0), Place(Tier.CPU, 1)), namespace="ns1"))
        assert a.drain(60)
        a.get_finished(set())
        assert a.pool.holds(0, PARTS[0]) and a.pool.holds(1, PARTS[1])
        slots = [[v.copy() for v in a.pool.layer_views(g)] for g in (0, 1)]
    finally:
        a.shutdown()
    for g in (0, 1):
        for f, (got, want) in enumerate(zip(slots[g], expected_part(a_caches, g), strict=True)):
            assert np.array_equal(got, want), f"group {g} frame {f}"

    b, b_caches = worker(config)
    filled(b_caches, seed=None)
    want = expected_load(a_caches)
    loaded = []

    def check_layer(name: str) -> None:
        """The forward reads this layer now: its group's pages are in (its
        memory is another group's layer's too, whose pages may come later)."""
        g, _ = b.pages.frame_of[NAMES.index(name)]
        ids = list(LOAD_IDS[g][slice(*LOAD_SPAN[g])])
        assert torch.equal(u8(b_caches[name])[ids], u8(want[name])[ids]), (
            f"{name} not in when the forward reached it"
        )
        loaded.append(name)

    try:
        for g, slot in ((0, 5), (1, 2)):  # other slots than A's
            for view, frame in zip(b.pool.layer_views(slot), slots[g], strict=True):
                view[:] = frame
            b.pool.claim(slot, PARTS[g])
        chunks = tuple(
            LoadChunk(PARTS[g], LOAD_IDS[g], *LOAD_SPAN[g], (Place(Tier.CPU, slot),), group=g)
            for g, slot in ((0, 5), (1, 2))
        )
        run_step(b, S3KVMetadata(loads=[LoadPlan("r", chunks, sync=True)], namespace="ns1"), check_layer)
        report = b.take_report()
        errors = b.take_load_errors()
    finally:
        b.shutdown()
    assert loaded == MODEL_ORDER and errors == set()
    assert report is not None and report.report.sync_loaded == {"r": 1} and not report.report.load_failed
    assert b.counters.totals()["load_bytes_cpu"] == 3 * 4 * PAGE  # the layers' frames, no padding
    assert_caches_equal(b_caches, want)


def test_parts_store_to_and_load_from_nvme_in_the_background(tmp_path):
    """Stores encoded into one NVMe file per part, of every group the same
    frames; a fresh replica's background load of them."""
    config = {"write_policy": "local_only", "disk_path": str(tmp_path)}
    a, a_caches = worker(config)
    try:
        filled(a_caches, seed=2)
        run_step(a, S3KVMetadata(stores=stores(Place(Tier.DISK), Place(Tier.DISK)), namespace="ns1"))
        assert a.drain(60)
        codec = a.engine.codec
        assert codec is not None and codec.num_layers == 2
        for g in (0, 1):
            frames = decoded(codec, PARTS[g], shard_path(tmp_path, "ns1", PARTS[g], 0).read_bytes())
            want = expected_part(a_caches, g)
            assert sorted(frames) == list(range(len(want)))
            for f, frame in enumerate(want):
                assert np.array_equal(frames[f], frame), f"group {g} frame {f}"
    finally:
        a.shutdown()

    b, b_caches = worker(config)
    filled(b_caches, seed=None)
    try:
        chunks = tuple(
            LoadChunk(PARTS[g], LOAD_IDS[g], *LOAD_SPAN[g], (Place(Tier.DISK),), group=g) for g in (0, 1)
        )
        run_step(b, S3KVMetadata(loads=[LoadPlan("r", chunks, sync=False)], namespace="ns1"))
        assert b.drain(60)
        _, recved = b.get_finished(set())
        errors = b.take_load_errors()
    finally:
        b.shutdown()
    assert recved == {"r"} and errors == set()
    assert_caches_equal(b_caches, expected_load(a_caches))


def test_a_plan_for_a_group_the_engine_lacks_is_refused_by_name():
    w, _ = worker({"write_policy": "local_only", "cpu_bytes": "64KiB"})
    try:
        meta = S3KVMetadata(
            stores=[StoreChunk(KEY, (1, 2, 3, 4), (Place(Tier.CPU, 0),), group=2)], namespace="ns1"
        )
        w.bind(meta)
        with pytest.raises(ValueError, match="KV cache group 2: this engine has 2"):
            w.save_layer(meta, NAMES[0])
    finally:
        w.shutdown()
