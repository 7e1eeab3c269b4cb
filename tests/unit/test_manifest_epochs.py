"""Epoch objects (s3kv.manifest.epochs): a round trip, and every epoch that
is not what its name says refused."""

import contextvars
import dataclasses
import random
import time

import numpy as np
import pytest

from s3kv.auth import FleetKeys
from s3kv.errors import CorruptManifest, PermissionDenied, UnsignedManifest
from s3kv.manifest import epochs as me
from s3kv.manifest import format as mf
from s3kv.manifest import protocol as mp

BASE = "pfx/" + "ab" * 16 + "/manifest/"
T_MS = 1_700_000_000_000
E_MS = 5000
E = T_MS // E_MS
SECRET = "s" * 32


def fps(*values):
    return np.array(values, dtype=np.uint64)


def seg(ts, writer, seq, added=(), removed=(), meta=None):
    return (
        mp.segment_name(BASE, ts, writer, seq),
        mf.ManifestObject("segment", fps(*added), fps(*removed), meta or {}),
    )


def sample(e=E):
    return me.Epoch(
        e,
        E_MS,
        "aggr",
        T_MS + 6000,
        [
            seg(T_MS + 2, "bbbb", 1, (5, 3), (), {"rank": 1, "ranks": 2}),
            seg(T_MS + 1, "aaaa", 1, (1, 2, 3), (9,)),
            seg(T_MS + 3, "cccc", 2, (), (4,), {"bad": [["x", None]]}),
        ],
    )


def test_an_epoch_round_trips_its_members_in_name_order():
    name = mp.epoch_name(BASE, E, E_MS)
    back = me.decode(BASE, name, me.encode(BASE, sample()))
    assert (back.e, back.e_ms, back.writer, back.ts) == (E, E_MS, "aggr", T_MS + 6000)
    assert [n for n, _ in back.members] == sorted(n for n, _ in sample().members)
    got = {n: (o.added.tolist(), o.removed.tolist(), o.meta) for n, o in back.members}
    assert got[mp.segment_name(BASE, T_MS + 1, "aaaa", 1)] == ([1, 2, 3], [9], {})
    assert got[mp.segment_name(BASE, T_MS + 2, "bbbb", 1)] == ([3, 5], [], {"rank": 1, "ranks": 2})
    empty = me.decode(BASE, name, me.encode(BASE, me.Epoch(E, E_MS, "aggr", T_MS, [])))
    assert empty.members == []


def test_every_corruption_and_an_epoch_under_another_name_are_refused():
    name = mp.epoch_name(BASE, E, E_MS)
    blob = me.encode(BASE, sample())
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x10
        with pytest.raises(CorruptManifest):
            me.decode(BASE, name, bytes(bad))
    for other in (mp.epoch_name(BASE, E + 1, E_MS), mp.epoch_name(BASE, E, E_MS + 1)):
        with pytest.raises(CorruptManifest, match="copied"):
            me.decode(BASE, other, blob)
    segment = mf.encode(mf.ManifestObject("segment", fps(1)))
    with pytest.raises(CorruptManifest, match="not an epoch"):
        me.decode(BASE, name, segment)


def _framed(meta, added=(), removed=()):
    return mf.frame("epoch", meta, fps(*added), fps(*removed))


def test_members_that_do_not_add_up_or_are_no_segments_are_refused():
    name = mp.epoch_name(BASE, E, E_MS)
    a = mp.segment_name(BASE, T_MS, "aaaa", 1)[len(BASE) :]
    b = mp.segment_name(BASE, T_MS + 1, "bbbb", 1)[len(BASE) :]
    head = {"e": E, "e_ms": E_MS, "writer": "w", "ts": T_MS}
    cases = {
        "unsorted": _framed({**head, "members": [[a, 2, 0, {}]]}, (2, 1)),
        "order": _framed({**head, "members": [[b, 1, 0, {}], [a, 1, 0, {}]]}, (1, 2)),
        "runs past": _framed({**head, "members": [[a, 3, 0, {}]]}, (1, 2)),
        "account": _framed({**head, "members": [[a, 1, 0, {}]]}, (1, 2)),
        "no segment": _framed({**head, "members": [["snap/" + mp.stamp(T_MS) + "-w", 0, 0, {}]]}),
        "elsewhere": _framed({**head, "members": [["../x/" + a, 0, 0, {}]]}),
        "counts": _framed({**head, "members": [[a, -1, 0, {}]]}),
        "rank": _framed({**head, "members": [[a, 0, 0, {"rank": 5, "ranks": 2}]]}),
        "writer": _framed({"e": E, "e_ms": E_MS, "ts": T_MS, "members": []}),
    }
    for why, data in cases.items():
        with pytest.raises(CorruptManifest):
            me.decode(BASE, name, data)
        assert why


def test_with_the_fleet_secret_only_an_epoch_signed_with_it_reads():
    name = mp.epoch_name(BASE, E, E_MS)
    keys = FleetKeys([SECRET])
    signed = me.encode(BASE, sample(), keys)
    assert len(me.decode(BASE, name, signed, keys=keys).members) == 3
    with pytest.raises(UnsignedManifest):
        me.decode(BASE, name, me.encode(BASE, sample()), keys=keys)
    with pytest.raises(UnsignedManifest):
        me.decode(BASE, name, me.encode(BASE, sample(), FleetKeys(["o" * 32])), keys=keys)


# -- replicas through epochs (s3kv.manifest.sync, protocol "epochs") ------------

import asyncio  # noqa: E402

