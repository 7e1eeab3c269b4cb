"""What the manifest's reader (:mod:`s3kv.manifest.reader`) does with what
real buckets hold: folder markers, names that are no manifest object's,
empty and garbage objects, objects this role may not read, stamps far in
the future and objects too large are skipped and counted once each, never
fatal and never sticky. A new replica starts warm; no junk stamp moves a
floor or a clock. (The same against a real S3 server:
tests/stores/test_manifest_sync_s3.py; replicas sharing and stamping past
junk: test_manifest_sync_junk.py; gc's compaction past it:
tests/ops/test_compaction_junk.py.)"""

from __future__ import annotations

import time

import pytest

from s3kv.errors import S3KVError
from s3kv.manifest import protocol as mp
from s3kv.stores.memory import MemoryStore
from tests.stores.manifest_junk import (
    BASE,
    FUTURE_MS,
    MAX_BYTES,
    SKEW_S,
    T,
    key,
    named_keys,
    real_history,
    reasons,
    replica,
    run,
    seeded,
    segment,
    skipped,
)
from tests.stores.wrappers import WrappedStore


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
    assert b.refreshed_at == clock[0]  # by its clock: every segment listed was read


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
