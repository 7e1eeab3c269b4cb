"""Publishing from the workers (s3kv.manifest.publish): rank segments, how
readers combine them, the hybrid clock, and the snapshot writer election
with rank writers. The in-memory store stands in for S3 here; the
end-to-end stop tests (tests/e2e/test_stop.py) use a real server."""

import asyncio

import numpy as np
import pytest

from s3kv.errors import CorruptManifest
from s3kv.manifest import format as mf
from s3kv.manifest import protocol as mp
from s3kv.manifest.journal import RankJournal, _unpublished
from s3kv.manifest.keyset import Manifest, fingerprints
from s3kv.manifest.protocol import replica_of
from s3kv.manifest.publish import ShardPublisher
from s3kv.manifest.ranks import rank_fields
from s3kv.manifest.sync import ManifestSync, SyncSettings
from s3kv.stores.base import PutMode
from s3kv.stores.memory import MemoryStore
from tests.stores.wrappers import HeldPuts, WrappedStore

BASE = "pfx/" + "ab" * 16 + "/manifest/"
T0 = 1_700_000_000.0


def run(coro):
    return asyncio.run(coro)


def key(i):
    return i.to_bytes(8, "big") * 2


def fp(i):
    return int(fingerprints([key(i)])[0])


def reader(store, clock, writer="rdr0", **kw):
    settings = SyncSettings(publish_s=1, refresh_s=1, skew_s=60, **kw)
    return ManifestSync(store, BASE, Manifest(), settings, writer=writer, clock=lambda: clock[0])


def publisher(store, clock, writer="aaaa", rank=0, ranks=1):
    return ShardPublisher(store, BASE, writer, rank=rank, ranks=ranks, publish_s=1, clock=lambda: clock[0])


def test_one_rank_publishes_ordinary_segments_that_any_reader_applies():
    store, clock = MemoryStore(), [T0]
    r = reader(store, clock)
    run(r.load())
    p = publisher(store, clock)
    assert run(p.publish()) == 0 and not run(store.list_keys(BASE + "seg/"))  # nothing to say: no PUT
    p.stored(fp(1))
    p.stored(fp(2))
    assert run(p.publish()) == 2
    (name,) = run(store.list_keys(BASE + "seg/"))
    assert mp.parse_name(BASE, name).writer == "aaaar0"
    obj = mf.decode(run(store.get(name)))
    assert "ranks" not in obj.meta and sorted(obj.added.tolist()) == sorted([fp(1), fp(2)])
    assert run(r.refresh()) == 2 and key(1) in r.manifest and key(2) in r.manifest
    assert run(reader(store, clock, "new0").load()) == 2  # a new replica starts warm


def test_a_failed_publish_keeps_its_keys_for_the_next():
    inner = MemoryStore()
    store, clock = WrappedStore(inner), [T0]
    p = publisher(store, clock)
    p.stored(fp(5))
    store.put = _failing_put  # S3 down
    with pytest.raises(ConnectionError):
        run(p.publish())
    assert p.pending == 1
    del store.put  # back up
    assert run(p.publish()) == 1 and p.pending == 0
    (name,) = run(inner.list_keys(BASE + "seg/"))
    assert mf.decode(run(inner.get(name))).added.tolist() == [fp(5)]


async def _failing_put(*args, **kwargs):
    raise ConnectionError("unreachable")


def _named(store) -> list[int]:
    """Every fingerprint the segments in ``store`` name, with repeats."""
    names = run(store.list_keys(BASE + "seg/"))
    return sorted(fp for name in names for fp in mf.decode(run(store.get(name))).added.tolist())


