"""The behaviour every tier must share, placement and bytes together.

A tier is split across vLLM's processes: the scheduler's
:class:`~s3kv.tiering.placement.TierIndex` decides where a chunk goes and what
is evicted, a worker's :class:`~s3kv.tiering.tiers.handler.TierHandler` holds the
bytes. :class:`LocalTier` joins them the way the scheduler and a worker do,
and :class:`TierConformance` is the suite: each handler's test class
subclasses it and provides the ``make_tier`` fixture (capacity in chunks ->
LocalTier). The handlers run on one event loop, as in a worker; the suite
calls them from threads through :class:`Calls`.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import threading
from collections.abc import Callable

import numpy as np
import pytest

from s3kv.chunk_reader import PageFormat
from s3kv.errors import CorruptChunk, NotFound
from s3kv.testing.pages import Frames
from s3kv.tiering.chunks import ChunkCodec, ChunkData
from s3kv.tiering.loop import BackgroundLoop
from s3kv.tiering.placement import Tier, TierIndex
from s3kv.tiering.plan import Place
from s3kv.tiering.tiers.handler import TierHandler

NAMESPACE = "5e" * 16
LAYERS = 4
LAYER_BYTES = 2 << 10
FMT = PageFormat(dtype="bfloat16", itemsize=2, page_shape=(2, 1, 32, 16), tokens=32, layer_bytes=LAYER_BYTES)
assert 2 * 1 * 32 * 16 * FMT.itemsize == LAYER_BYTES


def make_codec(
    codec_name: str = "zstd",
    *,
    namespace: str = NAMESPACE,
    rank: int = 0,
    num_layers: int = LAYERS,
    fmt: PageFormat = FMT,
) -> ChunkCodec:
    return ChunkCodec(namespace=namespace, rank=rank, num_layers=num_layers, fmt=fmt, codec=codec_name)


def key_of(i: int) -> bytes:
    return hashlib.blake2b(f"chunk {i}".encode(), digest_size=16).digest()


def layers_for(
    key: bytes, version: int = 0, num_layers: int = LAYERS, layer_bytes: int = LAYER_BYTES
) -> list[np.ndarray]:
    """Deterministic pages for ``key``: half random, half a repeated byte, so
    zstd really compresses and every chunk encodes to about the same size."""
    rng = np.random.default_rng([int.from_bytes(key[:8], "little"), version])
    out = []
    for i in range(num_layers):
        layer = np.full(layer_bytes, (key[0] + i + version) % 256, dtype=np.uint8)
        layer[: layer_bytes // 2] = rng.integers(0, 256, layer_bytes // 2, dtype=np.uint8)
        out.append(layer)
    return out


def make_chunk(chunk_codec: ChunkCodec, key: bytes, version: int = 0) -> ChunkData:
    return ChunkData(key, chunk_codec, layers=layers_for(key, version, chunk_codec.num_layers))


_LOOP: BackgroundLoop | None = None


def _loop() -> BackgroundLoop:
    global _LOOP
    if _LOOP is None:
        _LOOP = BackgroundLoop("s3kv-conformance")
    return _LOOP


class Calls:
    """A handler's methods, called and waited for (from any thread) on the
    suite's event loop; ``slot``: the place's slot."""

    def __init__(self, handler: TierHandler) -> None:
        self.handler = handler

    def _place(self, slot: int | None) -> Place:
        return Place(self.handler.tier, slot)

    def write(self, key: bytes, chunk: ChunkData, slot: int | None = None) -> int:
        assert chunk.key == key
        size = _loop().run(self.handler.write(self._place(slot), chunk), timeout=60)
        assert size is not None
        return size

    def read(self, key: bytes, sink, slot: int | None = None) -> int:
        return _loop().run(self.handler.read(self._place(slot), key, Frames(sink)), timeout=60)[0]

    def delete(self, key: bytes, slot: int | None = None) -> None:
        _loop().run(self.handler.delete(self._place(slot), key), timeout=60)

    def bytes_used(self) -> int:
        return _loop().run(self.handler.bytes_used(), timeout=60)


class LocalTier:
    """An index and a storage, joined as the scheduler and a worker join them.
    Index operations are serialized under one lock (the scheduler thread)."""

    def __init__(self, index: TierIndex, handler: TierHandler, size_of: Callable[[ChunkData], int]) -> None:
        self.index = index
        self.storage = Calls(handler)
        self.size_of = size_of
        self.lock = threading.Lock()
        self.written: dict[bytes, int] = {}
        """Bytes each write reported."""

    def _forget(self, evicted) -> None:
        """Delete evicted bytes before the lock is released, so no later write
        of the same key can be undone by a late delete."""
        for key, entry in evicted:
            self.storage.delete(key, entry.slot)

    def insert(self, chunk: ChunkData) -> bool:
        """reserve -> write -> commit; False if the index refused the key."""
        with self.lock:
            got = self.index.reserve(chunk.key, self.size_of(chunk))
            if got is None:
                return False
            entry, evicted = got
            self._forget(evicted)
        try:
            size = self.storage.write(chunk.key, chunk, slot=entry.slot)
        except BaseException:
            with self.lock:
                self.index.abort(chunk.key)
            raise
        with self.lock:
            self.written[chunk.key] = size
            self._forget(self.index.commit(chunk.key, size))
        return True

    def lookup(self, key: bytes) -> list[bytes] | None:
        """The layers of ``key`` if the index has it ready; pinned while read."""
        with self.lock:
            if key not in self.index:
                return None
            self.index.touch(key)
            self.index.pin(key)
            entry = self.index.get(key)
        layers: dict[int, bytes] = {}
        try:
            self.storage.read(key, lambda i, a: layers.__setitem__(i, a.tobytes()), slot=entry.slot)
        except (NotFound, CorruptChunk):
            with self.lock:
                self.index.remove(key)
            raise
        finally:
            with self.lock:
                self.index.unpin(key)
        assert sorted(layers) == list(range(len(layers)))
        return [layers[i] for i in range(len(layers))]

    def remove(self, key: bytes) -> None:
        with self.lock:
            entry = self.index.get(key)
            self.index.remove(key)
        if entry is not None:
            self.storage.delete(key, entry.slot)


def expected(key: bytes, version: int = 0) -> list[bytes]:
    return [a.tobytes() for a in layers_for(key, version)]


def read_raw(storage: Calls, key: bytes, slot: int | None) -> list[bytes]:
    layers: dict[int, bytes] = {}
    storage.read(key, lambda i, a: layers.__setitem__(i, a.tobytes()), slot=slot)
    return [layers[i] for i in sorted(layers)]


class TierConformance:
    tier: Tier
    """The tier under test (every tier in the registry has a suite)."""

    @pytest.fixture
    def chunk_codec(self) -> ChunkCodec:
        return make_codec()

    @pytest.fixture
    def make_tier(self) -> Callable[[int], LocalTier]:
        raise NotImplementedError

    def check_bytes_used(self, tier: LocalTier) -> None:
        """What the storage measures is what the index accounts."""
        assert tier.storage.bytes_used() == tier.index.used <= tier.index.capacity

    def test_insert_then_lookup_returns_every_layer(self, make_tier, chunk_codec):
        tier = make_tier(4)
        keys = [key_of(i) for i in range(3)]
        for k in keys:
            assert tier.insert(make_chunk(chunk_codec, k))
        for k in keys:
            assert k in tier.index
            assert tier.lookup(k) == expected(k)
        entry = tier.index.get(keys[0])
        got: list[int] = []
        n = tier.storage.read(keys[0], lambda i, a: got.append(a.nbytes), slot=entry.slot)
        assert got == [LAYER_BYTES] * LAYERS
        assert n == tier.written[keys[0]] >= LAYERS * LAYER_BYTES // 2

    def test_missing_key_raises_not_found(self, make_tier, chunk_codec):
        tier = make_tier(2)
        absent = key_of(99)
        with pytest.raises(NotFound):
            tier.storage.read(absent, lambda i, a: None, slot=0)
        assert tier.insert(make_chunk(chunk_codec, key_of(0)))
        slot = tier.index.get(key_of(0)).slot
        with pytest.raises(NotFound):  # another key, even in the slot that is in use
            tier.storage.read(absent, lambda i, a: None, slot=slot)
        assert absent not in tier.index and tier.lookup(absent) is None

    def test_lru_eviction_order(self, make_tier, chunk_codec):
        tier = make_tier(3)
        a, b, c, d, e = (key_of(i) for i in range(5))
        for k in (a, b, c):
            assert tier.insert(make_chunk(chunk_codec, k))
        b_slot = tier.index.get(b).slot
        assert tier.lookup(a) == expected(a)  # a is now the most recently used
        assert tier.insert(make_chunk(chunk_codec, d))
        assert b not in tier.index and not tier.index.has(b)
        with pytest.raises(NotFound):
            tier.storage.read(b, lambda i, a: None, slot=b_slot)
        assert list(tier.index.keys()) == [c, a, d]
        assert tier.insert(make_chunk(chunk_codec, e))
        assert list(tier.index.keys()) == [a, d, e]
        assert tier.index.evictions == 2
        for k in (a, d, e):
            assert tier.lookup(k) == expected(k)

    def test_capacity_holds_after_many_inserts(self, make_tier, chunk_codec):
        tier = make_tier(4)
        keys = [key_of(i) for i in range(20)]
        for k in keys:
            assert tier.insert(make_chunk(chunk_codec, k))
            assert tier.index.used <= tier.index.capacity
            self.check_bytes_used(tier)
        assert list(tier.index.keys()) == keys[-4:]
        assert tier.index.evictions == 16
        for k in keys[-4:]:
            assert tier.lookup(k) == expected(k)
        for k in keys[:-4]:
            assert tier.lookup(k) is None
            with pytest.raises(NotFound):
                tier.storage.read(k, lambda i, a: None, slot=0)

    def test_pinned_entries_are_never_evicted(self, make_tier, chunk_codec):
        tier = make_tier(2)
        a, b, c, d = (key_of(i) for i in range(4))
        assert tier.insert(make_chunk(chunk_codec, a)) and tier.insert(make_chunk(chunk_codec, b))
        assert tier.index.pin(a) and tier.index.pin(b)
        used = tier.index.used
        assert not tier.insert(make_chunk(chunk_codec, c))  # cannot fit: nothing evicted
        assert not tier.index.has(c) and tier.index.evictions == 0 and tier.index.used == used
        assert tier.lookup(a) == expected(a) and tier.lookup(b) == expected(b)
        tier.index.unpin(b)
        tier.index.touch(b)  # a is the least recently used, but pinned
        assert tier.insert(make_chunk(chunk_codec, c))
        assert list(tier.index.keys()) == [a, c]
        assert tier.lookup(a) == expected(a)
        tier.index.unpin(a)
        assert tier.insert(make_chunk(chunk_codec, d))  # a was read after c was written
        assert list(tier.index.keys()) == [a, d] and tier.index.evictions == 2
        assert tier.lookup(c) is None and tier.lookup(a) == expected(a)

    def test_reinsert_refused_while_present(self, make_tier, chunk_codec):
        tier = make_tier(3)
        a = key_of(0)
        assert tier.insert(make_chunk(chunk_codec, a))
        assert tier.index.reserve(a, tier.size_of(make_chunk(chunk_codec, a))) is None
        assert not tier.insert(make_chunk(chunk_codec, a, version=1))
        assert tier.lookup(a) == expected(a)
        b = key_of(1)
        assert tier.index.reserve(b, 1) is not None  # pending
        assert tier.index.reserve(b, 1) is None
        tier.remove(a)
        assert tier.insert(make_chunk(chunk_codec, a, version=1))
        assert tier.lookup(a) == expected(a, version=1) != expected(a)

    def test_remove_and_delete(self, make_tier, chunk_codec):
        tier = make_tier(3)
        a, b = key_of(0), key_of(1)
        assert tier.insert(make_chunk(chunk_codec, a)) and tier.insert(make_chunk(chunk_codec, b))
        a_slot = tier.index.get(a).slot
        used = tier.index.used
        tier.remove(a)
        assert a not in tier.index and tier.index.used < used
        with pytest.raises(NotFound):
            tier.storage.read(a, lambda i, a: None, slot=a_slot)
        tier.storage.delete(a, a_slot)  # absent: not an error
        assert tier.lookup(b) == expected(b)
        self.check_bytes_used(tier)

    def test_concurrent_distinct_keys(self, make_tier, chunk_codec):
        tier = make_tier(6)
        threads, per_thread = 6, 5
        errors: list[str] = []

        def work(t: int) -> tuple[int, int]:
            hits = inserted = 0
            mine = [key_of(1000 * t + i) for i in range(per_thread)]
            for round_ in range(3):
                for k in mine:
                    if tier.insert(make_chunk(chunk_codec, k)):
                        inserted += 1
                    for other in (k, key_of(1000 * ((t + 1) % threads) + round_)):
                        got = tier.lookup(other)
                        if got is None:
                            continue
                        hits += 1
                        if got != expected(other):
                            errors.append(other.hex())
            return hits, inserted

        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            results = list(pool.map(work, range(threads)))
        assert errors == []
        assert sum(h for h, _ in results) > threads and sum(i for _, i in results) >= threads
        assert tier.index.used <= tier.index.capacity and len(tier.index) == 6
        for k in list(tier.index.keys()):
            assert tier.lookup(k) == expected(k)
        self.check_bytes_used(tier)