from s3kv.manifest.keyset import Manifest, fingerprints  # noqa: E402
from s3kv.manifest.sync import ManifestSync, SyncSettings  # noqa: E402
from s3kv.stores.base import PutMode  # noqa: E402
from s3kv.stores.memory import MemoryStore  # noqa: E402
from tests.stores.wrappers import DirectoryBucketStore, HeldPuts, WrappedStore  # noqa: E402

PUBLISH_S = 1.0
SKEW_S = 10.0
T0 = 1_700_000_000.0


class Clock:
    def __init__(self, t=T0):
        self.t = t

    def __call__(self):
        return self.t


class Offset:
    """A replica's clock running ``by`` seconds off the fleet's ``clock``."""

    def __init__(self, clock, by):
        self.clock, self.by = clock, by

    def __call__(self):
        return self.clock.t + self.by


async def inline(f, *args):
    """The fleet model's offload: numpy work on the event loop itself."""
    return f(*args)


def replica(store, clock, writer, keys=None, **kw):
    kw.setdefault("protocol", "epochs")
    settings = SyncSettings(publish_s=PUBLISH_S, refresh_s=PUBLISH_S, skew_s=SKEW_S, **kw)
    return ManifestSync(
        store, BASE, Manifest(), settings, writer=writer, clock=clock, keys=keys, offload=inline
    )


def run(coro):
    return asyncio.run(coro)


def key(i):
    return i.to_bytes(8, "big") * 2


def fp(i):
    return int(fingerprints([key(i)])[0])


async def drive(replicas, clock, until, step=0.05):
    """Every replica's loop (tick when due, as ManifestSync.run does: an
    error is counted and tried again), on ``clock``, until ``until``."""
    while clock.t < until:
        for r in replicas:
            if r._clock() >= r.next_due():
                try:
                    await r.tick()
                except Exception:
                    r.counters.add("manifest_errors")
        clock.t = round(clock.t + step, 6)


async def start(replicas, clock):
    for r in replicas:
        await r.load()
        r._next_publish = r._clock() + PUBLISH_S
        if r.chain is not None:  # as ManifestSync.run starts the loop
            r.chain.due = r._clock()


async def add_in_turn(a, b, clock, n):
    """Start ``a`` and ``b``; keys 0..n-1 added one a second, by b and a in
    turn; then 4 s more, for the last epochs and snapshots to be written."""
    await start([a, b], clock)
    for i in range(n):
        (a if i % 2 else b).manifest.add(key(i))
        await drive([a, b], clock, clock.t + 1)
    await drive([a, b], clock, clock.t + 4)


def epochs_in(store):
    return sorted(run(store.list_keys(BASE + "ep/")))


def test_two_replicas_see_each_others_keys_through_epochs(bucket_kind):
    store = bucket_kind()
    clock = Clock()
    a, b = replica(store, clock, "aaaa"), replica(store, clock, "bbbb")

    async def go():
        await start([a, b], clock)
        a.manifest.add(key(1))
        b.manifest.add(key(2))
        await drive([a, b], clock, T0 + 6)

    run(go())
    assert key(2) in a.manifest and key(1) in b.manifest
    names = epochs_in(store)
    assert names and all(mp.parse_name(BASE, n).kind == "epoch" for n in names)
    total = a.counters.totals()
    assert total["manifest_epochs_read"] + total["manifest_epochs_written"] >= 4


def test_a_key_is_seen_within_two_intervals_and_the_settle(bucket_kind):
    store = bucket_kind()
    clock = Clock()
    a, b = replica(store, clock, "aaaa"), replica(store, clock, "bbbb")

    async def go():
        await start([a, b], clock)
        await drive([a, b], clock, T0 + 3)
        a.manifest.add(key(5))
        added = clock.t
        while key(5) not in b.manifest:
            await drive([a, b], clock, clock.t + 0.05)
        return clock.t - added

    took = run(go())
    s = a.s
    assert took <= 2 * PUBLISH_S + s.settle_s + s.grace_step_s + 0.2, took


def test_a_new_replica_starts_from_the_snapshot_and_the_epochs_after_it(bucket_kind):
    store = WrappedStore(MemoryStore())
    store = bucket_kind(store)
    clock = Clock()
    a, b = replica(store, clock, "aaaa", snapshot_epochs=4), replica(store, clock, "bbbb", snapshot_epochs=4)
    run(add_in_turn(a, b, clock, 12))
    snaps = run(store.list_keys(BASE + "snap/"))
    assert snaps
    snap = mf.decode(run(store.get(sorted(snaps)[-1])))
    assert snap.meta["e_ms"] == 1000 and snap.meta["epoch"] % 4 == 0 and snap.meta["horizon"]
    inner = store.inner if isinstance(store, DirectoryBucketStore) else store
    inner.gets.clear()
    c = replica(store, clock, "cccc", snapshot_epochs=4)
    run(c.load())
    assert all(key(i) in c.manifest for i in range(12))
    segment_gets = [g for g in inner.gets if "/seg/" in g.key]
    assert not segment_gets  # the snapshot and epochs only
    epoch_gets = {g.key for g in inner.gets if "/ep/" in g.key}
    assert all(mp.parse_epoch(BASE, n)[0] > snap.meta["epoch"] for n in epoch_gets)
    last = c.chain.last_closed(int(clock.t * 1000))
    assert c.next_epoch == last + 1 or c.next_epoch <= last


