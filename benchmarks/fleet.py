"""Fleet: what the hot manifest costs each replica as the fleet grows
(issue 18.4), from s3kv's own manifest classes.

N replicas, in one process, each with a :class:`~s3kv.manifest.Manifest`,
the scheduler side's :class:`~s3kv.manifest.ManifestSync` (access records,
polling for segments, snapshots) and one worker rank's
:class:`~s3kv.manifest.publish.ShardPublisher` (its stores' segments), at
the default settings (``manifest_publish_s`` 5 s, ``manifest_refresh_s``
5 s, ``manifest_clock_skew_s`` 60 s, a snapshot after 256 segments and
600 s). Each replica stores new chunks (``STORES_PER_S``; the worker's
publisher hears of each PUT, the scheduler side's manifest adds it
unpublished, as ``S3TierManager.complete_store`` does) and looks up
prompts: keys other replicas stored in the last minute and keys nobody
stored; its hits are recorded as uses (access records).

Time is virtual. The replicas' timers (each with its own phase, the
scheduler side's and the worker's apart) are events on one clock, passed
as ``clock`` to every class, and the driver calls what the loops
(``ManifestSync.run``, ``ShardPublisher.run``) would call when they would
call it: every request is a real one, but it takes no virtual time, so a
fleet of 100 whose 10,000 segment GETs per 5 s no loopback server serves
in real time runs at the default settings anyway, faster or slower than
real time (the "x virtual" column). Rates are per second of that clock,
i.e. real-time rates at the default settings; staleness is the protocol's
(timers only: add each refresh's request latency). A store's staleness:
from the chunk's PUT returning until a replica's manifest answers yes, at
its refreshes; "every replica" is the last of them.

Where the requests go: the fleet sweep uses s3kv's dict-backed
MemoryStore (listing from a sorted index, :class:`Bucket`) behind a wrapper that counts what S3 would be sent (a LIST per
1,000 keys listed, multipart PUTs by S3Store's parts) and the bytes (a
LIST page's XML measured on the loopback moto server); moto serves ~100
small requests a second on this machine, far fewer than N=100 needs. The
same driver then runs N=10 against moto through S3Store, counted by s3kv's
own ``s3_requests_*`` counters, and its requests must equal the model's;
and (full mode) N=10 runs the real loops on moto in real time, settings
and rates scaled by ``REALTIME_FACTOR``. Memory: the manifest's arrays and
tracemalloc peaks of a load, a merge and a snapshot's encoding at 1M and
10M keys. Start-up: a new replica loading a snapshot of 1M and 10M keys and
segments after it from moto.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import gc
import heapq
import logging
import math
import os
import sys
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import Bar, Result, main_for, start_server
from s3kv.config import S3KVConfig
from s3kv.keys import fingerprint
from s3kv.manifest import Manifest, ManifestSync, SyncSettings
from s3kv.manifest import format as mf
from s3kv.manifest.protocol import Horizon, manifest_prefix, segment_name, snapshot_name
from s3kv.manifest.publish import ShardPublisher
from s3kv.stats import Counters
from s3kv.stores.base import ByteRange, ObjectMeta, ObjectStore, PutMode, Update, check_directory_listing
from s3kv.stores.factory import make_store
from s3kv.stores.memory import MemoryStore
from s3kv.stores.s3 import S3Options

NAME = "fleet"
TITLE = "Fleet scale: the manifest's S3 requests, staleness, memory and start-up with N replicas"
GOAL = "report per-replica S3 traffic, staleness, memory and start-up at N = 10, 30, 100; 1,000 on paper"

BUCKET = "s3kv-fleet"
PREFIX = "fleet"
NAMESPACE = "f1ee7000000000000000000000000000"
BASE = manifest_prefix(PREFIX, NAMESPACE)
SETTINGS = SyncSettings()
"""The defaults: what a replica runs unless configured otherwise."""

STORES_PER_S = 10.0
"""New chunks a replica stores a second (~2,600 new prompt tokens/s at 256-token chunks)."""
LOOKUPS_PER_S = 4.0
"""Prompts a replica looks up a second..."""
LOOKUP_FLEET_KEYS = 16
"""... each with this many chunks other replicas stored in the last ``LOOKUP_AGE_S``..."""
LOOKUP_NEW_KEYS = 16
"""... and this many nobody stored."""
LOOKUP_AGE_S = 60.0
TICK_S = 0.1
"""The workload's step (stores and lookups), in virtual seconds."""
LIST_PAGE = 1000
"""Keys per ListObjectsV2 answer (S3's maximum, and what S3Store asks for)."""
TP = 1
"""Ranks per replica: each rank publishes its own segments (all counts of
segments scale with it; the paper figures say so)."""

PRICE_PUT = 0.005 / 1000
"""S3 Standard, us-east-1, per request: PUT, COPY, POST, LIST."""
PRICE_GET = 0.0004 / 1000
"""GET, SELECT and every other request (HEAD); DELETE is free."""
PRICE_EXPRESS_PUT = 0.00113 / 1000
PRICE_EXPRESS_GET = 0.00003 / 1000
"""S3 Express One Zone, us-east-1, per request (list prices since April
2025); no per-GB charge on requests under 512 KB, which manifest objects are."""
PREFIX_PUT_LIMIT = 3500
PREFIX_GET_LIMIT = 5500
"""S3's request rates per partitioned prefix (per second)."""
REALTIME_FACTOR = 2.5
"""The real-loop check's time compression: every interval divided by it."""
PAPER_N = 1000
START_SEGMENT_KEYS = 50
"""Keys in each segment of the start-up case (one publish interval's stores)."""


# -- a store that counts what S3 would be sent ----------------------------------------


def _dir(key: str) -> str:
    """The manifest directory of ``key`` (seg, snap, access) or "other"."""
    if key.startswith(BASE):
        head = key[len(BASE) :].split("/", 1)[0]
        if head in ("seg", "snap", "access"):
            return head
    return "other"


@dataclass
class ListBytes:
    """What a ListObjectsV2 answer weighs: per page, and per key beyond its name."""

    page: float = 1050.0
    key: float = 190.0

    @classmethod
    def measure(cls, server: Any) -> ListBytes:
        """From moto's answers for one and for 21 keys named like segments."""
        client = server.client()
        sizes: list[int] = []
        client.meta.events.register(
            "after-call.s3.ListObjectsV2", lambda http_response, **_: sizes.append(len(http_response.content))
        )
        base = manifest_prefix("calibrate", NAMESPACE)
        names = [segment_name(base, 1_700_000_000_000 + i, "0123456789ab01r0", i + 1) for i in range(21)]
        for name in names:
            client.put_object(Bucket=BUCKET, Key=name, Body=b"x")
        client.list_objects_v2(Bucket=BUCKET, Prefix=base, StartAfter=names[-2])
        client.list_objects_v2(Bucket=BUCKET, Prefix=base)
        per_key = (sizes[1] - sizes[0]) / 20
        client.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": n} for n in names]})
        return cls(page=sizes[0] - per_key, key=per_key - len(names[0]))