async def _until(condition) -> None:
    """Let the loop's other tasks run until ``condition()`` holds (no time passes)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the tasks never got there")


@pytest.mark.parametrize("periodic_fails", [False, True], ids=["lands", "fails"])
def test_a_publish_waits_for_the_one_in_flight_and_the_journal_counts_only_segments(tmp_path, periodic_fails):
    """The shutdown flush starts while the periodic segment PUT is still in
    flight (a slow S3): it waits for it, then publishes what is left (the
    periodic one's chunks too when its PUT fails); the journal's count never
    covers a chunk no segment names, so its replay would publish it."""
    inner = MemoryStore()
    store = HeldPuts(inner, hold="/seg/")
    journal = RankJournal(tmp_path, "aaaar0", {})
    p = ShardPublisher(store, BASE, "aaaa", rank=0, ranks=1, publish_s=1, clock=lambda: T0, journal=journal)

    async def stop() -> list[object]:
        p.stored(fp(1))
        periodic = asyncio.create_task(p.publish())
        await _until(lambda: store.held == 1)
        p.stored(fp(2))
        p.stored(fp(3))
        flush = asyncio.create_task(p.publish())
        # until the flush waits for the lock (or, were publishes to overlap, has its own PUT out)
        await _until(lambda: flush.done() or store.in_flight > 1 or p._publishing._waiters)
        store.release(ConnectionError("S3 down") if periodic_fails else None)
        return await asyncio.gather(periodic, flush, return_exceptions=True)

    periodic, flush = run(stop())
    replay, _, _ = _unpublished(tmp_path, "aaaar0")
    assert set(_named(inner)) | set(replay) == {fp(1), fp(2), fp(3)}  # nothing lost
    assert store.most_in_flight == 1  # never two segment PUTs of one rank at once
    if periodic_fails:
        assert isinstance(periodic, ConnectionError) and flush == 3
    else:
        assert (periodic, flush) == (1, 2)
    assert set(_named(inner)) == {fp(1), fp(2), fp(3)} and replay == [] and p.close() == 0


def test_each_put_is_journaled_as_it_starts_and_as_it_is_answered(tmp_path):
    """The publisher as the S3 handler's Published: a PUT's start and its
    answer go to the journal before anything is published; a created
    object's fingerprint waits for the next segment, a 412 is only
    journaled (the replay does not check it), and a PUT never answered is
    left for the replay to check."""
    inner = MemoryStore()
    journal = RankJournal(tmp_path, "aaaar0", {})
    p = ShardPublisher(inner, BASE, "aaaa", rank=0, ranks=1, publish_s=1, clock=lambda: T0, journal=journal)
    p.putting(key(1))
    assert _unpublished(tmp_path, "aaaar0")[:2] == ([], [key(1)])  # journaled before the PUT
    p.answered(key(1), created=True)
    p.putting(key(2))
    p.answered(key(2), created=False)
    p.putting(key(3))
    assert _unpublished(tmp_path, "aaaar0")[:2] == ([fp(1)], [key(3)])
    assert p.pending == 1 and run(p.publish()) == 1 and _named(inner) == [fp(1)]
    assert _unpublished(tmp_path, "aaaar0")[:2] == ([], [key(3)])
    assert p.close() == 0


def test_without_a_journal_only_created_objects_are_published():
    store, clock = MemoryStore(), [T0]
    p = publisher(store, clock)
    for i, created in ((1, True), (2, False)):
        p.putting(key(i))
        p.answered(key(i), created=created)
    assert p.pending == 1 and run(p.publish()) == 1 and _named(store) == [fp(1)]


def test_a_publish_cancelled_after_its_put_landed_is_published_again(tmp_path):
    """A stop cancels a segment PUT that S3 had committed before its answer
    came: its chunks stay unpublished for the journal (and the next publish),
    so they are named twice, which is harmless, and never lost."""
    inner = MemoryStore()
    store = HeldPuts(inner, hold="/seg/", land_first=True)
    journal = RankJournal(tmp_path, "aaaar0", {})
    p = ShardPublisher(store, BASE, "aaaa", rank=0, ranks=1, publish_s=1, clock=lambda: T0, journal=journal)

    async def cancelled() -> None:
        p.stored(fp(1))
        periodic = asyncio.create_task(p.publish())
        await _until(lambda: store.held == 1)
        periodic.cancel()
        with pytest.raises(asyncio.CancelledError):
            await periodic

    run(cancelled())
    assert _named(inner) == [fp(1)] and p.pending == 1
    assert _unpublished(tmp_path, "aaaar0")[0] == [fp(1)]  # the front end's replay would name it again
    assert run(p.publish()) == 1 and _named(inner) == [fp(1), fp(1)]
    assert _unpublished(tmp_path, "aaaar0")[0] == [] and p.close() == 0 and not list(tmp_path.iterdir())


def test_stamps_never_before_what_the_replica_has_seen():
    """A worker with a late clock stamps after the newest stamp its
    scheduler side saw, so it cannot land below other readers' floors."""
    store, clock = MemoryStore(), [T0]
    p = publisher(store, clock)
    seen = int((T0 + 300) * 1000)  # another replica's clock runs 5 minutes ahead
    p.observe(seen)
    p.stored(fp(1))
    run(p.publish())
    p.stored(fp(2))
    run(p.publish())
    stamps = sorted(mp.name_ts(n) for n in run(store.list_keys(BASE + "seg/")))
    assert stamps == [seen + 1, seen + 2]


def test_a_chunk_of_several_ranks_counts_once_every_rank_named_it():
    store, clock = MemoryStore(), [T0]
    r = reader(store, clock)
    run(r.load())
    p0, p1 = publisher(store, clock, rank=0, ranks=2), publisher(store, clock, rank=1, ranks=2)
    for i in (1, 2):
        p0.stored(fp(i))
    run(p0.publish())
    assert run(r.refresh()) == 0 and key(1) not in r.manifest  # rank 1's shards may not exist
    clock[0] += 1
    p1.stored(fp(1))
    run(p1.publish())
    assert run(r.refresh()) == 1 and key(1) in r.manifest and key(2) not in r.manifest
    fresh = reader(store, clock, "new0")
    run(fresh.load())
    assert key(1) in fresh.manifest and key(2) not in fresh.manifest


def test_a_snapshot_keeps_its_horizon_before_chunks_still_waiting_for_ranks():
    """Rank 0 named chunk 2 before the snapshot, rank 1 names it after: a
    replica that starts from the snapshot must still see it whole."""
    store, clock = MemoryStore(), [T0]
    snap = reader(store, clock, "aaaa", snapshot_every=1, snapshot_interval_s=0)
    run(snap.load())
    p0, p1 = publisher(store, clock, "bbbb", 0, 2), publisher(store, clock, "bbbb", 1, 2)
    p0.stored(fp(1))
    p1.stored(fp(1))
    run(p0.publish())
    run(p1.publish())
    clock[0] += 120  # well past the skew margin
    p0.stored(fp(2))
    run(p0.publish())
    clock[0] += 120
    run(snap.refresh())
    assert key(1) in snap.manifest and key(2) not in snap.manifest
    assert run(snap.maybe_snapshot()) is True
    (name,) = run(store.list_keys(BASE + "snap/"))
    horizon = mf.decode(run(store.get(name))).meta["horizon"]
    rank0_of_2 = sorted(run(store.list_keys(BASE + "seg/")))[-1]
    assert horizon < rank0_of_2  # the segment chunk 2 depends on is read again
    clock[0] += 120
    p1.stored(fp(2))
    run(p1.publish())
    fresh = reader(store, clock, "new0")
    run(fresh.load())
    assert key(1) in fresh.manifest and key(2) in fresh.manifest


def test_rank_writers_count_as_their_replica_in_the_snapshot_election():
    """Replica "aaaa" publishes only through its rank ("aaaar0"), which sorts
    after replica "aaaa5": that replica must still defer to "aaaa", so that
    one replica, not two, writes snapshots."""
    store, clock = MemoryStore(), [T0]
    a = reader(store, clock, "aaaa", snapshot_every=1, snapshot_interval_s=0)
    b = reader(store, clock, "aaaa5", snapshot_every=1, snapshot_interval_s=0)
    for r in (a, b):
        run(r.load())
    for writer in ("aaaa", "aaaa5"):
        p = publisher(store, clock, writer)
        p.stored(fp(len(writer)))
        run(p.publish())
    for r in (a, b):
        run(r.refresh())
    assert replica_of("aaaar0") == "aaaa" == replica_of("aaaa")
    assert run(b.maybe_snapshot()) is False and run(a.maybe_snapshot()) is True


@pytest.mark.parametrize(
    "meta",
    [
        {"rank": 2, "ranks": 2},
        {"rank": -1, "ranks": 2},
        {"rank": "0", "ranks": 2},
        {"rank": 0},
        {"ranks": 999},
    ],
)
def test_rank_segments_with_nonsense_ranks_are_garbage(meta):
    with pytest.raises(CorruptManifest):
        rank_fields(meta)
    store, clock = MemoryStore(), [T0]
    r = reader(store, clock)
    run(r.load())
    bad = mf.ManifestObject("segment", np.array([fp(1)], dtype=np.uint64), meta=meta)
    run(store.put(mp.segment_name(BASE, int(T0 * 1000), "zzzzr0", 1), mf.encode(bad), mode=PutMode.CREATE))
    assert run(r.refresh()) == 0 and key(1) not in r.manifest
    assert r.counters.totals()["manifest_skipped_garbage"] == 1


def _holding(store, clock, journal=None, rank=0, ranks=2):
    return ShardPublisher(
        store,
        BASE,
        "aaaa",
        rank=rank,
        ranks=ranks,
        publish_s=1,
        clock=lambda: clock[0],
        journal=journal,
        hold_s=3,
    )


def test_a_holding_rank_publishes_only_what_its_scheduler_side_did_not_in_time(tmp_path):
    """Protocol "epochs": the scheduler side names every whole chunk in the
    replica's one segment and acknowledges it to the ranks; a rank publishes
    (as a rank segment) only what stayed unacknowledged for ``hold_s``, and
    its journal counts what any segment names, in the journal's order."""
    store, clock = MemoryStore(), [T0]
    journal = RankJournal(tmp_path, "aaaar0", {})
    p = _holding(store, clock, journal)
    for i in (1, 2, 3):
        p.stored(fp(i))
    assert run(p.publish(held_s=p.hold_s)) == 0 and _named(store) == []  # held, not yet due
    p.acked([fp(2)])
    assert p.pending == 2 and _unpublished(tmp_path, "aaaar0")[0] == [fp(1), fp(2), fp(3)]  # 1 still open
    p.acked([fp(1), fp(99)])  # fp(99): another rank's chunk, never this one's
    assert _unpublished(tmp_path, "aaaar0")[0] == [fp(3)]
    clock[0] += 3
    p.stored(fp(4))  # fresh: still held
    assert run(p.publish(held_s=p.hold_s)) == 1 and _named(store) == [fp(3)]  # held too long: its own
    (name,) = run(store.list_keys(BASE + "seg/"))
    assert rank_fields(mf.decode(run(store.get(name))).meta) == (0, 2)  # a rank segment, as without holding
    assert _unpublished(tmp_path, "aaaar0")[0] == [fp(4)] and p.pending == 1
    assert run(p.publish()) == 1 and _named(store) == [fp(3), fp(4)]  # the shutdown flush: everything left
    assert p.close() == 0 and not list(tmp_path.iterdir())


def test_a_chunk_stored_twice_is_open_until_acknowledged_or_published_both_times():
    store, clock = MemoryStore(), [T0]
    p = _holding(store, clock)
    p.stored(fp(1))
    p.stored(fp(1))
    assert p.pending == 2
    p.acked([fp(1)])
    assert p.pending == 0 and run(p.publish()) == 0 and _named(store) == []


def test_an_acknowledgement_while_a_held_chunk_is_being_published_is_harmless():
    inner = MemoryStore()
    store, clock = HeldPuts(inner, hold="/seg/"), [T0]
    p = _holding(store, clock)

    async def race() -> int:
        p.stored(fp(1))
        flush = asyncio.create_task(p.publish())
        await _until(lambda: store.held == 1)
        p.acked([fp(1)])  # the scheduler side's segment landed first
        p.stored(fp(2))
        store.release(None)
        return await flush

    assert run(race()) == 1 and _named(inner) == [fp(1)] and p.pending == 1  # fp(2) is still open


@pytest.mark.parametrize("protocol", ["epochs", "segments"])
def test_the_protocol_decides_whether_ranks_hold_their_stores_for_the_replica_segment(protocol):
    from s3kv.config import parse_config
    from s3kv.manifest.publish import hold_s
    from s3kv.tiering.tiers.s3.manager import S3TierManager

    config = parse_config({"bucket": "b-x1", "manifest_protocol": protocol, "manifest_publish_s": 2})
    holds = protocol == "epochs"
    assert hold_s(config) == (6.0 if holds else None)
    assert S3TierManager.from_config(Manifest(), config).publishes_all is holds