def test_a_new_replica_of_a_fleet_that_was_down_lists_the_hole():
    store = MemoryStore()
    clock = Clock()
    a = replica(store, clock, "aaaa")

    async def go():
        await start([a], clock)
        a.manifest.add(key(1))
        await a.publish()  # published, then the fleet stopped before any epoch
        clock.t += 3600
        b = replica(store, clock, "bbbb")
        await b.load()
        return b

    b = run(go())
    assert key(1) in b.manifest
    assert not epochs_in(store)


@pytest.mark.parametrize("snapshots", [True, False], ids=["snapshot", "no-snapshot"])
def test_a_new_replica_starts_with_the_last_segment_of_a_fleet_that_stopped_after_its_last_epoch(
    bucket_kind, snapshots
):
    """The last replica's shutdown segment lands after its last epoch, and
    no aggregator is left to write the next: a replica started a little
    later (within the lookback, no hole yet) has those keys once loaded,
    not only after its loop has aggregated that epoch; it lists segments
    once (with no snapshot, the listing of every segment is that one)."""
    store = bucket_kind()
    clock = Clock()
    a = replica(store, clock, "aaaa", snapshot_epochs=60 if snapshots else 0)

    async def go():
        await start([a], clock)
        a.manifest.add(key(1))
        await drive([a], clock, T0 + 5)  # epochs written with key(1)
        a.manifest.add(key(2))
        await a.publish()  # its shutdown publish; then it stops
        clock.t += 15  # past every candidate's time to write the next (13 s), within the lookback (20 s)
        b = replica(store, clock, "bbbb")
        listings = []
        after = b._lister.after

        async def counted(floor):
            listings.append(floor)
            return await after(floor)

        b._lister.after = counted
        await b.load()
        return b, listings

    b, listings = run(go())
    assert epochs_in(store) and key(1) in b.manifest
    assert key(2) in b.manifest
    assert len(listings) == 1 and (listings[0] is None) is not snapshots


class CountingCreates(MemoryStore):
    """Holds epoch PUTs until both racers have listed, so they truly race."""

    def __init__(self):
        super().__init__()
        self.epoch_puts = []

    async def put(self, key, data, *, mode=PutMode.OVERWRITE):
        if "/ep/" in key:
            self.epoch_puts.append(key)
        return await super().put(key, data, mode=mode)


def test_two_aggregators_racing_write_one_epoch_and_apply_the_same_members():
    store = CountingCreates()
    clock = Clock()
    a, b, c = (replica(store, clock, w) for w in ("aaaa", "bbbb", "cccc"))

    async def go():
        await start([a, b, c], clock)
        c.manifest.add(key(3))
        await c.publish()
        e = mp.epoch_of(int(clock.t * 1000), 1000)
        clock.t = (mp.epoch_end(e, 1000) + 1) / 1000 + 5  # every rank's time has come
        # Both list and read before either writes.
        got = await asyncio.gather(a.aggregate(e), b.aggregate(e))
        return e, got

    e, got = run(go())
    assert store.epoch_puts.count(mp.epoch_name(BASE, e, 1000)) == 2  # both tried
    assert len(epochs_in(store)) == 1  # one won
    assert key(3) in a.manifest and key(3) in b.manifest and got == [1, 1]
    totals = [r.counters.totals() for r in (a, b)]
    assert sorted(t.get("manifest_epochs_written", 0) for t in totals) == [0, 1]
    assert a.next_epoch == b.next_epoch == e + 1


def test_an_aggregator_stopped_mid_epoch_is_replaced_by_the_next_rank(bucket_kind):
    class Stops(MemoryStore):
        stopped: set = set()

        async def put(self, key, data, *, mode=PutMode.OVERWRITE):
            if "/ep/" in key and self.stopped:
                raise ConnectionError("killed")  # after listing, before its PUT landed
            return await super().put(key, data, mode=mode)

    inner = Stops()
    store = bucket_kind(inner)
    clock = Clock()
    a, b = replica(store, clock, "aaaa"), replica(store, clock, "bbbb")

    async def go():
        await start([a, b], clock)
        a.manifest.add(key(1))
        b.manifest.add(key(2))
        await drive([a, b], clock, T0 + 2.2)  # both are members now
        e = mp.epoch_of(int(clock.t * 1000), 1000) + 1
        first, second = sorted((a, b), key=lambda r: r.aggregate_rank(e))
        first.manifest.add(key(10))
        second.manifest.add(key(11))
        await drive([a, b], clock, (mp.epoch_start(e, 1000)) / 1000 + 0.05)  # published into epoch e
        inner.stopped = {first.writer}
        due = first.chain.aggregate_at(e)
        await drive([first, second], clock, due + 0.01)
        assert first.next_epoch <= e  # its aggregation was cut off
        inner.stopped = set()
        # The stopped one is gone; the next rank writes the epoch after its grace.
        await drive([second], clock, second.chain.aggregate_at(e) + 3)
        return e, first, second

    e, first, second = run(go())
    assert mp.epoch_name(BASE, e, 1000) in epochs_in(store)
    assert key(10) in second.manifest and second.next_epoch > e
    assert second.counters.totals()["manifest_epochs_written"] >= 1


