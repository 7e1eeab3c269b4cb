"""The worker's transfer engine against the in-memory store, a real host pool
and a real NVMe directory (tmp_path)."""

import asyncio
import errno
import time

import numpy as np
import pytest

from s3kv.errors import Throttled, Transient
from s3kv.keys import object_key
from s3kv.stores.base import PutMode
from s3kv.stores.memory import MemoryStore
from s3kv.tiering import disk as disk_mod
from s3kv.tiering.chunks import PageFormat, plan_ranges
from s3kv.tiering.hostpool import HostPool
from s3kv.tiering.placement import Tier
from s3kv.tiering.planner import LoadChunk
from s3kv.tiering.transfer import EngineSettings, StoreJob, TransferEngine

LAYERS = 4
PAGE = 2 * 2 * 32 * 16  # bytes of one layer of a chunk
FMT = PageFormat(dtype="bfloat16", itemsize=2, page_shape=(2, 2, 32, 16), tokens=64, layer_bytes=PAGE)


def layers(seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, PAGE, dtype=np.uint8) for _ in range(LAYERS)]


def engine(store, *, pool_slots=0, disk_path=None, **kw):
    settings = EngineSettings(
        namespace="n" * 32,
        prefix="p",
        rank=0,
        num_layers=LAYERS,
        range_bytes=PAGE + 200,
        disk_path=str(disk_path) if disk_path else None,
        **kw,
    )
    e = TransferEngine(store, settings)
    e.configure(FMT, HostPool(pool_slots, PAGE, LAYERS) if pool_slots else None)
    return e


def chunk(key, *sources, **kw):
    return LoadChunk(key, (0, 1), 0, 2, sources or (Tier.S3,), **kw)


def store_job(key, seed, **kw):
    kw.setdefault("s3", True)
    return StoreJob(key, layers(seed), **kw)


class Results:
    """Everything polled from an engine, accumulated."""

    def __init__(self):
        self.finished_loads, self.written, self.failed, self.missing = {}, {}, {}, {}
        self.released, self.unavailable, self.disk_full = [], 0, False
        self.tier_ok, self.tier_failed, self.bad, self.existing = {}, {}, {}, set()

    def add(self, r):
        self.finished_loads.update(r.finished_loads)
        for mine, theirs in ((self.written, r.written), (self.failed, r.failed), (self.missing, r.missing)):
            for tier, keys in theirs.items():
                if isinstance(keys, dict):
                    mine.setdefault(tier, {}).update(keys)
                else:
                    mine.setdefault(tier, set()).update(keys)
        self.released += r.released
        self.unavailable += r.tier_failed.get(Tier.S3, 0)  # S3 did not answer
        for mine, theirs in ((self.tier_ok, r.tier_ok), (self.tier_failed, r.tier_failed)):
            for tier, n in theirs.items():
                mine[tier] = mine.get(tier, 0) + n
        self.bad.update(r.bad)
        self.existing |= r.existing
        self.disk_full |= r.disk_full


def wait_for(e, pred, timeout=10):
    deadline = time.monotonic() + timeout
    acc = Results()
    while time.monotonic() < deadline:
        acc.add(e.poll())
        if pred(acc):
            return acc
        time.sleep(0.01)
    raise AssertionError(f"timed out; have {vars(acc)}")


def stored_chunk(store, key, seed, **kw):
    """An engine on ``store`` that has just stored chunk ``key`` in S3."""
    e = engine(store, **kw)
    e.submit_store(store_job(key, seed))
    wait_for(e, lambda a: key in a.written.get(Tier.S3, {}))
    return e


def collect(got):
    return lambda c, layer, arr: got.__setitem__((c.key, layer), arr.copy())


def test_store_then_load_roundtrip():
    store = MemoryStore()
    e = engine(store)
    data = {bytes([i]) * 16: layers(i) for i in range(3)}
    for key, ls in data.items():
        assert e.submit_store(StoreJob(key, ls, s3=True))
    wait_for(e, lambda a: len(a.written.get(Tier.S3, {})) == 3)
    got = {}
    e.submit_load("job", [chunk(k) for k in data], collect(got))
    acc = wait_for(e, lambda a: "job" in a.finished_loads)
    assert acc.finished_loads["job"] == []
    for key, ls in data.items():
        for i in range(LAYERS):
            assert (got[(key, i)] == ls[i]).all()
    totals = e.counters.totals()
    assert totals["store_chunks_s3"] == 3 and totals["load_chunks_s3"] == 3
    e.close()


