"""gc over a manifest prefix that holds junk: its stamps
(:meth:`~s3kv.ops.inventory.NamespaceInfo.stamps`) and its compaction
(:mod:`s3kv.ops.compaction`) ignore names in the future, and it prunes
snapshots as replicas do. The replicas over the same junk:
tests/unit/test_manifest_reader.py and test_manifest_sync_junk.py."""

from __future__ import annotations

from s3kv.manifest import format as mf
from s3kv.manifest import protocol as mp
from s3kv.manifest.tombstones import publish_tombstones
from s3kv.ops.inventory import NamespaceInfo
from s3kv.stores.base import ObjectMeta
from s3kv.stores.memory import MemoryStore
from tests.stores.manifest_junk import (
    BASE,
    FUTURE_MS,
    NS,
    SKEW_S,
    T,
    key,
    real_history,
    replica,
    run,
    segment,
)
from tests.stores.wrappers import WrappedStore


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
