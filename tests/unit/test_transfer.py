"""The worker's transfer engine against the in-memory store, a real host pool
and a real NVMe directory (tmp_path)."""

import asyncio
import errno
import os
import threading
import time

import numpy as np
import pytest

from s3kv import codec
from s3kv.chunk_reader import PageFormat
from s3kv.errors import Throttled, Transient
from s3kv.frame_sinks import PageTarget
from s3kv.keys import object_key
from s3kv.stores.base import PutMode
from s3kv.stores.memory import MemoryStore
from s3kv.testing.chunks import chunk_id
from s3kv.testing.pages import Frames, Pages
from s3kv.tiering.chunks import plan_ranges
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import LoadChunk, Place, TierReport
from s3kv.tiering.tiers.nvme import files as disk_mod
from s3kv.tiering.tiers.nvme.report import NvmeReport
from s3kv.tiering.tiers.nvme.settings import NvmeSettings
from s3kv.tiering.tiers.s3.report import S3Report
from s3kv.tiering.tiers.s3.settings import S3Settings
from s3kv.tiering.worker.hostpool import HostPool
from s3kv.tiering.worker.transfer import EngineSettings, StoreJob, TransferEngine
from tests.conftest import wait_until

LAYERS = 4
PAGE = 2 * 2 * 32 * 16  # bytes of one layer of a chunk
FMT = PageFormat(dtype="bfloat16", itemsize=2, page_shape=(2, 2, 32, 16), tokens=64, layer_bytes=PAGE)


def layers(seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, PAGE, dtype=np.uint8) for _ in range(LAYERS)]


def engine(store, *, pool_slots=0, disk_path=None, clock=time.monotonic, **kw):
    """An engine; with ``disk_path`` an NVMe tier there, its settings (``disk_codec``,
    ``disk_fsync``, ``disk_timeout_s``) named as the config's keys."""
    nvme = {k.removeprefix("disk_"): kw.pop(k) for k in list(kw) if k.startswith("disk_")}
    settings = EngineSettings(
        **{
            "namespace": "n" * 32,
            "prefix": "p",
            "rank": 0,
            "num_layers": LAYERS,
            "wings": {Tier.S3: S3Settings(range_bytes=PAGE + 200)}
            | ({Tier.DISK: NvmeSettings(str(disk_path), **nvme)} if disk_path else {}),
            **kw,
        }
    )
    e = TransferEngine(store, settings, clock=clock)
    e.configure(FMT, HostPool(pool_slots, PAGE, LAYERS) if pool_slots else None)
    return e


def chunk(key, *sources, cpu_slot=None, promote_slot=None, promote_disk=False):
    """A load of ``key`` from ``sources`` (tiers, S3 by default), promoted to
    CPU slot ``promote_slot`` and/or the NVMe tier."""
    places = tuple(Place(t, cpu_slot if t is Tier.CPU else None) for t in sources or (Tier.S3,))
    promote = (Place(Tier.CPU, promote_slot),) if promote_slot is not None else ()
    return LoadChunk(key, (0, 1), 0, 2, places, promote + ((Place(Tier.DISK),) if promote_disk else ()))


def job(key, pages, slot=None, disk=False, s3=False, ready=None):
    """A store of ``pages`` into CPU slot ``slot`` and/or the NVMe tier and S3."""
    targets = ((Place(Tier.CPU, slot),) if slot is not None else ()) + tuple(
        Place(t) for t, wanted in ((Tier.DISK, disk), (Tier.S3, s3)) if wanted
    )
    # pinned as the scheduler side pins: a CPU slot that farther writes read
    return StoreJob(key, pages, targets, ready, pinned=slot is not None and len(targets) > 1)


def store_job(key, seed, **kw):
    kw.setdefault("s3", True)
    return job(key, layers(seed), **kw)


def files(e):
    """The engine's NVMe directory (the files under its handler)."""
    return e.handlers[Tier.DISK].files


def pool(e):
    return e.handlers[Tier.CPU].pool


class Results:
    """Every report polled from an engine, aggregated as vLLM aggregates
    ranks' reports, with per-tier views of it."""

    def __init__(self):
        self.report, self.finished_loads = TierReport(), {}

    def add(self, polled):
        self.finished_loads.update(polled.finished_loads)
        self.report = self.report.aggregate(polled.report)

    def _by_tier(self, pairs):
        out = {}
        for tier, key in pairs:
            out.setdefault(tier, set()).add(key)
        return out

    @property
    def written(self):
        """Tier -> key -> ranks (the NVMe tier: bytes of its files)."""
        out = {}
        for (tier, key), n in self.report.written.items():
            out.setdefault(tier, {})[key] = self._nvme.sizes[key] if tier is Tier.DISK else n
        return out

    @property
    def failed(self):
        return self._by_tier(self.report.failed)

    @property
    def missing(self):
        return self._by_tier(self.report.missing)

    @property
    def released(self):
        return [key for key, n in self.report.released.items() for _ in range(n)]

    @property
    def unavailable(self):
        return self.report.tier_failed.get(Tier.S3, 0)  # S3 did not answer

    @property
    def tier_ok(self):
        return self.report.tier_ok

    @property
    def tier_failed(self):
        return self.report.tier_failed

    @property
    def _nvme(self):
        return self.report.section(Tier.DISK, NvmeReport) or NvmeReport()

    @property
    def _s3(self):
        return self.report.section(Tier.S3, S3Report) or S3Report()

    @property
    def bad(self):
        return {key: etag for (key, _rank), etag in self._s3.bad.items()}

    @property
    def existing(self):
        return self._s3.existing

    @property
    def disk_full(self):
        return self._nvme.full


def wait_for(e, pred, timeout=120):
    acc = Results()

    def seen():
        acc.add(e.poll())
        return pred(acc)

    try:
        wait_until("the engine's reports", seen, timeout_s=timeout, every_s=0.01)
    except AssertionError:
        raise AssertionError(f"timed out; have {vars(acc)}") from None
    return acc


class FakeClock:
    """The worker's time (an engine's, or a tier's), moved only by the test:
    every timeout on the worker side reads it, so none races the test."""

    def __init__(self, now=0.0):
        self.now = now
        self.readers = set()
        """The threads that read it."""

    def __call__(self):
        self.readers.add(threading.get_ident())
        return self.now


def advance(e, clock, seconds):
    """Move ``clock`` on by ``seconds`` and wake ``e``'s loop (its timers run on
    the clock), so that what timed out meanwhile does so now."""
    clock.now += seconds
    e.spawn(asyncio.sleep(0)).result(timeout=60)


def settle(e, rounds=3):
    """Let ``e``'s loop run a few rounds: what threads told it before now
    (a disk thread took a read up) has reached the coroutines waiting for it."""
    for _ in range(rounds):
        e.spawn(asyncio.sleep(0)).result(timeout=60)


