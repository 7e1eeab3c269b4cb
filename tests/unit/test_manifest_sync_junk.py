"""Replicas (:mod:`s3kv.manifest.sync`) over a bucket that holds junk: they
go on sharing, stamp their segments and access records with their own
clocks, publish a slow PUT again until one is fast enough, and prune
their snapshots without counting or deleting junk. What the reader skips
and counts: test_manifest_reader.py."""

from __future__ import annotations

from s3kv.manifest import protocol as mp
from s3kv.stores.base import PutMode
from s3kv.stores.memory import MemoryStore
from tests.stores.manifest_junk import (
    BASE,
    SKEW_S,
    T,
    key,
    replica,
    run,
    seeded,
)


def test_replicas_go_on_sharing_and_stamp_with_their_own_clocks():
    clock = [T]
    store, a, objects = seeded(clock)
    b, c = replica(store, clock, "bbbb"), replica(store, clock, "cccc")
    run(b.load())
    run(c.load())
    b.manifest.add(key(10))
    run(b.publish())
    clock[0] += 1
    c.manifest.add(key(11))
    run(c.publish())
    run(b.refresh())
    run(c.refresh())
    assert key(11) in b.manifest and key(10) in c.manifest
    now_ms = int(clock[0] * 1000)
    for name in run(store.list_keys(BASE + "seg/")):
        if "-bbbb-" in name or "-cccc-" in name:  # not carried ten years ahead by the junk
            assert mp.name_ts(name) <= now_ms
    for r in (b, c):
        assert r.clock_ms <= now_ms + SKEW_S * 1000


def test_snapshot_pruning_neither_counts_nor_deletes_junk():
    clock = [T]
    store, a, objects = seeded(clock)
    a = replica(store, clock, "aaaa", snapshot_every=1, snapshot_interval_s=0, snapshots_kept=2)
    run(a.load())
    for i in range(3):
        a.manifest.add(key(40 + i))
        run(a.publish())
        run(a.refresh())
        assert run(a.maybe_snapshot())
        clock[0] += 1
    left = set(run(store.inner.list_keys(BASE + "snap/")))
    # The two newest of this replica's, though a future-stamped one sorts after them...
    assert len({n for n in left if "-aaaa" in n}) == 2
    # ... which stays, as do names that are no snapshot's (not s3kv's to delete).
    kept = {j.name for j in objects if j.name.endswith(("/snap/backup", "-futr"))}
    assert len(kept) == 2 and kept <= left


def test_access_records_use_the_segments_clock():
    """A replica whose clock is behind one it has heard from stamps its access
    records after that one's segments, as it does its own segments."""
    store = MemoryStore()
    fast, slow = [T + 30], [T]
    a, b = replica(store, fast, "aaaa"), replica(store, slow, "bbbb")
    run(a.load())
    run(b.load())
    a.manifest.add(key(1))
    run(a.publish())
    run(b.refresh())
    b.manifest.touch([key(1)])
    run(b.publish())
    (seg,) = run(store.list_keys(BASE + "seg/"))
    (record,) = run(store.list_keys(BASE + "access/"))
    assert mp.name_ts(record) > mp.name_ts(seg) > int(slow[0] * 1000)


def test_slow_puts_are_published_again_until_one_lands_in_time():
    """Three PUTs of a's segment in a row each take longer than the whole
    margin, and meanwhile b publishes and looks, so each lands behind b's
    floor. Publishing it again twice at most (as s3kv once did) lost the key
    for good; publishing it again until a PUT is fast, b sees it."""
    clock = [T]
    slow_puts = 3

    class Slow(MemoryStore):
        async def put(self, key, data, *, mode=PutMode.OVERWRITE):
            nonlocal slow_puts
            if "-aaaa-" in key and slow_puts:
                slow_puts -= 1
                clock[0] += SKEW_S + 10  # the PUT is in flight all this time...
                b.manifest.add(mp.stamp(slow_puts).encode()[:16].ljust(16, b"x"))
                await b.publish()  # ... while b publishes and looks: its floor passes this name
                await b.refresh()
            return await super().put(key, data, mode=mode)

    store = Slow()
    a, b = replica(store, clock, "aaaa"), replica(store, clock, "bbbb")
    run(a.load())
    run(b.load())
    a.manifest.add(key(1))
    run(a.publish())
    run(b.refresh())
    assert key(1) in b.manifest
    ours = [n for n in run(store.list_keys(BASE + "seg/")) if "-aaaa-" in n]
    assert len(ours) == 4 and slow_puts == 0