@pytest.mark.parametrize("how", ["corrupt", "unsigned", "other key", "copied"])
def test_a_bad_epoch_object_is_skipped_counted_and_its_keys_still_seen(how):
    store = MemoryStore()
    clock = Clock()
    keys = FleetKeys([SECRET])
    a, b = replica(store, clock, "aaaa", keys), replica(store, clock, "bbbb", keys)

    async def go():
        await start([a, b], clock)
        await drive([a, b], clock, T0 + 2)
        a.manifest.add(key(7))
        await a.publish()
        e = mp.epoch_of(int(clock.t * 1000), 1000)
        name = mp.epoch_name(BASE, e, 1000)
        members = [
            (n, mf.decode(await store.get(n), keys=keys)) for n in await store.list_keys(BASE + "seg/")
        ]
        forged = me.Epoch(e, 1000, "evil", int(clock.t * 1000), [])
        body = {
            "corrupt": b"S3KM" + b"\0" * 60,
            "unsigned": me.encode(BASE, forged),
            "other key": me.encode(BASE, forged, FleetKeys(["o" * 32])),
        }.get(how)
        if how == "copied":  # a real, signed epoch of another number
            body = me.encode(BASE, me.Epoch(e - 1, 1000, "aaaa", int(clock.t * 1000), []), keys)
        assert members
        await store.put(name, body)
        await drive([b], clock, clock.t + 4)
        return e

    e = run(go())
    assert key(7) in b.manifest
    t = b.counters.totals()
    assert t["manifest_epochs_skipped"] == 1 and t["manifest_epochs_covered"] == 1
    assert b.next_epoch > e


def test_a_replica_whose_clock_is_far_ahead_does_not_aggregate_and_nothing_is_lost():
    """A clock 1.5 margins ahead: it writes no epoch (an early one would miss
    the fleet's segments still to come), reads the fleet's, and its own keys
    reach the fleet once the fleet's time reaches their stamps."""
    store = MemoryStore()
    clock = Clock()

    a, b = replica(store, clock, "aaaa"), replica(store, clock, "bbbb")
    fast = replica(store, Offset(clock, 1.5 * SKEW_S), "ffff")

    async def go():
        await start([a, b], clock)
        await drive([a, b], clock, clock.t + 3)  # a fleet at work; then a replica far ahead joins
        await start([fast], clock)
        for i in range(6):
            a.manifest.add(key(i))
            b.manifest.add(key(100 + i))
            fast.manifest.add(key(200 + i))
            await drive([a, b, fast], clock, clock.t + 1)
        await drive([a, b, fast], clock, clock.t + 1.5 * SKEW_S + 4)

    run(go())
    t = fast.counters.totals()
    assert t.get("manifest_epochs_refused", 0) >= 1 and t.get("manifest_epochs_written", 0) == 0
    every = [key(i) for i in range(6)] + [key(100 + i) for i in range(6)] + [key(200 + i) for i in range(6)]
    for r in (a, b, fast):
        assert all(k in r.manifest for k in every), r.writer


def test_a_replica_whose_clock_is_behind_loses_nothing():
    store = MemoryStore()
    clock = Clock()

    a, b = replica(store, clock, "aaaa"), replica(store, clock, "bbbb")
    slow = replica(store, Offset(clock, -0.9 * SKEW_S), "ssss")

    async def go():
        await start([a, b, slow], clock)
        for i in range(6):
            a.manifest.add(key(i))
            slow.manifest.add(key(200 + i))
            await drive([a, b, slow], clock, clock.t + 1)
        await drive([a, b, slow], clock, clock.t + SKEW_S + 4)

    run(go())
    every = [key(i) for i in range(6)] + [key(200 + i) for i in range(6)]
    for r in (a, b, slow):
        assert all(k in r.manifest for k in every), r.writer


def test_a_replica_whose_clock_is_behind_sees_a_key_when_the_fleet_does():
    """Epochs are due by the fleet's time: a replica whose clock runs 0.9 of
    the margin behind learns it from the stamps it reads (others' segments
    and epochs) and reads each epoch when the others do, not that much later."""
    store = MemoryStore()
    clock = Clock()

    a, b = replica(store, clock, "aaaa"), replica(store, clock, "bbbb")
    slow = replica(store, Offset(clock, -0.9 * SKEW_S), "ssss")

    async def go():
        await start([a, b, slow], clock)
        a.manifest.add(key(1))  # the replicas hear of each other
        await drive([a, b, slow], clock, T0 + 4)
        a.manifest.add(key(5))
        added = clock.t
        while key(5) not in slow.manifest:
            await drive([a, b, slow], clock, clock.t + 0.05)
        return clock.t - added

    took = run(go())
    s = a.s
    assert took <= 2 * PUBLISH_S + s.settle_s + s.grace_step_s + 0.2, took


def test_a_replica_whose_clock_is_behind_and_joins_a_running_fleet_catches_up():
    """A replica 0.9 of the margin behind that starts while the fleet runs
    reads only epochs written long ago by its clock's reckoning: every stamp
    in them looks no later than its own clock, so the stamps alone never say
    it is late. It finds out by asking for the next epoch early (once every
    few epochs, and at once again while that finds one), and then sees a key
    when the fleet does."""
    store = MemoryStore()
    clock = Clock()

    class Behind(Clock):
        def __call__(self):
            return clock.t - 0.9 * SKEW_S

    a, b = replica(store, clock, "aaaa"), replica(store, clock, "bbbb")
    slow = replica(store, Behind(), "ssss")

    async def go():
        await start([a, b], clock)
        a.manifest.add(key(1))
        await drive([a, b], clock, T0 + 3 * SKEW_S)
        await start([slow], clock)
        await drive([a, b, slow], clock, clock.t + 4 * SKEW_S)
        a.manifest.add(key(5))
        added = clock.t
        while key(5) not in slow.manifest and clock.t < added + 3 * SKEW_S:
            await drive([a, b, slow], clock, clock.t + 0.05)
        return clock.t - added

    took = run(go())
    s = a.s
    assert took <= 2 * PUBLISH_S + s.settle_s + s.grace_step_s + 0.2, took


