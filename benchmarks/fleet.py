"""Fleet: what the shared manifest costs each replica as the fleet grows
(issues 18.4 and 30), from the real loops of N replicas in virtual time.

N replicas in one process, each with a :class:`~s3kv.manifest.Manifest`,
its scheduler side's :class:`~s3kv.manifest.ManifestSync` and its TP
ranks' :class:`~s3kv.manifest.publish.ShardPublisher`\\ s, running their own
loops (``ManifestSync.run``, ``ShardPublisher.run``) as tasks of one event
loop whose time is virtual (:mod:`s3kv.testing.virtual_loop`): when no
task is ready, time jumps to the next timer. Every class gets the clock
``T0 + loop.time() + offset`` (its replica's skew) and runs numpy work
inline. So a fleet of 1,000 runs at the default settings, as fast as its
work allows, and every request, timer and race is the real code's.

The bucket is s3kv's MemoryStore (a sorted index for listings), behind a
wrapper per replica (:class:`ModelStore`) that counts what S3 would be
sent (a LIST per 1,000 keys; bytes with a ListObjectsV2 page's XML
measured on moto) by manifest directory (seg/, ep/, snap/, access/), and
makes each request take S3's time: ``asyncio.sleep`` of ``LATENCY`` (a
PUT's object appears when it returns; a GET or LIST reads half-way). A
fraction of segment PUTs is slow (up to 0.45 of the skew margin late), and
replicas' clocks are spread over a fraction of the margin. Fleet-wide
requests are counted per directory per virtual second: the busiest
prefix's peak second against S3's 5,500 GET/s and 3,500 PUT/s.

Each replica stores new chunks (each rank's publisher hears of each PUT;
the scheduler side's manifest adds it unpublished, as
``S3TierManager.complete_store`` does) and looks up prompts: chunks other
replicas stored in the last minute and chunks nobody stored; hits are
recorded as uses (access records). Chunk requests are not sent to the
bucket: they are counted at the workload's nominal rates. After the
measured window the stores stop, the loops run on (a drain), and every
chunk published must then be in every other replica's manifest ("keys
lost"); then a new replica loads (start-up, in virtual time with latency).

At large N the model may have only some replicas read (``readers``):
all N publish (every rank), the others' ManifestSync runs with its reads
off; the readers' requests are scaled to the fleet. It says so in its notes.

Cross-check (full mode): the same builder runs the real loops on the
loopback moto server with the real clock (settings compressed), and its
requests per replica-second are set beside the model's at the same settings.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import dataclasses
import functools
import gc
import logging
import math
import os
import resource
import sys
import time
from collections import OrderedDict, defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from benchmarks.common import Bar, Result, main_for, start_server
from s3kv.config import S3KVConfig
from s3kv.keys import fingerprint
from s3kv.manifest import Manifest, ManifestSync, SyncSettings
from s3kv.manifest import epochs as me
from s3kv.manifest import format as mf
from s3kv.manifest.protocol import manifest_prefix, segment_name
from s3kv.manifest.publish import HOLD_INTERVALS, ShardPublisher
from s3kv.stats import Counters
from s3kv.stores.base import (
    ByteRange,
    GetResult,
    ObjectMeta,
    ObjectStore,
    PutMode,
    Update,
    check_directory_listing,
)
from s3kv.stores.factory import make_store
from s3kv.stores.memory import MemoryStore
from s3kv.testing import virtual_loop

NAME = "fleet"
TITLE = "Fleet scale: the manifest's S3 requests, staleness, keys lost and start-up with N replicas"
GOAL = (
    "N=1,000 TP 8: fleet manifest GET/s on any prefix < 5,500; manifest $/replica-hour no more than at N=10; "
    "staleness p99 <= 2 publish + 1 refresh; start-up < 10 s; keys lost 0"
)

BUCKET = "s3kv-fleet"
PREFIX = "fleet"
NAMESPACE = "f1ee7000000000000000000000000000"
BASE = manifest_prefix(PREFIX, NAMESPACE)
T0 = 1_800_000_000.0
"""The virtual clock's wall time at loop time 0."""
PROTOCOLS = ("segments", "epochs")

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
LATENCY = {"get": 0.025, "list": 0.025, "head": 0.025, "put": 0.040, "delete": 0.040}
"""Seconds a request takes (S3 Standard, same region, small objects: first byte ~15-30 ms, PUT ~30-50 ms)."""
CHUNK_PREFIXES = 256
"""Chunk objects lie under ``{namespace}/{kk}/``: their requests spread over 256 prefixes."""

PRICE_PUT = 0.005 / 1000
"""S3 Standard, us-east-1, per request: PUT, COPY, POST, LIST."""
PRICE_GET = 0.0004 / 1000
"""GET, SELECT and every other request (HEAD); DELETE is free."""
PREFIX_PUT_LIMIT = 3500
PREFIX_GET_LIMIT = 5500
"""S3's request rates per partitioned prefix (per second)."""
REALTIME_FACTOR = 2.5
"""The real-loop check's time compression: every interval divided by it."""


@dataclass
class Model:
    """One run of the model: the fleet, the protocol, the faults, the window."""

    n: int
    protocol: str = "segments"
    tp: int = 1
    warmup_s: float = 70.0
    measure_s: float = 60.0
    drain_s: float | None = None
    """After the window, stores stop and the loops run on this long (default:
    the slowest PUT plus two publish intervals, two refreshes and the epochs' settling)."""
    stores_per_s: float = STORES_PER_S
    readers: int | None = None
    """Replicas whose ManifestSync reads (None: all)."""
    skew_fraction: float = 0.9
    """Replicas' clocks lie within this fraction of the skew margin of each other."""
    slow_put_fraction: float = 0.02
    """Segment PUTs that land late, by up to ``slow_put_max`` of the margin."""
    slow_put_max: float = 0.45
    latency: dict[str, float] = field(default_factory=lambda: dict(LATENCY))
    settings: dict[str, Any] = field(default_factory=dict)
    """SyncSettings overrides (the cross-check's compressed intervals)."""
    startup: bool = True
    track_every: int = 1
    """Staleness is followed for one store in this many (keys lost: every one);
    at large N each reader checking each of the fleet's stores is the model's own cost."""
    seed: int = 30

    def sync_settings(self) -> SyncSettings:
        return settings_for(self.protocol, **self.settings)


def settings_for(protocol: str, **overrides: Any) -> SyncSettings:
    """The default settings with ``protocol``, refused clearly where this
    build has no such protocol."""
    if protocol not in PROTOCOLS:
        raise SystemExit(f"--protocol: {protocol!r}, expected one of {', '.join(PROTOCOLS)}")
    names = {f.name for f in dataclasses.fields(SyncSettings)}
    if "protocol" in names:
        overrides["protocol"] = protocol
    elif protocol != "segments":
        raise SystemExit(f"protocol {protocol!r}: this build's SyncSettings has no protocol (segments only)")
    return SyncSettings(**overrides)