def idle(e, threads):
    """Wait until every job queued on ``threads`` (one of ``e``'s executors)
    so far is over, and the engine's loop has heard of it: each of its
    threads takes one of a barrier's jobs, after what was queued before."""
    n = threads._max_workers
    barrier = threading.Barrier(n)
    for f in [threads.submit(barrier.wait, 60) for _ in range(n)]:
        f.result(timeout=60)
    e.spawn(asyncio.sleep(0)).result(timeout=60)


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
        assert e.submit_store(job(key, ls, s3=True))
    wait_for(e, lambda a: len(a.written.get(Tier.S3, {})) == 3)
    got = {}
    e.submit_load("job", [chunk(k) for k in data], Pages(collect(got)))
    acc = wait_for(e, lambda a: "job" in a.finished_loads)
    assert acc.finished_loads["job"] == []
    for key, ls in data.items():
        for i in range(LAYERS):
            assert (got[(key, i)] == ls[i]).all()
    totals = e.counters.totals()
    assert totals["store_chunks_s3"] == 3 and totals["load_chunks_s3"] == 3
    e.close()


def test_stored_encoded_bytes_are_the_s3_objects_beside_an_uncompressed_disk_file(tmp_path):
    """The compression ratio's bytes: one figure a chunk, its object in
    S3's codec (the shared copy), also where the NVMe tier writes its file
    uncompressed beside it (disk_codec none: the disk's object is listed
    first among the targets)."""
    store = MemoryStore()
    e = engine(store, disk_path=tmp_path, disk_codec="none")
    key = b"z" * 16
    pages = [np.zeros(PAGE, np.uint8) for _ in range(LAYERS)]  # compresses well
    assert e.submit_store(job(key, pages, disk=True, s3=True))
    wait_for(e, lambda a: key in a.written.get(Tier.S3, {}) and key in a.written.get(Tier.DISK, {}))
    s3_object = asyncio.run(store.get(chunk_id(e, key).object_key))
    assert len(s3_object) < len(files(e).path(key).read_bytes())  # the two copies differ
    totals = e.counters.totals()
    assert totals["store_encoded_bytes"] == len(s3_object)
    assert totals["store_raw_bytes"] == LAYERS * PAGE
    e.close()


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_0_times_each_load_by_tier_for_the_cost_model(tmp_path, rank):
    store = MemoryStore()
    e = engine(store, rank=rank, disk_path=tmp_path)
    keys = [bytes([i]) * 16 for i in range(3)]
    for i, key in enumerate(keys):
        e.submit_store(job(key, layers(i), disk=i == 0, s3=True))
    # the NVMe write may finish after every S3 one: the load reads it from there
    wait_for(e, lambda a: len(a.written.get(Tier.S3, {})) == 3 and keys[0] in a.written.get(Tier.DISK, {}))
    e.submit_load("job", [chunk(keys[0], Tier.DISK), chunk(keys[1]), chunk(keys[2])], Pages(collect({})))
    acc = wait_for(e, lambda a: "job" in a.finished_loads)
    assert acc.finished_loads["job"] == []
    timings = {t.tier: t for t in acc.report.load_timings}
    if rank:  # one rank's figures are the fleet's: the others send none
        assert timings == {}
        return
    assert set(timings) == {Tier.DISK, Tier.S3}
    assert (timings[Tier.DISK].chunks, timings[Tier.S3].chunks) == (1, 2)
    for t in timings.values():
        assert t.req_id == "job" and 0 < t.first_s <= t.last_s
    # A failed load says nothing of its tiers' speed.
    e.submit_load("gone", [chunk(b"z" * 16), chunk(keys[1])], Pages(collect({})))
    acc = wait_for(e, lambda a: "gone" in a.finished_loads)
    assert acc.finished_loads["gone"] and acc.report.load_timings == []
    e.close()


def test_write_through_to_every_tier_then_load_from_each(tmp_path):
    store = MemoryStore()
    e = engine(store, pool_slots=2, disk_path=tmp_path)
    key = b"w" * 16
    data = layers(7)
    slot_views = pool(e).layer_views(1)
    for view, layer in zip(slot_views, data):
        view[:] = layer  # the connector's copy out of the KV cache
    e.submit_store(job(key, slot_views, slot=1, disk=True, s3=True))
    acc = wait_for(e, lambda a: all(key in a.written.get(t, {}) for t in Tier) and a.released)
    assert acc.released == [key]  # the slot may be reused once encoded
    assert files(e).path(key).is_file() and asyncio.run(store.exists(chunk_id(e, key).object_key))
    assert acc.written[Tier.DISK][key] == files(e).path(key).stat().st_size
    for tier, kw in ((Tier.CPU, {"cpu_slot": 1}), (Tier.DISK, {}), (Tier.S3, {})):
        got = {}
        e.submit_load(tier.value, [chunk(key, tier, **kw)], Pages(collect(got)))
        r = wait_for(e, lambda a, t=tier: t.value in a.finished_loads)
        assert r.finished_loads[tier.value] == [], tier
        assert all((got[(key, i)] == data[i]).all() for i in range(LAYERS)), tier
        assert e.counters.totals()[f"load_chunks_{tier.value}"] == 1
    e.close()


@pytest.mark.parametrize("disk_codec", ["none", "blosc2"])
def test_s3_load_promotes_to_cpu_slot_and_disk(tmp_path, disk_codec):
    store = MemoryStore()
    key = b"p" * 16
    stored_chunk(store, key, 8).close()
    e = engine(store, pool_slots=1, disk_path=tmp_path, disk_codec=disk_codec)
    e.submit_load("j", [chunk(key, Tier.S3, promote_slot=0, promote_disk=True)], Pages(lambda *a: None))
    acc = wait_for(e, lambda a: "j" in a.finished_loads and key in a.written.get(Tier.DISK, {}))
    assert acc.finished_loads["j"] == [] and key in acc.written[Tier.CPU]
    assert pool(e).holds(0, key)
    assert all((v == d).all() for v, d in zip(pool(e).layer_views(0), layers(8)))
    s3_object = asyncio.run(store.get(chunk_id(e, key).object_key))
    blob = files(e).path(key).read_bytes()
    if disk_codec == e.codec.codec:  # the promoted file is the S3 object, byte for byte
        assert blob == s3_object
    else:  # the same pages, in the disk's codec
        assert codec.parse_header(blob).codec == disk_codec != codec.parse_header(s3_object).codec
        got: dict[int, np.ndarray] = {}
        files(e).read(key, Frames(lambda i, a: got.__setitem__(i, a.copy())))
        assert all((got[i] == d).all() for i, d in enumerate(layers(8)))
    e.close()


