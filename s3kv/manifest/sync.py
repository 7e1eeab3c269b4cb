"""Keeping a replica's manifest in step with the fleet's, through S3.

A :class:`ManifestSync` runs on the scheduler side's background event loop:
at start-up it loads the newest snapshot and the segments after it; then,
every ``publish_s``, it writes a segment with the keys this replica stored
(and an access record of the keys it used), and every ``refresh_s`` it lists
segments newer than the newest it has seen, less a clock-skew margin, and
applies the ones it has not. Nothing here runs in vLLM's scheduling loop:
the loop only reads the in-memory :class:`~s3kv.manifest.keyset.Manifest`.

A bucket holds more than s3kv wrote: what is skipped, how it is counted
and what is retried is :mod:`s3kv.manifest.reader`'s. What the log says is
:func:`~s3kv.manifest.replay.replay`'s, which gc's compaction reads it with
too; snapshots are written and pruned as :mod:`s3kv.manifest.snapshots`
says, for gc as for replicas. Only segments that were applied move the
listing floor.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from s3kv.auth import FleetKeys
from s3kv.config import DEFAULTS, MANIFEST_PROTOCOLS, S3KVConfig
from s3kv.errors import (
    AlreadyExists,
    CorruptManifest,
    NotFound,
    PermissionDenied,
    RangeNotSatisfiable,
    S3KVError,
    TooLarge,
)
from s3kv.manifest import epochs as me
from s3kv.manifest import format as mf
from s3kv.manifest.arrays import EMPTY, as_sorted_unique
from s3kv.manifest.keyset import Manifest
from s3kv.manifest.listing import SegmentLister
from s3kv.manifest.protocol import (
    SNAPSHOTS,
    Horizon,
    HybridClock,
    access_hour,
    access_name,
    epoch_end,
    epoch_ms,
    epoch_name,
    epoch_of,
    epoch_start,
    name_ts,
    new_writer_id,
    parse_name,
    replica_of,
)
from s3kv.manifest.ranks import PARTIAL_TTL_MS, RankTally
from s3kv.manifest.reader import ObjectReader
from s3kv.manifest.replay import bad_removals, changes, replay
from s3kv.manifest.snapshots import SNAPSHOTS_KEPT, stale_snapshots, write_snapshot
from s3kv.manifest.writer import SegmentWriter
from s3kv.stats import Counters
from s3kv.stores.base import ObjectStore, PutMode

log = logging.getLogger("s3kv.manifest")

Offload = Callable[..., Awaitable[Any]]
"""Runs ``f(*args)`` off the event loop: :func:`asyncio.to_thread`, or
inline where the loop's time is virtual (the fleet model)."""


@dataclass(frozen=True)
class SyncSettings:
    """The manifest loop's settings, cut from the config by :meth:`from_config`;
    tests may build one (the defaults are the config's, or not config keys)."""

    publish_s: float = DEFAULTS.manifest_publish_s
    refresh_s: float = DEFAULTS.manifest_refresh_s
    skew_s: float = DEFAULTS.manifest_clock_skew_s
    """Replicas' clocks may disagree by this much without missing segments."""
    snapshot_every: int = 256
    """Segments past the newest snapshot before a replica writes a new one..."""
    snapshot_interval_s: float = 600.0
    """... and no sooner than this after the newest snapshot."""
    snapshots_kept: int = SNAPSHOTS_KEPT
    fetch_concurrency: int = 64
    max_object_bytes: int = DEFAULTS.manifest_max_bytes
    """A segment or snapshot larger than this is refused unread (``manifest_max_bytes``)."""
    get_attempts: int = 3
    """GETs of one object that fail otherwise (not denied, missing or
    corrupt: throttled, reset, timed out) before it is skipped."""
    protocol: str = "segments"
    """How other replicas' segments are read (``manifest_protocol``):
    "epochs" (through epoch objects, :mod:`s3kv.manifest.epochs`) or
    "segments" (each one, every ``refresh_s``). The config's default is
    "epochs"; a settings object built by hand reads segments."""
    settle_s: float = 1.0
    """Epochs: an epoch is read (and aggregated, by the first candidate) this
    long after its end, so that the PUTs of its segments have landed."""
    grace_step_s: float = 1.0
    """Epochs: each next candidate aggregates an epoch still missing this much later."""
    max_rank: int = 8
    """Epochs: candidates beyond this rank spread over a few more grace steps."""
    snapshot_epochs: int = 60
    """Epochs: the aggregator of every epoch whose number is a multiple of
    this writes a snapshot (snapshots by count, whatever the fleet's size)."""
    epoch_retry_s: float = 0.5
    """Epochs: an epoch not there yet is asked for again this soon."""

    def __post_init__(self) -> None:
        if self.protocol not in MANIFEST_PROTOCOLS:
            raise ValueError(
                f"manifest protocol {self.protocol!r}: must be one of {', '.join(MANIFEST_PROTOCOLS)}"
            )

    @classmethod
    def from_config(cls, config: S3KVConfig) -> SyncSettings:
        """The ``manifest_*`` keys of ``config``; the rest are not keys."""
        return cls(
            publish_s=config.manifest_publish_s,
            refresh_s=config.manifest_refresh_s,
            skew_s=config.manifest_clock_skew_s,
            max_object_bytes=config.manifest_max_bytes,
            protocol=config.manifest_protocol,
        )