def has_protocol(protocol: str) -> bool:
    return protocol == "segments" or "protocol" in {f.name for f in dataclasses.fields(SyncSettings)}


# -- the bucket, and what S3 would be sent --------------------------------------------

DIRS = ("seg", "ep", "snap", "access")


def _dir(key: str) -> str:
    """The manifest directory of ``key`` (seg, ep, snap, access) or "other"."""
    if key.startswith(BASE):
        head = key[len(BASE) :].split("/", 1)[0]
        if head in DIRS:
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


class Traffic:
    """The fleet's requests per (directory, operation, second of virtual
    time), weighted (a sampled reader's reads stand for the fleet's)."""

    def __init__(self) -> None:
        self.per_s: dict[tuple[str, str, int], float] = defaultdict(float)

    def add(self, d: str, op: str, t: float, weight: float) -> None:
        self.per_s[(d, op, int(t))] += weight

    def peak(self, op: str, t0: float, t1: float) -> tuple[str, float]:
        """The busiest directory's busiest second for ``op`` within [t0, t1)."""
        best = ("-", 0.0)
        for (d, o, s), v in self.per_s.items():
            if o == op and t0 <= s and s + 1 <= t1 and v > best[1]:
                best = (d, v)
        return best


READS = ("get", "list", "head")