def test_write_through_to_every_tier_then_load_from_each(tmp_path):
    store = MemoryStore()
    e = engine(store, pool_slots=2, disk_path=tmp_path)
    key = b"w" * 16
    data = layers(7)
    slot_views = e.pool.layer_views(1)
    for view, layer in zip(slot_views, data):
        view[:] = layer  # the connector's copy out of the KV cache
    e.submit_store(StoreJob(key, slot_views, slot=1, disk=True, s3=True))
    acc = wait_for(e, lambda a: all(key in a.written.get(t, {}) for t in Tier) and a.released)
    assert acc.released == [key]  # the slot may be reused once encoded
    assert e.disk.path(key).is_file() and asyncio.run(store.exists(e.chunk_id(key).object_key))
    assert acc.written[Tier.DISK][key] == e.disk.path(key).stat().st_size
    for tier, kw in ((Tier.CPU, {"cpu_slot": 1}), (Tier.DISK, {}), (Tier.S3, {})):
        got = {}
        e.submit_load(tier.value, [chunk(key, tier, **kw)], collect(got))
        r = wait_for(e, lambda a, t=tier: t.value in a.finished_loads)
        assert r.finished_loads[tier.value] == [], tier
        assert all((got[(key, i)] == data[i]).all() for i in range(LAYERS)), tier
        assert e.counters.totals()[f"load_chunks_{tier.value}"] == 1
    e.close()


def test_s3_load_promotes_to_cpu_slot_and_disk(tmp_path):
    store = MemoryStore()
    key = b"p" * 16
    stored_chunk(store, key, 8).close()
    e = engine(store, pool_slots=1, disk_path=tmp_path)
    e.submit_load("j", [chunk(key, Tier.S3, promote_slot=0, promote_disk=True)], lambda *a: None)
    acc = wait_for(e, lambda a: "j" in a.finished_loads and key in a.written.get(Tier.DISK, {}))
    assert acc.finished_loads["j"] == [] and key in acc.written[Tier.CPU]
    assert e.pool.holds(0, key)
    assert all((v == d).all() for v, d in zip(e.pool.layer_views(0), layers(8)))
    # The promoted file is the S3 object, byte for byte.
    assert e.disk.read_blob(key) == asyncio.run(store.get(e.chunk_id(key).object_key))
    e.close()


def test_disk_miss_falls_back_to_s3_and_reports_the_disk(tmp_path):
    store = MemoryStore()
    key = b"f" * 16
    stored_chunk(store, key, 9).close()
    e = engine(store, disk_path=tmp_path)
    got = {}
    e.submit_load("j", [chunk(key, Tier.DISK, Tier.S3)], collect(got))
    acc = wait_for(e, lambda a: "j" in a.finished_loads)
    assert acc.finished_loads["j"] == []
    assert acc.missing == {Tier.DISK: {key}}
    assert (got[(key, 0)] == layers(9)[0]).all()
    e.close()


def test_corrupt_disk_file_is_removed_and_reported(tmp_path):
    e = engine(MemoryStore(), disk_path=tmp_path)
    key = b"d" * 16
    e.submit_store(StoreJob(key, layers(3), disk=True))
    wait_for(e, lambda a: key in a.written.get(Tier.DISK, {}))
    path = e.disk.path(key)
    blob = bytearray(path.read_bytes())
    blob[-5] ^= 0x01
    path.write_bytes(bytes(blob))
    written = []
    e.submit_load("j", [chunk(key, Tier.DISK)], lambda c, layer, arr: written.append(layer))
    acc = wait_for(e, lambda a: "j" in a.finished_loads)
    assert [c.key for c in acc.finished_loads["j"]] == [key] and acc.missing == {Tier.DISK: {key}}
    assert LAYERS - 1 not in written  # the bad layer never reached the pages
    assert not path.exists()
    assert e.counters.totals()["load_errors_corrupt"] == 1
    e.close()


def test_second_writer_finds_chunk_existing():
    store = MemoryStore()
    key = b"k" * 16
    e1, e2 = stored_chunk(store, key, 1), engine(store)
    e2.submit_store(store_job(key, 2))
    wait_for(e2, lambda a: key in a.written.get(Tier.S3, {}))
    assert e2.counters.totals().get("store_chunks_existing") == 1
    e1.close(), e2.close()


