"""Replicas keeping their manifests in step through a store
(s3kv.manifest.sync; the in-memory store here, a real S3 server in
tests/stores/test_manifest_sync_s3.py and the end-to-end tests)."""

import asyncio

import numpy as np
import pytest

from s3kv.manifest import format as mf
from s3kv.manifest import protocol as mp
from s3kv.manifest.keyset import Manifest, fingerprints
from s3kv.manifest.sync import ManifestSync, SyncSettings
from s3kv.stores.base import PutMode
from s3kv.stores.memory import MemoryStore

BASE = "pfx/" + "ab" * 16 + "/manifest/"


def fps(*values):
    return np.array(values, dtype=np.uint64)


def replica(store, clock, writer, **kw):
    settings = SyncSettings(publish_s=1, refresh_s=1, skew_s=60, **kw)
    return ManifestSync(store, BASE, Manifest(), settings, writer=writer, clock=lambda: clock[0])


def started(store, clock, *writers):
    """Replicas that have loaded the manifest, one per writer id."""
    out = [replica(store, clock, w) for w in writers]
    for r in out:
        run(r.load())
    return out


def key(i):
    return i.to_bytes(8, "big") * 2


def run(coro):
    return asyncio.run(coro)


def test_replicas_learn_each_others_chunks_and_a_new_one_starts_warm(bucket_kind):
    store = bucket_kind()
    clock = [1_700_000_000.0]
    a, b = started(store, clock, "aaaa", "bbbb")
    a.manifest.add(key(1))
    run(a.publish())
    clock[0] += 1
    b.manifest.add(key(2))
    run(b.publish())
    run(a.refresh())
    run(b.refresh())
    assert key(2) in a.manifest and key(1) in b.manifest
    assert run(a.refresh()) == 0  # nothing new: nothing fetched again
    c = replica(store, clock, "cccc")
    assert run(c.load()) == 2 and key(1) in c.manifest and key(2) in c.manifest


def test_clock_skew_within_the_margin_loses_nothing(bucket_kind):
    store = bucket_kind()
    fast, slow = [1_700_000_100.0], [1_700_000_070.0]  # 30 s apart
    a, b = replica(store, fast, "aaaa"), replica(store, slow, "bbbb")
    run(a.load())
    run(b.load())
    a.manifest.add(key(1))
    run(a.publish())  # named at a's (later) time
    run(a.refresh())
    b.manifest.add(key(2))
    run(b.publish())  # b has not seen a's segment: named 30 s before it
    run(a.refresh())
    assert key(2) in a.manifest
    run(b.refresh())
    b.manifest.add(key(3))
    run(b.publish())  # b has now seen a's segment: named after it, whatever b's clock says
    names = sorted(run(store.list_keys(BASE + "seg/")))
    assert names[-1].split("-")[1] == "bbbb"
    run(a.refresh())
    assert key(3) in a.manifest


def test_snapshot_then_newer_segments_and_tombstones(bucket_kind):
    store = bucket_kind()
    clock = [1_700_000_000.0]
    a = replica(store, clock, "aaaa", snapshot_every=3)
    run(a.load())
    for i in range(4):
        a.manifest.add(key(i))
        run(a.publish())
        clock[0] += 1
    run(a.refresh())
    assert run(a.maybe_snapshot()) is True
    (snap,) = run(store.list_keys(BASE + "snap/"))
    # After the snapshot: one more store, and gc's tombstone for key 0.
    a.manifest.add(key(10))
    run(a.publish())
    clock[0] += 1
    gc = mf.ManifestObject("segment", removed=fingerprints([key(0)]))
    run(
        store.put(
            mp.segment_name(BASE, int(clock[0] * 1000), "gc00", 1, directory=store.directory), mf.encode(gc)
        )
    )
    run(a.refresh())
    assert key(0) not in a.manifest  # every replica drops what gc deleted
    fresh = replica(store, clock, "dddd")
    run(fresh.load())
    got = {i for i in (0, 1, 2, 3, 10) if key(i) in fresh.manifest}
    assert got == {1, 2, 3, 10}
    # It read the snapshot and only the segments after it.
    assert fresh.counters.totals()["manifest_segments_loaded"] == 2


def test_only_the_first_writer_snapshots(bucket_kind):
    store = bucket_kind()
    clock = [1_700_000_000.0]
    a, b = replica(store, clock, "aaaa", snapshot_every=1), replica(store, clock, "bbbb", snapshot_every=1)
    for r in (a, b):
        run(r.load())
        r.manifest.add(key(ord(r.writer[0])))
        run(r.publish())
    for r in (a, b):
        run(r.refresh())
    assert run(b.maybe_snapshot()) is False and run(a.maybe_snapshot()) is True


