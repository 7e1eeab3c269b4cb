"""The one snapshot writer and the one prune rule (s3kv.manifest.snapshots)
that replicas and gc's compaction both follow."""

import asyncio

import numpy as np
import pytest

from s3kv.errors import AlreadyExists
from s3kv.manifest import format as mf
from s3kv.manifest import protocol as mp
from s3kv.manifest.snapshots import SNAPSHOTS_KEPT, stale_snapshots, write_snapshot
from s3kv.manifest.sync import SyncSettings
from s3kv.stores.memory import MemoryStore

BASE = "pfx/" + "ab" * 16 + "/manifest/"
NOW_MS = 1_700_000_000_000


def snap(ts_ms, writer="aaaa"):
    return mp.snapshot_name(BASE, ts_ms, writer)


def test_the_newest_few_stay_and_the_rest_go_oldest_first():
    names = [snap(NOW_MS - i * 1000) for i in range(6)]
    assert stale_snapshots(BASE, names, limit_ms=NOW_MS, kept=2) == sorted(names)[:4]
    assert stale_snapshots(BASE, names, limit_ms=NOW_MS) == sorted(names)[: 6 - SNAPSHOTS_KEPT]
    assert stale_snapshots(BASE, names[:2], limit_ms=NOW_MS, kept=3) == []


def test_junk_is_neither_counted_among_the_newest_nor_deleted():
    real = [snap(NOW_MS - i * 1000) for i in range(4)]
    future = snap(NOW_MS + 10**9, "futr")
    junk = [BASE + "snap/backup", BASE + "snap/" + mp.stamp(NOW_MS - 500) + "-not a writer", future]
    stale = stale_snapshots(BASE, real + junk, limit_ms=NOW_MS, kept=2)
    assert stale == sorted(real)[:2]  # the two newest real ones stay, though junk sorts after them


def test_the_cover_and_every_snapshot_after_it_stay():
    """gc prunes segments under the newest snapshot old enough (the cover):
    it stays, as do the younger ones, however many they are."""
    names = [snap(NOW_MS - i * 1000) for i in range(8)]
    ordered = sorted(names)
    stale = stale_snapshots(BASE, names, limit_ms=NOW_MS, kept=2, cover=ordered[3])
    assert stale == ordered[:3]
    assert stale_snapshots(BASE, names, limit_ms=NOW_MS, kept=2, cover=ordered[-1]) == ordered[:6]


def test_replicas_keep_as_many_as_gc_by_default():
    assert SyncSettings().snapshots_kept == SNAPSHOTS_KEPT


def test_the_writer_stamps_names_and_signs_nothing_it_was_not_given():
    store = MemoryStore()
    live = np.array([3, 5, 8], dtype=np.uint64)
    horizon = mp.Horizon.over([mp.segment_name(BASE, NOW_MS - 10, "w", 1)], 60_000)
    stamps = iter([NOW_MS, NOW_MS])

    def write(by=None):
        return asyncio.run(
            write_snapshot(store, BASE, live, horizon, writer="gc1", next_ts=lambda: next(stamps), by=by)
        )

    meta = write(by="gc")
    assert meta.key == snap(NOW_MS, "gc1") and meta.size == len(asyncio.run(store.get(meta.key)))
    obj = mf.decode(asyncio.run(store.get(meta.key)))
    assert obj.kind == "snapshot" and obj.added.tolist() == [3, 5, 8]
    assert obj.meta == {**horizon.meta(), "writer": "gc1", "by": "gc"}
    assert not mf.is_signed(asyncio.run(store.get(meta.key)))
    with pytest.raises(AlreadyExists):  # create-only: a name is written once
        write()