class LatePuts(MemoryStore):
    """Segment PUTs that land ``late_s`` after they were sent (chosen by
    ``late``): the writer's PUT call returns only then, as a slow S3's does,
    while the other replicas go on."""

    def __init__(self, clock, late, late_s):
        super().__init__()
        self.clock, self.late, self.late_s = clock, late, late_s
        self.waiting = []
        self.tasks = {}
        """Each replica's tick under way (:func:`drive_concurrently`)."""

    async def put(self, key, data, *, mode=PutMode.OVERWRITE):
        if "/seg/" in key and self.late(key):
            landed = asyncio.get_running_loop().create_future()
            self.waiting.append((self.clock.t + self.late_s, landed))
            await landed
        return await super().put(key, data, mode=mode)

    def land(self):
        now = [(t, f) for t, f in self.waiting if t <= self.clock.t]
        self.waiting = [(t, f) for t, f in self.waiting if t > self.clock.t]
        for _, f in now:
            f.set_result(None)


async def drive_concurrently(replicas, clock, store, until, step=0.05):
    """Each replica's loop as its own task (tick when due; an error counted),
    on ``clock``: a replica waiting for a late PUT holds only itself up."""
    tasks = store.tasks

    async def tick(r):
        try:
            await r.tick()
        except Exception:
            r.counters.add("manifest_errors")

    while clock.t < until:
        for r in replicas:
            if (r not in tasks or tasks[r].done()) and r._clock() >= r.next_due():
                tasks[r] = asyncio.ensure_future(tick(r))
        for _ in range(1000):  # until every task is done or waits for its PUT to land
            await asyncio.sleep(0)
            if sum(not t.done() for t in tasks.values()) == len(store.waiting):
                break
        else:
            raise AssertionError("a replica's tick neither ends nor waits for a PUT")
        clock.t = round(clock.t + step, 6)
        store.land()
    for _ in range(100):
        await asyncio.sleep(0)


@pytest.mark.parametrize("seed", [1, 2])
def test_clocks_a_margin_apart_and_late_puts_lose_no_key(seed):
    """Ten replicas whose clocks are up to the skew margin apart, a third of
    the segment PUTs landing 0.45 of the margin late: every fingerprint any
    replica published reaches every replica."""
    rng = random.Random(seed)
    clock = Clock()
    store = LatePuts(clock, lambda _key: rng.random() < 0.3, 0.45 * SKEW_S)

    def skewed(offset):
        return lambda: clock.t + offset

    replicas = [replica(store, skewed(rng.uniform(-0.5, 0.5) * SKEW_S), f"r{i:03d}") for i in range(10)]
    published = set()

    async def go():
        await start(replicas, clock)
        n = 0
        for _ in range(40):
            for r in rng.sample(replicas, 4):
                r.manifest.add(key(n))
                published.add(n)
                n += 1
            await drive_concurrently(replicas, clock, store, clock.t + rng.uniform(0.2, 1.5))
        await drive_concurrently(replicas, clock, store, clock.t + 2 * SKEW_S)

    run(go())
    for r in replicas:
        missing = [i for i in sorted(published) if key(i) not in r.manifest]
        assert not missing, (r.writer, missing)
    written = sum(r.counters.totals().get("manifest_epochs_written", 0) for r in replicas)
    assert written >= 40  # epochs carried them, not a fallback


def test_an_older_replica_reading_segments_and_a_new_one_reading_epochs_share_every_chunk(bucket_kind):
    store = bucket_kind()
    clock = Clock()
    old = replica(store, clock, "oldr", protocol="segments")
    new, other = (replica(store, clock, w, snapshot_epochs=3) for w in ("neww", "othr"))

    async def go():
        await start([old, new, other], clock)
        old._next_refresh = clock.t + PUBLISH_S
        for i in range(5):
            old.manifest.add(key(i))
            new.manifest.add(key(100 + i))
            await drive([old, new, other], clock, clock.t + 1)
        await drive([old, new, other], clock, clock.t + 4)

    run(go())
    every = [key(i) for i in range(5)] + [key(100 + i) for i in range(5)]
    for r in (old, new, other):
        assert all(k in r.manifest for k in every), r.writer
    assert not old.counters.totals().get("manifest_epochs_read")  # the old one never reads epochs
    assert epochs_in(store)
    # An older replica starting now starts from the newest snapshot, which
    # the epochs' aggregators wrote (their legacy horizon), and the segments after it.
    (newest, *_) = sorted(run(store.list_keys(BASE + "snap/")), reverse=True)
    assert "epoch" in mf.decode(run(store.get(newest))).meta
    late = replica(store, clock, "late", protocol="segments")
    run(late.load())
    assert all(k in late.manifest for k in every)


WHO = contextvars.ContextVar("who", default="")
"""The replica whose tick runs (tasks it starts inherit it)."""


async def tick_as(r):
    WHO.set(r.writer)
    await r.tick()


@dataclasses.dataclass
class CountingStore(WrappedStore):
    """Counts GETs and LISTs by the replica that sent them (:data:`WHO`)."""

    by: dict = dataclasses.field(default_factory=dict)

    def _count(self, what):
        who = WHO.get()
        self.by.setdefault(who, {"get": 0, "list": 0})[what] += 1

    async def get(self, key, range=None):
        self._count("get")
        return await super().get(key, range)

    async def list(self, prefix="", *, start_after=None):
        self._count("list")
        async for m in super().list(prefix, start_after=start_after):
            yield m