class HeldGets(MemoryStore):
    """GETs of object ``held`` wait until the test sets ``release``."""

    def __init__(self):
        super().__init__()
        self.held, self.release = None, threading.Event()

    async def get(self, key, range=None):
        if key == self.held:
            await asyncio.to_thread(self.release.wait)
        return await super().get(key, range)


def test_a_loads_copies_into_the_nvme_tier_start_once_its_last_chunk_is_in(tmp_path):
    """A copy written from the object (decoded, encoded in the disk's codec,
    written) would take the cores the load's other chunks need: the copies
    a request's load promotes into the NVMe tier start once its last chunk
    is in, not as each chunk is."""
    store = HeldGets()
    first, second = b"a" * 16, b"b" * 16
    e = stored_chunk(store, first, 1, disk_path=tmp_path)
    e.submit_store(store_job(second, 2))
    wait_for(e, lambda a: second in a.written.get(Tier.S3, {}))
    handler = e.handlers[Tier.DISK]
    begun = []  # (key, chunks the load had in when its copy began)
    save = handler.save

    def recording_save(place, data, start=None):
        begun.append((data.key, e.counters.totals().get("load_chunks_s3", 0)))
        return save(place, data, start)

    handler.save = recording_save
    store.held = chunk_id(e, second).object_key
    loads = [chunk(first, Tier.S3, promote_disk=True), chunk(second, Tier.S3, promote_disk=True)]
    e.submit_load("j", loads, Pages(lambda *a: None))
    try:
        wait_until("the first chunk to be in", lambda: e.counters.totals().get("load_chunks_s3", 0) == 1)
        e.spawn(asyncio.sleep(0)).result(timeout=60)  # the loop is past the first chunk's end
        assert begun == []  # its copy waits for the second chunk
    finally:
        store.release.set()
    acc = wait_for(e, lambda a: "j" in a.finished_loads and len(a.written.get(Tier.DISK, {})) == 2)
    assert acc.finished_loads["j"] == []
    assert sorted(begun) == [(first, 2), (second, 2)]
    assert files(e).path(first).exists() and files(e).path(second).exists()
    e.close()


def test_disk_miss_falls_back_to_s3_and_reports_the_disk(tmp_path):
    store = MemoryStore()
    key = b"f" * 16
    stored_chunk(store, key, 9).close()
    e = engine(store, disk_path=tmp_path)
    got = {}
    e.submit_load("j", [chunk(key, Tier.DISK, Tier.S3)], Pages(collect(got)))
    acc = wait_for(e, lambda a: "j" in a.finished_loads)
    assert acc.finished_loads["j"] == []
    assert acc.missing == {Tier.DISK: {key}}
    assert (got[(key, 0)] == layers(9)[0]).all()
    e.close()


def test_corrupt_disk_file_is_removed_and_reported(tmp_path):
    e = engine(MemoryStore(), disk_path=tmp_path)
    key = b"d" * 16
    e.submit_store(job(key, layers(3), disk=True))
    wait_for(e, lambda a: key in a.written.get(Tier.DISK, {}))
    path = files(e).path(key)
    blob = bytearray(path.read_bytes())
    blob[-5] ^= 0x01
    path.write_bytes(bytes(blob))
    written = []
    e.submit_load("j", [chunk(key, Tier.DISK)], Pages(lambda c, layer, arr: written.append(layer)))
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


class HeldPuts(MemoryStore):
    """PUTs wait until the test sets ``release``."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    async def put(self, key, data, *, mode=PutMode.OVERWRITE):
        await asyncio.to_thread(self.release.wait, 60)  # still under way while the test submits the rest
        await super().put(key, data, mode=mode)


def test_backpressure_drops_write_through_but_keeps_the_cpu_copy():
    store = HeldPuts()
    e = engine(store, pool_slots=5, max_inflight_bytes=2 * LAYERS * PAGE)  # room for two
    jobs = [job(bytes([i]) * 16, pool(e).layer_views(i), slot=i, s3=True) for i in range(5)]
    accepted = [e.submit_store(j) for j in jobs]
    store.release.set()
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
    e.submit_store(job(key, layers(1), disk=True, s3=True))
    acc = wait_for(e, lambda a: key in a.failed.get(Tier.DISK, ()) and key in a.written.get(Tier.S3, {}))
    assert acc.disk_full
    assert e.counters.totals()["store_dropped_disk_full"] == 1
    e.close()


class FlakyStore(MemoryStore):
    """GETs fail with ``fail``, or take ``delay`` on the engine's clock."""

    def __init__(self, fail=None, delay=0.0):
        super().__init__()
        self.fail, self.delay, self.gets = fail, delay, 0

    async def get(self, key, range=None):
        self.gets += 1
        if self.delay:
            await asyncio.sleep(self.delay)  # on the engine's loop: its clock's time
        if self.fail:
            raise self.fail
        return await super().get(key, range)


@pytest.mark.parametrize(
    ("store", "kind"),
    [
        (FlakyStore(), "missing"),
        (FlakyStore(fail=Transient("connection refused")), "unavailable"),
        (FlakyStore(fail=Throttled("SlowDown (HTTP 503)")), "throttled"),
        (FlakyStore(delay=60.0), "timeout"),
    ],
)
def test_load_failures_are_classified_and_reported(store, kind, tmp_path):
    clock = FakeClock()  # no time passes but the timeout's
    e = engine(store, pool_slots=1, load_timeout_s=3.0, disk_path=tmp_path, clock=clock)
    c = chunk(b"x" * 16, Tier.S3, promote_slot=0, promote_disk=True)
    e.submit_load("j", [c], Pages(lambda *a: None))
    if kind == "timeout":
        wait_until("the GET to be under way", lambda: store.gets)
        advance(e, clock, 3.0)  # the load's deadline, the GET still far from done
    acc = wait_for(e, lambda a: "j" in a.finished_loads)
    assert acc.finished_loads["j"] == [c]
    assert e.counters.totals()[f"load_errors_{kind}"] == 1
    assert (acc.missing == {Tier.S3: {b"x" * 16}}) == (kind == "missing")
    assert acc.unavailable == (kind in ("unavailable", "throttled", "timeout"))
    assert acc.failed == {Tier.CPU: {b"x" * 16}, Tier.DISK: {b"x" * 16}}  # the promotions are off
    # The NVMe copy, written from the object, never began; a CPU slot's
    # fill may have taken some layers.
    assert acc.report.unstarted == {(Tier.DISK, b"x" * 16): 1}
    assert not list(tmp_path.rglob("*.r0"))
    e.close(0.1)