class ModelStore(ObjectStore):
    """``inner`` (the fleet's bucket) as one replica sees S3: each request
    counted (``s3_requests_<op>`` in ``counters``, and here by operation and
    manifest directory, with bytes), on the fleet's :class:`Traffic`, and
    taking S3's time (``latency``; a PUT's object appears when it returns, a
    listing or GET reads half-way through). ``slow``: (rng, fraction, max
    seconds) of segment PUTs that land late; what they name goes to ``slowed``."""

    def __init__(
        self,
        inner: ObjectStore,
        counters: Counters,
        list_bytes: ListBytes,
        traffic: Traffic | None = None,
        *,
        latency: dict[str, float] | None = None,
        read_weight: float = 1.0,
        slow: tuple[np.random.Generator, float, float] | None = None,
        slowed: set[int] | None = None,
    ) -> None:
        self.inner = inner
        self.directory = inner.directory
        self.counters = counters
        self.list_bytes = list_bytes
        self.traffic = traffic
        self.latency = latency or {}
        self.read_weight = read_weight
        self.slow = slow
        self.slow_puts = 0
        self.slow_until = 0.0
        """While a slow PUT is in flight (loop time): the writer's loop waits
        on it, so what it stores meanwhile is published late too."""
        self.slowed = slowed if slowed is not None else set()
        """Fingerprints named by a slow segment PUT (their staleness is the fault's)."""
        self.counts: dict[str, float] = defaultdict(float)
        """``{op}:{dir}`` requests, ``bytes_{op}:{dir}`` bytes, ``keys_list:{dir}`` keys listed."""

    def _add(self, op: str, key: str, requests: int, nbytes: float = 0) -> None:
        d = _dir(key)
        self.counts[f"{op}:{d}"] += requests
        if nbytes:
            self.counts[f"bytes_{op}:{d}"] += nbytes
        self.counters.add(f"s3_requests_{op}", requests)
        if self.traffic is not None:
            weight = self.read_weight if op in READS else 1.0
            self.traffic.add(d, op, asyncio.get_running_loop().time(), requests * weight)

    async def _wait(self, op: str, part: float = 1.0) -> None:
        delay = self.latency.get(op, 0.0) * part
        if delay:
            await asyncio.sleep(delay)

    async def put(
        self, key: str, data: bytes | memoryview, *, mode: PutMode | Update = PutMode.OVERWRITE
    ) -> str | None:
        self._add("put", key, 1, len(data))  # manifest objects are far below the multipart threshold
        await self._wait("put")
        if self.slow is not None and _dir(key) == "seg":
            rng, fraction, most = self.slow
            if rng.random() < fraction:
                self.slow_puts += 1
                self.slowed.update(mf.decode(bytes(data)).added.tolist())
                delay = float(rng.uniform(0, most))
                now = asyncio.get_running_loop().time()
                self.slow_until = max(self.slow_until, now + delay)
                await asyncio.sleep(delay)
        return await self.inner.put(key, data, mode=mode)

    async def get(self, key: str, range: ByteRange | None = None) -> bytes:
        return (await self.get_object(key, range)).data

    async def get_object(self, key: str, range: ByteRange | None = None) -> GetResult:
        self._add("get", key, 1)
        await self._wait("get", 0.5)
        try:
            got = await self.inner.get_object(key, range)
        finally:
            await self._wait("get", 0.5)
        self.counts[f"bytes_get:{_dir(key)}"] += len(got.data)
        return got

    async def head(self, key: str) -> ObjectMeta:
        self._add("head", key, 1)
        await self._wait("head", 0.5)
        try:
            return await self.inner.head(key)
        finally:
            await self._wait("head", 0.5)

    async def list(self, prefix: str = "", *, start_after: str | None = None) -> AsyncIterator[ObjectMeta]:
        await self._wait("list", 0.5)
        listed = [m async for m in self.inner.list(prefix, start_after=start_after)]
        pages = max(1, math.ceil(len(listed) / LIST_PAGE))
        key_bytes = sum(len(m.key) for m in listed)
        self._add(
            "list",
            prefix,
            pages,
            pages * self.list_bytes.page + len(listed) * self.list_bytes.key + key_bytes,
        )
        self.counts[f"keys_list:{_dir(prefix)}"] += len(listed)
        for p in range(pages):
            await self._wait("list", 0.5 if p == 0 else 1.0)
            for meta in listed[p * LIST_PAGE : (p + 1) * LIST_PAGE]:
                yield meta

    async def delete_many(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        if keys:
            self._add("delete", keys[0], math.ceil(len(keys) / 1000))
            await self._wait("delete")
        await self.inner.delete_many(keys)

    async def delete_if(self, key: str, etag: str) -> None:
        self._add("delete", key, 1)
        await self._wait("delete")
        await self.inner.delete_if(key, etag)


# -- the fleet ------------------------------------------------------------------------


class SharedDecode:
    """The replicas' ``offload``: work inline (:func:`~s3kv.testing.virtual_loop.inline`),
    except that an epoch object's decode is done once for the whole fleet:
    N replicas GET the same bytes, and in one process decoding them N times
    is the model's own cost (N processes would decode in parallel). The
    result is shared read-only (the manifest's arrays functions return new
    arrays, never their inputs); an object that does not decode is decoded
    (and refused) by each replica."""

    def __init__(self, kept: int = 64) -> None:
        self.kept = kept
        self._done: OrderedDict[tuple[str, int, int], Any] = OrderedDict()
        self.hits = 0

    async def __call__(self, f: Callable[..., Any], *args: Any) -> Any:
        if isinstance(f, functools.partial) and f.func is me.decode and len(args) == 3:
            name, data = args[1], args[2]
            key = (name, len(data), xxhash.xxh3_64_intdigest(data))
            got = self._done.get(key)
            if got is None:
                got = f(*args)
                self._done[key] = got
                if len(self._done) > self.kept:
                    self._done.popitem(last=False)
            else:
                self.hits += 1
            return got
        return f(*args)


class ReadingSync(ManifestSync):
    """A replica's ManifestSync, telling the model after each of its
    loop's ticks (the model checks what its manifest now has)."""

    after_tick: Callable[[], None] | None = None

    async def tick(self) -> None:
        await super().tick()
        if self.after_tick is not None:
            self.after_tick()


class WritingSync(ManifestSync):
    """A replica whose ManifestSync only writes (its segments and access
    records), its reads left to the sampled readers: the model's cut at large N."""

    async def load(self) -> int:
        self.loaded = True
        return 0

    async def tick(self) -> None:
        now = self._clock()
        if now >= self._next_publish:
            self._next_publish = now + self.s.publish_s
            await self.publish()
        self._next_refresh = self._next_publish


@dataclass
class Replica:
    idx: int
    store: ObjectStore
    counters: Counters
    manifest: Manifest
    sync: ManifestSync
    publishers: list[ShardPublisher]
    reads: bool = True
    offset: float = 0.0
    unseen: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    """Ledger rows of others' stores this replica's manifest did not have at its last check."""
    cursor: int = 0
    """Ledger rows up to here were looked for."""


class Ledger:
    """Every chunk the fleet stored: fingerprint, key, time, owner; and when
    the reading replicas' manifests first had it."""

    def __init__(self, capacity: int, track_every: int = 1) -> None:
        self.n = 0
        self.track_every = track_every
        """Rows followed for staleness: those whose index is a multiple of it."""
        self.fps = np.empty(capacity, dtype=np.uint64)
        self.t = np.empty(capacity)
        self.owner = np.empty(capacity, dtype=np.int32)
        self.keys: list[bytes] = []
        self.last_seen = np.empty(capacity)
        """Staleness for the last of the reading replicas to see it, so far."""
        self.seen_by = np.empty(capacity, dtype=np.int32)
        self.pairs: list[np.ndarray] = []
        """Staleness of each (store, other replica) pair, per check."""

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
        """Which of the others' stores ``r``'s manifest now has."""
        start = -(-r.cursor // self.track_every) * self.track_every
        new = np.arange(start, self.n, self.track_every)
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


UNREGISTERED: set[str] = set()
"""Counter names the manifest code added that s3kv.stats does not know."""


class ModelCounters(Counters):
    """The replicas' counters: a name s3kv.stats does not register is
    noted (and reported in the notes) instead of failing the loop, so that
    a work-in-progress protocol can be measured."""

    def add(self, name: str, value: float = 1) -> None:
        try:
            super().add(name, value)
        except KeyError:
            UNREGISTERED.add(name)


def _writer_ids(n: int, rng: np.random.Generator) -> list[str]:
    """Writer ids as :func:`~s3kv.manifest.protocol.new_writer_id` makes them."""
    return [f"{int(rng.integers(16**10)):010x}{i % 100:02d}" for i in range(n)]


def replica_hold_s(settings: SyncSettings) -> float | None:
    """How long a rank holds a store for its scheduler side's segment, as
    :func:`s3kv.manifest.publish.hold_s` says for a config of ``settings``'
    protocol and publish interval (None under "segments": ranks publish)."""
    if settings.protocol != "epochs":
        return None
    return HOLD_INTERVALS * settings.publish_s


def build_replica(
    i: int,
    writer: str,
    store: ObjectStore,
    counters: Counters,
    settings: SyncSettings,
    tp: int,
    clock: Callable[[], float],
    *,
    reads: bool = True,
    offload: Any = None,
) -> Replica:
    """One replica as s3kv builds it: the scheduler side's ManifestSync and
    one ShardPublisher per rank, all on ``clock``."""
    manifest = Manifest()
    extra = {} if offload is None else {"offload": offload}
    cls = ReadingSync if reads else WritingSync
    sync = cls(store, BASE, manifest, settings, counters=counters, writer=writer, clock=clock, **extra)
    publishers = [
        ShardPublisher(
            store,
            BASE,
            writer,
            rank=rank,
            ranks=tp,
            publish_s=settings.publish_s,
            skew_s=settings.skew_s,
            counters=counters,
            clock=clock,
            hold_s=replica_hold_s(settings),
        )
        for rank in range(tp)
    ]
    return Replica(i, store, counters, manifest, sync, publishers, reads=reads)


def _step_meta(reps: list[Replica]) -> None:
    """What each replica's scheduler side sends its workers with a step's
    metadata: the newest stamp it saw, and the fingerprints its segments
    named since the last step (one ``take_published`` a replica, given to
    every rank, as the connector's metadata is)."""
    for r in reps:
        clock_ms = r.sync.clock_ms
        published = r.sync.take_published()
        for p in r.publishers:
            p.observe(clock_ms)
            if published:
                p.acked(published)


def _workload(
    reps: list[Replica],
    ledger: Ledger,
    rng: np.random.Generator,
    now: float,
    dt: float,
    stores_per_s: float,
    lookups: bool = True,
) -> tuple[int, int, int]:
    """``dt`` seconds of stores and lookups for every replica. Returns
    (chunks stored, fleet keys looked up, of them found)."""
    looked = found = 0
    stores = rng.poisson(stores_per_s * dt, len(reps))
    for i in np.nonzero(stores)[0].tolist():
        r, count = reps[i], int(stores[i])
        blob = rng.bytes(16 * count)
        keys = [blob[j : j + 16] for j in range(0, len(blob), 16)]
        # Every rank's PUT returned; the scheduler side hears of it and, under
        # "epochs", publishes it in the replica's one segment
        # (S3TierManager.complete_store with publishes_all) while the ranks hold it.
        replica_publishes = r.publishers[0].hold_s is not None if r.publishers else False
        for key in keys:
            fp = fingerprint(key)
            for pub in r.publishers:
                pub.stored(fp)
            r.manifest.add(key, publish=replica_publishes)
        ledger.add(keys, now, r.idx)
        store = r.store
        if isinstance(store, ModelStore) and store.slow_until > now:  # published after the slow PUT
            store.slowed.update(fingerprint(k) for k in keys)
    if not lookups:
        return int(stores.sum()), 0, 0
    n_lookups = rng.poisson(LOOKUPS_PER_S * dt, len(reps))
    lo = int(np.searchsorted(ledger.t[: ledger.n], now - LOOKUP_AGE_S))
    for i in np.nonzero(n_lookups)[0].tolist():
        r = reps[i]
        if not r.reads:
            continue
        for _ in range(int(n_lookups[i])):
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
    """Each replica's counts so far (its store's, if it counts)."""
    return [dict(getattr(r.store, "counts", {})) for r in reps]


def _rss_mib() -> float:
    """This process's peak resident memory so far (MiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def simulate(m: Model, list_bytes: ListBytes, bucket: Bucket | None = None) -> dict[str, Any]:
    """``m`` on the running loop (a :class:`~s3kv.testing.virtual_loop.VirtualTimeLoop`):
    ``warmup_s``, then ``measure_s`` measured, then a drain without stores,
    then a new replica's start-up."""
    wall0 = time.perf_counter()
    cpu_start = time.process_time()
    loop = asyncio.get_running_loop()
    settings = m.sync_settings()
    rng = np.random.default_rng(m.seed)
    bucket = bucket if bucket is not None else Bucket()
    traffic = Traffic()
    n_read = m.n if m.readers is None else max(1, min(m.readers, m.n))
    readers = set(range(m.n)) if n_read == m.n else set(rng.choice(m.n, n_read, replace=False).tolist())
    weight = m.n / n_read
    margin = settings.skew_s
    offsets = rng.uniform(-0.5, 0.5, m.n) * m.skew_fraction * margin
    slow = (np.random.default_rng(m.seed + 1), m.slow_put_fraction, m.slow_put_max * margin)
    slowed: set[int] = set()
    reps: list[Replica] = []
    shared = SharedDecode()
    for i, writer in enumerate(_writer_ids(m.n, rng)):
        counters = ModelCounters()
        store = ModelStore(
            bucket,
            counters,
            list_bytes,
            traffic,
            latency=m.latency,
            read_weight=weight,
            slow=slow,
            slowed=slowed,
        )
        off = float(offsets[i])
        r = build_replica(
            i,
            writer,
            store,
            counters,
            settings,
            m.tp,
            lambda off=off: T0 + loop.time() + off,
            reads=i in readers,
            offload=shared,
        )
        r.offset = off
        reps.append(r)
    ledger = Ledger(int(m.n * m.stores_per_s * (m.warmup_s + m.measure_s) * 1.3) + 1024, m.track_every)
    state = {"measuring": False}

    def checker(r: Replica) -> Callable[[], None]:
        return lambda: ledger.check(r, loop.time(), state["measuring"])

    for r in reps:
        if r.reads:
            r.sync.after_tick = checker(r)  # type: ignore[attr-defined]
    tasks: list[asyncio.Task[Any]] = []
    phases = rng.uniform(0, settings.publish_s, (m.n, 1 + m.tp))

    async def later(delay: float, coro: Any) -> None:
        await asyncio.sleep(delay)
        await coro

    for r in reps:  # each loop starts at its own phase
        tasks.append(asyncio.ensure_future(later(float(phases[r.idx, 0]), r.sync.run())))
        tasks += [
            asyncio.ensure_future(later(float(phases[r.idx, 1 + k]), p.run()))
            for k, p in enumerate(r.publishers)
        ]
    stored = looked = found = 0
    cpu0 = time.process_time()
    end_measure = m.warmup_s + m.measure_s
    start: list[dict[str, float]] = []
    try:
        await asyncio.sleep(settings.publish_s)  # every loop has started
        while (now := loop.time()) < end_measure:
            if not start and now >= m.warmup_s:
                start, state["measuring"] = _totals(reps), True
                cpu0 = time.process_time()
            _step_meta(reps)  # the scheduler side's clock and acks, sent to the workers with each step
            a, b, c = _workload(reps, ledger, rng, now, TICK_S, m.stores_per_s)
            if state["measuring"]:
                stored, looked, found = stored + a, looked + b, found + c
            await asyncio.sleep(TICK_S)
        finish = _totals(reps)
        cpu = time.process_time() - cpu0
        state["measuring"] = False
        drain = m.drain_s
        if drain is None:
            drain = m.slow_put_max * margin + 3 * settings.publish_s + 2 * settings.refresh_s + 10
        t_drain = loop.time()
        while loop.time() < t_drain + drain:
            _step_meta(reps)
            await asyncio.sleep(TICK_S)
        wall_run = time.perf_counter() - wall0
        # Keys lost: a chunk published that some reading replica never saw.
        missing = np.zeros(ledger.n, dtype=bool)
        rows = np.arange(ledger.n)
        for r in reps:
            if r.reads:
                mine = ledger.owner[: ledger.n] == r.idx
                hit = r.manifest.present_fps(ledger.fps[: ledger.n])
                missing |= ~hit & ~mine
        lost = int(np.count_nonzero(missing))
        slowed_fps = np.fromiter(slowed, dtype=np.uint64, count=len(slowed))
        lost_slowed = int(np.count_nonzero(missing & np.isin(ledger.fps[: ledger.n], slowed_fps)))
        # Staleness of the stores made while measuring: to the last reading replica.
        target = np.where(np.isin(ledger.owner[: ledger.n], list(readers)), n_read - 1, n_read)
        in_window = (
            (ledger.t[: ledger.n] >= m.warmup_s)
            & (ledger.t[: ledger.n] < end_measure)
            & (rows % m.track_every == 0)
        )
        all_seen = rows[in_window & (ledger.seen_by[: ledger.n] >= target)]
        fast = ~np.isin(ledger.fps[all_seen], slowed_fps)
        memory = [r.manifest.fps.nbytes for r in reps if r.reads]
        names = [
            len(r.sync._seen) + (len(r.sync.chain.covered) if r.sync.chain is not None else 0)
            for r in reps
            if r.reads
        ]
        boot: dict[str, Any] = {}
        if m.startup:
            counters = ModelCounters()
            store = ModelStore(bucket, counters, list_bytes, None, latency=m.latency)
            new = build_replica(
                m.n,
                "feedfacefe99",
                store,
                counters,
                settings,
                m.tp,
                lambda: T0 + loop.time(),
                offload=virtual_loop.inline,
            )
            t = loop.time()
            w = time.perf_counter()
            keys = await new.sync.load()
            boot = {
                "s": loop.time() - t,
                "wall_s": time.perf_counter() - w,
                "keys": keys,
                "counts": dict(store.counts),
            }
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    window = [{k: f.get(k, 0) - s.get(k, 0) for k in f} for s, f in zip(start, finish)]
    pairs = np.concatenate(ledger.pairs) if ledger.pairs else np.empty(0, np.float32)
    return {
        "model": m,
        "settings": settings,
        "n_read": n_read,
        "weight": weight,
        "readers": [r.reads for r in reps],
        "window": window,
        "traffic": traffic,
        "stale_all": ledger.last_seen[all_seen],
        "stale_fast": ledger.last_seen[all_seen[fast]],
        "slowed_keys": int(np.count_nonzero(~fast)),
        "stale_pairs": pairs,
        "stores_checked": int(np.count_nonzero(in_window)),
        "stores_unseen": int(np.count_nonzero(in_window)) - len(all_seen),
        "lost": lost,
        "lost_slowed": lost_slowed,
        "keys": ledger.n,
        "stored": stored,
        "looked": looked,
        "found": found,
        "memory": float(np.mean(memory)) if memory else 0.0,
        "names": float(np.mean(names)) if names else 0.0,
        "boot": boot,
        "slow_puts": sum(getattr(r.store, "slow_puts", 0) for r in reps),
        "wall_s": wall_run,
        "cpu_s": cpu,
        "cpu_all_s": time.process_time() - cpu_start,
        "rss_mib": _rss_mib(),
        "directory": bool(bucket.directory),
    }


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """s3kv's warnings off while the model runs (a thousand replicas warn
    alike), and back as they were after: the model runs in test processes too."""
    logger = logging.getLogger("s3kv")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def run_model(m: Model, list_bytes: ListBytes, bucket: Bucket | None = None) -> dict[str, Any]:
    """:func:`simulate` on a fresh virtual-time loop."""
    with _quiet():
        out = virtual_loop.run(simulate(m, list_bytes, bucket))
    gc.collect()
    return out


# -- figures --------------------------------------------------------------------------


@dataclass
class Rates:
    """One replica's requests per second of virtual (= real) time: the
    fleet's totals (sampled readers' reads scaled to the fleet) over N."""

    n: int
    tp: int
    protocol: str
    put: float
    list: float
    get: float
    head: float
    by_dir: dict[str, float]
    up_bps: float
    down_bps: float
    peak_get: tuple[str, float]
    peak_put: tuple[str, float]
    chunk_put: float
    chunk_get: float

    @property
    def manifest_cost_per_hour(self) -> float:
        """The manifest's requests alone, USD per replica-hour (LIST priced as PUT, HEAD as GET)."""
        return 3600 * ((self.put + self.list) * PRICE_PUT + (self.get + self.head) * PRICE_GET)

    @property
    def cost_per_hour(self) -> float:
        """Every request a replica sends S3: the manifest's and its chunks' PUTs and GETs."""
        return self.manifest_cost_per_hour + 3600 * (self.chunk_put * PRICE_PUT + self.chunk_get * PRICE_GET)


def rates_of(sim: dict[str, Any]) -> Rates:
    m: Model = sim["model"]
    s, n, w = m.measure_s, m.n, sim["weight"]
    total: dict[str, float] = defaultdict(float)
    for reads, counts in zip(sim["readers"], sim["window"]):
        for k, v in counts.items():
            op = k.split(":", 1)[0].removeprefix("bytes_").removeprefix("keys_")
            total[k] += v * (w if reads and op in READS else 1.0)
    per = {k: v / n / s for k, v in total.items()}

    def op(name: str) -> float:
        return sum(v for k, v in per.items() if k.startswith(name + ":"))

    up = sum(v for k, v in per.items() if k.startswith("bytes_put:"))
    down = sum(v for k, v in per.items() if k.startswith(("bytes_get:", "bytes_list:")))
    t0, t1 = m.warmup_s, m.warmup_s + m.measure_s
    reader_s = max(sim["n_read"] * s, 1e-9)
    return Rates(
        n=n,
        tp=m.tp,
        protocol=m.protocol,
        put=op("put"),
        list=op("list"),
        get=op("get"),
        head=op("head"),
        by_dir={k: v for k, v in per.items() if not k.startswith(("bytes_", "keys_"))},
        up_bps=up,
        down_bps=down,
        peak_get=sim["traffic"].peak("get", t0, t1),
        peak_put=sim["traffic"].peak("put", t0, t1),
        chunk_put=STORES_PER_S * m.tp,
        chunk_get=sim["found"] / reader_s * m.tp,
    )


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def _stale(values: np.ndarray) -> str:
    if not len(values):
        return "-"
    return f"{_pct(values, 50):.1f} / {_pct(values, 99):.1f} / {float(values.max()):.1f}"


COLUMNS = [
    "protocol",
    "replicas",
    "TP",
    "PUT / LIST / GET per s",
    "busiest prefix GET/s (peak s)",
    "busiest prefix PUT/s (peak s)",
    "staleness p50/p99/max s (max with slow PUTs)",
    "keys lost",
    "start-up (s)",
    "manifest MiB / names held",
    "$/replica-hour: manifest / all",
    "wall s / peak RSS GiB",
]


def row(sim: dict[str, Any]) -> list[Any]:
    r = rates_of(sim)
    m: Model = sim["model"]
    boot = sim["boot"]
    sampled = "" if sim["n_read"] == m.n else f" ({sim['n_read']} read)"
    return [
        m.protocol,
        f"{m.n:,}{sampled}",
        m.tp,
        f"{r.put:.2f} / {r.list:.2f} / {r.get + r.head:.1f}",
        f"{r.peak_get[1]:,.0f} ({r.peak_get[0]})",
        f"{r.peak_put[1]:,.0f} ({r.peak_put[0]})",
        f"{_stale(sim['stale_fast'])} ({float(sim['stale_all'].max()) if len(sim['stale_all']) else 0:.0f})",
        f"{sim['lost']} of {sim['keys']:,}",
        f"{boot['s']:.1f}" if boot else "-",
        f"{sim['memory'] / 2**20:.2f} / {sim['names']:,.0f}",
        f"{r.manifest_cost_per_hour:.4f} / {r.cost_per_hour:.4f}",
        f"{sim['wall_s']:.0f} / {sim['rss_mib'] / 1024:.1f}",
    ]


def _random_fps(n: int, seed: int) -> np.ndarray:
    return np.unique(np.random.default_rng(seed).integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True))


# -- the cross-check: the real loops on moto, in real time ----------------------------


def scaled_settings(factor: float) -> dict[str, Any]:
    """Every interval of the defaults divided by ``factor``."""
    d = SyncSettings()
    return {
        "publish_s": d.publish_s / factor,
        "refresh_s": d.refresh_s / factor,
        "skew_s": d.skew_s / factor,
        "snapshot_interval_s": d.snapshot_interval_s / factor,
    }


async def realtime(
    endpoint: str, n: int, protocol: str, factor: float, wall_s: float, warm_s: float, bucket: str = BUCKET
) -> dict[str, Any]:
    """``n`` replicas running the real loops on moto through S3Store, in
    real time, intervals divided by ``factor`` and the workload multiplied
    by it, in ``bucket`` (empty: a fleet's first start). Requests per
    replica-second (at those settings) and staleness."""
    settings = settings_for(protocol, **scaled_settings(factor))
    config = S3KVConfig(bucket=bucket, endpoint_url=endpoint, region="us-east-1")
    rng = np.random.default_rng(3)
    reps = []
    for i, writer in enumerate(_writer_ids(n, rng)):
        counters = Counters()
        reps.append(build_replica(i, writer, make_store(config, counters), counters, settings, 1, time.time))
    ledger = Ledger(int(n * STORES_PER_S * factor * wall_s * 1.3) + 1024)
    loaded = 0

    def on_loaded() -> None:
        nonlocal loaded
        loaded += 1

    tasks = [asyncio.ensure_future(r.sync.run(on_loaded)) for r in reps]
    deadline = time.time() + LOAD_TIMEOUT_S
    while loaded < n:
        if time.time() > deadline:
            for task in tasks:
                task.cancel()
            raise RuntimeError(
                f"cross-check {protocol}: {n - loaded} of {n} replicas did not load in {LOAD_TIMEOUT_S:.0f} s"
            )
        await asyncio.sleep(0.05)
    tasks += [asyncio.ensure_future(p.run()) for r in reps for p in r.publishers]
    t0 = time.time()
    start: list[dict[str, float]] = []
    marked = 0.0
    try:
        while (now := time.time()) < t0 + wall_s:
            _step_meta(reps)
            _workload(reps, ledger, rng, now, TICK_S / factor, STORES_PER_S * factor)
            for r in reps:  # staleness, to this poll's resolution
                ledger.check(r, time.time(), bool(start))
            if not start and now >= t0 + warm_s:
                start, marked = _counter_totals(reps), time.time()
            await asyncio.sleep(TICK_S / factor)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finish = _counter_totals(reps)
    span = time.time() - marked
    for r in reps:
        await r.store.close()
    pairs = np.concatenate(ledger.pairs) if ledger.pairs else np.empty(0)
    out = {op: float(np.mean([f[op] - s[op] for s, f in zip(start, finish)])) / span for op in OPS}
    out["stale_p50"] = _pct(pairs, 50)
    out["stale_max"] = float(pairs.max()) if len(pairs) else float("nan")
    return out


OPS = ("put", "list", "get", "head")
LOAD_TIMEOUT_S = 180.0
"""The cross-check's replicas must load from an empty bucket within this (real
seconds). Under epochs each GETs the lookback's epochs (24, none there yet):
30 replicas' clients and 720 GETs took 17-20 s on moto on a busy 2-core
machine, over 60 s while another benchmark ran beside it."""


def _counter_totals(reps: list[Replica]) -> list[dict[str, float]]:
    out = []
    for r in reps:
        t = r.counters.totals()
        out.append({op: float(t.get(f"s3_requests_{op}", 0)) for op in OPS})
    return out


def model_at(
    n: int, protocol: str, factor: float, wall_s: float, warm_s: float, list_bytes: ListBytes
) -> dict[str, Any]:
    """The model at the cross-check's settings: its requests per replica-second."""
    m = Model(
        n,
        protocol,
        warmup_s=warm_s,
        measure_s=wall_s - warm_s,
        drain_s=0.0,
        stores_per_s=STORES_PER_S * factor,
        skew_fraction=0.0,
        slow_put_fraction=0.0,
        settings=scaled_settings(factor),
        startup=False,
    )
    sim = run_model(m, list_bytes)
    r = rates_of(sim)
    pairs = sim["stale_pairs"]
    return {
        "put": r.put,
        "list": r.list,
        "get": r.get,
        "head": r.head,
        "stale_p50": _pct(pairs, 50),
        "stale_max": float(pairs.max()) if len(pairs) else float("nan"),
    }


# -- the benchmark --------------------------------------------------------------------

SWEEP = [(10, 1), (10, 8), (100, 1), (300, 1), (1000, 1), (1000, 8)]
"""(replicas, TP) of the full run."""
SEGMENTS_SKIP = [(10, 8), (1000, 8)]
"""Not run for protocol "segments" in the full run (unless --sizes names
them): its N^2 x TP GETs take far longer than the sweep's budget."""
CROSSCHECKS = [(10, "epochs"), (30, "epochs"), (10, "segments")]
"""(replicas, protocol) of the real loops on loopback moto, beside the model."""
CROSSCHECK_WALL_S = 50.0
CROSSCHECK_WARM_S = 25.0
"""Each cross-check's run and the part before its measure (real seconds):
the first epochs after a fleet starts from an empty bucket are aggregated
by every replica (none knows the others yet), and with 8 s of warm-up that
race fell in the window at N=30 (the model's GETs 1.71/s against the real
loops' 0.54)."""
QUICK = [(4, 1), (8, 2)]
LARGE_MEASURE_S = 20.0
LARGE_WARMUP_S = 40.0
LARGE_STORES_PER_S = 1.0
"""At N >= 1,000 (the sweep's cut, said in the notes): a shorter window and
warm-up, and fewer stores (requests do not depend on the store rate: one
segment a replica an interval whatever it names)."""


@dataclass
class Options:
    """The fleet's knobs beyond ``--quick`` (``python -m benchmarks.fleet --help``)."""

    sizes: list[tuple[int, int]] | None = None
    protocols: tuple[str, ...] = PROTOCOLS
    readers: int | None = 25
    """Protocol "segments": sampled readers at N > ``sample_above`` (None:
    every replica reads). Protocol "epochs" is never sampled: every replica
    may aggregate, so each one runs its whole loop."""
    sample_above: int = 100
    track_every: int | None = None
    """Staleness followed for one store in this many (None: N // 100 from N = 300)."""
    measure_s: float | None = None
    large_measure_s: float | None = None
    large_stores_per_s: float | None = None
    large_warmup_s: float | None = None
    skew_fraction: float = 0.9
    slow_put_fraction: float = 0.02
    crosscheck: bool = True


OPTIONS = Options()


def parse_options(argv: list[str]) -> tuple[Options, list[str]]:
    """The fleet's own flags, taken out of ``argv`` (the rest is main_for's)."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--sizes", help="replicas[xTP],... e.g. 10,100,1000x8")
    ap.add_argument("--protocols", default=",".join(PROTOCOLS))
    ap.add_argument(
        "--readers",
        type=int,
        default=25,
        help="segments: replicas that read at N above --sample-above (0: all)",
    )
    ap.add_argument("--sample-above", type=int, default=100)
    ap.add_argument("--track-every", type=int, help="staleness of one store in this many (default N // 100)")
    ap.add_argument("--measure-s", type=float)
    ap.add_argument("--large-measure-s", type=float, help="measured window at N >= 1000")
    ap.add_argument("--large-stores-per-s", type=float, help="chunks a replica stores a second at N >= 1000")
    ap.add_argument("--large-warmup-s", type=float, help="warm-up at N >= 1000")
    ap.add_argument("--skew-fraction", type=float, default=0.9)
    ap.add_argument("--slow-put-fraction", type=float, default=0.02)
    ap.add_argument("--no-crosscheck", action="store_true")
    args, rest = ap.parse_known_args(argv)
    sizes = None
    if args.sizes:
        sizes = []
        for part in args.sizes.split(","):
            n, _, tp = part.partition("x")
            sizes.append((int(n), int(tp or 1)))
    protocols = tuple(p for p in args.protocols.split(",") if p)
    for p in protocols:
        if p not in PROTOCOLS:
            raise SystemExit(f"--protocols: {p!r}, expected {', '.join(PROTOCOLS)}")
    return (
        Options(
            sizes=sizes,
            protocols=protocols,
            readers=args.readers or None,
            sample_above=args.sample_above,
            track_every=args.track_every,
            measure_s=args.measure_s,
            large_measure_s=args.large_measure_s,
            large_stores_per_s=args.large_stores_per_s,
            large_warmup_s=args.large_warmup_s,
            skew_fraction=args.skew_fraction,
            slow_put_fraction=args.slow_put_fraction,
            crosscheck=not args.no_crosscheck,
        ),
        rest,
    )


def model_for(n: int, tp: int, protocol: str, quick: bool, opts: Options) -> Model:
    """The run at (``n``, ``tp``): the defaults, with the cuts large N needs."""
    measure = opts.measure_s or (20.0 if quick else 60.0)
    stores = STORES_PER_S
    warmup = 15.0 if quick else 70.0
    if n >= 1000:
        measure = opts.large_measure_s or LARGE_MEASURE_S
        stores = opts.large_stores_per_s or LARGE_STORES_PER_S
        warmup = opts.large_warmup_s or LARGE_WARMUP_S
    return Model(
        n,
        protocol,
        tp=tp,
        warmup_s=warmup,
        measure_s=measure,
        stores_per_s=stores,
        readers=opts.readers if n > opts.sample_above and protocol == "segments" else None,
        track_every=opts.track_every or max(1, n // 100 if n >= 300 else 1),
        skew_fraction=opts.skew_fraction,
        slow_put_fraction=opts.slow_put_fraction if not quick else max(opts.slow_put_fraction, 0.1),
    )


def _say(text: str) -> None:
    print(f"fleet: {text}", file=sys.stderr, flush=True)


def run(work: Path, quick: bool, opts: Options | None = None) -> Result:
    opts = opts or OPTIONS
    t_start = time.perf_counter()
    with _quiet():
        return _run(work, quick, opts, t_start)


def _run(work: Path, quick: bool, opts: Options, t_start: float) -> Result:
    protocols = [p for p in opts.protocols if has_protocol(p)]
    skipped = [p for p in opts.protocols if not has_protocol(p)]
    sizes = opts.sizes or (QUICK if quick else SWEEP)
    list_bytes = ListBytes()
    checks: list[tuple[int, str, dict[str, Any], dict[str, Any]]] = []
    failed: list[str] = []
    if opts.crosscheck and not quick:
        server, creds, _pids = start_server("moto", work)
        os.environ.update(creds)
        try:
            server.create_bucket(BUCKET)
            list_bytes = ListBytes.measure(server)
            for n, p in CROSSCHECKS:
                if p in protocols:
                    factor = REALTIME_FACTOR if n == 10 else 1.0
                    # A bucket of its own: the fleet before it (other
                    # intervals, so another epoch length) left its segments,
                    # which a new fleet aggregates into its own epochs first.
                    bucket = f"{BUCKET}-{p}-{n}"
                    server.create_bucket(bucket)
                    try:
                        real = asyncio.run(
                            realtime(
                                server.endpoint_url,
                                n,
                                p,
                                factor,
                                wall_s=CROSSCHECK_WALL_S,
                                warm_s=CROSSCHECK_WARM_S,
                                bucket=bucket,
                            )
                        )
                    except RuntimeError as e:
                        failed.append(str(e))
                        continue
                    model = model_at(n, p, factor, CROSSCHECK_WALL_S, CROSSCHECK_WARM_S, list_bytes)
                    checks.append((n, p, real, model))
                    _say(f"cross-check N={n} {p}: real {real} model {model}")
        finally:
            server.stop()
    sims = []
    not_run = []
    for p in protocols:
        for n, tp in sizes:
            if p == "segments" and not opts.sizes and (n, tp) in SEGMENTS_SKIP:
                not_run.append(f"{p} N={n:,} TP {tp}")
                continue
            m = model_for(n, tp, p, quick, opts)
            sim = run_model(m, list_bytes)
            sims.append(sim)
            _say(f"{p} N={n} TP {tp}: {row(sim)}")
    rows = [row(sim) for sim in sims]
    bars = [
        Bar(f"{s['model'].protocol} N={s['model'].n} TP{s['model'].tp} GET/s", rates_of(s).get) for s in sims
    ]

    notes = [
        "Real loops (ManifestSync.run and every rank's ShardPublisher.run) of N replicas on one event loop "
        "whose time is virtual (s3kv.testing.virtual_loop), at the default settings unless said: publish "
        "and refresh every 5 s, skew margin 60 s. Rates are per replica per second of that clock (= real "
        "seconds): the fleet's totals over N.",
        f"Requests take S3's time: GET, LIST, HEAD {1000 * LATENCY['get']:.0f} ms, PUT "
        f"{1000 * LATENCY['put']:.0f} ms (a PUT's object appears as it returns). Faults: replicas' clocks "
        f"spread uniformly over {opts.skew_fraction:.0%} of the skew margin (pairwise up to that far apart); "
        f"{opts.slow_put_fraction:.0%} of segment PUTs land late by up to 45% of the margin.",
        f"Workload per replica: {STORES_PER_S:.0f} new chunks/s stored (every rank's shard), "
        f"{LOOKUPS_PER_S:.0f} lookups/s of {LOOKUP_FLEET_KEYS} chunks others stored in the last "
        f"{LOOKUP_AGE_S:.0f} s and {LOOKUP_NEW_KEYS} nobody did; hits recorded as uses.",
        "Busiest prefix: the fleet's requests per manifest directory (seg/, ep/, snap/, access/) in each "
        f"second of the window, the peak second, against S3's {PREFIX_GET_LIMIT:,} GET/s and "
        f"{PREFIX_PUT_LIMIT:,} PUT/s per prefix. Chunk objects spread over {CHUNK_PREFIXES} prefixes "
        f"({{namespace}}/{{kk}}/): at N=1,000 TP 8, {1000 * STORES_PER_S * 8 / CHUNK_PREFIXES:,.0f} PUT/s each.",
        "Keys lost: chunks published (anywhere in the run) that some reading replica's manifest lacked after "
        "the drain (stores stopped; loops ran on for the slowest PUT plus three publish intervals, two "
        "refreshes and 10 s). Staleness: a store in the window to the last reading replica having it, "
        "checked after each of its loop's ticks; p50/p99/max leave out stores a slow PUT delayed (named "
        "in a slow segment PUT, or stored by its writer while one was in flight: its loop waits on it), "
        "which the figure in brackets includes.",
        "Start-up: a new replica's load() at the end of the run, in virtual time with the latencies above "
        "(no snapshot is due within the run at the default snapshot settings unless the protocol writes "
        "them by count: what it reads is everything since the newest).",
        "Memory per replica: the manifest's arrays (MiB) and the segment names its sync holds to skip "
        "what it applied (epochs: and those epochs covered, which aggregators leave out). Cost: the manifest's requests (PUT and LIST $0.005, GET and HEAD $0.0004 per "
        "1,000, us-east-1) and all requests with the chunks' at the nominal workload: one PUT per rank's "
        f"shard stored ({STORES_PER_S:.0f} x TP a second) and one GET per rank's shard of each fleet hit.",
    ]
    cuts = sorted(
        {
            (
                s["model"].protocol,
                s["model"].n,
                s["model"].tp,
                s["model"].measure_s,
                s["model"].stores_per_s,
                s["n_read"],
                s["model"].track_every,
                s["model"].warmup_s,
            )
            for s in sims
        }
    )
    for protocol, n, tp, measure, stores, n_read, track, warmup in cuts:
        said = []
        if warmup != 70.0 and not quick:
            said.append(
                f"warm-up {warmup:.0f} s, not 70 (an aggregator's listing of the 120 s lookback holds "
                f"{warmup:.0f}+ s of segments: its LIST pages, under 0.01/s a replica, are undercounted)"
            )
        if track != 1:
            said.append(f"staleness followed for one store in {track} (keys lost: every store)")
        if stores != STORES_PER_S:
            said.append(
                f"stores {stores:g} chunks/s per replica, not {STORES_PER_S:g} (bytes and keys scale with it; requests do not)"
            )
        if n_read != n:
            said.append(
                f"only {n_read} replicas read (the rest publish only); their reads scaled by {n / n_read:.1f}; "
                "keys lost and staleness there are not the protocol's alone: a replica that does not read "
                "keeps no hybrid clock of others' stamps, and under epochs it never aggregates"
            )
        if said or (measure != 60.0 and not quick):
            notes.append(
                f"Cut at {protocol} N={n:,} TP {tp}, measured {measure:.0f} s: " + "; ".join(said) + "."
            )
    if UNREGISTERED:
        notes.append(
            "The manifest code counted names s3kv.stats does not register (a KeyError in production; "
            f"noted here instead): {', '.join(sorted(UNREGISTERED))}."
        )
    if skipped:
        notes.append(
            f"Not run: protocol(s) {', '.join(skipped)} (this build's SyncSettings has no protocol)."
        )
    if not_run:
        notes.append(
            f"Not run: {', '.join(not_run)} (too long for the sweep's budget on 2 cores; ANALYSIS.md's "
            "figure on paper stands for it)."
        )
    notes += [f"Cross-check failed: {e}." for e in failed]
    for n, p, real, model in checks:
        notes.append(
            f"Cross-check N={n}, {p}: the real loops on loopback moto, a fleet's first start in a bucket of its own (real clock, intervals "
            f"/{REALTIME_FACTOR if n == 10 else 1.0:g}) sent PUT {real['put']:.2f}, LIST {real['list']:.2f}, "
            f"GET {real['get'] + real['head']:.2f} per replica-second; the model at the same settings "
            f"{model['put']:.2f}, {model['list']:.2f}, {model['get'] + model['head']:.2f}; staleness per pair "
            f"p50 {real['stale_p50']:.1f} s (model {model['stale_p50']:.1f}), max {real['stale_max']:.1f} "
            f"({model['stale_max']:.1f})."
        )
    for sim in sims:
        m = sim["model"]
        if sim["lost"] or sim["stores_unseen"]:
            notes.append(
                f"{m.protocol} N={m.n} TP {m.tp}: {sim['lost']} keys lost ({sim['lost_slowed']} of them in "
                f"slow segment PUTs), {sim['stores_unseen']} of "
                f"{sim['stores_checked']} window stores not seen by every reader."
            )
        pairs = sim["stale_pairs"]
        if len(pairs):
            notes.append(
                f"{m.protocol} N={m.n} TP {m.tp}: staleness per (store, other replica) pair p50 "
                f"{_pct(pairs, 50):.1f} s, p99 {_pct(pairs, 99):.1f} s, max {float(pairs.max()):.1f} s "
                f"(the table's: to the last replica); run {sim['wall_s']:.0f} s wall, {sim['cpu_all_s']:.0f} s "
                f"CPU, peak RSS {sim['rss_mib'] / 1024:.2f} GiB."
            )
        b = sim["boot"]
        if b:
            c = b["counts"]
            notes.append(
                f"{m.protocol} N={m.n} TP {m.tp}: start-up {b['s']:.2f} s virtual ({b['wall_s']:.1f} s of CPU), "
                f"{sum(v for k, v in c.items() if k.startswith('get:')):.0f} GETs, "
                f"{sum(v for k, v in c.items() if k.startswith('list:')):.0f} LISTs, {b['keys']:,} keys; "
                f"{sim['slow_puts']} slow segment PUTs in the run."
            )
    return Result(
        name=NAME,
        title=TITLE,
        goal=GOAL,
        columns=COLUMNS,
        rows=rows,
        verdict=verdict(sims),
        notes=notes,
        bars=bars,
        ylabel="manifest GETs per second per replica",
        seconds=time.perf_counter() - t_start,
    )


def verdict(sims: list[dict[str, Any]]) -> str:
    """The goals, judged on protocol "epochs" at N=1,000 TP 8 (against N=10
    at the same TP for the cost): "met: ..." or "missed: ..." with the
    figures; "no goal" where that size was not run (a quick run)."""
    by = {(s["model"].n, s["model"].tp): s for s in sims if s["model"].protocol == "epochs"}
    big = by.get((1000, 8))
    small = by.get((10, 8)) or by.get((10, 1))
    if big is None or small is None:
        return "no goal"
    d = SyncSettings()
    within = 2 * d.publish_s + d.refresh_s
    peak = rates_of(big).peak_get[1]
    cost, cost10 = rates_of(big).manifest_cost_per_hour, rates_of(small).manifest_cost_per_hour
    p99 = _pct(big["stale_fast"], 99)
    boot = big["boot"]["s"] if big["boot"] else float("inf")
    lost = sum(s["lost"] for s in by.values())
    checks = [
        (peak < PREFIX_GET_LIMIT, f"busiest prefix {peak:,.0f} GET/s (< {PREFIX_GET_LIMIT:,})"),
        (cost <= cost10, f"manifest ${cost:.4f}/replica-hour (N=10: ${cost10:.4f})"),
        (p99 <= within, f"staleness p99 {p99:.1f} s (<= {within:.0f} s)"),
        (boot < 10, f"start-up {boot:.1f} s (< 10 s)"),
        (lost == 0, f"{lost} keys lost"),
    ]
    missed = [text for ok, text in checks if not ok]
    said = "; ".join(text for _, text in checks)
    return f"missed ({'; '.join(missed)}): {said}" if missed else f"met at N=1,000 TP 8: {said}"


def main(argv: list[str]) -> int:
    global OPTIONS
    OPTIONS, rest = parse_options(argv[1:])
    sys.argv = [argv[0], *rest]
    return main_for(run, "s3kv-bench-fleet")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