@pytest.mark.parametrize("n", [4, 16])
def test_a_replicas_gets_per_epoch_do_not_grow_with_the_fleet(n):
    """Every replica publishes every interval. Reading segments, each would
    GET n of them an interval; reading epochs, a replica GETs about one
    epoch (and a retry) an interval, plus an aggregator's n now and then:
    per replica, a constant on average, whatever n."""
    store = CountingStore(MemoryStore())
    clock = Clock()
    replicas = [replica(store, clock, f"r{i:03d}") for i in range(n)]
    epochs = 20

    async def go():
        await start(replicas, clock)
        await drive(replicas, clock, clock.t + 3)
        store.by.clear()
        for i in range(epochs):
            for j, r in enumerate(replicas):
                r.manifest.add(key(i * 1000 + j))
            await drive_named(replicas, clock, clock.t + 1)

    async def drive_named(rs, clock, until, step=0.05):
        while clock.t < until:
            for r in rs:
                if r._clock() >= r.next_due():
                    await asyncio.create_task(tick_as(r))
            clock.t = round(clock.t + step, 6)

    run(go())
    gets = [store.by.get(r.writer, {"get": 0})["get"] for r in replicas]
    lists = [store.by.get(r.writer, {"list": 0})["list"] for r in replicas]
    # Mean per replica per epoch: one epoch GET, a retry, n segment GETs for the 1/n-th it aggregates.
    assert sum(gets) / n / epochs <= 4, gets
    assert max(gets) / epochs <= 4 + n, gets  # no replica reads every segment every interval
    assert sum(lists) / n / epochs <= 1.5, lists
    for r in replicas:
        assert all(key(i * 1000 + j) in r.manifest for i in range(epochs - 3) for j in range(n))


def test_the_loop_of_each_replica_carries_keys_through_epochs_on_the_wall_clock():
    """ManifestSync.run (load, then tick when due) on the real clock: a key
    one replica stores reaches the other within a few intervals."""
    store = MemoryStore()
    fast = dict(publish_s=0.2, refresh_s=0.2, skew_s=2.0, settle_s=0.05, grace_step_s=0.05)

    def looping(writer):
        settings = SyncSettings(protocol="epochs", **fast)
        return ManifestSync(store, BASE, Manifest(), settings, writer=writer)

    a, b = looping("aaaa"), looping("bbbb")

    async def go():
        tasks = [asyncio.ensure_future(r.run()) for r in (a, b)]
        try:
            while not (a.loaded and b.loaded):
                await asyncio.sleep(0.01)
            a.manifest.add(key(1))
            started = time.monotonic()
            while key(1) not in b.manifest and time.monotonic() - started < 20:
                await asyncio.sleep(0.01)
            return time.monotonic() - started
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    took = run(go())
    assert key(1) in b.manifest, took
    assert took < 3 * 0.2 + 0.05 + 1.0, took  # two intervals, the settle, a grace or two (a slow CI)
    assert epochs_in(store)


class View(MemoryStore):
    """``bucket`` as one replica sees it: the same objects (a subclass slows
    or hangs some of its requests)."""

    def __init__(self, bucket):
        super().__init__()
        self._objects = bucket._objects


def test_a_slow_segment_put_does_not_hold_up_reading_epochs():
    """ManifestSync.run publishes in a task of its own: while this replica's
    segment PUT takes 0.9 of the margin, its loop still reads the fleet's
    epochs when they are due (before, the tick awaited the PUT and read that
    much later), and what it stored reaches the others once the PUT lands."""
    from s3kv.testing import virtual_loop

    bucket = MemoryStore()

    class SlowSegments(View):
        """``bucket`` as replica "ssss" sees it: its segment PUTs take 0.9 of the margin."""

        slow = True

        async def put(self, key, data, *, mode=PutMode.OVERWRITE):
            if "/seg/" in key and self.slow:
                await asyncio.sleep(0.9 * SKEW_S)
            return await super().put(key, data, mode=mode)

    async def go():
        loop = asyncio.get_running_loop()

        def clock():
            return T0 + loop.time()

        def make(store, writer):
            settings = SyncSettings(
                publish_s=PUBLISH_S, refresh_s=PUBLISH_S, skew_s=SKEW_S, protocol="epochs"
            )
            return ManifestSync(store, BASE, Manifest(), settings, writer=writer, clock=clock, offload=inline)

        slow_store = SlowSegments(bucket)
        a, slow = make(bucket, "aaaa"), make(slow_store, "ssss")
        tasks = [asyncio.ensure_future(r.run()) for r in (a, slow)]
        try:
            while not (a.loaded and slow.loaded):
                await asyncio.sleep(0.05)
            a.manifest.add(key(1))
            slow.manifest.add(key(2))  # its PUT is in flight for 9 s
            await asyncio.sleep(2 * PUBLISH_S)
            a.manifest.add(key(3))
            added = loop.time()
            while key(3) not in slow.manifest and loop.time() < added + 3 * SKEW_S:
                await asyncio.sleep(0.05)
            took = loop.time() - added
            while key(2) not in a.manifest and loop.time() < added + 3 * SKEW_S:
                await asyncio.sleep(0.05)
            return took, key(2) in a.manifest
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    took, seen = virtual_loop.run(go())
    s = SyncSettings()
    assert took <= 2 * PUBLISH_S + s.settle_s + s.grace_step_s + 0.2, took
    assert seen


