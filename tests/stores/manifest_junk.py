"""What a shared bucket's manifest prefix may hold besides s3kv's own
objects: one or more of each kind of junk, with the reason a replica must
give for skipping it (the ``manifest_skipped`` label) and the keys it
names, which no replica may take from it."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

from s3kv.manifest import format as mf
from s3kv.manifest import protocol as mp
from s3kv.manifest.keyset import Manifest, fingerprints
from s3kv.manifest.sync import ManifestSync, SyncSettings
from s3kv.stores.memory import MemoryStore
from tests.stores.wrappers import WrappedStore

FUTURE_MS = 10 * 365 * 86_400_000
"""Ten years ahead: far beyond any clock-skew margin."""
MAX_BYTES = 64 << 10
"""The ``max_object_bytes`` the tests run with."""


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") * 2


@dataclass(frozen=True)
class Junk:
    name: str
    body: bytes
    reason: str
    keys: tuple[bytes, ...] = ()


def segment(*keys: bytes, removed: tuple[bytes, ...] = ()) -> bytes:
    return mf.encode(mf.ManifestObject("segment", fingerprints(list(keys)), fingerprints(list(removed))))


def snapshot(*keys: bytes, horizon: str = "") -> bytes:
    meta = {"horizon": horizon, "recent": [], "writer": "junk"} if horizon else {}
    return mf.encode(mf.ManifestObject("snapshot", fingerprints(list(keys)), meta=meta))


def junk(base: str, now_ms: int, *, markers: bool = True) -> list[Junk]:
    """Junk stamped around ``now_ms`` (newer than the real snapshot a test
    wrote before, so that a loading replica meets it first)."""
    future_seg = mp.segment_name(base, now_ms + FUTURE_MS, "futr", 1)
    big = [key(5000 + i) for i in range(MAX_BYTES // 8 + 10)]
    out = [
        Junk(base + "seg/README.txt", b"what this folder is for", "foreign"),
        Junk(base + "seg/" + mp.stamp(now_ms - 950) + "-w0", segment(key(1001)), "foreign", (key(1001),)),
        Junk(
            mp.segment_name(base, now_ms - 940, "w0", 1) + ".partial",
            segment(key(1002)),
            "foreign",
            (key(1002),),
        ),
        Junk(base + "snap/backup", snapshot(key(1003)), "foreign", (key(1003),)),
        Junk(mp.segment_name(base, now_ms - 900, "junk", 1), b"", "garbage"),
        Junk(mp.segment_name(base, now_ms - 800, "junk", 2), bytes(range(200)), "garbage"),
        Junk(
            mp.segment_name(base, now_ms - 700, "junk", 3),
            mf.encode(mf.ManifestObject("access", fingerprints([key(1004)]))),
            "garbage",
            (key(1004),),
        ),
        Junk(mp.snapshot_name(base, now_ms - 600, "junk"), b"", "garbage"),
        Junk(mp.snapshot_name(base, now_ms - 550, "junkb"), b"S3KM" + bytes(96), "garbage"),
        Junk(mp.segment_name(base, now_ms - 500, "deny", 1), segment(key(1005)), "denied", (key(1005),)),
        Junk(mp.snapshot_name(base, now_ms - 450, "deny"), snapshot(key(1006)), "denied", (key(1006),)),
        Junk(future_seg, segment(key(1007)), "future", (key(1007),)),
        Junk(
            mp.snapshot_name(base, now_ms + FUTURE_MS, "futr"),
            snapshot(key(1008), horizon=future_seg),
            "future",
            (key(1008),),
        ),
        # A current name, but what it covers reaches into the future.
        Junk(
            mp.snapshot_name(base, now_ms - 350, "horz"),
            snapshot(key(1009), horizon=future_seg),
            "future",
            (key(1009),),
        ),
        Junk(mp.segment_name(base, now_ms - 400, "big", 1), segment(*big), "oversize", tuple(big[:3])),
    ]
    if markers:
        out += [Junk(base + "seg/", b"", "marker"), Junk(base + "snap/", b"", "marker")]
    return out


def reasons(objects: list[Junk]) -> Counter[str]:
    return Counter(j.reason for j in objects)


def named_keys(objects: list[Junk], reason: str | None = None) -> list[bytes]:
    return [k for j in objects if reason in (None, j.reason) for k in j.keys]


# Replicas over a bucket with real history and junk, for the unit tests of the
# reader, the sync and gc's compaction.

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