class Bucket(MemoryStore):
    """s3kv's MemoryStore, listing from a sorted index (bisect to the first
    key after ``start_after``) as S3 does, instead of sorting every key the
    bucket holds at each listing: the fleet lists thousands of times."""

    def __init__(self) -> None:
        super().__init__()
        self._sorted: list[str] = []
        self._etags: dict[str, str] = {}

    async def put(
        self, key: str, data: bytes | memoryview, *, mode: PutMode | Update = PutMode.OVERWRITE
    ) -> str | None:
        new = key not in self._objects
        etag = await super().put(key, data, mode=mode)
        if new:
            bisect.insort(self._sorted, key)
        self._etags[key] = etag or ""
        return etag

    async def list(self, prefix: str = "", *, start_after: str | None = None) -> AsyncIterator[ObjectMeta]:
        if start_after is not None and start_after >= prefix:
            i = bisect.bisect_right(self._sorted, start_after)
        else:
            i = bisect.bisect_left(self._sorted, prefix)
        while i < len(self._sorted) and self._sorted[i].startswith(prefix):
            key = self._sorted[i]
            data, mtime = self._objects[key]
            yield ObjectMeta(key, len(data), mtime, self._etags[key])
            i += 1

    async def delete_many(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        await super().delete_many(keys)
        gone = set(keys)
        self._sorted = [k for k in self._sorted if k not in gone]
        for k in gone:
            self._etags.pop(k, None)


class DirectoryBucket(Bucket):
    """:class:`Bucket` listed as an S3 Express directory bucket lists: whole
    prefixes that end with '/', no StartAfter (refused, as S3Store refuses
    it there). Its order stays the index's: the fleet counts requests, and
    the manifest's tests cover the order (tests/unit/test_manifest_listing.py)."""

    directory = True

    async def list(self, prefix: str = "", *, start_after: str | None = None) -> AsyncIterator[ObjectMeta]:
        check_directory_listing(BUCKET, prefix, start_after)
        async for meta in super().list(prefix):
            yield meta


class CountingStore(ObjectStore):
    """``inner`` (shared by the fleet), with one replica's requests counted
    as S3Store counts them (``s3_requests_<op>`` in ``counters``) and, here,
    by operation and manifest directory, with their bytes."""

    def __init__(self, inner: ObjectStore, counters: Counters, list_bytes: ListBytes) -> None:
        self.inner = inner
        self.directory = inner.directory
        self.counters = counters
        self.list_bytes = list_bytes
        self.counts: dict[str, float] = {}
        """``{op}:{dir}`` requests and ``bytes_{op}:{dir}`` bytes."""
        opts = S3Options()
        self._threshold, self._part = opts.multipart_threshold, opts.part_size

    def _add(self, op: str, key: str, requests: int, nbytes: float = 0) -> None:
        d = _dir(key)
        self.counts[f"{op}:{d}"] = self.counts.get(f"{op}:{d}", 0) + requests
        if nbytes:
            self.counts[f"bytes_{op}:{d}"] = self.counts.get(f"bytes_{op}:{d}", 0) + nbytes
        self.counters.add(f"s3_requests_{op}", requests)

    async def put(
        self, key: str, data: bytes | memoryview, *, mode: PutMode | Update = PutMode.OVERWRITE
    ) -> str | None:
        n = len(data)
        parts = 1 if n < self._threshold else math.ceil(n / self._part) + 2  # create, parts, complete
        self._add("put", key, parts, n)
        return await self.inner.put(key, data, mode=mode)

    async def get(self, key: str, range: ByteRange | None = None) -> bytes:
        self._add("get", key, 1)
        data = bytes(memoryview(await self.inner.get(key, range)))  # a body of its own, as over HTTP
        self.counts[f"bytes_get:{_dir(key)}"] = self.counts.get(f"bytes_get:{_dir(key)}", 0) + len(data)
        return data

    async def head(self, key: str) -> ObjectMeta:
        self._add("head", key, 1)
        return await self.inner.head(key)

    async def list(self, prefix: str = "", *, start_after: str | None = None) -> AsyncIterator[ObjectMeta]:
        n = key_bytes = 0
        try:
            async for meta in self.inner.list(prefix, start_after=start_after):
                n += 1
                key_bytes += len(meta.key)
                yield meta
        finally:  # a page per 1,000 keys (one for none), counted once the listing is read
            pages = max(1, math.ceil(n / LIST_PAGE))
            self._add(
                "list", prefix, pages, pages * self.list_bytes.page + n * self.list_bytes.key + key_bytes
            )
            d = _dir(prefix)
            self.counts[f"keys_list:{d}"] = self.counts.get(f"keys_list:{d}", 0) + n

    async def delete_many(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        if keys:
            self._add("delete", keys[0], math.ceil(len(keys) / 1000))
        await self.inner.delete_many(keys)


# -- the fleet ------------------------------------------------------------------------


class VirtualClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass
class Replica:
    idx: int
    store: ObjectStore
    counters: Counters
    manifest: Manifest
    sync: ManifestSync
    publisher: ShardPublisher
    unseen: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    """Ledger rows of others' stores this replica's manifest did not have at its last refresh."""
    cursor: int = 0
    """Ledger rows up to here were looked for at a refresh."""
    refreshes: int = 0
    refresh_wall_s: float = 0.0


class Ledger:
    """Every chunk the fleet stored: fingerprint, key, time, owner; and when
    the other replicas' manifests first had it."""

    def __init__(self, n_replicas: int, capacity: int) -> None:
        self.n = 0
        self.replicas = n_replicas
        self.fps = np.empty(capacity, dtype=np.uint64)
        self.t = np.empty(capacity)
        self.owner = np.empty(capacity, dtype=np.int32)
        self.keys: list[bytes] = []
        self.last_seen = np.empty(capacity)
        """Staleness for the last of the other replicas to see it, so far."""
        self.seen_by = np.empty(capacity, dtype=np.int32)
        self.pairs: list[np.ndarray] = []
        """Staleness of each (store, other replica) pair, per refresh."""

    def add(self, keys: list[bytes], t: float, owner: int) -> None:
        if self.n + len(keys) > len(self.fps):
            grow = max(len(self.fps), len(keys))
            for name in ("fps", "t", "owner", "last_seen", "seen_by"):
                arr = getattr(self, name)
                setattr(self, name, np.concatenate([arr, np.empty(grow, dtype=arr.dtype)]))
        end = self.n + len(keys)
        self.fps[self.n : end] = [fingerprint(k) for k in keys]
        self.t[self.n : end] = t
        self.owner[self.n : end] = owner
        self.last_seen[self.n : end] = 0.0
        self.seen_by[self.n : end] = 0
        self.keys.extend(keys)
        self.n = end

    def check(self, r: Replica, now: float, record: bool) -> None:
        """After ``r``'s refresh: which of the others' stores it now has."""
        new = np.arange(r.cursor, self.n)
        r.cursor = self.n
        new = new[self.owner[new] != r.idx]
        cand = np.concatenate([r.unseen, new])
        if not len(cand):
            return
        hit = r.manifest.present_fps(self.fps[cand])
        seen, r.unseen = cand[hit], cand[~hit]
        lag = now - self.t[seen]
        np.maximum.at(self.last_seen, seen, lag)
        self.seen_by[seen] += 1
        if record:
            self.pairs.append(lag.astype(np.float32))


def _writer_ids(n: int, rng: np.random.Generator) -> list[str]:
    """Writer ids as :func:`~s3kv.manifest.protocol.new_writer_id` makes them."""
    return [f"{int(rng.integers(16**10)):010x}{i % 100:02d}" for i in range(n)]


def _replica(
    i: int, writer: str, store: ObjectStore, counters: Counters, clock: Callable[[], float]
) -> Replica:
    manifest = Manifest()
    sync = ManifestSync(store, BASE, manifest, SETTINGS, counters=counters, writer=writer, clock=clock)
    publisher = ShardPublisher(
        store,
        BASE,
        writer,
        rank=0,
        ranks=TP,
        publish_s=SETTINGS.publish_s,
        skew_s=SETTINGS.skew_s,
        counters=counters,
        clock=clock,
    )
    return Replica(i, store, counters, manifest, sync, publisher)


def _workload(
    reps: list[Replica], ledger: Ledger, rng: np.random.Generator, now: float, dt: float, scale: float = 1.0
) -> tuple[int, int]:
    """``dt`` seconds of stores and lookups (rates times ``scale``) for every
    replica. Returns (chunks stored, fleet keys looked up, of them found)."""
    looked = found = 0
    stores = rng.poisson(STORES_PER_S * scale * dt, len(reps))
    for i in np.nonzero(stores)[0].tolist():
        r, count = reps[i], stores[i]
        if count:
            blob = rng.bytes(16 * int(count))
            keys = [blob[j : j + 16] for j in range(0, len(blob), 16)]
            for key in keys:  # the worker's PUT returned; the scheduler side hears of it
                r.publisher.stored(fingerprint(key))
                r.manifest.add(key, publish=False)
            ledger.add(keys, now, r.idx)
    lookups = rng.poisson(LOOKUPS_PER_S * scale * dt, len(reps))
    lo = int(np.searchsorted(ledger.t[: ledger.n], now - LOOKUP_AGE_S))
    for i in np.nonzero(lookups)[0].tolist():
        r = reps[i]
        for _ in range(int(lookups[i])):
            rows = rng.integers(lo, ledger.n, LOOKUP_FLEET_KEYS) if ledger.n > lo else np.empty(0, int)
            rows = rows[ledger.owner[rows] != r.idx]
            blob = rng.bytes(16 * LOOKUP_NEW_KEYS)
            keys = [ledger.keys[j] for j in rows.tolist()] + [
                blob[j : j + 16] for j in range(0, len(blob), 16)
            ]
            hit = r.manifest.present(keys)
            r.manifest.touch([k for k, h in zip(keys, hit.tolist()) if h])  # S3TierManager.record_use
            looked += len(rows)
            found += int(np.count_nonzero(hit[: len(rows)]))
    return int(stores.sum()), looked, found


def _totals(reps: list[Replica]) -> list[dict[str, float]]:
    """Each replica's counts so far: its store's (if it counts) and its s3_requests_*."""
    out = []
    for r in reps:
        counts = dict(getattr(r.store, "counts", {}))
        counts.update({k: v for k, v in r.counters.totals().items() if k.startswith("s3_requests_")})
        out.append(counts)
    return out


async def simulate(
    n: int,
    duration_s: float,
    warmup_s: float,
    store_for: Callable[[int, Counters], ObjectStore],
    seed: int = 18,
) -> dict[str, Any]:
    """The fleet on a virtual clock: ``warmup_s`` (the listing window fills),
    then ``duration_s`` measured."""
    rng = np.random.default_rng(seed)
    t0 = float(int(time.time()))
    clock = VirtualClock(t0)
    reps = []
    for i, writer in enumerate(_writer_ids(n, rng)):
        counters = Counters()  # one replica's: its store's requests and both sides' manifest figures
        reps.append(_replica(i, writer, store_for(i, counters), counters, clock))
    for r in reps:
        await r.sync.load()
    end = t0 + warmup_s + duration_s
    ledger = Ledger(n, int(n * STORES_PER_S * (warmup_s + duration_s) * 1.3) + 1024)
    events: list[tuple[float, int, int, str]] = []
    # (time, order at that time, replica, what): the scheduler side publishes
    # before it refreshes (one loop, the same intervals); the worker has its own phase.
    for r in reps:
        sched, worker = rng.uniform(0, SETTINGS.publish_s), rng.uniform(0, SETTINGS.publish_s)
        heapq.heappush(events, (t0 + worker, 1, r.idx, "shard"))
        heapq.heappush(events, (t0 + sched, 2, r.idx, "publish"))
        heapq.heappush(events, (t0 + sched + SETTINGS.refresh_s - SETTINGS.publish_s, 3, r.idx, "refresh"))
    heapq.heappush(events, (t0, 0, -1, "tick"))
    heapq.heappush(events, (t0 + warmup_s, 0, -1, "mark"))
    start: list[dict[str, float]] = []
    cpu0 = wall0 = 0.0
    snapshots: list[tuple[int, int]] = []
    stored = looked = found = 0
    measuring = False
    wall_start = time.perf_counter()
    while events:
        t, order, i, what = heapq.heappop(events)
        if t > end:
            break
        clock.t = t
        if what == "tick":
            a, b, c = _workload(reps, ledger, rng, t, TICK_S)
            if measuring:
                stored, looked, found = stored + a, looked + b, found + c
            heapq.heappush(events, (t + TICK_S, 0, -1, "tick"))
            continue
        if what == "mark":
            start, measuring = _totals(reps), True
            cpu0, wall0 = time.process_time(), time.perf_counter()
            for r in reps:
                r.refreshes, r.refresh_wall_s = 0, 0.0
            continue
        r = reps[i]
        if what == "shard":
            r.publisher.observe(r.sync.clock_ms)  # the scheduler side's clock, sent with each step
            await r.publisher.publish()
            heapq.heappush(events, (t + r.publisher.publish_s, order, i, what))
        elif what == "publish":
            await r.sync.publish()
            heapq.heappush(events, (t + SETTINGS.publish_s, order, i, what))
        else:
            w = time.perf_counter()
            await r.sync.refresh()
            r.refresh_wall_s += time.perf_counter() - w
            r.refreshes += 1
            if await r.sync.maybe_snapshot():
                snapshots.append((len(r.manifest), i))
            ledger.check(r, t, measuring and t <= end)
            heapq.heappush(events, (t + SETTINGS.refresh_s, order, i, what))
    wall = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0
    finish = _totals(reps)
    for r in reps:
        with contextlib.suppress(Exception):
            await r.store.close()
    window = [{k: f.get(k, 0) - s.get(k, 0) for k in f} for s, f in zip(start, finish)]
    # Staleness of the stores made while measuring, early enough that every
    # replica had two full rounds to see them.
    m0, m1 = t0 + warmup_s, end - SETTINGS.publish_s - 2 * SETTINGS.refresh_s
    rows = np.nonzero((ledger.t[: ledger.n] >= m0) & (ledger.t[: ledger.n] <= m1))[0]
    all_seen = rows[ledger.seen_by[rows] == n - 1]
    pairs = np.concatenate(ledger.pairs) if ledger.pairs else np.empty(0, np.float32)
    return {
        "n": n,
        "seconds": duration_s,
        "wall_s": time.perf_counter() - wall_start,
        "window_wall_s": wall,
        "cpu_s": cpu,
        "window": window,
        "finish": finish,
        "refreshes": sum(r.refreshes for r in reps),
        "refresh_wall_s": sum(r.refresh_wall_s for r in reps),
        "stale_all": ledger.last_seen[all_seen],
        "stale_pairs": pairs,
        "stores_checked": len(rows),
        "stores_unseen": len(rows) - len(all_seen),
        "snapshots": snapshots,
        "stored": stored,
        "looked": looked,
        "found": found,
        "keys": ledger.n,
        "directory": bool(reps[0].store.directory),
    }


# -- figures --------------------------------------------------------------------------


def _mean(window: list[dict[str, float]], key: str) -> float:
    return float(np.mean([w.get(key, 0.0) for w in window])) if window else 0.0


@dataclass
class Rates:
    """One replica's manifest traffic per real second (mean over the fleet)."""

    n: int
    put: float
    put_seg: float
    put_access: float
    list: float
    get: float
    keys_per_list: float
    segs_per_poll: float
    up_bps: float
    down_bps: float
    list_bps: float
    snapshot_put: float
    """Amortized: the fleet's one snapshot writer's share per replica."""
    chunk_put: float = 0.0
    """Chunk shards stored: one create-only PUT each (under the multipart threshold)."""
    chunk_get: float = 0.0
    """Chunk shards loaded from S3 (every fleet hit found): one GET each (a shard under ``range_bytes``)."""
    directory: bool = False
    """On an S3 Express directory bucket (its layout, and its prices)."""

    def _prices(self) -> tuple[float, float]:
        return (PRICE_EXPRESS_PUT, PRICE_EXPRESS_GET) if self.directory else (PRICE_PUT, PRICE_GET)

    @property
    def manifest_cost_per_hour(self) -> float:
        """The manifest's requests alone, USD per replica-hour."""
        put, get = self._prices()
        return 3600 * ((self.put + self.snapshot_put + self.list) * put + self.get * get)

    @property
    def cost_per_hour(self) -> float:
        """Every request a replica sends S3: the manifest's and its chunks' PUTs and GETs."""
        put, get = self._prices()
        return self.manifest_cost_per_hour + 3600 * (self.chunk_put * put + self.chunk_get * get)


def snapshot_period_s(n: int) -> float:
    """How often the fleet writes a snapshot at the default settings."""
    segments_per_s = n * TP / SETTINGS.publish_s
    return max(SETTINGS.snapshot_interval_s, SETTINGS.snapshot_every / segments_per_s)


def rates_of(sim: dict[str, Any]) -> Rates:
    w, s, n = sim["window"], sim["seconds"], sim["n"]
    put_seg = _mean(w, "put:seg") / s
    put_access = _mean(w, "put:access") / s
    lists = _mean(w, "list:seg") / s
    polls = sim["refreshes"] / n / s  # refreshes per replica-second
    return Rates(
        n=n,
        put=put_seg + put_access,
        put_seg=put_seg,
        put_access=put_access,
        list=lists,
        get=_mean(w, "get:seg") / s,
        keys_per_list=_mean(w, "keys_list:seg") / s / polls,
        segs_per_poll=_mean(w, "get:seg") / s / polls,
        up_bps=(_mean(w, "bytes_put:seg") + _mean(w, "bytes_put:access")) / s,
        down_bps=(_mean(w, "bytes_get:seg") + _mean(w, "bytes_list:seg")) / s,
        list_bps=_mean(w, "bytes_list:seg") / s,
        snapshot_put=2 / snapshot_period_s(n) / n,  # its PUT and its LIST of snapshots
        chunk_put=sim["stored"] / n / s * TP,
        chunk_get=sim["found"] / n / s * TP,
        directory=sim["directory"],
    )


def paper(n: int, at: Rates) -> Rates:
    """The rates at ``n`` replicas, from those measured at ``at.n``: what
    does not depend on N (a replica's own PUTs) stays, segments per poll and
    keys per listing grow with N, LIST pages by S3's 1,000 keys."""
    k = n / at.n
    keys = at.keys_per_list * k
    polls = 1 / SETTINGS.refresh_s
    seg_bytes = (at.down_bps - at.list_bps) * k  # every other replica's segments
    list_pages = math.ceil(keys / LIST_PAGE)
    list_bps = at.list_bps / max(at.keys_per_list, 1) * keys
    return Rates(
        n=n,
        put=at.put,
        put_seg=at.put_seg,
        put_access=at.put_access,
        list=list_pages * polls,
        get=at.get * k,
        keys_per_list=keys,
        segs_per_poll=at.segs_per_poll * k,
        up_bps=at.up_bps,
        down_bps=seg_bytes + list_bps,
        list_bps=list_bps,
        snapshot_put=2 / snapshot_period_s(n) / n,
        chunk_put=at.chunk_put,
        chunk_get=at.chunk_get,
    )


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def _row(r: Rates, stale: str, wall: str) -> list[Any]:
    return [
        f"{r.n:,}" + (" (directory)" if r.directory else ""),
        round(r.put + r.snapshot_put, 3),
        round(r.list, 3),
        round(r.get, 1),
        round(r.segs_per_poll, 1),
        f"{r.keys_per_list:,.0f}",
        f"{r.up_bps / 1e3:.2f} / {r.down_bps / 1e3:.1f}",
        stale,
        f"{r.chunk_put:.1f} / {r.chunk_get:.1f}",
        f"{r.manifest_cost_per_hour:.4f} / {r.cost_per_hour:.4f}",
        f"{r.get * r.n:,.0f}",
        wall,
    ]


# -- memory and start-up --------------------------------------------------------------


def _random_fps(n: int, seed: int) -> np.ndarray:
    return np.unique(np.random.default_rng(seed).integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True))


def _traced(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` and its peak of traced memory beyond what was held before."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = fn()
        return out, tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def memory(n_keys: int) -> dict[str, float]:
    """A replica's manifest at ``n_keys``: its bytes, and the peaks of
    loading it from a snapshot, of a merge, and of writing a snapshot."""
    fps = _random_fps(n_keys, n_keys)
    meta = {"horizon": "", "recent": [], "writer": "bench"}
    body, encode_peak = _traced(lambda: mf.encode(mf.ManifestObject("snapshot", fps, meta=meta)))
    inner = CountingStore(Bucket(), Counters(), ListBytes())
    name = snapshot_name(BASE, int(time.time() * 1000) - 1000, "bench")
    asyncio.run(inner.put(name, body))
    del body
    manifest = Manifest()

    def load() -> int:
        gc.collect()
        sync = ManifestSync(inner, BASE, manifest, SETTINGS)
        return asyncio.run(sync.load())

    gc.collect()
    tracemalloc.start()
    try:
        base0 = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        loaded = load()
        gc.collect()
        held, load_peak = (v - base0 for v in tracemalloc.get_traced_memory())
        nbytes = manifest.fps.nbytes
        # A merge: the fleet's changes since the last (merge_at of them) folded in.
        manifest.fps.update(_random_fps(manifest.fps.merge_at, 7))
        tracemalloc.reset_peak()
        now0 = tracemalloc.get_traced_memory()[0]
        manifest.fps.merge()
        merge_peak = tracemalloc.get_traced_memory()[1] - now0
    finally:
        tracemalloc.stop()
    assert loaded == len(fps)
    return {
        "keys": loaded,
        "nbytes": nbytes,
        "held": held,
        "load_peak": load_peak,
        "merge_peak": merge_peak,
        "encode_peak": encode_peak,
        "snapshot_bytes": 8 * len(fps),
    }


class Phases(ObjectStore):
    """``inner``, noting when a load turns from the snapshot to the segments
    (its first listing of segments)."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.segments_at: float | None = None

    async def put(
        self, key: str, data: bytes | memoryview, *, mode: PutMode | Update = PutMode.OVERWRITE
    ) -> str | None:
        return await self.inner.put(key, data, mode=mode)

    async def get(self, key: str, range: ByteRange | None = None) -> bytes:
        return await self.inner.get(key, range)

    async def head(self, key: str) -> ObjectMeta:
        return await self.inner.head(key)

    def list(self, prefix: str = "", *, start_after: str | None = None) -> AsyncIterator[ObjectMeta]:
        if prefix.endswith("/seg/") and self.segments_at is None:
            self.segments_at = time.perf_counter()
        return self.inner.list(prefix, start_after=start_after)

    async def delete_many(self, keys: Iterable[str]) -> None:
        await self.inner.delete_many(keys)

    async def close(self) -> None:
        await self.inner.close()


async def startup(endpoint: str, sizes: list[int], n_segments: int) -> list[dict[str, float]]:
    """A new replica's ``load()`` from moto: the newest snapshot (of each
    size in turn) and ``n_segments`` segments written after its horizon."""
    config = S3KVConfig(bucket=BUCKET, endpoint_url=endpoint, region="us-east-1")
    base = manifest_prefix(PREFIX + "-startup", NAMESPACE)
    writer_store = make_store(config)
    now_ms = int(time.time() * 1000)
    old = segment_name(base, now_ms - 3_600_000, "0000000000ab00r0", 1)
    await writer_store.put(old, mf.encode(mf.ManifestObject("segment", _random_fps(START_SEGMENT_KEYS, 1))))
    horizon = Horizon.over([old], int(SETTINGS.skew_s * 1000))
    sem = asyncio.Semaphore(16)
    span = int(SETTINGS.snapshot_interval_s * 1000)

    async def put_segment(j: int) -> None:
        ts = now_ms - span + j * span // max(n_segments, 1)
        name = segment_name(base, ts, f"{j % 1000:010x}{j % 100:02d}r0", j + 1)
        body = mf.encode(mf.ManifestObject("segment", _random_fps(START_SEGMENT_KEYS, 100 + j)))
        async with sem:
            await writer_store.put(name, body, mode=PutMode.CREATE)

    await asyncio.gather(*(put_segment(j) for j in range(n_segments)))
    out = []
    for k, size in enumerate([0, *sizes]):
        body = mf.encode(
            mf.ManifestObject("snapshot", _random_fps(size, size), meta={**horizon.meta(), "writer": "bench"})
        )
        t = time.perf_counter()
        await writer_store.put(snapshot_name(base, now_ms - 500 + k, "bench"), body)
        put_s = time.perf_counter() - t
        del body
        counters = Counters()
        store = Phases(make_store(config, counters))
        manifest = Manifest()
        t = time.perf_counter()
        keys = await ManifestSync(store, base, manifest, SETTINGS, counters=counters).load()
        load_s = time.perf_counter() - t
        snapshot_s = (store.segments_at or t) - t
        await store.close()
        totals = counters.totals()
        out.append(
            {
                "snapshot_keys": size,
                "keys": keys,
                "load_s": load_s,
                "snapshot_s": snapshot_s,
                "segments_s": load_s - snapshot_s,
                "put_s": put_s,
                "gets": totals.get("s3_requests_get", 0),
                "lists": totals.get("s3_requests_list", 0),
            }
        )
    await writer_store.close()
    return out


# -- real loops, real time ------------------------------------------------------------


async def realtime(endpoint: str, n: int, factor: float, wall_s: float, warm_s: float) -> dict[str, Any]:
    """``n`` replicas running the real loops (``ManifestSync.run``,
    ``ShardPublisher.run``) on moto, every interval and rate scaled by
    ``factor``; their rates and staleness scaled back to real time."""
    settings = SyncSettings(
        publish_s=SETTINGS.publish_s / factor,
        refresh_s=SETTINGS.refresh_s / factor,
        skew_s=SETTINGS.skew_s / factor,
        snapshot_interval_s=SETTINGS.snapshot_interval_s / factor,
    )
    config = S3KVConfig(bucket=BUCKET, endpoint_url=endpoint, region="us-east-1")
    base = manifest_prefix(PREFIX + "-realtime", NAMESPACE)
    rng = np.random.default_rng(3)
    reps = []
    for i, writer in enumerate(_writer_ids(n, rng)):
        counters = Counters()
        store = make_store(config, counters)
        manifest = Manifest()
        sync = ManifestSync(store, base, manifest, settings, counters=counters, writer=writer)
        pub = ShardPublisher(
            store,
            base,
            writer,
            rank=0,
            ranks=TP,
            publish_s=settings.publish_s,
            skew_s=settings.skew_s,
            counters=counters,
        )
        reps.append(Replica(i, store, counters, manifest, sync, pub))
    ledger = Ledger(n, int(n * STORES_PER_S * factor * wall_s * 1.3) + 1024)
    loaded = 0

    def on_loaded() -> None:
        nonlocal loaded
        loaded += 1

    tasks = [asyncio.create_task(r.sync.run(on_loaded)) for r in reps]
    while loaded < n:
        await asyncio.sleep(0.05)
    tasks += [asyncio.create_task(r.publisher.run()) for r in reps]
    t0 = time.time()
    start: list[dict[str, float]] = []
    marked = 0.0
    try:
        while (now := time.time()) < t0 + wall_s:
            for r in reps:
                r.publisher.observe(r.sync.clock_ms)
            _workload(reps, ledger, rng, now, TICK_S / factor, scale=factor)
            for r in reps:  # staleness, to this poll's resolution
                ledger.check(r, time.time(), bool(start))
            if not start and now >= t0 + warm_s:
                start, marked = _totals(reps), time.time()
            await asyncio.sleep(TICK_S / factor)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finish = _totals(reps)
    span = time.time() - marked
    for r in reps:
        await r.store.close()
    window = [{k: f.get(k, 0) - s.get(k, 0) for k in f} for s, f in zip(start, finish)]
    pairs = np.concatenate(ledger.pairs) * factor if ledger.pairs else np.empty(0)
    per_s = span * factor  # real seconds the window stands for
    return {
        "put": _mean(window, "s3_requests_put") / per_s,
        "list": _mean(window, "s3_requests_list") / per_s,
        "get": _mean(window, "s3_requests_get") / per_s,
        "stale_p50": _pct(pairs, 50),
        "stale_max": float(pairs.max()) if len(pairs) else float("nan"),
    }


# -- the benchmark --------------------------------------------------------------------


def run(work: Path, quick: bool) -> Result:
    t_start = time.perf_counter()
    logging.getLogger("s3kv").setLevel(logging.ERROR)
    sizes_n = [10, 30] if quick else [10, 30, 100]
    warmup, measure = SETTINGS.skew_s + 5, (30.0 if quick else 60.0)
    check_s = 30.0 if quick else 40.0
    mem_sizes = [1_000_000] if quick else [1_000_000, 10_000_000]
    start_segments = 50 if quick else 150

    server, creds, _pids = start_server("moto", work)
    os.environ.update(creds)
    try:
        server.create_bucket(BUCKET)
        list_bytes = ListBytes.measure(server)
        endpoint = server.endpoint_url
        # The driver against moto (N=10), then the same against the model.
        config = S3KVConfig(bucket=BUCKET, endpoint_url=endpoint, region="us-east-1")
        on_moto = asyncio.run(simulate(10, check_s, 5.0, lambda i, c: make_store(config, c)))
        shared = Bucket()
        on_model = asyncio.run(simulate(10, check_s, 5.0, lambda i, c: CountingStore(shared, c, list_bytes)))
        ops = ("put", "get", "list", "head", "delete")
        moto_ops = {op: sum(f.get(f"s3_requests_{op}", 0) for f in on_moto["finish"]) for op in ops}
        model_ops = {op: sum(f.get(f"s3_requests_{op}", 0) for f in on_model["finish"]) for op in ops}
        moto_refresh_ms = 1000 * on_moto["refresh_wall_s"] / max(on_moto["refreshes"], 1)
        moto_cpu_per_req = on_moto["cpu_s"] / max(sum(moto_ops.values()), 1)
        real = (
            None if quick else asyncio.run(realtime(endpoint, 10, REALTIME_FACTOR, wall_s=20.0, warm_s=5.0))
        )
        boot = asyncio.run(startup(endpoint, mem_sizes, start_segments))
    finally:
        server.stop()

    sims = []
    for n in sizes_n:
        shared = Bucket()
        sims.append(
            asyncio.run(simulate(n, measure, warmup, lambda i, c, s=shared: CountingStore(s, c, list_bytes)))
        )
    # The largest fleet again on an S3 Express directory bucket: segments
    # under minute prefixes, each listed whole.
    shared_dir = DirectoryBucket()
    on_directory = asyncio.run(
        simulate(sizes_n[-1], measure, warmup, lambda i, c: CountingStore(shared_dir, c, list_bytes))
    )
    mems = [memory(k) for k in mem_sizes]

    rows, bars, measured = [], [], []
    for sim in sims:
        r = rates_of(sim)
        measured.append(r)
        st = sim["stale_all"]
        stale = (
            f"{_pct(st, 50):.1f} / {_pct(st, 99):.1f} / {float(st.max()) if len(st) else float('nan'):.1f}"
        )
        rows.append(_row(r, stale, f"{sim['wall_s']:.0f} (x{(warmup + measure) / sim['wall_s']:.1f})"))
        bars.append(Bar(f"N={r.n} GET/s", r.get))
    big = measured[-1]
    rd = rates_of(on_directory)
    st = on_directory["stale_all"]
    rows.append(
        _row(
            rd,
            f"{_pct(st, 50):.1f} / {_pct(st, 99):.1f} / {float(st.max()) if len(st) else float('nan'):.1f}",
            f"{on_directory['wall_s']:.0f} (x{(warmup + measure) / on_directory['wall_s']:.1f})",
        )
    )
    at_paper = paper(PAPER_N, big)
    rows.append(_row(at_paper, "throttled (see notes)", "paper"))
    bars.append(Bar(f"N={PAPER_N:,} GET/s (paper)", at_paper.get))

    # -- notes
    r10 = measured[0]
    notes = [
        f"Per replica, per real second at the default settings (publish and refresh every "
        f"{SETTINGS.publish_s:.0f} s, clock-skew margin {SETTINGS.skew_s:.0f} s, TP {TP}); means over the "
        f"replicas of {measure:.0f} virtual seconds after {warmup:.0f} s of warm-up. Workload per replica: "
        f"{STORES_PER_S:.0f} new chunks/s stored, {LOOKUPS_PER_S:.0f} lookups/s of {LOOKUP_FLEET_KEYS} "
        f"chunks other replicas stored in the last {LOOKUP_AGE_S:.0f} s and {LOOKUP_NEW_KEYS} nobody did.",
        "PUT: the worker's segment and the scheduler side's access record, each once per publish "
        f"interval (at N=10: {r10.put_seg:.2f} + {r10.put_access:.2f}/s), and the fleet's one snapshot "
        f"writer's share ({SETTINGS.snapshot_interval_s:.0f} s apart). LIST: one per refresh per 1,000 "
        "keys in the listing window, which holds every segment of the last skew margin (the floor is "
        "60 s before the newest stamp seen). GET: every segment any rank of any replica wrote, its own "
        "ranks' included (N x TP per publish interval).",
        "Columns: PUT/s, LIST/s, GET/s per replica; segments fetched per poll; keys per listing; "
        "manifest kB/s up (PUT bodies) / down (GET bodies + LIST XML); staleness from a store to the "
        "last replica seeing it, p50 / p99 / max, virtual s; chunk shards PUT and GET per second; S3 "
        "request cost per replica-hour, USD (PUT and LIST $0.005, GET $0.0004 per 1,000, us-east-1), of the "
        "manifest's requests and of all of them (manifest and chunks); fleet-wide GET/s on the manifest "
        "prefix; wall seconds of the run (and virtual seconds per wall second).",
        f"Chunk requests: one create-only PUT per chunk shard stored (a shard is under the multipart "
        f"threshold), one GET per chunk shard loaded (a shard under range_bytes is one ranged GET); every "
        f"fleet key a lookup found is counted as loaded from S3 (none was in a local tier yet), TP {TP}. At "
        f"N={r10.n}: {r10.chunk_put:.1f} PUT/s and {r10.chunk_get:.1f} GET/s, "
        f"${r10.cost_per_hour - r10.manifest_cost_per_hour:.4f} of the ${r10.cost_per_hour:.4f} per "
        f"replica-hour ({100 * (1 - r10.manifest_cost_per_hour / r10.cost_per_hour):.0f}%); at N={big.n} the "
        f"manifest's share is {100 * big.manifest_cost_per_hour / big.cost_per_hour:.0f}%.",
    ]
    notes.append(
        f"Directory bucket (S3 Express One Zone), N={rd.n}: segments filed under minute prefixes, a poll lists "
        f"each minute from the floor to a skew ahead, whole (no StartAfter): {rd.list:.3f} LIST/s per replica "
        f"against {big.list:.3f} on a general-purpose bucket ({rd.list / max(big.list, 1e-9):.1f}x), the "
        f"same GETs ({rd.get:.1f}/s against {big.get:.1f}) and PUTs; "
        f"{on_directory['stores_unseen']} of {on_directory['stores_checked']} stores unseen at the end. "
        f"Cost at Express request prices (PUT and LIST ${PRICE_EXPRESS_PUT * 1000:.5f}, GET "
        f"${PRICE_EXPRESS_GET * 1000:.5f} per 1,000): the manifest's ${rd.manifest_cost_per_hour:.4f} per "
        f"replica-hour against ${big.manifest_cost_per_hour:.4f} on S3 Standard, all requests "
        f"${rd.cost_per_hour:.4f} against ${big.cost_per_hour:.4f}."
    )
    for sim in [*sims, on_directory]:
        if sim["stores_unseen"]:
            notes.append(
                f"N={sim['n']}: {sim['stores_unseen']} of {sim['stores_checked']} stores measured were not "
                "in every replica's manifest by the end."
            )
    pairs = sims[-1]["stale_pairs"]
    notes.append(
        f"Staleness is the protocol's: up to one publish interval until the segment, up to one refresh "
        f"until a replica lists it (per pair at N={sims[-1]['n']}: p50 {_pct(pairs, 50):.1f} s, max "
        f"{float(pairs.max()) if len(pairs) else float('nan'):.1f} s); each refresh's requests add their "
        f"latency (on loopback moto a refresh at N=10 took {moto_refresh_ms:.0f} ms of wall time). "
        f"Lookups of others' chunks stored 0-{LOOKUP_AGE_S:.0f} s earlier found "
        f"{100 * sims[-1]['found'] / max(sims[-1]['looked'], 1):.1f}% at N={sims[-1]['n']}."
    )
    same = all(moto_ops[op] == model_ops[op] for op in ops)
    notes.append(
        f"Cross-check, N=10 for {check_s:.0f} virtual s through S3Store on loopback moto, counted by s3kv's "
        f"s3_requests_* counters: {', '.join(f'{op} {moto_ops[op]:.0f}' for op in ops if moto_ops[op])}; "
        + (
            "the counting model sent exactly the same."
            if same
            else "the model: " + ", ".join(f"{op} {model_ops[op]:.0f}" for op in ops if model_ops[op]) + "."
        )
        + f" Client CPU per request there: {1000 * moto_cpu_per_req:.1f} ms (aiobotocore and the manifest "
        "code, on the scheduler side's event loop in the engine-core process)."
    )
    notes.append(
        "Download bytes are mostly LIST XML, the same window listed again at every refresh: "
        + ", ".join(f"{100 * r.list_bps / r.down_bps:.0f}% at N={r.n}" for r in measured)
        + f" (a ListObjectsV2 answer: {list_bytes.page:.0f} B a page, {list_bytes.key:.0f} B a key plus "
        "its name, measured on moto); a segment at this workload is "
        f"~{8 * STORES_PER_S * SETTINGS.publish_s + 100:.0f} B."
    )
    last = sims[-1]
    refresh_ms = 1000 * last["refresh_wall_s"] / max(last["refreshes"], 1)
    notes.append(
        f"CPU on the scheduler side: in-process (no HTTP) a refresh at N={last['n']} took {refresh_ms:.0f} ms "
        f"(list, sift, GET, decode and apply {big.segs_per_poll:.0f} segments), "
        f"{100 * refresh_ms / 1000 / SETTINGS.refresh_s:.1f}% of a core; the HTTP client adds its "
        f"{1000 * moto_cpu_per_req:.1f} ms a request: {100 * big.get * moto_cpu_per_req:.0f}% of a core at "
        f"N={big.n}, {100 * at_paper.get * moto_cpu_per_req:.0f}% at N={PAPER_N:,}, in the engine-core "
        "process whose GIL vLLM's scheduling loop shares."
    )
    if real is not None:
        notes.append(
            f"Real loops (ManifestSync.run, ShardPublisher.run), N=10 on moto, time compressed "
            f"{REALTIME_FACTOR}x (publish and refresh {SETTINGS.publish_s / REALTIME_FACTOR:.1f} s, skew "
            f"{SETTINGS.skew_s / REALTIME_FACTOR:.0f} s, workload {REALTIME_FACTOR}x), scaled back: PUT "
            f"{real['put']:.2f}/s, LIST {real['list']:.2f}/s, GET {real['get']:.2f}/s per replica (the driver: "
            f"{r10.put + r10.snapshot_put:.2f}, {r10.list:.2f}, {r10.get:.2f}); staleness per pair p50 "
            f"{real['stale_p50']:.1f} s, max {real['stale_max']:.1f} s (moto's latency and this machine's "
            f"load scaled up {REALTIME_FACTOR}x with it)."
        )
    for m in mems:
        notes.append(
            f"Memory at {m['keys'] / 1e6:.0f}M keys: the manifest holds {m['nbytes'] / 2**20:.1f} MiB "
            f"({m['nbytes'] / m['keys']:.2f} B/key; tracemalloc after load: {m['held'] / 2**20:.1f} MiB). "
            f"Peaks above that: loading the snapshot {m['load_peak'] / 2**20:.0f} MiB "
            f"({m['load_peak'] / m['snapshot_bytes']:.1f}x its {m['snapshot_bytes'] / 2**20:.0f} MiB), a "
            f"merge of {Manifest().fps.merge_at:,} changes {m['merge_peak'] / 2**20:.0f} MiB, encoding a "
            f"snapshot (the elected writer) {m['encode_peak'] / 2**20:.0f} MiB."
        )
    seg_rate = start_segments * len(boot) / sum(b["segments_s"] for b in boot)
    for b in boot[1:]:
        notes.append(
            f"Start-up of a new replica on loopback moto, {b['snapshot_keys'] / 1e6:.0f}M-key snapshot + "
            f"{start_segments} segments: {b['load_s']:.2f} s ({b['gets']:.0f} GETs, {b['lists']:.0f} LISTs): "
            f"the snapshot {b['snapshot_s']:.2f} s, the segments {b['segments_s']:.2f} s (writing the "
            f"snapshot took {b['put_s']:.2f} s). Segments load at {seg_rate:.0f}/s here (16 GETs at once)."
        )
    worst_segments = SETTINGS.snapshot_interval_s / SETTINGS.publish_s * TP
    notes.append(
        f"A new replica reads the segments written since the newest snapshot: up to "
        f"{worst_segments:.0f} x N (snapshots {SETTINGS.snapshot_interval_s:.0f} s apart), i.e. "
        + ", ".join(f"{int(worst_segments * n):,} at N={n:,}" for n in [*sizes_n, PAPER_N])
        + f"; at moto's {seg_rate:.0f}/s that is "
        + ", ".join(f"{worst_segments * n / seg_rate:.0f} s" for n in [*sizes_n, PAPER_N])
        + " (S3 at ~25 ms a GET, 16 at once: ~640/s)."
    )
    fleet_get = at_paper.get * PAPER_N
    n_limit = math.sqrt(PREFIX_GET_LIMIT * SETTINGS.publish_s / TP)
    notes.append(
        f"N={PAPER_N:,} on paper (scaled from N={big.n}: GETs and keys listed by N, LIST pages by 1,000 "
        f"keys): {at_paper.get:.0f} GET/s per replica, {fleet_get:,.0f} GET/s fleet-wide on one manifest "
        f"prefix whose hot end moves with the clock, {fleet_get / PREFIX_GET_LIMIT:.0f}x S3's "
        f"{PREFIX_GET_LIMIT:,}/s per prefix: the fleet's N^2 x TP / publish_s GETs reach it at N = "
        f"{n_limit:.0f} (TP 1), {math.sqrt(PREFIX_GET_LIMIT * SETTINGS.publish_s / 8):.0f} (TP 8). PUTs "
        f"({at_paper.put * PAPER_N:,.0f}/s fleet-wide) stay under {PREFIX_PUT_LIMIT:,}/s. "
        f"The manifest's requests cost ${at_paper.manifest_cost_per_hour:.3f} per replica-hour "
        f"(${at_paper.manifest_cost_per_hour * PAPER_N * 730:,.0f} a month for the fleet), against "
        f"${measured[0].manifest_cost_per_hour:.4f} at N={measured[0].n}; with the chunks' PUTs and GETs "
        f"(the same per replica at any N) ${at_paper.cost_per_hour:.3f}, against "
        f"${measured[0].cost_per_hour:.4f}. See ANALYSIS.md, 'Fleet scale (issue 18.4)'.",
    )
    return Result(
        name=NAME,
        title=TITLE,
        goal=GOAL,
        columns=[
            "replicas",
            "PUT/s",
            "LIST/s",
            "GET/s",
            "segments/poll",
            "keys/listing",
            "kB/s up / down",
            "staleness p50/p99/max (s)",
            "chunk PUT/s / GET/s",
            "$/replica-hour: manifest / all",
            "fleet GET/s",
            "wall s (x virtual)",
        ],
        rows=rows,
        verdict="no goal",
        notes=notes,
        bars=bars,
        ylabel="manifest GETs per second per replica",
        seconds=time.perf_counter() - t_start,
    )


if __name__ == "__main__":
    sys.exit(main_for(run, "s3kv-bench-fleet"))