def test_ranges_group_whole_layers():
    from s3kv.codec import Frame

    frames = [Frame(100 + i * 10, 10, 20, 0) for i in range(6)]
    assert plan_ranges(frames, have_until=120, range_bytes=25) == [(120, 140, [2, 3]), (140, 160, [4, 5])]
    assert plan_ranges(frames, have_until=0, range_bytes=5) == [
        (100 + i * 10, 110 + i * 10, [i]) for i in range(6)
    ]


class SlowPutStore(MemoryStore):
    async def put(self, key, data, *, mode=PutMode.OVERWRITE):
        await asyncio.sleep(0.3)
        await super().put(key, data, mode=mode)


def test_backpressure_drops_write_through_but_keeps_the_cpu_copy():
    e = engine(SlowPutStore(), pool_slots=5, max_inflight_bytes=2 * LAYERS * PAGE)  # room for two
    jobs = [StoreJob(bytes([i]) * 16, e.pool.layer_views(i), slot=i, s3=True) for i in range(5)]
    accepted = [e.submit_store(j) for j in jobs]
    assert accepted == [True, True, False, False, False]
    acc = wait_for(e, lambda a: len(a.written.get(Tier.S3, {})) + len(a.failed.get(Tier.S3, ())) == 5)
    assert e.counters.totals()["store_dropped_backpressure"] == 3
    assert len(acc.failed[Tier.S3]) == 3
    assert len(acc.written[Tier.CPU]) == 5  # every chunk is in its slot
    wait_for(e, lambda a: len(acc.released) + len(a.released) == 5)
    assert not e.accepts(3 * LAYERS * PAGE) and e.accepts(LAYERS * PAGE)
    e.close()


def test_disk_full_drops_the_store_and_says_so(tmp_path, monkeypatch):
    def full(path, data, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_mod, "atomic_write", full)
    e = engine(MemoryStore(), disk_path=tmp_path)
    key = b"e" * 16
    e.submit_store(StoreJob(key, layers(1), disk=True, s3=True))
    acc = wait_for(e, lambda a: key in a.failed.get(Tier.DISK, ()) and key in a.written.get(Tier.S3, {}))
    assert acc.disk_full
    assert e.counters.totals()["store_dropped_disk_full"] == 1
    e.close()


class FlakyStore(MemoryStore):
    def __init__(self, fail=None, delay=0.0):
        super().__init__()
        self.fail, self.delay = fail, delay

    async def get(self, key, range=None):
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail:
            raise self.fail
        return await super().get(key, range)


@pytest.mark.parametrize(
    ("store", "kind"),
    [
        (FlakyStore(), "missing"),
        (FlakyStore(fail=Transient("connection refused")), "unavailable"),
        (FlakyStore(fail=Throttled("SlowDown (HTTP 503)")), "throttled"),
        (FlakyStore(delay=2.0), "timeout"),
    ],
)
def test_load_failures_are_classified_and_reported(store, kind):
    e = engine(store, pool_slots=1, load_timeout_s=0.3)
    c = chunk(b"x" * 16, Tier.S3, promote_slot=0)
    e.submit_load("j", [c], lambda *a: None)
    acc = wait_for(e, lambda a: "j" in a.finished_loads)
    assert acc.finished_loads["j"] == [c]
    assert e.counters.totals()[f"load_errors_{kind}"] == 1
    assert (acc.missing == {Tier.S3: {b"x" * 16}}) == (kind == "missing")
    assert acc.unavailable == (kind in ("unavailable", "throttled", "timeout"))
    assert acc.failed == {Tier.CPU: {b"x" * 16}}  # the promotion is off
    e.close(0.1)


def test_corrupt_object_is_reported_deleted_and_never_written():
    store = MemoryStore()
    key = b"c" * 16
    e = stored_chunk(store, key, 3)
    name = e.chunk_id(key).object_key
    blob = bytearray(asyncio.run(store.get(name)))
    blob[-10] ^= 0xFF  # last layer's frame
    asyncio.run(store.put(name, bytes(blob)))
    written = []
    e.submit_load("j", [chunk(key)], lambda c, layer, arr: written.append(layer))
    acc = wait_for(e, lambda a: "j" in a.finished_loads)
    assert len(acc.finished_loads["j"]) == 1 and acc.missing == {Tier.S3: {key}}
    assert LAYERS - 1 not in written
    assert not asyncio.run(store.exists(name))
    e.close()