def test_corrupt_object_is_reported_deleted_and_never_written():
    store = MemoryStore()
    key = b"c" * 16
    e = stored_chunk(store, key, 3)
    name = chunk_id(e, key).object_key
    blob = bytearray(asyncio.run(store.get(name)))
    blob[-10] ^= 0xFF  # last layer's frame
    asyncio.run(store.put(name, bytes(blob)))
    written = []
    e.submit_load("j", [chunk(key)], Pages(lambda c, layer, arr: written.append(layer)))
    acc = wait_for(e, lambda a: "j" in a.finished_loads)
    assert len(acc.finished_loads["j"]) == 1 and acc.missing == {Tier.S3: {key}}
    assert LAYERS - 1 not in written
    assert not asyncio.run(store.exists(name))
    e.close()


def test_layout_mismatch_is_corrupt():
    key = b"m" * 16
    e = stored_chunk(MemoryStore(), key, 4)
    e.configure(PageFormat("float16", 2, FMT.page_shape, 64, PAGE))
    e.submit_load("j", [chunk(key)], Pages(lambda *a: None))
    wait_for(e, lambda a: "j" in a.finished_loads)
    assert e.counters.totals()["load_errors_corrupt"] == 1
    e.close()


def test_no_write_reaches_pages_after_a_timeout():
    """A load that times out must not write into blocks vLLM got back."""

    class SlowSecondRange(MemoryStore):
        slow, over = 0, 0

        async def get(self, key, range=None):
            if range is not None and range.start > 0:
                self.slow += 1
                try:
                    await asyncio.sleep(5.0)  # on the engine's clock, past the load's deadline
                finally:
                    self.over += 1  # arrived, or cancelled with its load
            return await super().get(key, range)

    key = b"t" * 16
    store = SlowSecondRange()
    clock = FakeClock()
    # the header and first range take no time on it
    e = stored_chunk(store, key, 5, load_timeout_s=2.0, clock=clock)
    writes = []
    e.submit_load("j", [chunk(key)], Pages(lambda c, layer, arr: writes.append(layer)))
    wait_until("a slow range to be under way", lambda: store.slow)
    advance(e, clock, 2.0)  # the load's deadline
    wait_for(e, lambda a: "j" in a.finished_loads)
    seen = list(writes)
    advance(e, clock, 5.0)  # the slow ranges arrive, if they were not cancelled with the load
    wait_until("the slow ranges to be over", lambda: store.slow and store.over == store.slow, every_s=0.005)
    idle(e, e._loop.threads)  # and are decoded (or not) on the codec threads
    assert writes == seen
    e.close()


def test_write_through_runs_at_background_priority(tmp_path):
    """Encoding and NVMe writes (a store's, and the copies a load promotes)
    must not take CPU from the forward or loads; NVMe reads must not wait
    behind them."""
    import threading

    from s3kv.tiering.loop import STORE_NICE

    if os.nice(0) >= STORE_NICE:
        pytest.skip("the tests already run at a lower priority than s3kv's store threads")
    e = engine(FlakyStore(), disk_path=tmp_path)
    nice = lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # noqa: E731
    background = e._loop.run(e._loop.in_background(nice), timeout=5)
    foreground = e._loop.run(e._loop.in_threads(nice), timeout=5)
    assert background > foreground
    disk = e.handlers[Tier.DISK]
    disk_writes = e._loop.run(disk.run(nice, write=True), timeout=5)
    disk_reads = e._loop.run(disk.run(nice), timeout=5)
    assert disk_writes == background and disk_reads == foreground
    e.close(0.1)


def test_the_job_loops_timers_and_bounds_run_on_its_clock():
    """The loop's timers (asyncio sleeps and timeouts) and the bounds of
    drain and close are on the clock it was given: a clock that stands
    still holds them, and they end once it has moved past them."""
    from s3kv.tiering.loop import JobLoop

    clock = FakeClock()
    jobs = JobLoop("t", 1, clock)
    try:
        sleeping = jobs.submit(asyncio.sleep(3600.0))  # an hour: no real time would do
        for _ in range(3):
            jobs.run(asyncio.sleep(0), timeout=60)
        assert not sleeping.done()  # no time passed on the clock
        clock.now += 3600.0
        jobs.run(asyncio.sleep(0), timeout=60)  # wakes the loop
        assert sleeping.result(timeout=60) is None
        jobs.track(asyncio.Event().wait())  # a job that never ends
        drained = []
        draining = threading.Thread(target=lambda: drained.append(jobs.drain(0.5)))
        draining.start()
        wait_until("the drain to take its time", lambda: draining.ident in clock.readers)
        assert drained == []
        clock.now += 0.5
        draining.join(60)
        assert drained == [False]
    finally:
        closing = threading.Thread(target=jobs.close, args=(0.2,))
        closing.start()
        wait_until("the close to take its time", lambda: closing.ident in clock.readers)
        clock.now += 0.2
        closing.join(60)
    assert not closing.is_alive()


def test_write_through_threads_leave_the_forward_a_core(monkeypatch):
    """Encoding is paced to the cores a forward leaves: on two cores one
    write-through thread, with more cores half the codec threads."""
    import s3kv.tiering.loop as loop

    monkeypatch.setattr(loop, "_ALLOWED_CPUS", {0, 1})
    assert loop.store_threads(4) == 1
    assert loop.store_threads(1) == 1
    monkeypatch.setattr(loop, "_ALLOWED_CPUS", {0})
    assert loop.store_threads(4) == 1
    monkeypatch.setattr(loop, "_ALLOWED_CPUS", set(range(8)))
    assert loop.store_threads(4) == 2
    assert loop.store_threads(8) == 4
    monkeypatch.setattr(loop, "_ALLOWED_CPUS", {0, 1})
    jobs = loop.JobLoop("t", 4)
    try:
        assert jobs.background_threads._max_workers == 1
    finally:
        jobs.close(0.1)


def test_s3kv_threads_escape_the_forwards_core_binding(tmp_path):
    """vLLM's CPU worker binds its threads to its OpenMP cores and new threads
    inherit that; s3kv's threads must be free to use the other cores."""
    import threading

    from s3kv.tiering import loop

    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs a process allowed on two or more cores")
    allowed = loop._ALLOWED_CPUS
    seen = {}

    def start_bound():
        os.sched_setaffinity(0, {min(allowed)})  # as vLLM's binding leaves the thread
        e = engine(FlakyStore(), disk_path=tmp_path)
        aff = lambda: os.sched_getaffinity(0)  # noqa: E731
        seen["codec"] = e._loop.run(e._loop.in_threads(aff), timeout=5)
        seen["store"] = e._loop.run(e._loop.in_background(aff), timeout=5)
        seen["disk"] = e._loop.run(e.handlers[Tier.DISK].run(aff), timeout=5)
        seen["disk-write"] = e._loop.run(e.handlers[Tier.DISK].run(aff, write=True), timeout=5)

        async def on_loop():
            return os.sched_getaffinity(0)

        seen["loop"] = e._loop.run(on_loop(), timeout=5)
        e.close(0.1)

    t = threading.Thread(target=start_bound)
    t.start()
    t.join()
    assert seen == {
        "codec": allowed,
        "store": allowed,
        "disk": allowed,
        "disk-write": allowed,
        "loop": allowed,
    }


