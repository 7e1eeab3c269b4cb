"""Every tier handler in the registry (host pool, NVMe directory, S3 over
the in-memory store), built by its spec as a worker builds it, passes the
same conformance suite; the NVMe tier's checked reads are tested here too."""

from __future__ import annotations

import itertools
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from s3kv.chunk_reader import PageFormat
from s3kv.errors import CorruptChunk, NotFound
from s3kv.stats import Counters
from s3kv.stores.memory import MemoryStore
from s3kv.tiering.chunks import ChunkCodec, ChunkData
from s3kv.tiering.placement import Tier, TierIndex
from s3kv.tiering.plan import Place
from s3kv.tiering.tiers.cpu.handler import CpuHandler
from s3kv.tiering.tiers.handler import TierHandler
from s3kv.tiering.tiers.nvme.files import DiskTier
from s3kv.tiering.tiers.nvme.handler import NvmeHandler
from s3kv.tiering.tiers.nvme.settings import NvmeSettings
from s3kv.tiering.tiers.registry import TIERS
from s3kv.tiering.tiers.report import RankReport
from s3kv.tiering.tiers.s3.handler import S3Handler
from s3kv.tiering.tiers.settings import EngineSettings, WorkerEnv
from s3kv.tiering.worker.hostpool import HostPool
from tests.tiers.conformance import (
    LAYER_BYTES,
    LAYERS,
    Calls,
    LocalTier,
    TierConformance,
    expected,
    key_of,
    layers_for,
    make_chunk,
    make_codec,
    read_raw,
)


def byte_capacity(chunks: int, chunk_bytes: int) -> int:
    """Room for ``chunks`` chunks of about ``chunk_bytes``, not for one more."""
    return chunks * chunk_bytes + chunk_bytes // 2


def built(tier: Tier, chunk_codec: ChunkCodec, *, pool=None, store=None, disk_path=None) -> TierHandler:
    """``tier``'s handler as a worker builds it: by its spec in the registry,
    from the worker's settings and parts (timeouts no busy machine reaches)."""
    settings = EngineSettings(
        chunk_codec.namespace,
        "p",
        chunk_codec.rank,
        chunk_codec.num_layers,
        codec=chunk_codec.codec,
        load_timeout_s=60,
        wings={}
        if disk_path is None
        else {Tier.DISK: NvmeSettings(str(disk_path), codec=chunk_codec.codec, fsync=False, timeout_s=60)},
    )
    env = WorkerEnv(settings, chunk_codec, RankReport(), Counters(), None, pool, store)  # type: ignore[arg-type]
    handler = next(spec for spec in TIERS if spec.tier is tier).handler(env)
    assert handler is not None and handler.tier is tier
    probe = getattr(handler, "probe", None)  # the NVMe tier's probe file counts in its bytes while written
    if probe is not None:
        probe.result(60)
    return handler


def test_every_tier_in_the_registry_runs_the_suite():
    suites = {cls.tier for cls in TierConformance.__subclasses__()}
    assert suites == {spec.tier for spec in TIERS}


def nvme(root: Path, chunk_codec) -> NvmeHandler:
    """The NVMe handler, with timeouts no busy machine reaches."""
    return NvmeHandler(DiskTier(root, chunk_codec), timeout_s=60, write_queue_s=60)


class TestS3Tier(TierConformance):
    tier = Tier.S3

    @pytest.fixture
    def make_tier(self, chunk_codec):
        chunk_bytes = len(make_chunk(chunk_codec, key_of(-1)).blob)

        def make(chunks: int) -> LocalTier:
            index = TierIndex("s3", byte_capacity(chunks, chunk_bytes))
            handler = built(Tier.S3, chunk_codec, store=MemoryStore())
            assert isinstance(handler, S3Handler)
            return LocalTier(index, handler, lambda c: len(c.blob))

        return make


