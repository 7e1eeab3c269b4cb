"""The manifest survives what real buckets hold: folder markers, names that
are no manifest object's, empty and garbage objects, objects this role may
not read, stamps far in the future and objects too large are skipped and
counted once each, never fatal and never sticky. A new replica starts warm
and replicas go on sharing; no junk stamp moves a floor or a clock. (The
same against a real S3 server: tests/stores/test_manifest_s3.py.)"""

from __future__ import annotations

import asyncio
import time

import pytest

from s3kv.errors import S3KVError
from s3kv.manifest import format as mf
from s3kv.manifest import protocol as mp
from s3kv.manifest.keyset import Manifest
from s3kv.manifest.sync import ManifestSync, SyncSettings
from s3kv.manifest.tombstones import publish_tombstones
from s3kv.manifest.writer import REPUBLISH_MAX
from s3kv.ops.inventory import NamespaceInfo
from s3kv.stores.base import ObjectMeta, PutMode
from s3kv.stores.memory import MemoryStore
from tests.stores.manifest_junk import FUTURE_MS, MAX_BYTES, junk, key, named_keys, reasons, segment
from tests.stores.wrappers import WrappedStore

NS = "ab" * 16
BASE = f"pfx/{NS}/manifest/"
T = 1_700_000_000.0
SKEW_S = 60


def run(coro):
    return asyncio.run(coro)


def replica(store, clock, writer, **kw) -> ManifestSync:
    settings = SyncSettings(publish_s=1, refresh_s=1, skew_s=SKEW_S, max_object_bytes=MAX_BYTES, **kw)
    return ManifestSync(store, BASE, Manifest(), settings, writer=writer, clock=lambda: clock[0])


def skipped(sync: ManifestSync) -> dict[str, float]:
    prefix = "manifest_skipped_"
    return {k[len(prefix) :]: v for k, v in sync.counters.totals().items() if k.startswith(prefix) and v}


def real_history(store, clock, snapshot: bool = True) -> ManifestSync:
    """What a replica wrote: keys 1 and 2, a snapshot of them, then key 3."""
    a = replica(store, clock, "aaaa", snapshot_every=1, snapshot_interval_s=0)
    run(a.load())
    for i in (1, 2):
        a.manifest.add(key(i))
        run(a.publish())
        clock[0] += 0.1
    run(a.refresh())
    if snapshot:
        assert run(a.maybe_snapshot())
    clock[0] += 1
    a.manifest.add(key(3))
    run(a.publish())
    clock[0] += 5
    return a


def seeded(clock, snapshot: bool = True):
    """A bucket with real history, then every kind of junk; the wrapper
    denies the 'denied' ones and lists the markers."""
    inner = MemoryStore()
    a = real_history(inner, clock, snapshot)
    objects = junk(BASE, int(clock[0] * 1000))
    for j in objects:
        if j.reason != "marker":
            run(inner.put(j.name, j.body))
    store = WrappedStore(
        inner,
        denied={j.name for j in objects if j.reason == "denied"},
        markers={j.name for j in objects if j.reason == "marker"},
    )
    return store, a, objects


@pytest.mark.parametrize("snapshot", [True, False], ids=["snapshot", "segments-only"])
def test_a_new_replica_starts_warm_past_every_kind_of_junk(snapshot):
    clock = [T]
    store, a, objects = seeded(clock, snapshot)
    b = replica(store, clock, "bbbb")
    assert run(b.load()) >= 3
    assert all(key(i) in b.manifest for i in (1, 2, 3))  # the real snapshot, and the segment after it
    assert not any(k in b.manifest for k in named_keys(objects))
    expect = reasons(objects)
    if snapshot:  # the segments are listed from the real snapshot's floor: 'seg/' sorts below it
        expect["marker"] -= 1
    assert skipped(b) == expect
    # Nothing was fetched that its name or listed size rules out.
    future = int(clock[0] * 1000) + SKEW_S * 1000
    never = {
        j.name
        for j in objects
        if j.reason in ("marker", "foreign", "oversize") or not j.body or (mp.name_ts(j.name) or 0) > future
    }
    assert len(never) == 11
    assert not [g for g in store.gets if g.key in never]
    limit = int(clock[0] * 1000) + SKEW_S * 1000
    assert b.clock_ms <= limit and mp.name_ts(b._segment_floor()) <= limit


def test_junk_is_counted_once_and_denied_objects_are_not_fetched_again():
    clock = [T]
    store, a, objects = seeded(clock)
    b = replica(store, clock, "bbbb")
    run(b.load())
    first = skipped(b)
    errors = b.counters.totals()["manifest_errors"]
    for _ in range(4):
        clock[0] += 1
        run(b.refresh())
    assert skipped(b) == first and b.counters.totals()["manifest_errors"] == errors
    for j in objects:
        if j.reason in ("denied", "garbage") and j.body:
            assert len(store.gets_of(j.name)) == 1, j.name
    assert b.refreshed_at is not None and b.refreshed_at >= time.time() - 60


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