# -- what the tiers' breakers hear ---------------------------------------------------


def test_a_403_on_one_object_drops_the_key_without_blaming_s3():
    from s3kv.errors import PermissionDenied
    from tests.stores.wrappers import WrappedStore

    key = b"q" * 16
    inner = MemoryStore()
    stored_chunk(inner, key, 1).close()
    e = engine(WrappedStore(inner))
    e.s3.denied.add(chunk_id(e, key).object_key)  # a bucket policy or KMS key for its prefix
    c = chunk(key)
    e.submit_load("j", [c], Pages(lambda *a: None))
    acc = wait_for(e, lambda a: "j" in a.finished_loads)
    assert acc.finished_loads["j"] == [c] and acc.missing == {Tier.S3: {key}}
    assert acc.tier_failed == {} and acc.tier_ok == {Tier.S3: 1}  # S3 answered
    assert acc.bad == {}  # not the fleet's business: another role may read it
    assert e.counters.totals()["load_errors_denied"] == 1
    # A store that finds it in the way (a 412) does not publish what this
    # rank cannot read.
    e.submit_store(store_job(key, 2))
    acc = wait_for(e, lambda a: key in a.failed.get(Tier.S3, ()) or key in a.written.get(Tier.S3, {}))
    assert key in acc.failed[Tier.S3] and key not in acc.existing and acc.tier_failed == {}
    e.close()
    # Refused credentials are the tier's trouble: its breaker hears them.
    e = engine(FlakyStore(fail=PermissionDenied("k: ExpiredToken (HTTP 400)", credentials=True)))
    e.submit_load("j", [chunk(key)], Pages(lambda *a: None))
    acc = wait_for(e, lambda a: "j" in a.finished_loads)
    assert acc.tier_failed == {Tier.S3: 1} and acc.missing == {}
    assert e.counters.totals()["load_errors_unavailable"] == 1
    e.close(0.1)


def test_absent_or_corrupt_is_an_answer_from_a_working_tier(tmp_path):
    key = b"z" * 16
    e = engine(MemoryStore(), disk_path=tmp_path)
    e.submit_load("absent", [chunk(key, Tier.DISK, Tier.S3)], Pages(lambda *a: None))
    acc = wait_for(e, lambda a: "absent" in a.finished_loads)
    assert acc.missing == {Tier.DISK: {key}, Tier.S3: {key}}
    assert acc.tier_ok == {Tier.DISK: 1, Tier.S3: 1} and acc.tier_failed == {}
    e.submit_store(job(key, layers(3), disk=True))
    wait_for(e, lambda a: key in a.written.get(Tier.DISK, {}))
    path = files(e).path(key)
    blob = bytearray(path.read_bytes())
    blob[-5] ^= 0x01
    path.write_bytes(bytes(blob))
    e.submit_load("corrupt", [chunk(key, Tier.DISK)], Pages(lambda *a: None))
    acc = wait_for(e, lambda a: "corrupt" in a.finished_loads)
    assert acc.missing == {Tier.DISK: {key}} and acc.tier_ok == {Tier.DISK: 1} and acc.tier_failed == {}
    e.close()


class SlowGets(MemoryStore):
    """Once ``fail_puts``, PUTs fail (S3 in trouble for writes) and GETs last
    until one has failed."""

    def __init__(self):
        super().__init__()
        self.fail_puts, self.gets, self.failed_puts = False, 0, 0
        self.put_failed = asyncio.Event()  # set on the engine's loop, as the GETs wait there

    async def get(self, key, range=None):
        self.gets += 1
        if self.fail_puts:  # a load still in flight when the store fails
            await self.put_failed.wait()
        return await super().get(key, range)

    async def put(self, key, data, *, mode=PutMode.OVERWRITE):
        if self.fail_puts:
            self.failed_puts += 1
            self.put_failed.set()
            raise Transient(f"{key}: InternalError (HTTP 500)")
        return await super().put(key, data, mode=mode)


def test_a_failed_s3_store_does_not_fail_loads_in_flight():
    store = SlowGets()
    key = b"l" * 16
    e = stored_chunk(store, key, 4)
    store.fail_puts = True
    got, gets = {}, store.gets
    e.submit_load("j", [chunk(key)], Pages(collect(got)))
    wait_until("the load to be under way", lambda: store.gets > gets, every_s=0.005)
    e.submit_store(store_job(b"s" * 16, 5))
    acc = wait_for(e, lambda a: "j" in a.finished_loads and a.tier_failed)
    assert acc.finished_loads["j"] == [] and (got[(key, 0)] == layers(4)[0]).all()
    assert acc.tier_failed == {Tier.S3: 1} and acc.tier_ok == {Tier.S3: 1}  # the breaker hears both
    e.close()


def test_a_failed_nvme_write_does_not_fail_disk_reads_in_flight(tmp_path, monkeypatch):
    key = b"r" * 16
    e = engine(MemoryStore(), disk_path=tmp_path)
    e.submit_store(job(key, layers(6), disk=True))
    wait_for(e, lambda a: key in a.written.get(Tier.DISK, {}))
    real_read = files(e).read
    disk = e.handlers[Tier.DISK]
    real_failing = disk.failing

    reading, write_failed, handled = threading.Event(), threading.Event(), threading.Event()

    def slow_read(*a, **kw):
        reading.set()
        assert write_failed.wait(30)  # the read still under way when the write fails
        assert handled.wait(30)  # and while the failure is handled
        return real_read(*a, **kw)

    def failing_write(*a, **kw):
        write_failed.set()
        raise Transient("EIO")

    def failing(**kw):  # the disk's breaker hears of the failed write
        real_failing(**kw)
        handled.set()

    monkeypatch.setattr(disk, "failing", failing)
    monkeypatch.setattr(files(e), "read", slow_read)
    monkeypatch.setattr(files(e), "write", failing_write)
    e.submit_load("j", [chunk(key, Tier.DISK)], Pages(lambda *a: None))
    assert reading.wait(30)
    e.submit_store(job(b"x" * 16, layers(7), disk=True))
    acc = wait_for(e, lambda a: "j" in a.finished_loads and Tier.DISK in a.failed and a.tier_failed)
    assert acc.finished_loads["j"] == []
    assert acc.tier_failed == {Tier.DISK: 1} and acc.failed == {Tier.DISK: {b"x" * 16}}
    e.close()