def test_layout_mismatch_is_corrupt():
    key = b"m" * 16
    e = stored_chunk(MemoryStore(), key, 4)
    e.configure(PageFormat("float16", 2, FMT.page_shape, 64, PAGE))
    e.submit_load("j", [chunk(key)], lambda *a: None)
    wait_for(e, lambda a: "j" in a.finished_loads)
    assert e.counters.totals()["load_errors_corrupt"] == 1
    e.close()


def test_no_write_reaches_pages_after_a_timeout():
    """A load that times out must not write into blocks vLLM got back."""

    class SlowSecondRange(MemoryStore):
        async def get(self, key, range=None):
            if range is not None and range.start > 0:
                await asyncio.sleep(1.0)
            return await super().get(key, range)

    key = b"t" * 16
    e = stored_chunk(SlowSecondRange(), key, 5, load_timeout_s=0.3)
    writes = []
    e.submit_load("j", [chunk(key)], lambda c, layer, arr: writes.append(layer))
    wait_for(e, lambda a: "j" in a.finished_loads)
    seen = list(writes)
    time.sleep(1.5)  # the slow ranges arrive now
    assert writes == seen
    e.close()


def test_write_through_runs_at_background_priority():
    """Encoding and NVMe writes must not take CPU from the forward or loads."""
    import os
    import threading

    from s3kv.tiering.transfer import STORE_NICE

    if os.nice(0) >= STORE_NICE:
        pytest.skip("the tests already run at a lower priority than s3kv's store threads")
    e = engine(FlakyStore())
    nice = lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # noqa: E731
    background = e._loop.run(e._run_background(nice), timeout=5)
    foreground = e._loop.run(e._run(nice), timeout=5)
    assert background > foreground
    e.close(0.1)


def test_s3kv_threads_escape_the_forwards_core_binding():
    """vLLM's CPU worker binds its threads to its OpenMP cores and new threads
    inherit that; s3kv's threads must be free to use the other cores."""
    import os
    import threading

    from s3kv.tiering import loop

    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs a process allowed on two or more cores")
    allowed = loop._ALLOWED_CPUS
    seen = {}

    def start_bound():
        os.sched_setaffinity(0, {min(allowed)})  # as vLLM's binding leaves the thread
        e = engine(FlakyStore())
        aff = lambda: os.sched_getaffinity(0)  # noqa: E731
        seen["codec"] = e._loop.run(e._run(aff), timeout=5)
        seen["store"] = e._loop.run(e._run_background(aff), timeout=5)
        seen["disk"] = e._loop.run(e._run_disk(aff), timeout=5)

        async def on_loop():
            return os.sched_getaffinity(0)

        seen["loop"] = e._loop.run(on_loop(), timeout=5)
        e.close(0.1)

    t = threading.Thread(target=start_bound)
    t.start()
    t.join()
    assert seen == {"codec": allowed, "store": allowed, "disk": allowed, "loop": allowed}


def test_created_objects_are_told_to_the_publisher_but_412s_are_not():
    store = MemoryStore()
    created = []
    e1, e2 = engine(store), engine(store)
    e1.on_s3_stored = e2.on_s3_stored = created.append
    key = b"p" * 16
    e1.submit_store(store_job(key, 1))
    wait_for(e1, lambda a: key in a.written.get(Tier.S3, {}))
    e2.submit_store(store_job(key, 2))
    wait_for(e2, lambda a: key in a.existing)
    assert created == [key]
    e1.close(), e2.close()


class _HangingPut(MemoryStore):
    """S3 that accepts the connection and never answers a PUT."""

    async def put(self, key, data, *, mode=PutMode.OVERWRITE):
        await asyncio.Event().wait()


def test_close_stops_taking_stores_drains_flushes_and_ends_in_time():
    store = MemoryStore()
    e = engine(store)
    order = []
    e.on_s3_stored = lambda key: order.append(("stored", key))

    async def flush():
        order.append(("flush", None))

    key = b"c" * 16
    e.submit_store(store_job(key, 1))
    e.close(5.0, flush)
    assert order == [("stored", key), ("flush", None)]  # drained, then published
    assert asyncio.run(store.list_keys("p/")) == [object_key("p", "n" * 32, key, 0)]
    assert not e.submit_store(store_job(b"d" * 16, 2))  # closed: the write-through is dropped
    hung = engine(_HangingPut())
    flushed = []

    async def slow_flush():
        flushed.append(True)
        await asyncio.Event().wait()

    hung.submit_store(store_job(key, 3))
    start = time.monotonic()
    hung.close(1.0, slow_flush)
    assert time.monotonic() - start < 3.0 and flushed == [True]  # bounded, the flush still ran