def test_what_a_replica_remembers_of_epochs_stays_within_the_lookback():
    store = MemoryStore()
    clock = Clock()
    a, b = replica(store, clock, "aaaa"), replica(store, clock, "bbbb")
    lookback_epochs = int(2 * SKEW_S / PUBLISH_S)

    async def go():
        await start([a, b], clock)
        for i in range(3 * lookback_epochs):
            a.manifest.add(key(i))
            await drive([a, b], clock, clock.t + PUBLISH_S)

    run(go())
    assert all(key(i) in b.manifest for i in range(3 * lookback_epochs - 3))
    for r in (a, b):
        assert 0 < len(r.chain.covered) <= lookback_epochs + 3, len(r.chain.covered)
        assert len(r._seen) <= lookback_epochs + 3, len(r._seen)


def test_a_hole_after_the_snapshot_is_read_from_the_segments(bucket_kind):
    """The fleet wrote epochs and a snapshot, then a replica published and
    every replica stopped before the epoch after was written; an hour later
    a new one starts: the missing epochs are a hole it lists segments for."""
    store = bucket_kind()
    clock = Clock()
    a, b = replica(store, clock, "aaaa", snapshot_epochs=2), replica(store, clock, "bbbb", snapshot_epochs=2)

    async def go():
        await start([a, b], clock)
        for i in range(5):
            a.manifest.add(key(i))
            await drive([a, b], clock, clock.t + PUBLISH_S)
        a.manifest.add(key(99))
        await a.publish()  # then the fleet stops
        clock.t += 3600
        c = replica(store, clock, "cccc")
        await c.load()
        return c

    c = run(go())
    assert run(store.list_keys(BASE + "snap/"))
    assert all(key(i) in c.manifest for i in (0, 1, 2, 3, 4, 99))
    assert c.next_epoch >= mp.epoch_of(int(clock.t * 1000), 1000) - int(2 * SKEW_S)


class GcFleet:
    """A fleet of six replicas adding a key each a second, and gc's
    compaction writing a snapshot: every segment listed, replayed, under
    their horizon, no ``epoch`` in its header."""

    def __init__(self, bucket_kind, **kw):
        self.inner = WrappedStore(MemoryStore())
        self.store = bucket_kind(self.inner)
        self.clock = Clock()
        self.fleet = [replica(self.store, self.clock, f"r{i:03d}", snapshot_epochs=0, **kw) for i in range(6)]
        self.every = []

    async def add_for(self, seconds):
        for _ in range(int(seconds / PUBLISH_S)):
            for r in self.fleet:
                self.every.append(key(len(self.every)))
                r.manifest.add(self.every[-1])
            await drive(self.fleet, self.clock, self.clock.t + PUBLISH_S)

    async def gc_snapshot(self):
        from s3kv.manifest.arrays import EMPTY
        from s3kv.manifest.ranks import RankTally
        from s3kv.manifest.replay import replay
        from s3kv.manifest.snapshots import write_snapshot

        names = sorted(await self.inner.inner.list_keys(BASE + "seg/"))
        read = [(n, mf.decode(await self.inner.inner.get(n))) for n in names]
        live = replay(EMPTY, read, RankTally())
        horizon = mp.Horizon.over(names, int(SKEW_S * 1000))
        now = lambda: int(self.clock.t * 1000)  # noqa: E731
        await write_snapshot(self.store, BASE, live, horizon, writer="gc01", next_ts=now, by="gc")
        return horizon


def test_a_new_replica_starts_from_a_snapshot_without_epoch_through_the_epochs(bucket_kind):
    """gc's compaction (or an older replica) wrote the newest snapshot: a
    horizon, no ``epoch``. A new replica reads the epochs from the horizon's
    (less the lookback), not every segment since the horizon: its GETs grow
    with the epochs, not with the fleet's segments, and it has every key."""
    f = GcFleet(bucket_kind)
    store, inner, clock, fleet, every, add_for = f.store, f.inner, f.clock, f.fleet, f.every, f.add_for

    async def go():
        await start(fleet, clock)
        await add_for(30)
        await f.gc_snapshot()
        await add_for(10)
        await drive(fleet, clock, clock.t + 4)  # the last epochs written

    run(go())
    (snap,) = run(store.list_keys(BASE + "snap/"))
    assert "epoch" not in mf.decode(run(store.get(snap))).meta
    segments = len(run(inner.inner.list_keys(BASE + "seg/")))
    assert segments >= 6 * 35  # a segment a replica a second
    inner.gets.clear()
    c = replica(store, clock, "cccc")
    run(c.load())
    assert not [k for k in every if k not in c.manifest]
    segment_gets = [g.key for g in inner.gets if "/seg/" in g.key]
    epoch_gets = [g.key for g in inner.gets if "/ep/" in g.key]
    assert not segment_gets, len(segment_gets)  # no hole: the epochs carried every one
    lookback_epochs = int(2 * SKEW_S / PUBLISH_S)
    assert len(epoch_gets) <= 10 + lookback_epochs + 6, len(epoch_gets)
    assert len(inner.gets) <= len(epoch_gets) + 1  # and the snapshot


