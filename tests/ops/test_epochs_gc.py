"""gc and the listing over a manifest prefix that holds epoch objects
(``manifest/ep/{e_ms}/{e}``, :mod:`s3kv.manifest.epochs`): they are the
fleet's manifest objects, never foreign; gc's compaction prunes those no
reader needs any more (ending more than the lookback, twice the skew
margin, before the oldest kept snapshot's epoch, and older than
``segment_min_age_s``), never the newest of a chain, never one a kept
snapshot's reader needs, and none while a kept snapshot's header does not
read; a retired namespace loses them with its manifest."""

from __future__ import annotations

import time

from s3kv.manifest import format as mf
from s3kv.manifest import protocol as mp
from s3kv.ops import gc
from s3kv.ops.inventory import epoch_id, scan
from s3kv.ops.verify import verify
from s3kv.stores.memory import MemoryStore
from tests.stores.manifest_junk import BASE, SKEW_S, T, run

E_MS = 5000
"""The fleet's epoch length (publish_s 5 s)."""
NOW_MS = int(T * 1000)
LOOKBACK_MS = 2 * SKEW_S * 1000
HOUR = mp.HOUR_MS


def epoch_at(ts_ms: int, e_ms: int = E_MS) -> str:
    """The epoch object of the epoch stamp ``ts_ms`` falls in."""
    return mp.epoch_name(BASE, mp.epoch_of(ts_ms, e_ms), e_ms)


def snapshot_body(epoch: int | None = None, *, e_ms: int = E_MS, horizon: str = "") -> bytes:
    meta: dict = {"horizon": horizon, "recent": [], "writer": "w0"}
    if epoch is not None:
        meta |= {"epoch": epoch, "e_ms": e_ms}
    return mf.encode(mf.ManifestObject("snapshot", meta=meta))


def put_snapshots(store: MemoryStore, ages_h: tuple[int, ...] = (4, 3, 2, 1)) -> dict[int, str]:
    """A snapshot ``age`` hours old for each age, each covering the epochs
    up to the one before its stamp."""
    names = {}
    for age in ages_h:
        ts = NOW_MS - age * HOUR
        names[age] = mp.snapshot_name(BASE, ts, "w0")
        run(store.put(names[age], snapshot_body(mp.epoch_of(ts, E_MS) - 1)))
    return names


def compact(store: MemoryStore) -> gc.Result:
    inv = run(scan(store, "pfx"))
    return run(gc.execute(store, inv, gc.plan(inv, gc.Policy(skew_s=SKEW_S), T), lease=None, clock=lambda: T))


def epochs_left(store: MemoryStore) -> set[str]:
    return set(run(store.list_keys(BASE + mp.EPOCHS)))


def test_the_listing_takes_epochs_for_manifest_objects_and_other_names_under_ep_for_foreign():
    store = MemoryStore()
    real = [epoch_at(NOW_MS - 30_000), epoch_at(NOW_MS - 30_000, 2000)]
    junk = [BASE + "ep/README", BASE + "ep/005000/12", BASE + "ep/000000/000000000001", real[0] + ".partial"]
    for name in real + junk:
        run(store.put(name, b"x" * 100))
    info = run(scan(store, "pfx")).namespaces[BASE.split("/")[1]]
    assert sorted(m.key for m in info.epochs) == sorted(real)
    assert {m.key for m in info.foreign} == set(junk)
    assert set(real) <= {m.key for m in info.manifest_objects}
    assert epoch_id(BASE, real[1]).e_ms == 2000 and epoch_id(BASE, junk[1]) is None
    report = run(verify(store, run(scan(store, "pfx")), sample=0))
    assert {p.key for p in report.foreign} == set(junk)  # the real ones are no stranger's


def test_gc_prunes_epochs_no_reader_needs_and_keeps_the_rest():
    store = MemoryStore()
    snaps = put_snapshots(store)
    # The snapshots kept: the newest three (3 h, 2 h, 1 h old). The oldest of
    # them covers the epoch before 3 h ago; its readers need the epochs after
    # it and those within the lookback before it.
    s3 = mp.epoch_of(NOW_MS - 3 * HOUR, E_MS) - 1
    floor = mp.epoch_end(s3, E_MS) - LOOKBACK_MS
    old = [epoch_at(NOW_MS - 4 * HOUR), epoch_at(floor - E_MS), epoch_at(NOW_MS - 5 * HOUR, 2000)]
    needed = [
        epoch_at(floor + 1),  # within the lookback before the oldest kept snapshot's epoch
        mp.epoch_name(BASE, s3, E_MS),
        mp.epoch_name(BASE, s3 + 1, E_MS),  # the first one its readers GET
        epoch_at(NOW_MS - 2 * HOUR),
        epoch_at(NOW_MS - 2 * HOUR, 2000),  # another chain's, as new: kept by time
        epoch_at(NOW_MS - 5_000),  # the newest
    ]
    lonely = epoch_at(NOW_MS - 6 * HOUR, 3000)  # the newest (and only) one of its chain
    junk = BASE + "ep/005000/old"
    for name in (*old, *needed, lonely, junk):
        run(store.put(name, b"x" * 64))
    result = compact(store)
    assert result.epochs_deleted == len(old) and not result.failed
    assert epochs_left(store) == {*needed, lonely, junk}
    assert snaps[4] not in set(run(store.list_keys(BASE + "snap/")))  # pruned as replicas prune
    assert compact(store).epochs_deleted == 0  # nothing more to prune


