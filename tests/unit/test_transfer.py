"""The worker's transfer engine against the in-memory store."""

import asyncio
import time

import numpy as np
import pytest

from s3kv.errors import Transient
from s3kv.stores.base import PutMode
from s3kv.stores.memory import MemoryStore
from s3kv.tiering.chunks import PageFormat, plan_ranges
from s3kv.tiering.transfer import EngineSettings, LoadRequest, TransferEngine

FMT = PageFormat(dtype="bfloat16", itemsize=2, page_shape=(2, 2, 32, 16), tokens=64)
LAYERS = 4
PAGE = 2 * 2 * 32 * 16  # bytes of one layer of a chunk


def layers(seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, PAGE, dtype=np.uint8) for _ in range(LAYERS)]


def engine(store, **kw):
    settings = EngineSettings(
        namespace="n" * 32, prefix="p", rank=0, num_layers=LAYERS, range_bytes=PAGE + 200, **kw
    )
    e = TransferEngine(store, settings)
    e.page_format = FMT
    return e


def stored_chunk(store, key, seed, **kw):
    """An engine on ``store`` that has just stored chunk ``key``."""
    e = engine(store, **kw)
    e.submit_store(key, layers(seed))
    wait_for(e, lambda a: a["stored"])
    return e


def wait_for(e, pred, timeout=10):
    deadline = time.monotonic() + timeout
    acc = {"finished_loads": {}, "stored": [], "missing": [], "store_failed": []}
    while time.monotonic() < deadline:
        r = e.poll()
        acc["finished_loads"].update(r.finished_loads)
        for k in ("stored", "missing", "store_failed"):
            acc[k] += getattr(r, k)
        if pred(acc):
            return acc
        time.sleep(0.01)
    raise AssertionError(f"timed out; have {acc}")


def test_store_then_load_roundtrip():
    store = MemoryStore()
    e = engine(store)
    data = {bytes([i]) * 16: layers(i) for i in range(3)}
    for key, ls in data.items():
        assert e.submit_store(key, ls)
    wait_for(e, lambda a: len(a["stored"]) == 3)
    got = {}
    e.submit_load(
        "job",
        [LoadRequest(k, k) for k in data],
        lambda tag, layer, arr: got.__setitem__((tag, layer), arr.copy()),
    )
    acc = wait_for(e, lambda a: "job" in a["finished_loads"])
    assert acc["finished_loads"]["job"] == []
    for key, ls in data.items():
        for i in range(LAYERS):
            assert (got[(key, i)] == ls[i]).all()
    totals = e.counters.totals()
    assert totals["store_chunks"] == 3 and totals["load_chunks"] == 3
    e.close()


def test_ranges_group_whole_layers():
    from s3kv.codec import Frame

    frames = [Frame(100 + i * 10, 10, 20, 0) for i in range(6)]
    assert plan_ranges(frames, have_until=120, range_bytes=25) == [(120, 140, [2, 3]), (140, 160, [4, 5])]
    assert plan_ranges(frames, have_until=0, range_bytes=5) == [
        (100 + i * 10, 110 + i * 10, [i]) for i in range(6)
    ]


def test_second_writer_finds_chunk_existing():
    store = MemoryStore()
    key = b"k" * 16
    e1, e2 = stored_chunk(store, key, 1), engine(store)
    e2.submit_store(key, layers(2))
    wait_for(e2, lambda a: a["stored"])
    assert e2.counters.totals().get("store_chunks_existing") == 1
    e1.close(), e2.close()


class SlowPutStore(MemoryStore):
    async def put(self, key, data, *, mode=PutMode.OVERWRITE):
        await asyncio.sleep(0.3)
        await super().put(key, data, mode=mode)


def test_backpressure_drops_and_counts():
    e = engine(SlowPutStore(), max_inflight_bytes=2 * LAYERS * PAGE)  # room for two chunks
    accepted = [e.submit_store(bytes([i]) * 16, layers(i)) for i in range(5)]
    assert accepted == [True, True, False, False, False]
    acc = wait_for(e, lambda a: len(a["stored"]) + len(a["store_failed"]) == 5)
    assert e.counters.totals()["store_dropped_backpressure"] == accepted.count(False)
    assert len(acc["store_failed"]) == accepted.count(False)
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
        (FlakyStore(delay=2.0), "timeout"),
    ],
)
def test_load_failures_are_classified_and_reported(store, kind):
    e = engine(store, load_timeout_s=0.3)
    e.submit_load("j", [LoadRequest(b"x" * 16, "tag-x")], lambda *a: None)
    acc = wait_for(e, lambda a: "j" in a["finished_loads"])
    assert acc["finished_loads"]["j"] == ["tag-x"]
    assert e.counters.totals()[f"load_errors_{kind}"] == 1
    assert (acc["missing"] == [b"x" * 16]) == (kind == "missing")
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
    e.submit_load("j", [LoadRequest(key, "t")], lambda tag, layer, arr: written.append(layer))
    acc = wait_for(e, lambda a: "j" in a["finished_loads"])
    assert acc["finished_loads"]["j"] == ["t"] and acc["missing"] == [key]
    assert LAYERS - 1 not in written
    assert not asyncio.run(store.exists(name))
    e.close()


def test_layout_mismatch_is_corrupt():
    key = b"m" * 16
    e = stored_chunk(MemoryStore(), key, 4)
    e.page_format = PageFormat("float16", 2, FMT.page_shape, 64)
    e.submit_load("j", [LoadRequest(key, "t")], lambda *a: None)
    wait_for(e, lambda a: "j" in a["finished_loads"])
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
    e.submit_load("j", [LoadRequest(key, "t")], lambda tag, layer, arr: writes.append(layer))
    wait_for(e, lambda a: "j" in a["finished_loads"])
    seen = list(writes)
    time.sleep(1.5)  # the slow ranges arrive now
    assert writes == seen
    e.close()