def test_a_load_out_of_time_gives_up_without_blaming_a_tier(tmp_path, monkeypatch):
    key = b"o" * 16
    clock = FakeClock()
    e = engine(MemoryStore(), disk_path=tmp_path, load_timeout_s=0.3, disk_timeout_s=5.0, clock=clock)
    e.submit_store(job(key, layers(2), disk=True, s3=True))
    wait_for(e, lambda a: key in a.written.get(Tier.DISK, {}) and key in a.written.get(Tier.S3, {}))
    real_read = files(e).read

    reading, slow_over, read_done = threading.Event(), threading.Event(), threading.Event()

    def slow_read(*a, **kw):
        reading.set()
        assert slow_over.wait(30)  # slow (0.6 s), but well within the disk's own bound
        try:
            return real_read(*a, **kw)
        finally:
            read_done.set()

    monkeypatch.setattr(files(e), "read", slow_read)
    c = chunk(key, Tier.DISK, Tier.S3)
    e.submit_load("j", [c], Pages(lambda *a: None))
    assert reading.wait(30)
    advance(e, clock, 0.6)
    acc = wait_for(e, lambda a: "j" in a.finished_loads)
    assert acc.finished_loads["j"] == [c]
    slow_over.set()
    assert read_done.wait(30)  # the slow read is over: nothing more to hear of it
    idle(e, e.handlers[Tier.DISK]._threads[False])
    acc.add(e.poll())
    assert acc.tier_failed == {}  # neither the disk nor S3 (which had no time left) failed
    totals = e.counters.totals()
    assert totals["load_errors_gave_up"] >= 1 and "load_errors_timeout" not in totals
    e.close()