class TestHostPoolTier(TierConformance):
    tier = Tier.CPU

    @pytest.fixture
    def make_tier(self, chunk_codec):
        def make(chunks: int) -> LocalTier:
            pool = HostPool(chunks, LAYER_BYTES, LAYERS)
            handler = built(Tier.CPU, chunk_codec, pool=pool)
            assert isinstance(handler, CpuHandler) and handler.pool is pool
            return LocalTier(TierIndex("cpu", pool.num_slots, slots=True), handler, lambda c: 1)

        return make

    def check_bytes_used(self, tier: LocalTier) -> None:
        pool = tier.storage.handler.pool
        assert isinstance(pool, HostPool)
        assert (
            tier.storage.bytes_used()
            == pool.num_slots * pool.slot_bytes
            == pool.num_slots * LAYERS * LAYER_BYTES
        )
        assert tier.index.used <= tier.index.capacity == pool.num_slots

    def test_a_staged_store_is_taken_where_the_connector_copied_it(self, make_tier, chunk_codec):
        """stage() claims a slot as being overwritten and hands out its
        pages; the store's write then takes them as they are (no copy over
        them, even from other arrays), and pages() gives the slot's own
        views once it holds the key, None before and for another key."""
        tier = make_tier(2)
        handler, pool = tier.storage.handler, tier.storage.handler.pool
        key, place = key_of(1), Place(Tier.CPU, 1)
        pool.claim(1, key_of(9))
        views = handler.stage(place)
        assert not pool.holds(1, key_of(9)) and handler.pages(place, key) is None
        for v, a in zip(views, layers_for(key)):
            v[:] = a
        elsewhere = ChunkData(key, chunk_codec, layers=layers_for(key, 7))  # not what the slot holds
        assert tier.storage.write(key, elsewhere, slot=1) == pool.slot_bytes
        got = handler.pages(place, key)
        assert got is not None and [g.tobytes() for g in got] == expected(key)
        assert all(np.shares_memory(g, pool.buffer) for g in got)  # the slot's views, no copies
        assert handler.pages(place, key_of(2)) is None and handler.pages(Place(Tier.CPU), key) is None
        # Not staged (a promotion, a test): the pages are copied in.
        assert tier.storage.write(key, elsewhere, slot=1) == pool.slot_bytes
        assert [g.tobytes() for g in handler.pages(place, key)] == expected(key, 7)

    def test_slots_match_the_index(self, make_tier, chunk_codec):
        tier = make_tier(3)
        keys = [key_of(i) for i in range(3)]
        for k in keys:
            assert tier.insert(make_chunk(chunk_codec, k))
        pool = tier.storage.handler.pool
        for k in keys:
            slot = tier.index.get(k).slot
            assert pool.holds(slot, k)
            assert [v.tobytes() for v in pool.layer_views(slot)] == expected(k)