def test_a_future_segment_is_applied_once_time_catches_up():
    clock = [T]
    store, a, objects = seeded(clock)
    b = replica(store, clock, "bbbb")
    run(b.load())
    (future,) = [j for j in objects if j.reason == "future" and "/seg/" in j.name]
    assert future.keys[0] not in b.manifest
    run(b.refresh())
    assert skipped(b)["future"] == 3 and not store.gets_of(future.name)
    clock[0] += FUTURE_MS / 1000
    run(b.refresh())
    assert future.keys[0] in b.manifest and skipped(b)["future"] == 3


def test_objects_too_large_are_refused_unread_or_read_bounded():
    """By the listing's size, without a GET; listed small but larger when
    read (changed since), with a GET of at most the bound plus one byte."""
    clock = [T]
    inner = MemoryStore()
    real_history(inner, clock)
    big = segment(*(key(7000 + i) for i in range(MAX_BYTES // 8)))
    listed_big = mp.segment_name(BASE, int(clock[0] * 1000), "big", 1)
    grown = mp.segment_name(BASE, int(clock[0] * 1000), "grow", 1)
    run(inner.put(listed_big, big))
    run(inner.put(grown, big))
    store = WrappedStore(inner, listed_sizes={grown: 100})
    b = replica(store, clock, "bbbb")
    run(b.load())
    assert skipped(b) == {"oversize": 2} and key(7000) not in b.manifest and key(3) in b.manifest
    assert not store.gets_of(listed_big)
    (get,) = store.gets_of(grown)
    assert get.range is not None and get.range.end - get.range.start <= MAX_BYTES + 1
    assert get.returned == MAX_BYTES + 1


def test_failing_gets_are_retried_a_few_times_then_skipped():
    clock = [T]
    inner = MemoryStore()
    a = real_history(inner, clock)
    store = WrappedStore(inner)
    b = replica(store, clock, "bbbb", get_attempts=3)
    run(b.load())
    a.manifest.add(key(20))
    run(a.publish())
    (stuck,) = [n for n in run(inner.list_keys(BASE + "seg/")) if n.endswith(f"{a._segments._seq:06d}")]
    store.failing = {stuck}
    after_load = b.refreshed_at
    run(b.refresh())
    run(b.refresh())
    assert b.refreshed_at == after_load  # stale while the segment may still come
    while time.time() <= after_load:  # so that a new stamp can be told from the old
        pass
    clock[0] += 3600  # past every floor: fetched by name
    run(b.refresh())
    assert len(store.gets_of(stuck)) == 3 and key(20) not in b.manifest
    assert b.refreshed_at > after_load  # given up on: staleness does not stick
    run(b.refresh())
    assert len(store.gets_of(stuck)) == 3
    # Live sharing goes on.
    a.manifest.add(key(21))
    run(a.publish())
    run(b.refresh())
    assert key(21) in b.manifest


def test_a_snapshot_that_keeps_failing_is_given_up_for_an_older_one():
    clock = [T]
    inner = MemoryStore()
    a = real_history(inner, clock)
    a.manifest.add(key(30))
    run(a.publish())
    run(a.refresh())
    clock[0] += 1
    assert run(a.maybe_snapshot())
    newest = sorted(run(inner.list_keys(BASE + "snap/")))[-1]
    store = WrappedStore(inner, failing={newest})
    b = replica(store, clock, "bbbb", get_attempts=3)
    for _ in range(2):
        with pytest.raises(S3KVError):
            run(b.load())  # run() loads again after a pause
    run(b.load())
    assert all(key(i) in b.manifest for i in (1, 2, 3, 30)) and len(store.gets_of(newest)) == 3


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


def test_a_slow_put_is_published_again_a_bounded_number_of_times():
    clock = [T]

    class Slow(MemoryStore):
        puts = 0

        async def put(self, key, data, *, mode=PutMode.OVERWRITE):
            self.puts += 1
            if self.puts > 10:
                raise RuntimeError("PUT nonstop")
            clock[0] += 40  # every PUT longer than half the 60 s margin
            return await super().put(key, data, mode=mode)

    store = Slow()
    a = replica(store, clock, "aaaa")
    run(a.load())
    a.manifest.add(key(1))
    run(a.publish())
    assert len(run(store.list_keys(BASE + "seg/"))) == 1 + REPUBLISH_MAX


def test_gc_stamps_ignore_names_in_the_future():
    """A junk far-future name must not carry gc's tombstones there: replicas
    would not apply them for years."""
    now = T
    base = f"pfx/{NS}/"
    info = NamespaceInfo(NS, base)
    real = mp.segment_name(info.manifest_base, int(now * 1000) - 5000, "w0", 1)
    future = mp.segment_name(info.manifest_base, int(now * 1000) + FUTURE_MS, "junk", 1)
    info.segments = [ObjectMeta(real, 100, now), ObjectMeta(future, 100, now)]
    stamps = info.stamps("gc0", skew_s=SKEW_S, clock=lambda: now)
    assert stamps.seen_ms == mp.name_ts(real)
    store = MemoryStore()
    run(store.put(future, segment(key(1))))
    run(store.put(real, segment(key(2))))
    name = run(publish_tombstones(store, info.manifest_base, [key(2)], stamps, SKEW_S, clock=lambda: now))
    assert mp.name_ts(name) == int(now * 1000)
    b = replica(store, [now], "bbbb")
    run(b.load())
    assert key(2) not in b.manifest  # the tombstone, applied now, beats the add before it


def test_gc_compaction_keeps_future_stamps_out_of_its_snapshot():
    """gc's snapshot names the newest segment as its horizon: a junk
    far-future one would make every replica refuse the snapshot, and a name
    that is no segment's would make them read every segment after it."""
    from s3kv.ops import gc
    from s3kv.ops.inventory import scan

    clock = [T]
    inner = MemoryStore()
    real_history(inner, clock, snapshot=False)
    future = mp.segment_name(BASE, int(clock[0] * 1000) + FUTURE_MS, "junk", 1)
    run(inner.put(future, segment(key(99))))
    run(inner.put(mp.segment_name(BASE, int(clock[0] * 1000), "zz", 1) + ".partial", segment(key(98))))
    store = WrappedStore(inner, markers={BASE + "seg/"})
    inv = run(scan(store, "pfx"))
    p = gc.plan(inv, gc.Policy(), clock[0])
    result = run(gc.execute(store, inv, p, lease=None, clock=lambda: clock[0]))
    assert result.snapshots_written == 1
    (snap,) = run(store.list_keys(BASE + "snap/"))
    horizon = mf.decode(run(store.get(snap))).meta["horizon"]
    assert mp.name_ts(snap) <= int(clock[0] * 1000) + 1000 and horizon < future  # not carried ahead
    assert mp.parse_name(BASE, horizon).writer == "aaaa"
    b = replica(store, clock, "bbbb")
    run(b.load())
    assert all(key(i) in b.manifest for i in (1, 2, 3)) and key(99) not in b.manifest
    assert b.counters.totals().get("manifest_segments_loaded", 0) == 0  # the snapshot covered them


def test_gc_compaction_prunes_snapshots_as_replicas_do():
    """gc keeps the newest few snapshots by the replicas' rule: a junk
    far-future one is not counted among them, and a name that is no
    snapshot's is not gc's to delete."""
    from s3kv.ops import gc
    from s3kv.ops.inventory import scan

    clock = [T]
    store = MemoryStore()
    real_history(store, clock, snapshot=False)
    now_ms = int(clock[0] * 1000)
    body = mf.encode(mf.ManifestObject("snapshot", meta={"horizon": "", "recent": []}))
    real = [mp.snapshot_name(BASE, now_ms - h * mp.HOUR_MS, "w0") for h in (4, 3, 2, 1)]
    future = mp.snapshot_name(BASE, now_ms + FUTURE_MS, "futr")
    foreign = BASE + "snap/" + mp.stamp(now_ms - 5 * mp.HOUR_MS) + "-not a writer"
    for name in (*real, future, foreign):
        run(store.put(name, body))
    inv = run(scan(store, "pfx"))
    result = run(
        gc.execute(store, inv, gc.plan(inv, gc.Policy(), clock[0]), lease=None, clock=lambda: clock[0])
    )
    assert result.snapshots_written == 1 and result.snapshots_deleted == 2
    left = set(run(store.list_keys(BASE + "snap/")))
    assert left - {future, foreign} == {*real[2:], *(n for n in left if "-gc" in n)}
    assert {future, foreign} <= left and len(left) == 5


class _FailingGets(MemoryStore):
    """GETs of the named objects raise the given error."""

    def __init__(self, errors: dict[str, Exception]) -> None:
        super().__init__()
        self.errors = errors

    async def get(self, key, range=None):
        if key in self.errors:
            raise self.errors[key]
        return await super().get(key, range)


def test_an_object_emptied_since_it_was_listed_is_garbage_but_a_bug_is_not(caplog):
    from s3kv.errors import RangeNotSatisfiable

    clock = [T]
    emptied = mp.segment_name(BASE, int(T * 1000) - 2000, "gone", 1)
    buggy = mp.segment_name(BASE, int(T * 1000) - 1000, "bug", 1)
    store = _FailingGets({emptied: RangeNotSatisfiable("range not satisfiable"), buggy: ValueError("a bug")})
    for name in (emptied, buggy):
        run(store.put(name, segment(key(1))))
    b = replica(store, clock, "bbbb")
    run(b.load())
    assert skipped(b) == {"garbage": 1} and emptied in b.reader.skipped
    # A ValueError from a bug is no "object shrank": it is an error, retried, then given up on.
    assert buggy not in b.reader.skipped and buggy in b.reader.retry and "a bug" in caplog.text
    for _ in range(2):
        run(b.refresh())
    assert b.reader.skipped[buggy] == "failed" and skipped(b) == {"garbage": 1}