class ManifestSync:
    def __init__(
        self,
        store: ObjectStore,
        base: str,
        manifest: Manifest,
        settings: SyncSettings | None = None,
        *,
        counters: Counters | None = None,
        writer: str | None = None,
        clock: Callable[[], float] = time.time,
        keys: FleetKeys | None = None,
        offload: Offload = asyncio.to_thread,
    ) -> None:
        self.store = store
        self._offload = offload
        """Where numpy work on millions of keys runs (a thread by default)."""
        self.keys = keys
        """The fleet secret: what is written is signed, only what is signed is read."""
        self.base = base
        self.manifest = manifest
        self.s = settings or SyncSettings()
        self.counters = counters or Counters()
        self.writer = writer or new_writer_id()
        self._clock = clock
        self._stamps = HybridClock(clock)
        """This replica's stamps: after every segment it applied or wrote."""
        self._lock = threading.Lock()
        self._to_publish: list[int] = []
        self._bad: list[tuple[int, str, str | None]] = []
        """Bad chunk objects to report: (fingerprint, object name, ETag)."""
        self._bad_seen: set[tuple[str, str | None]] = set()
        """(object name, ETag) of every bad object reported so far: one
        object that many loads (or ranks) found bad is recorded once."""
        self._used: set[int] = set()
        self._used_published: set[int] = set()
        self._used_hour = ""
        self.reader = ObjectReader(
            store,
            base,
            keys=keys,
            counters=self.counters,
            skew_s=self.s.skew_s,
            max_object_bytes=self.s.max_object_bytes,
            get_attempts=self.s.get_attempts,
            fetch_concurrency=self.s.fetch_concurrency,
        )
        """Segments and snapshots read: sifted, bounded, junk skipped and counted."""
        self._lister = SegmentLister(store, base, skew_s=self.s.skew_s, clock=clock)
        """Segments after a floor, on this bucket's kind (general or directory)."""
        self._segments = SegmentWriter(
            store,
            base,
            self.writer,
            self._stamps.next,
            keys=keys,
            skew_s=self.s.skew_s,
            clock=clock,
            counters=self.counters,
        )
        self._tally = RankTally()
        """Chunks some ranks' segments named, waiting for the other ranks'."""
        self._seen: dict[str, int] = {}
        """Segment names applied (or written) recently, with their stamps."""
        self._since_snapshot = 0
        self._snapshot_ts = 0
        self._snapshot_meta: dict[str, Any] = {}
        """The header of the snapshot :meth:`load` started from."""
        self.loaded = False
        self.refreshed_at: float | None = None
        self._next_publish = 0.0
        self._next_refresh = 0.0
        """When (``clock`` seconds) :meth:`tick` next publishes and refreshes."""
        """Wall time the manifest was last up to date with S3 (every segment listed was read)."""
        # -- protocol "epochs" --
        self.epochs = self.s.protocol == "epochs"
        self.e_ms = epoch_ms(self.s.publish_s)
        self._lookback_ms = 2 * int(self.s.skew_s * 1000)
        """How far before an epoch its aggregator lists: late segments go to a later epoch."""
        self.next_epoch = 0
        """Every epoch before it is applied (read, aggregated or covered)."""
        self._epoch_due = 0.0
        """When (``clock`` seconds) :meth:`tick` next looks at :attr:`next_epoch`."""
        self._epoch_gets = 0
        """GETs of :attr:`next_epoch` so far."""
        self._covered: dict[str, int] = {}
        """Segments that epoch objects named (within the lookback), with the
        epoch: an aggregator leaves them out."""
        self._candidates: dict[str, int] = {}
        """Replicas that were members of epochs (within the lookback), with
        the newest such epoch: who may aggregate."""
        self._epoch_lister = SegmentLister(store, base, skew_s=self.s.skew_s, clock=clock)
        self._jitter = (xxhash.xxh3_64_intdigest(self.writer.encode()) % 1000) / 1000
        self._warned_ahead = False
        manifest.sync = self

    @property
    def clock_ms(self) -> int:
        """The newest stamp seen (or written): the workers' segments are stamped after it."""
        return self._stamps.seen_ms

    # -- what the scheduler side tells us (any thread) ---------------------------
    def stored(self, fp: int) -> None:
        with self._lock:
            self._to_publish.append(fp)

    def used(self, fps: np.ndarray) -> None:
        with self._lock:
            self._used.update(fps.tolist())

    def bad(self, fp: int, name: str, etag: str | None) -> None:
        with self._lock:
            if (name, etag) in self._bad_seen:
                return
            self._bad_seen.add((name, etag))
            self._bad.append((fp, name, etag))

    # -- reading -----------------------------------------------------------------
    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _applied(self, fetched: list[tuple[str, mf.ManifestObject]]) -> None:
        """Segments applied: seen (their stamps observed), and the chunks they
        report bad never republished from a 412."""
        for name, obj in fetched:
            self.manifest.bad.update(bad_removals(obj).tolist())
            ts = name_ts(name) or 0
            self._seen[name] = ts
            self._stamps.observe(ts)
        self.counters.add("manifest_segments_loaded", len(fetched))
        self._since_snapshot += len(fetched)

    async def _apply(self, fetched: list[tuple[str, mf.ManifestObject]]) -> int:
        """Apply newly read segments to the live set (their
        :func:`~s3kv.manifest.replay.changes`, all at once and off the event
        loop: numpy work on millions of keys). Returns the fingerprints added."""
        if not fetched:
            return 0
        changed = changes(fetched, self._tally)
        await self._offload(self.manifest.fps.update_many, changed)
        self._applied(fetched)
        return sum(len(added) for added, _ in changed)

    async def _load_snapshot(self) -> tuple[np.ndarray, str | None]:
        """The newest snapshot that reads: (its keys, where the segments after
        it start). When none reads, the segments are read from the start
        instead."""
        reader = self.reader
        self._snapshot_meta = {}
        now_ms = self._now_ms()
        limit = now_ms + int(self.s.skew_s * 1000)
        listed = [m async for m in self.store.list(self.base + SNAPSHOTS)]
        for meta in sorted(reader.sift(listed, "snapshot", now_ms), key=lambda m: m.key, reverse=True):
            try:
                snap = await reader.read(meta.key, meta.size, "snapshot")
            finally:
                reader.retry.pop(meta.key, None)  # snapshots are retried by loading again
            if snap is None:
                if reader.failures.get(meta.key):
                    raise S3KVError(f"reading manifest snapshot {meta.key} failed; loading again later")
                continue
            last = Horizon.last_of(snap.meta)
            parsed = parse_name(self.base, last, directory=self.store.directory) if last else None
            if parsed is not None and parsed.ts > limit:
                # Written by a replica that trusted a stamp in the future:
                # what it covers cannot be told. An older one, then.
                reader.skip(meta.key, "future", f"its horizon {last} is in the future")
                continue
            horizon = Horizon.of(snap.meta)
            self._snapshot_meta = snap.meta
            self._snapshot_ts = name_ts(meta.key) or 0
            for name in horizon.recent:
                n = parse_name(self.base, name, directory=self.store.directory)
                if n is not None and n.kind == "segment" and n.ts <= limit:
                    self._seen[name] = n.ts
            if parsed is None or parsed.kind != "segment":
                return snap.added, None
            self._stamps.observe(parsed.ts)
            return snap.added, self._segment_floor()
        return EMPTY, None

    async def load(self) -> int:
        """Start-up: the newest snapshot, then every segment after it,
        replayed (:func:`~s3kv.manifest.replay.replay`) and swapped in at
        once. Returns the fingerprints loaded."""
        if self.epochs:
            return await self._load_epochs()
        snapshot, start_after = await self._load_snapshot()
        self._lister.restart()
        listed = await self._lister.after(start_after)
        todo = [(m.key, m.size) for m in self.reader.sift(listed, "segment", self._now_ms(), self._seen)]
        fetched = await self.reader.segments(todo)
        live = await self._offload(replay, snapshot, fetched, self._tally)
        await self._offload(self.manifest.fps.replace, live)
        self._since_snapshot = 0
        self._applied(fetched)
        self._lister.done()
        await self._offload(self.manifest.fps.merge)
        self.loaded = True
        self.refreshed_at = self._clock()
        return len(live)

    def _segment_floor(self) -> str:
        return self._lister.floor(self.clock_ms, int(self.s.skew_s * 1000))

    async def refresh(self) -> int:
        """New segments of other replicas since the last look (protocol
        "epochs": the epochs due by now). Returns the fingerprints added."""
        if self.epochs:
            return await self._advance()
        start_after = self._segment_floor() if self.clock_ms else None
        listed = await self._lister.after(start_after)
        todo = dict(self.reader.retry)
        todo.update((m.key, m.size) for m in self.reader.sift(listed, "segment", self._now_ms(), self._seen))
        keys = await self._apply(await self.reader.segments(sorted(todo.items()))) if todo else 0
        self._lister.done()
        if not self.reader.retry:
            self.refreshed_at = self._clock()
        floor = self.clock_ms - 2 * int(self.s.skew_s * 1000)
        self._seen = {n: ts for n, ts in self._seen.items() if ts >= floor}
        if len(self._tally):
            self._tally.expire(self._lister.floor(self.clock_ms, PARTIAL_TTL_MS))
        if self.manifest.fps.needs_merge():
            await self._offload(self.manifest.fps.merge)
        return keys

    # -- protocol "epochs" ---------------------------------------------------------
    def _epoch_read_at(self, e: int) -> float:
        """When (``clock`` seconds) this replica first asks for epoch ``e``:
        after its end and the settle time, and a little after the first
        candidate's try (spread by writer, so the fleet's GETs do not come at once)."""
        end_s = (epoch_end(e, self.e_ms) + 1) / 1000
        return end_s + self.s.settle_s + self.s.grace_step_s * 0.5 * (1 + self._jitter)

    def aggregate_rank(self, e: int) -> int:
        """This replica's place among the candidates to aggregate epoch ``e``:
        the replicas that were members of recent epochs and itself, ordered
        by a hash of (e, replica), so the work rotates."""
        candidates = set(self._candidates) | {self.writer}
        order = sorted(candidates, key=lambda r: (xxhash.xxh3_64_intdigest(f"{e}/{r}".encode()), r))
        return order.index(self.writer)

    def _aggregate_at(self, e: int) -> float:
        """When this replica aggregates epoch ``e`` if it is still missing."""
        rank = self.aggregate_rank(e)
        delay = min(rank, self.s.max_rank) * self.s.grace_step_s
        if rank > self.s.max_rank:  # the rest spread over three more steps
            spread = xxhash.xxh3_64_intdigest(f"{e}/{self.writer}/spread".encode()) % 1000 / 1000
            delay += self.s.grace_step_s * 3 * spread
        return (epoch_end(e, self.e_ms) + 1) / 1000 + self.s.settle_s + delay

    def _last_closed(self, now_ms: int) -> int:
        """The newest epoch whose end and settle time have passed."""
        return epoch_of(now_ms - int(self.s.settle_s * 1000), self.e_ms) - 1

    async def _get_epoch(self, e: int) -> tuple[str, me.Epoch | None]:
        """Epoch ``e``'s object: ("ok", it), ("missing", None) when there is
        none yet, ("bad", None) when it does not read (corrupt, unsigned or
        forged with the fleet secret, too large, stamped in the future:
        counted as ``manifest_epochs_skipped``), ("failed", None) when the
        GET failed otherwise (throttled, reset)."""
        name = epoch_name(self.base, e, self.e_ms)
        try:
            data = await self.reader.fetch(name)
            decode = functools.partial(me.decode, keys=self.keys, directory=self.store.directory)
            epoch: me.Epoch = await self._offload(decode, self.base, name, data)
            if epoch.ts > self._now_ms() + int(self.s.skew_s * 1000):
                raise CorruptManifest(f"{name}: written at {epoch.ts}, in the future")
        except NotFound:
            self.counters.add("manifest_epochs_missing")
            return "missing", None
        except PermissionDenied as err:
            if err.credentials:
                raise
            return self._bad_epoch(name, err)
        except (CorruptManifest, RangeNotSatisfiable, TooLarge) as err:
            return self._bad_epoch(name, err)
        except Exception as err:
            self.counters.add("manifest_errors")
            log.warning("s3kv: fetching manifest epoch %s failed (%s); trying again", name, err)
            return "failed", None
        self.counters.add("manifest_epochs_read")
        return "ok", epoch

    def _bad_epoch(self, name: str, err: Exception) -> tuple[str, None]:
        self.counters.add("manifest_epochs_skipped")
        self.counters.add("manifest_errors")
        log.warning("s3kv: skipping manifest epoch %s (%s); reading its segments instead", name, err)
        return "bad", None

    def _took(self, e: int, members: list[me.Member], *, covered: bool) -> list[me.Member]:
        """Epoch ``e``'s members, known: the replicas among them become
        candidates; with ``covered`` (an epoch object named them) later
        epochs leave them out. Returns those not applied yet."""
        for name, _ in members:
            parsed = parse_name(self.base, name)
            if parsed is not None:
                self._candidates[replica_of(parsed.writer)] = e
            if covered:
                self._covered[name] = e
        return [(n, o) for n, o in members if n not in self._seen]

    async def _segments_of(self, e: int, *, check_clock: bool) -> list[me.Member] | None:
        """The segments epoch ``e`` covers, listed and read: stamped up to
        its end, from ``lookback`` before its start, none an earlier epoch
        covered. With ``check_clock``, None when this replica's clock looks
        far ahead of the fleet's: the other writers' newest stamp is more
        than the skew margin behind it."""
        now_ms = self._now_ms()
        skew_ms = int(self.s.skew_s * 1000)
        self._epoch_lister.restart()
        listed = await self._epoch_lister.after(self._epoch_lister.floor(epoch_start(e, self.e_ms), self._lookback_ms))
        if check_clock:
            others = [
                p.ts
                for m in listed
                if (p := parse_name(self.base, m.key, directory=self.store.directory)) is not None
                and p.kind == "segment"
                and replica_of(p.writer) != self.writer
                and p.ts <= now_ms + skew_ms
            ]
            if others and max(others) < now_ms - skew_ms:
                return None
        end = epoch_end(e, self.e_ms)
        todo = [
            (m.key, m.size)
            for m in self.reader.sift(listed, "segment", now_ms, self._covered)
            if (name_ts(m.key) or 0) <= end
        ]
        fetched = await self.reader.segments(todo)
        for name, _ in todo:  # one that failed is listed again by the next epoch
            self.reader.retry.pop(name, None)
        return fetched

    async def _cover(self, e: int, members: list[me.Member] | None = None) -> int:
        """Epoch ``e`` covered by this replica alone, from raw segments
        (its object does not read, or this replica may not write it):
        applied, nothing written. Later epochs still name these segments."""
        if members is None:
            members = await self._segments_of(e, check_clock=False) or []
        self.counters.add("manifest_epochs_covered")
        keys = await self._apply(self._took(e, members, covered=False))
        self._next(e)
        return keys

    async def _read(self, e: int, epoch: me.Epoch) -> int:
        keys = await self._apply(self._took(e, epoch.members, covered=True))
        self._next(e)
        return keys

    def _next(self, e: int) -> None:
        self.next_epoch, self._epoch_gets = e + 1, 0

    async def aggregate(self, e: int) -> int:
        """Write epoch ``e`` (create-only: of racing aggregators one wins; a
        loser reads the winner's), apply it, and, every ``snapshot_epochs``,
        snapshot. Returns the fingerprints added."""
        members = await self._segments_of(e, check_clock=True)
        if members is None:
            self.counters.add("manifest_epochs_refused")
            if not self._warned_ahead:
                self._warned_ahead = True
                log.warning(
                    "s3kv: this replica's clock looks more than %.0f s ahead of the fleet's (the other "
                    "replicas' newest segments are older than that); not aggregating manifest epochs",
                    self.s.skew_s,
                )
            return await self._cover(e, await self._segments_of(e, check_clock=False))
        epoch = me.Epoch(e, self.e_ms, self.writer, self._now_ms(), members)
        body: bytes = await self._offload(me.encode, self.base, epoch, self.keys)
        name = epoch_name(self.base, e, self.e_ms)
        if len(body) > self.s.max_object_bytes:
            log.warning("s3kv: manifest epoch %s would be %d bytes, over the limit; not written", name, len(body))
            return await self._cover(e, members)
        try:
            await self.store.put(name, body, mode=PutMode.CREATE)
        except AlreadyExists:
            status, theirs = await self._get_epoch(e)
            if status == "ok" and theirs is not None:
                return await self._read(e, theirs)
            return await self._cover(e, members)
        self.counters.add("manifest_epochs_written")
        keys = await self._read(e, epoch)
        if self.s.snapshot_epochs and e % self.s.snapshot_epochs == 0:
            await self._epoch_snapshot(e)
        return keys

    async def _step(self) -> int | None:
        """Epoch :attr:`next_epoch`, if it is due: read, or aggregated at
        this replica's rank's time. Returns the fingerprints added, or None
        when it is not due (yet) or not there yet (:meth:`next_due` says when)."""
        e = self.next_epoch
        now = self._clock()
        aggregate_at, read_at = self._aggregate_at(e), self._epoch_read_at(e)
        if now < min(aggregate_at, read_at):
            self._epoch_due = min(aggregate_at, read_at)
            return None
        if self._epoch_gets == 0 or now < aggregate_at:
            self._epoch_gets += 1
            status, epoch = await self._get_epoch(e)
            if status == "ok" and epoch is not None:
                return await self._read(e, epoch)
            if status == "bad":
                return await self._cover(e)
            if now < aggregate_at:
                self._epoch_due = min(aggregate_at, now + self.s.epoch_retry_s)
                return None
        return await self.aggregate(e)

    async def _advance(self) -> int:
        """Every epoch due by now, in order."""
        keys = 0
        while (got := await self._step()) is not None:
            keys += got
        self.refreshed_at = self._clock()
        self._forget()
        if self.manifest.fps.needs_merge():
            await self._offload(self.manifest.fps.merge)
        return keys

    def _forget(self) -> None:
        """Names older than any later epoch lists: memory stays bounded by the lookback."""
        floor = epoch_start(self.next_epoch, self.e_ms) - self._lookback_ms - self.e_ms
        self._seen = {n: ts for n, ts in self._seen.items() if ts >= floor}
        self._covered = {n: e for n, e in self._covered.items() if (name_ts(n) or 0) >= floor}
        oldest = self.next_epoch - self._lookback_ms // self.e_ms - 2
        self._candidates = {r: e for r, e in self._candidates.items() if e >= oldest}
        if len(self._tally):
            self._tally.expire(self._lister.floor(self.clock_ms, PARTIAL_TTL_MS))

    async def _epoch_snapshot(self, e: int) -> None:
        """The snapshot of this replica's manifest, which has applied every
        epoch up to ``e``: meta ``epoch`` (where a new replica's epochs
        start) and the legacy horizon (where an older replica's segments do)."""
        oldest = self._tally.oldest()
        # A chunk still waiting for other ranks: a replica starting from this
        # snapshot reads the epoch that named its first segment again.
        since = e if oldest is None or oldest not in self._covered else self._covered[oldest] - 1
        horizon = Horizon.over(
            (n for n in self._seen if oldest is None or n < oldest), int(self.s.skew_s * 1000)
        )
        await self._snapshot(horizon, {"epoch": since, "e_ms": self.e_ms})

    async def _load_epochs(self) -> int:
        """Start-up, protocol "epochs": the newest snapshot, then the epochs
        after it, fetched many at once and applied in order. Where one is
        missing long after its end (a hole: the fleet was down, or the
        snapshot is older than epochs) the segments from there are listed
        instead, then epochs from a lookback before now. Returns the
        fingerprints loaded."""
        snapshot, start_after = await self._load_snapshot()
        meta = self._snapshot_meta
        now_ms = self._now_ms()
        last = self._last_closed(now_ms)
        lookback_epochs = -(-self._lookback_ms // self.e_ms)
        e: int | None = None
        if meta.get("e_ms") == self.e_ms and isinstance(meta.get("epoch"), int) and meta["epoch"] <= last:
            e = int(meta["epoch"]) + 1
        members: list[me.Member] = []
        taken: set[str] = set(self._seen)

        def take(got: list[me.Member]) -> None:
            for name, obj in got:
                if name not in taken:
                    taken.add(name)
                    members.append((name, obj))

        self._lister.restart()
        if e is None:  # no snapshot of epochs: the segments since its horizon
            take(await self._raw_segments(start_after, taken))
            e = max(epoch_of(now_ms, self.e_ms) - lookback_epochs, 0)
        while e <= last:
            batch = range(e, min(last, e + self.s.fetch_concurrency - 1) + 1)
            got = await asyncio.gather(*(self._get_epoch(x) for x in batch))
            stop = False
            for x, (status, epoch) in zip(batch, got, strict=True):
                if status == "ok" and epoch is not None:
                    take(self._took(x, epoch.members, covered=True))
                elif status == "bad":
                    self.counters.add("manifest_epochs_covered")
                    take(self._took(x, await self._segments_of(x, check_clock=False) or [], covered=False))
                elif epoch_end(x, self.e_ms) < now_ms - self._lookback_ms:
                    # A hole: whatever segments its aggregators would have taken, listed.
                    floor = self._lister.floor(epoch_start(x, self.e_ms), self._lookback_ms)
                    take(await self._raw_segments(floor, taken))
                    e = max(x + 1, epoch_of(now_ms, self.e_ms) - lookback_epochs)
                    break
                else:  # not written yet: the loop reads or aggregates it
                    stop = True
                    break
                e = x + 1
            if stop:
                break
        self.next_epoch, self._epoch_gets = e, 0
        live = await self._offload(replay, snapshot, members, self._tally)
        await self._offload(self.manifest.fps.replace, live)
        self._applied(members)
        self._lister.done()
        self._forget()
        await self._offload(self.manifest.fps.merge)
        self.loaded = True
        self.refreshed_at = self._clock()
        return len(live)

    async def _raw_segments(self, start_after: str | None, seen: set[str]) -> list[me.Member]:
        """Every segment listed after ``start_after`` not in ``seen``, read (today's load)."""
        listed = await self._lister.after(start_after)
        todo = [(m.key, m.size) for m in self.reader.sift(listed, "segment", self._now_ms(), seen)]
        fetched = await self.reader.segments(todo)
        for name, _ in todo:
            self.reader.retry.pop(name, None)
        return fetched

    # -- writing -----------------------------------------------------------------
    async def publish(self) -> None:
        """Write what this replica stored and used since the last call, and
        the bad objects it found. On any failure (or cancellation) they go
        back for the next call."""
        with self._lock:
            fps, self._to_publish = self._to_publish, []
            bad, self._bad = self._bad, []
        if fps:
            try:
                await self._put_segment(mf.ManifestObject("segment", as_sorted_unique(fps)))
            except BaseException:
                with self._lock:
                    self._to_publish[:0] = fps
                    self._bad[:0] = bad
                raise
        if bad:
            record = mf.ManifestObject(
                "segment",
                removed=as_sorted_unique([fp for fp, _, _ in bad]),
                meta={"bad": [[name, etag] for _, name, etag in bad], "writer": self.writer},
            )
            try:
                await self._put_segment(record)
            except BaseException:
                with self._lock:
                    self._bad[:0] = bad
                raise
        with self._lock:
            used, self._used = self._used, set()
        if used:
            try:
                await self._publish_access(used)
            except BaseException:
                with self._lock:
                    self._used |= used
                raise

    async def _put_segment(self, segment: mf.ManifestObject) -> None:
        for name, ts in await self._segments.put(segment):
            self._seen[name] = ts
            self._since_snapshot += 1

    async def _publish_access(self, used: set[int]) -> None:
        ts = self._stamps.next()  # the segments' clock: a late clock cannot age a use
        hour = access_hour(ts)
        if hour != self._used_hour:
            self._used_hour, self._used_published = hour, set()
        new = used - self._used_published
        if not new:
            return
        name = access_name(self.base, ts, self.writer, self._segments.next_seq())
        body = mf.encode(mf.ManifestObject("access", as_sorted_unique(new)), self.keys)
        await self.store.put(name, body, mode=PutMode.CREATE)
        self._used_published |= new

    async def maybe_snapshot(self) -> bool:
        """Write a snapshot when many segments piled up since the newest one,
        and it is old enough. Of the writers seen recently, the one whose id
        sorts first does it, and removes all but the newest few snapshots."""
        now_ms = int(self._clock() * 1000)
        if (
            self._since_snapshot < self.s.snapshot_every
            or now_ms - self._snapshot_ts < self.s.snapshot_interval_s * 1000
        ):
            return False
        # One writer per replica: a rank publisher counts as its replica's.
        names = (parse_name(self.base, n, directory=self.store.directory) for n in self._seen)
        writers = {replica_of(n.writer) for n in names if n is not None}
        if writers and min(writers | {self.writer}) != self.writer:
            return False
        # The horizon stays before any segment a chunk still waiting for
        # other ranks depends on: a reader starting from this snapshot reads
        # that segment again, and so completes the chunk when the rest come.
        oldest = self._tally.oldest()
        horizon = Horizon.over(
            (n for n in self._seen if oldest is None or n < oldest), int(self.s.skew_s * 1000)
        )
        await self._snapshot(horizon)
        return True

    async def _snapshot(self, horizon: Horizon, extra: dict[str, Any] | None = None) -> None:
        """Write a snapshot of the live set covering ``horizon`` (and
        ``extra`` in its header), then prune all but the newest few."""
        live = await self._offload(self.manifest.fps.array)  # a merge: millions of keys
        snap = await write_snapshot(
            self.store,
            self.base,
            live,
            horizon,
            writer=self.writer,
            next_ts=self._stamps.next,
            keys=self.keys,
            offload=self._offload,
            extra=extra,
        )
        self._since_snapshot, self._snapshot_ts = 0, name_ts(snap.key) or 0
        self.counters.add("manifest_snapshots_written")
        log.info("s3kv: manifest snapshot %s (%d keys)", snap.key, len(live))
        listed = [m.key async for m in self.store.list(self.base + SNAPSHOTS)]
        limit = self._now_ms() + int(self.s.skew_s * 1000)
        old = stale_snapshots(self.base, listed, limit_ms=limit, kept=self.s.snapshots_kept)
        if old:
            await self.store.delete_many(old)

    # -- the loop ----------------------------------------------------------------
    def next_due(self) -> float:
        """When (``clock`` seconds) :meth:`tick` next has something to do."""
        return min(self._next_publish, self._epoch_due if self.epochs else self._next_refresh)

    async def tick(self) -> None:
        """What is due now: a publish, a refresh (and maybe a snapshot);
        protocol "epochs": a publish, the epochs due."""
        now = self._clock()
        if now >= self._next_publish:
            self._next_publish = now + self.s.publish_s
            await self.publish()
        if self.epochs:
            if now >= self._epoch_due:
                await self._advance()
        elif now >= self._next_refresh:
            self._next_refresh = now + self.s.refresh_s
            await self.refresh()
            await self.maybe_snapshot()

    async def run(self, on_loaded: Callable[[], None] | None = None) -> None:
        """Load, then publish and refresh forever (until cancelled). Timed by
        ``clock`` and :func:`asyncio.sleep` only, so that many replicas' loops
        can share one event loop whose time is virtual (the fleet model)."""
        retry = self.s.refresh_s
        while not self.loaded:
            try:
                started = self._clock()
                n = await self.load()
                log.info("s3kv: manifest loaded: %d keys in %.2f s", n, self._clock() - started)
            except Exception as e:
                self.counters.add("manifest_errors")
                log.warning("s3kv: loading the manifest failed (%s); retrying in %.0f s", e, retry)
                await asyncio.sleep(retry)
                retry = min(retry * 2, 60.0)
        if on_loaded is not None:
            on_loaded()
        now = self._clock()
        self._next_publish = now + self.s.publish_s
        self._next_refresh = now + self.s.refresh_s  # load() just looked
        self._epoch_due = now
        longest = min(self.s.publish_s, self.s.refresh_s)
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.counters.add("manifest_errors")
                log.warning("s3kv: manifest sync failed (%s); trying again", e)
            # Never longer than an interval: a wall clock stepped back must
            # not stall the loop.
            await asyncio.sleep(min(longest, max(0.05, self.next_due() - self._clock())))