class TestDiskTier(TierConformance):
    tier = Tier.DISK

    @pytest.fixture(params=["zstd", "none"])
    def chunk_codec(self, request):
        return make_codec(request.param)

    @pytest.fixture
    def make_tier(self, tmp_path: Path, chunk_codec):
        counter = itertools.count()
        chunk_bytes = len(make_chunk(chunk_codec, key_of(-1)).blob)

        def make(chunks: int) -> LocalTier:
            handler = built(Tier.DISK, chunk_codec, disk_path=tmp_path / f"disk{next(counter)}")
            assert isinstance(handler, NvmeHandler) and handler.files.codec.codec == chunk_codec.codec
            return LocalTier(
                TierIndex("disk", byte_capacity(chunks, chunk_bytes)), handler, lambda c: len(c.blob)
            )

        return make

    def check_bytes_used(self, tier: LocalTier) -> None:
        super().check_bytes_used(tier)
        partials = [
            n
            for _, _, files in os.walk(tier.storage.handler.files.root)
            for n in files
            if n.endswith(".partial")
        ]
        assert partials == []

    def test_zstd_compresses(self, chunk_codec):
        blob = make_chunk(chunk_codec, key_of(0)).blob
        if chunk_codec.codec == "zstd":
            assert len(blob) < 0.7 * LAYERS * LAYER_BYTES
        else:
            assert len(blob) > LAYERS * LAYER_BYTES

    def test_flipped_bytes_raise_corrupt_and_the_file_goes(self, make_tier, chunk_codec):
        tier = make_tier(2)
        k = key_of(0)
        good = make_chunk(chunk_codec, k).blob
        path = tier.storage.handler.files.path(k)
        for pos in (5, 40, len(good) // 2, len(good) - 1):
            assert tier.insert(make_chunk(chunk_codec, k))
            assert path.read_bytes() == good
            bad = bytearray(good)
            bad[pos] ^= 0x10
            path.write_bytes(bytes(bad))
            with pytest.raises(CorruptChunk):
                tier.lookup(k)
            assert not path.exists() and k not in tier.index and not tier.index.has(k)
            with pytest.raises(NotFound):
                read_raw(tier.storage, k, None)

    def test_truncated_file_is_corrupt(self, make_tier, chunk_codec):
        tier = make_tier(2)
        k = key_of(0)
        assert tier.insert(make_chunk(chunk_codec, k))
        path = tier.storage.handler.files.path(k)
        path.write_bytes(path.read_bytes()[:-1])
        with pytest.raises(CorruptChunk):
            read_raw(tier.storage, k, None)
        assert not path.exists()

    @pytest.mark.parametrize("what", ["namespace", "key", "rank", "page format"])
    def test_foreign_file_is_rejected(self, tmp_path, chunk_codec, what):
        mine = Calls(nvme(tmp_path / "disk", chunk_codec))
        k, other_key = key_of(0), key_of(1)
        foreign_codec = {
            "namespace": make_codec(chunk_codec.codec, namespace="ab" * 16),
            "rank": make_codec(chunk_codec.codec, rank=1),
            "page format": make_codec(
                chunk_codec.codec,
                fmt=PageFormat("float16", 2, chunk_codec.fmt.page_shape, 32, chunk_codec.fmt.layer_bytes),
            ),
        }.get(what, chunk_codec)
        theirs = Calls(nvme(tmp_path / "other", foreign_codec))
        written = other_key if what == "key" else k
        theirs.write(written, ChunkData(written, foreign_codec, layers=layers_for(k)))
        assert read_raw(theirs, written, None) == expected(k)  # valid where it was written
        mine_path = mine.handler.files.path(k)
        mine_path.parent.mkdir(parents=True)
        shutil.copyfile(theirs.handler.files.path(written), mine_path)
        with pytest.raises(CorruptChunk):
            read_raw(mine, k, None)
        assert not mine_path.exists()

    def test_readers_racing_a_republisher_see_whole_chunks(self, tmp_path, chunk_codec):
        layer_bytes, layers = 64 << 10, 8
        fmt = PageFormat("bfloat16", 2, (2, 1, 32, 512), 32, layer_bytes)
        big = make_codec(chunk_codec.codec, num_layers=layers, fmt=fmt)
        tier = Calls(nvme(tmp_path / "disk", big))
        k = key_of(7)
        versions = [layers_for(k, v, layers, layer_bytes) for v in range(2)]
        blobs = [ChunkData(k, big, layers=v).blob for v in versions]
        wanted = [[a.tobytes() for a in v] for v in versions]
        done = threading.Event()
        seen = {"missing": 0, "v0": 0, "v1": 0, "bad": 0, "corrupt": 0}
        seen_lock = threading.Lock()

        def write() -> None:
            try:
                for i in range(150):
                    tier.write(k, ChunkData(k, big, blob=blobs[i % 2]))
                    if i % 10 == 4:
                        tier.delete(k)
            finally:
                done.set()

        def read() -> None:
            while not done.is_set():
                try:
                    got = read_raw(tier, k, None)
                    outcome = "v0" if got == wanted[0] else "v1" if got == wanted[1] else "bad"
                except NotFound:
                    outcome = "missing"
                except CorruptChunk:
                    outcome = "corrupt"
                with seen_lock:
                    seen[outcome] += 1

        threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert seen["bad"] == seen["corrupt"] == 0, seen
        assert seen["v0"] + seen["v1"] > 0, seen
        assert read_raw(tier, k, None) == wanted[1]  # the last write (149) was version 1