def test_gc_keeps_every_epoch_younger_than_the_segment_min_age():
    """Fresh snapshots' epochs are recent: the epochs a replica that fell
    behind reads in order stay, whatever the snapshots say."""
    store = MemoryStore()
    for age_s in (40, 30, 20):
        ts = NOW_MS - age_s * 1000
        run(store.put(mp.snapshot_name(BASE, ts, "w0"), snapshot_body(mp.epoch_of(ts, E_MS) - 1)))
    young = [epoch_at(NOW_MS - s * 1000) for s in (590, 300, 100, 5)]
    old = epoch_at(NOW_MS - 700_000)
    for name in (*young, old):
        run(store.put(name, b"x"))
    assert compact(store).epochs_deleted == 1
    assert epochs_left(store) == set(young)


def test_a_kept_snapshot_of_before_epochs_holds_the_epochs_from_its_horizon():
    """A snapshot without an epoch in its header (an older replica's, gc's
    own): its readers list segments after its horizon; the epochs from there
    less the lookback stay."""
    store = MemoryStore()
    put_snapshots(store, (4, 3, 2))
    horizon_ms = NOW_MS - 5 * HOUR
    horizon = mp.segment_name(BASE, horizon_ms, "w0", 1)
    run(store.put(mp.snapshot_name(BASE, NOW_MS - HOUR, "old"), snapshot_body(horizon=horizon)))
    kept = [epoch_at(horizon_ms - LOOKBACK_MS + E_MS), epoch_at(NOW_MS - 3 * HOUR - 10 * E_MS)]
    pruned = epoch_at(horizon_ms - LOOKBACK_MS - E_MS)
    for name in (*kept, pruned, epoch_at(NOW_MS - 5_000)):
        run(store.put(name, b"x"))
    assert compact(store).epochs_deleted == 1
    assert pruned not in epochs_left(store) and set(kept) <= epochs_left(store)


def test_no_epoch_is_pruned_while_a_kept_snapshots_header_does_not_read():
    """A kept snapshot gc cannot read may be one a newer replica reads (a
    newer format), or one that says nonsense: which epochs its readers need
    is unknown, so none goes this run."""
    for body in (b"S3KM" + bytes(60), snapshot_body(-3), snapshot_body(7, e_ms=0)):
        store = MemoryStore()
        put_snapshots(store, (4, 3, 2))
        run(store.put(mp.snapshot_name(BASE, NOW_MS - HOUR, "bad"), body))
        old = [epoch_at(NOW_MS - 5 * HOUR), epoch_at(NOW_MS - 4 * HOUR)]
        for name in (*old, epoch_at(NOW_MS - 5_000)):
            run(store.put(name, b"x"))
        assert compact(store).epochs_deleted == 0
        assert set(old) <= epochs_left(store)


def test_no_epoch_is_pruned_without_a_snapshot():
    store = MemoryStore()
    old = [epoch_at(NOW_MS - 5 * HOUR), epoch_at(NOW_MS - 4 * HOUR), epoch_at(NOW_MS - 5_000)]
    for name in old:
        run(store.put(name, b"x"))
    assert compact(store).epochs_deleted == 0 and epochs_left(store) == set(old)


def test_a_retired_namespace_loses_its_epochs_with_its_manifest():
    store = MemoryStore()
    put_snapshots(store, (2,))
    names = [epoch_at(NOW_MS - 3 * HOUR), epoch_at(NOW_MS - 2 * HOUR)]
    for name in names:
        run(store.put(name, b"x"))
    inv = run(scan(store, "pfx"))
    (ns,) = inv.namespaces
    policy = gc.Policy(namespaces=(ns,), retire=True, min_age_s=0, skew_s=SKEW_S)
    later = time.time() + 1  # the store dates its objects by the wall clock
    p = gc.plan(inv, policy, later)
    assert set(names) <= {o.key for o in p.namespace_objects}
    result = run(gc.execute(store, inv, p, lease=None, clock=lambda: later))
    assert result.namespaces_removed == [ns] and not epochs_left(store)