def test_corrupt_segment_is_skipped_and_counted(bucket_kind):
    store = bucket_kind()
    clock = [1_700_000_000.0]
    a, b = started(store, clock, "aaaa", "bbbb")
    run(
        store.put(
            mp.segment_name(BASE, int(clock[0] * 1000) + 5, "zzzz", 1, directory=store.directory), b"garbage"
        )
    )
    a.manifest.add(key(7))
    run(a.publish())
    run(b.refresh())
    assert key(7) in b.manifest and b.counters.totals()["manifest_errors"] == 1


def test_access_records_are_batched_per_hour_without_repeats():
    store = MemoryStore()
    clock = [1_700_000_000.0]
    a = replica(store, clock, "aaaa")
    run(a.load())
    a.manifest.touch([key(1), key(2)])
    run(a.publish())
    a.manifest.touch([key(2)])  # already recorded this hour
    run(a.publish())
    clock[0] += 3600
    a.manifest.touch([key(2)])
    run(a.publish())
    names = sorted(run(store.list_keys(BASE + "access/")))
    assert len(names) == 2 and names[0].split("/")[-2] != names[1].split("/")[-2]
    first = mf.decode(run(store.get(names[0])))
    assert first.kind == "access" and first.added.tolist() == sorted(fingerprints([key(1), key(2)]).tolist())


def test_failed_publish_is_retried_with_the_same_keys():
    class Failing(MemoryStore):
        fail = True

        async def put(self, key, data, *, mode=PutMode.OVERWRITE):
            if self.fail:
                raise OSError("down")
            return await super().put(key, data, mode=mode)

    store = Failing()
    clock = [1_700_000_000.0]
    a = replica(store, clock, "aaaa")
    run(a.load())
    a.manifest.add(key(4))
    with pytest.raises(OSError):
        run(a.publish())
    store.fail = False
    run(a.publish())
    (name,) = run(store.list_keys(BASE + "seg/"))
    assert mf.decode(run(store.get(name))).added.tolist() == fingerprints([key(4)]).tolist()


def test_an_unreadable_newest_snapshot_falls_back_to_an_older_one(bucket_kind):
    store = bucket_kind()
    clock = [1_700_000_000.0]
    a = replica(store, clock, "aaaa", snapshot_every=1, snapshot_interval_s=0)
    run(a.load())
    a.manifest.add(key(1))
    run(a.publish())
    assert run(a.maybe_snapshot())
    clock[0] += 1
    run(store.put(mp.snapshot_name(BASE, int(clock[0] * 1000), "zzzz"), b"torn"))
    b = replica(store, clock, "bbbb")
    run(b.load())
    assert key(1) in b.manifest and b.counters.totals()["manifest_errors"] == 1


def test_a_segment_whose_get_failed_is_fetched_later_even_past_the_floor(bucket_kind):
    class Flaky(MemoryStore):
        fail: set[str] = set()

        async def get(self, key, range=None):
            if key in self.fail:
                raise OSError("connection reset")
            return await super().get(key, range)

    flaky = Flaky()
    store = bucket_kind(flaky)
    clock = [1_700_000_000.0]
    a, b = started(store, clock, "aaaa", "bbbb")
    a.manifest.add(key(1))
    run(a.publish())
    (name,) = run(store.list_keys(BASE + "seg/"))
    flaky.fail = {name}
    run(b.refresh())
    assert key(1) not in b.manifest
    clock[0] += 3600  # b's own publishes move its floor far past a's segment
    b.manifest.add(key(2))
    run(b.publish())
    flaky.fail = set()
    run(b.refresh())
    assert key(1) in b.manifest


def test_a_slow_put_is_published_again_under_a_fresh_stamp(bucket_kind):
    class Slow(MemoryStore):
        async def put(self, key, data, *, mode=PutMode.OVERWRITE):
            if "/seg/" in key and not self.objects_seen:
                clock[0] += 40  # longer than half the 60 s margin
            self.objects_seen = True
            return await super().put(key, data, mode=mode)

        objects_seen = False

    clock = [1_700_000_000.0]
    store = bucket_kind(Slow())
    a = replica(store, clock, "aaaa")
    run(a.load())
    a.manifest.add(key(5))
    run(a.publish())
    names = sorted(run(store.list_keys(BASE + "seg/")))
    assert len(names) == 2 and mp.name_ts(names[1]) - mp.name_ts(names[0]) >= 40_000


def test_snapshots_are_pruned_to_the_newest_few(bucket_kind):
    store = bucket_kind()
    clock = [1_700_000_000.0]
    a = replica(store, clock, "aaaa", snapshot_every=1, snapshot_interval_s=0, snapshots_kept=2)
    run(a.load())
    for i in range(4):
        a.manifest.add(key(i))
        run(a.publish())
        assert run(a.maybe_snapshot())
        clock[0] += 1
    assert len(run(store.list_keys(BASE + "snap/"))) == 2
    fresh = replica(store, clock, "bbbb")
    run(fresh.load())
    assert all(key(i) in fresh.manifest for i in range(4))