def test_a_snapshot_without_epoch_before_any_epoch_lists_only_the_segments_after_it(bucket_kind):
    """Older replicas (protocol "segments") and gc ran; then a replica of
    epochs starts: the epochs after the snapshot's horizon are a hole, and
    the segments it lists from there are those the snapshot does not hold."""
    f = GcFleet(bucket_kind, protocol="segments")

    async def go():
        await start(f.fleet, f.clock)
        await f.add_for(30)
        horizon = await f.gc_snapshot()
        await f.add_for(10)
        return horizon

    horizon = run(go())
    f.inner.gets.clear()
    c = replica(f.store, f.clock, "cccc")
    run(c.load())
    assert not [k for k in f.every if k not in c.manifest]
    segment_gets = [g.key for g in f.inner.gets if "/seg/" in g.key]
    floor = c._lister.floor(mp.name_ts(horizon.last), int(SKEW_S * 1000))
    assert segment_gets and not [n for n in segment_gets if n <= floor or n in horizon.recent]


class NoDeletes(MemoryStore):
    """A replica's role without s3:DeleteObject (gc deletes with its own)."""

    async def delete_many(self, keys):
        keys = list(keys)
        if keys:
            raise PermissionDenied(f"{keys[0]}: AccessDenied")


def test_a_replica_that_may_not_delete_keeps_reading_epochs_after_writing_snapshots():
    """Its snapshot is written and its pruning refused: counted, told once,
    and the manifest goes on (the refusal used to fail the tick that wrote
    the snapshot, again at every try: the replica read no epoch after it)."""
    store = NoDeletes()
    clock = Clock()
    a, b = (replica(store, clock, w, snapshot_epochs=2) for w in ("aaaa", "bbbb"))
    run(add_in_turn(a, b, clock, 16))
    assert len(run(store.list_keys(BASE + "snap/"))) > a.s.snapshots_kept  # none pruned
    denied = a.counters.totals().get("manifest_prune_denied", 0) + b.counters.totals().get(
        "manifest_prune_denied", 0
    )
    assert denied >= 1
    assert all(key(i) in a.manifest and key(i) in b.manifest for i in range(16))
    assert a.counters.totals().get("manifest_errors", 0) == 0 == b.counters.totals().get("manifest_errors", 0)


def test_a_first_start_catching_up_its_epochs_still_publishes_what_is_due():
    """A first start reads the whole lookback (2 x skew) epoch by epoch. While
    that catch-up runs, a bad record (and a store) still goes out when its
    publish is due: a replica whose run was shorter than its catch-up, then
    killed at shutdown, published neither (the e2e trust test caught it)."""
    from s3kv.testing import virtual_loop

    bucket = MemoryStore()
    read_s = 0.5  # each epoch read: the catch-up of ~20 epochs takes ~10 s

    class SlowEpochs(View):
        async def get_object(self, key, range=None):
            if "/ep/" in key:
                await asyncio.sleep(read_s)
            return await super().get_object(key, range)

        async def get(self, key, range=None):
            if "/ep/" in key:
                await asyncio.sleep(read_s)
            return await super().get(key, range)

    async def go():
        loop = asyncio.get_running_loop()

        def clock():
            return T0 + loop.time()

        settings = SyncSettings(publish_s=PUBLISH_S, refresh_s=PUBLISH_S, skew_s=SKEW_S, protocol="epochs")
        r = ManifestSync(
            SlowEpochs(bucket), BASE, Manifest(), settings, writer="rrrr", clock=clock, offload=inline
        )
        task = asyncio.ensure_future(r.run())
        try:
            while not r.loaded:
                await asyncio.sleep(0.05)
            start = loop.time()
            r.manifest.add(key(1))
            r.manifest.quarantine(key(2), BASE + "bad-object", "etag")
            loaded_at = r.refreshed_at
            while loop.time() < start + 4 * PUBLISH_S:
                if any(m.get("bad") for m in await _segment_metas(bucket)):
                    break
                await asyncio.sleep(0.05)
            caught_up = r.refreshed_at != loaded_at
            return loop.time() - start, caught_up, await _segment_metas(bucket)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    took, caught_up, metas = virtual_loop.run(go())
    assert [m["bad"] for m in metas if m.get("bad")] == [[[BASE + "bad-object", "etag"]]], metas
    assert took <= 2 * PUBLISH_S + read_s, took
    assert not caught_up  # the catch-up was still going when the record went out


async def _segment_metas(store):
    out = []
    for name in await store.list_keys(BASE + "seg/"):
        out.append(mf.decode(await store.get(name), name=name).meta)
    return out


def test_the_shutdown_publish_waits_for_the_loops_publish_it_cancels():
    """At shutdown the loop is cancelled and the last publish called at once:
    the loop's own publish, cancelled mid-PUT, puts its bad record back while
    the last one runs. The last one waits for it, so the record goes out."""
    bucket = MemoryStore()

    async def go():
        clock = Clock(T0)
        settings = SyncSettings(publish_s=PUBLISH_S, refresh_s=PUBLISH_S, skew_s=SKEW_S, protocol="segments")
        store = HeldPuts(bucket, hold="/seg/")  # the first segment PUT, until cancelled
        r = ManifestSync(store, BASE, Manifest(), settings, writer="rrrr", clock=clock, offload=inline)
        task = asyncio.ensure_future(r.run())
        while not r.loaded:
            await asyncio.sleep(0)
        r.manifest.quarantine(key(2), BASE + "bad-object", "etag")
        clock.t += 2 * PUBLISH_S
        while not store.held:  # the loop's publish took the record and hangs in its PUT
            await asyncio.sleep(0.01)
        task.cancel()
        await r.publish()  # as the shutdown's, scheduled right behind the cancel
        await asyncio.gather(task, return_exceptions=True)
        return await _segment_metas(bucket)

    metas = run(go())
    assert [m["bad"] for m in metas if m.get("bad")] == [[[BASE + "bad-object", "etag"]]], metas