def test_disk_reads_are_timed_from_their_start_and_never_wait_for_writes(tmp_path, monkeypatch):
    import threading

    from s3kv.tiering.tiers.nvme.handler import DISK_THREADS

    keys = [bytes([0xD0 + i]) * 16 for i in range(2 * DISK_THREADS)]
    clock = FakeClock()
    e = engine(MemoryStore(), disk_path=tmp_path, disk_timeout_s=1.5, clock=clock)
    for i, key in enumerate(keys):
        e.submit_store(job(key, layers(i), disk=True))
    wait_for(e, lambda a: len(a.written.get(Tier.DISK, {})) == len(keys))
    real_read = files(e).read
    stuck = threading.Event()
    reads, lock = [], threading.Lock()
    batches = [threading.Event(), threading.Event()]  # the reads the test lets finish

    def slow_read(*a, **kw):
        with lock:
            reads.append(len(reads))
            n = reads[-1]
        assert batches[n // DISK_THREADS].wait(30)  # 1 s: within the bound, but two in a row are not
        return real_read(*a, **kw)

    hung = []

    def hung_write(*a, **kw):
        hung.append(1)
        stuck.wait(30)
        raise Transient("EIO")

    monkeypatch.setattr(files(e), "read", slow_read)
    monkeypatch.setattr(files(e), "write", hung_write)
    for i in range(DISK_THREADS + 1):  # every write thread hung, one more write queued
        e.submit_store(job(bytes([0xE0 + i]) * 16, layers(9), disk=True))
    wait_until("every write thread to hang", lambda: len(hung) == DISK_THREADS, every_s=0.005)
    # The last write queued behind them before the clock moves: it is
    # encoded on the background thread first (at a lower priority), which a
    # busy machine may hold back; queued later, it would find the hung
    # writes past their bound already and fail for the disk's sake itself.
    queue = e.handlers[Tier.DISK]._threads[True]._work_queue
    wait_until("the last write to queue", lambda: queue.qsize() == 1, every_s=0.005)
    # Twice as many reads as threads: half of them wait for a thread first.
    e.submit_load("j", [chunk(k, Tier.DISK) for k in keys], Pages(lambda *a: None))
    wait_until("the first reads to be under way", lambda: len(reads) == DISK_THREADS)
    advance(e, clock, 1.0)
    batches[0].set()
    wait_until("the others to be under way", lambda: len(reads) == 2 * DISK_THREADS)
    settle(e)  # the reads' guards heard that their threads took them up
    advance(e, clock, 1.0)  # and the hung writes are past their bound
    batches[1].set()
    acc = wait_for(e, lambda a: "j" in a.finished_loads)
    assert acc.finished_loads["j"] == [] and acc.tier_ok.get(Tier.DISK) == len(keys)
    # Meanwhile the hung writes timed out (the disk's failures: the first
    # of them may have made the other give up) and the queued one gave up;
    # no read was failed for them.
    writes = {bytes([0xE0 + i]) * 16 for i in range(DISK_THREADS + 1)}
    more = wait_for(e, lambda a: acc.failed.get(Tier.DISK, set()) | a.failed.get(Tier.DISK, set()) == writes)
    failures = acc.tier_failed.get(Tier.DISK, 0) + more.tier_failed.get(Tier.DISK, 0)
    assert 1 <= failures <= DISK_THREADS and acc.tier_failed.keys() | more.tier_failed.keys() == {Tier.DISK}
    stuck.set()
    e.close()


def disk_and_s3_engine(tmp_path, n, **kw):
    """An engine whose NVMe tier and S3 both hold chunks ``keys``."""
    keys = [bytes([0xA0 + i]) * 16 for i in range(n)]
    e = engine(MemoryStore(), disk_path=tmp_path, **kw)
    for i, key in enumerate(keys):
        e.submit_store(job(key, layers(i), disk=True, s3=True))
    wait_for(
        e, lambda a: all(k in a.written.get(Tier.DISK, {}) and k in a.written.get(Tier.S3, {}) for k in keys)
    )
    return e, keys


def test_a_read_that_waits_for_a_busy_disk_goes_to_s3_without_blaming_the_disk(tmp_path, monkeypatch):
    from s3kv.tiering.tiers.nvme.handler import DISK_THREADS

    clock = FakeClock()
    e, keys = disk_and_s3_engine(tmp_path, 3 * DISK_THREADS, disk_timeout_s=1.2, clock=clock)
    real_read = files(e).read
    reads, lock = [], threading.Lock()
    batches = [threading.Event(), threading.Event()]  # the reads the test lets finish

    def busy_read(*a, **kw):
        with lock:
            reads.append(len(reads))
            n = reads[-1]
        # each read in time (0.8 s), but the third in a row waits too long
        assert batches[n // DISK_THREADS].wait(30)
        return real_read(*a, **kw)

    monkeypatch.setattr(files(e), "read", busy_read)
    e.submit_load("j", [chunk(k, Tier.DISK, Tier.S3) for k in keys], Pages(lambda *a: None))
    wait_until("the first reads to be under way", lambda: len(reads) == DISK_THREADS)
    advance(e, clock, 0.8)
    batches[0].set()
    wait_until("the second reads to be under way", lambda: len(reads) == 2 * DISK_THREADS)
    settle(e)  # their guards heard that their threads took them up
    advance(e, clock, 0.4)  # the third reads waited their bound for a thread: S3 serves them
    wait_until("S3 to serve them", lambda: e.counters.totals().get("load_chunks_s3") == DISK_THREADS)
    batches[1].set()
    acc = wait_for(e, lambda a: "j" in a.finished_loads)
    assert acc.finished_loads["j"] == [] and acc.tier_failed == {}
    totals = e.counters.totals()
    assert totals["load_chunks_s3"] >= 1 and totals["load_errors_gave_up"] == totals["load_chunks_s3"]
    e.close()


def test_a_read_that_waits_for_a_hung_disk_is_the_disks_failure(tmp_path, monkeypatch):
    import threading

    from s3kv.tiering.tiers.nvme.handler import DISK_THREADS

    clock = FakeClock()
    e, keys = disk_and_s3_engine(tmp_path, DISK_THREADS + 1, clock=clock)
    disk = e.handlers[Tier.DISK]
    disk.timeout_s = 0.3  # short for the reads under test, not the writes before them
    hung = threading.Event()
    real_read, real_run = files(e).read, disk.run
    entered, queued = [], []

    def hung_read(*a, **kw):
        entered.append(1)
        hung.wait(30)
        return real_read(*a, **kw)

    async def run(*a, **kw):  # a read's guard has taken its time by now
        queued.append(1)
        return await real_run(*a, **kw)

    monkeypatch.setattr(files(e), "read", hung_read)
    monkeypatch.setattr(disk, "run", run)
    e.submit_load("first", [chunk(k, Tier.DISK) for k in keys[:DISK_THREADS]], Pages(lambda *a: None))
    wait_until("every read thread to hang", lambda: len(entered) == DISK_THREADS)
    advance(e, clock, 0.3)
    wait_for(e, lambda a: "first" in a.finished_loads)  # they timed out; their threads hang on
    # The next read waits behind stuck threads: that is the disk's failure
    # too (it is a breaker's probe: its answer must come back), then S3 serves.
    e.submit_load("next", [chunk(keys[-1], Tier.DISK, Tier.S3)], Pages(lambda *a: None))
    wait_until("the next read to wait for a thread", lambda: len(queued) == DISK_THREADS + 1)
    advance(e, clock, 0.3)
    acc = wait_for(e, lambda a: "next" in a.finished_loads)
    assert acc.finished_loads["next"] == []
    assert acc.tier_failed == {Tier.DISK: 1} and acc.tier_ok == {Tier.S3: 1}
    hung.set()
    e.close()


def test_a_disk_that_stalls_inside_a_read_pauses_the_disk_only(tmp_path, monkeypatch):
    """A disk read that hangs in the middle of a frame, after its load's gate
    took it (a D-state read, a volume that stops answering), times out and S3
    serves the chunk without waiting for it: the engine's loop goes on (S3
    loads and PUTs finish while the disk hangs; the engine closes), and when
    the read comes back at last, its bytes land nowhere in the pages (they
    keep S3's)."""
    clock = FakeClock()  # the disk's time moves when we say
    e, (key, other) = disk_and_s3_engine(tmp_path, 2, clock=clock)
    nvme = e.handlers[Tier.DISK]
    nvme.timeout_s = 0.5
    kv = {k: np.zeros((LAYERS, PAGE), np.uint8) for k in (key, other, b"w" * 16)}
    half = PAGE // 2

    def write(c, layer, data):
        kv[c.key][layer] = data

    def target(c, layer):  # the pages themselves, as on the host platform (two runs of blocks)
        return PageTarget([kv[c.key][layer][:half], kv[c.key][layer][half:]], lambda: None)

    real_preadv_all, real_read = disk_mod.preadv_all, files(e).read
    stalled, resume, read_over = threading.Event(), threading.Event(), threading.Event()
    frames: list[int] = []

    def stalling_preadv_all(fd, buffers, offset):
        frames.append(offset)
        if len(frames) == 2:  # frame 1, frame 0 already read
            stalled.set()
            resume.wait()
        return real_preadv_all(fd, buffers, offset)

    def read(*a, **kw):
        try:
            return real_read(*a, **kw)
        finally:
            read_over.set()

    monkeypatch.setattr(disk_mod, "preadv_all", stalling_preadv_all)
    # Not in the page cache (from there no read waits for the disk): every frame is read from it.
    monkeypatch.setattr(disk_mod, "preadv_cached", lambda fd, buffers, offset: 0)
    monkeypatch.setattr(files(e), "read", read)
    try:
        e.submit_load("j", [chunk(key, Tier.DISK, Tier.S3)], Pages(write, target))
        assert stalled.wait(60)
        advance(e, clock, 1.0)  # the disk's timeout is up
        acc = wait_for(e, lambda a: "j" in a.finished_loads)
        assert acc.finished_loads["j"] == [] and acc.tier_failed == {Tier.DISK: 1}
        totals = e.counters.totals()
        assert totals["load_errors_timeout"] == 1 and totals["load_chunks_s3"] == 1
        assert "load_chunks_disk" not in totals
        s3_bytes = layers(0)
        assert all((kv[key][i] == s3_bytes[i]).all() for i in range(LAYERS))
        # The engine's loop is not waiting for the disk: an S3 load and a PUT finish meanwhile.
        e.submit_load("other", [chunk(other)], Pages(write, target))
        e.submit_store(store_job(b"w" * 16, 9))
        wait_for(e, lambda a: "other" in a.finished_loads and b"w" * 16 in a.written.get(Tier.S3, {}))
        assert all((kv[other][i] == layers(1)[i]).all() for i in range(LAYERS))
        assert not read_over.is_set()  # all that while the read hung
        closing = threading.Thread(target=e.close)  # nor does the engine's close wait for it
        closing.start()
        closing.join(60)
        assert not closing.is_alive() and not read_over.is_set()
        # The disk answers at last, with bytes other than S3's (the file changed meanwhile).
        fd = os.open(files(e).path(key), os.O_WRONLY)
        try:
            os.pwrite(fd, b"\xee" * PAGE, frames[1])
        finally:
            os.close(fd)
    finally:
        resume.set()
    assert read_over.wait(60)
    assert all((kv[key][i] == s3_bytes[i]).all() for i in range(LAYERS))


class ClockedGets(MemoryStore):
    """Each GET takes ``get_s`` on ``clock``."""

    def __init__(self, clock, get_s):
        super().__init__()
        self.clock, self.get_s, self.gets = clock, get_s, 0

    async def get(self, key, range=None):
        self.gets += 1
        self.clock.now += self.get_s
        return await super().get(key, range)


def test_a_chunk_that_falls_back_from_a_stalled_disk_to_s3_is_timed_by_the_s3_attempt(tmp_path, monkeypatch):
    """A chunk planned from NVMe whose read hangs until the disk's timeout
    (6 s on the engine's clock), then loaded from S3: the cost model hears
    S3's attempt alone, and nothing of the disk's (its breaker hears that)."""
    clock = FakeClock(100.0)
    store = ClockedGets(clock, 0.01)
    key = b"f" * 16
    e = engine(store, disk_path=tmp_path, clock=clock)
    e.submit_store(job(key, layers(5), disk=True, s3=True))
    wait_for(e, lambda a: key in a.written.get(Tier.DISK, {}) and key in a.written.get(Tier.S3, {}))
    disk = e.handlers[Tier.DISK]
    disk.timeout_s = 6.0
    hung, reading = threading.Event(), threading.Event()
    real_read = files(e).read

    def hung_read(*a, **kw):  # no answer until the timeout
        reading.set()
        hung.wait(30)
        return real_read(*a, **kw)

    monkeypatch.setattr(files(e), "read", hung_read)
    gets = store.gets
    e.submit_load("j", [chunk(key, Tier.DISK, Tier.S3)], Pages(collect({})))
    assert reading.wait(30)
    settle(e)  # the read's guard heard that a thread took it up
    advance(e, clock, 6.0)  # the disk's whole wait
    acc = wait_for(e, lambda a: "j" in a.finished_loads)
    assert acc.finished_loads["j"] == []
    assert acc.tier_failed == {Tier.DISK: 1} and acc.tier_ok == {Tier.S3: 1}
    (timing,) = acc.report.load_timings
    s3_s = (store.gets - gets) * 0.01  # its GETs, one range each or together
    assert timing.tier is Tier.S3 and timing.chunks == 1 and timing.others == 0
    assert timing.first_s == pytest.approx(s3_s) and timing.last_s == pytest.approx(s3_s)
    assert timing.load_s == pytest.approx(6.0 + s3_s)  # the load's own time: its round trip's part
    hung.set()
    e.close()


class PutLog(list):
    """A :class:`~s3kv.manifest.publish.Published` that records what an
    engine's S3 handler tells of its PUTs, in order: ("I", key) as one
    starts, ("S", key) when it created the object, ("N", key) when it was
    answered without creating one (a 412)."""

    def putting(self, key: bytes) -> None:
        self.append(("I", key))

    def answered(self, key: bytes, *, created: bool) -> None:
        self.append(("S" if created else "N", key))


def put_log(*engines) -> PutLog:
    """One :class:`PutLog` the S3 handlers of ``engines`` are built with."""
    log = PutLog()
    for e in engines:
        e.set_namespace(e.namespace, log)
    return log


def test_created_objects_are_told_to_the_publisher_but_412s_are_not():
    store = MemoryStore()
    e1, e2 = engine(store), engine(store)
    log = put_log(e1, e2)
    key = b"p" * 16
    e1.submit_store(store_job(key, 1))
    wait_for(e1, lambda a: key in a.written.get(Tier.S3, {}))
    e2.submit_store(store_job(key, 2))
    wait_for(e2, lambda a: key in a.existing)
    assert [k for kind, k in log if kind == "S"] == [key]
    assert log == [("I", key), ("S", key), ("I", key), ("N", key)]  # the 412 only answered
    e1.close(), e2.close()


class _HangingPut(MemoryStore):
    """S3 that accepts the connection and never answers a PUT."""

    async def put(self, key, data, *, mode=PutMode.OVERWRITE):
        await asyncio.Event().wait()


def test_close_stops_taking_stores_drains_flushes_and_ends_in_time():
    store = MemoryStore()
    e = engine(store)
    order = put_log(e)

    async def flush():
        order.append(("flush", None))

    key = b"c" * 16
    e.submit_store(store_job(key, 1))
    e.close(5.0, flush)
    assert order == [("I", key), ("S", key), ("flush", None)]  # drained, then published
    assert asyncio.run(store.list_keys("p/")) == [object_key("p", "n" * 32, key, 0)]
    assert not e.submit_store(store_job(b"d" * 16, 2))  # closed: the write-through is dropped
    flushed = []

    async def slow_flush():
        flushed.append(True)
        await asyncio.Event().wait()

    clock = FakeClock()
    hung = engine(_HangingPut(), clock=clock)
    hung.submit_store(store_job(key, 3))
    closing = threading.Thread(target=hung.close, args=(1.0, slow_flush))
    closing.start()
    wait_until("the close to take its time", lambda: closing.ident in clock.readers)
    clock.now += 0.75  # the PUT's time is up (a quarter of the second is kept for the flush)
    wait_until("the flush to start", lambda: flushed == [True])
    clock.now += 0.25  # and the flush's
    closing.join(60)
    assert not closing.is_alive() and flushed == [True]  # bounded on its clock, the flush still ran


def test_a_pinned_slot_is_released_on_a_rank_without_the_farther_tiers():
    """The scheduler side pinned the slot for the NVMe and S3 writes; a rank
    that holds neither tier still reads nothing from it and says so."""
    e = engine(None, pool_slots=2)  # no NVMe directory, no S3 store on this rank
    key = b"p" * 16
    slot_views = pool(e).layer_views(0)
    for view, layer in zip(slot_views, layers(3)):
        view[:] = layer
    e.submit_store(job(key, slot_views, slot=0, disk=True, s3=True))
    acc = wait_for(e, lambda a: a.released and key in a.written.get(Tier.CPU, {}))
    assert acc.released == [key]
    assert acc.failed == {Tier.DISK: {key}, Tier.S3: {key}}
    e.close()


def test_a_failed_copy_into_the_cpu_slot_is_reported_not_left_pending():
    store = MemoryStore()
    e = engine(store, pool_slots=1)
    key = b"q" * 16
    wrong = [np.zeros(PAGE + 1, np.uint8) for _ in range(LAYERS)]  # not a slot's page size
    e.submit_store(job(key, wrong, slot=0, s3=True))
    # the CPU write fails, and the write-through ends one way or the other: nothing stays pending
    acc = wait_for(
        e,
        lambda a: (
            key in a.failed.get(Tier.CPU, set())
            and a.released
            and (key in a.written.get(Tier.S3, {}) or key in a.failed.get(Tier.S3, set()))
        ),
    )
    assert key not in acc.written.get(Tier.CPU, {}) and acc.released == [key]
    e.close()
