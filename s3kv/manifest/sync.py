"""Keeping a replica's manifest in step with the fleet's, through S3.

A :class:`ManifestSync` runs on the scheduler side's background event loop:
at start-up it loads the newest snapshot and the segments after it; then,
every ``publish_s``, it writes a segment with the keys this replica stored
(and an access record of the keys it used), and every ``refresh_s`` it lists
segments newer than the newest it has seen, less a clock-skew margin, and
applies the ones it has not. Nothing here runs in vLLM's scheduling loop:
the loop only reads the in-memory :class:`~s3kv.manifest.keyset.Manifest`.

That is protocol "segments" (``SyncSettings.protocol``), every replica
reading every segment: N requests a replica an interval. Protocol "epochs"
(the config's default, ``manifest_protocol``) publishes the same segments
but reads them through epoch objects, one a ``publish_s``, that one replica
of the fleet aggregates and every other one GETs: that is the sync's
:class:`~s3kv.manifest.chain.EpochChain` (:attr:`ManifestSync.chain`), which
this module's loop, loading and refreshing hand over to.

A bucket holds more than s3kv wrote: what is skipped, how it is counted
and what is retried is :mod:`s3kv.manifest.reader`'s. What the log says is
:func:`~s3kv.manifest.replay.replay`'s, which gc's compaction reads it with
too; snapshots are written and pruned as :mod:`s3kv.manifest.snapshots`
says, for gc as for replicas. Only segments that were applied move the
listing floor.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from s3kv.auth import FleetKeys
from s3kv.errors import PermissionDenied, S3KVError
from s3kv.manifest import format as mf
from s3kv.manifest.arrays import EMPTY, as_sorted_unique
from s3kv.manifest.chain import EpochChain
from s3kv.manifest.keyset import Manifest
from s3kv.manifest.listing import SegmentLister
from s3kv.manifest.protocol import (
    SNAPSHOTS,
    Horizon,
    HybridClock,
    access_hour,
    access_name,
    epoch_ms,
    name_ts,
    new_writer_id,
    parse_name,
    replica_of,
)
from s3kv.manifest.ranks import PARTIAL_TTL_MS, RankTally
from s3kv.manifest.reader import ObjectReader
from s3kv.manifest.replay import bad_removals, changes, replay
from s3kv.manifest.settings import Offload, SyncSettings
from s3kv.manifest.snapshots import stale_snapshots, write_snapshot
from s3kv.manifest.writer import SegmentWriter
from s3kv.stats import Counters
from s3kv.stores.base import ObjectStore, PutMode

log = logging.getLogger("s3kv.manifest")


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
        self._published: list[int] = []
        """What this replica's segments named since :meth:`take_published`."""
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
        """Wall time the manifest was last up to date with S3 (every segment listed was read)."""
        self._next_publish = 0.0
        self._next_refresh = 0.0
        """When (``clock`` seconds) :meth:`tick` next publishes and refreshes."""
        self._publishing: asyncio.Task[None] | None = None
        """Within :meth:`run`: the publish under way, a task of its own, so
        that a slow PUT holds up only the next publish, not reading (the
        replica's segment is its chunks' under protocol "epochs": a PUT 30 s
        slow made this replica read the fleet's epochs 30 s late)."""
        self._in_run = False
        self._prune_denied = False
        """Told once that old snapshots may not be deleted here."""
        self.chain = EpochChain(self) if self.s.protocol == "epochs" else None
        """Protocol "epochs": how other replicas' segments are read (else each one, every refresh)."""
        manifest.sync = self

    @property
    def clock_ms(self) -> int:
        """The newest stamp seen (or written): the workers' segments are stamped after it."""
        return self._stamps.seen_ms

    @property
    def epochs(self) -> bool:
        """Whether this replica reads the log through epochs (protocol "epochs")."""
        return self.chain is not None

    @property
    def e_ms(self) -> int:
        """An epoch's length (ms): ``publish_s``."""
        return epoch_ms(self.s.publish_s)

    @property
    def next_epoch(self) -> int:
        """Protocol "epochs": every epoch before it is applied (0 under "segments")."""
        return self.chain.next_epoch if self.chain is not None else 0

    def aggregate_rank(self, e: int) -> int:
        """This replica's place among the candidates to aggregate epoch ``e``
        (:meth:`EpochChain.aggregate_rank`)."""
        return self._epoch_chain().aggregate_rank(e)

    async def aggregate(self, e: int) -> int | None:
        """Write epoch ``e`` (:meth:`EpochChain.aggregate`)."""
        return await self._epoch_chain().aggregate(e)

    def _epoch_chain(self) -> EpochChain:
        if self.chain is None:
            raise S3KVError(f"manifest protocol {self.s.protocol!r} has no epochs")
        return self.chain

    # -- what the scheduler side tells us (any thread) ---------------------------
    def stored(self, fp: int) -> None:
        with self._lock:
            self._to_publish.append(fp)

    def take_published(self) -> list[int]:
        """The fingerprints this replica's segments named since the last
        call, for its ranks to stop holding (sent with the next step's plans)."""
        with self._lock:
            out, self._published = self._published, []
            return out

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
            bad = bad_removals(obj)
            if len(bad):
                self.manifest.bad.from_segment(bad.tolist(), obj.meta)
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
            self.manifest.bad.from_snapshot(snap.meta)  # the bad records of the segments it covers
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
        if self.chain is not None:
            return await self.chain.load()
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
        if self.chain is not None:
            return await self.chain.advance()
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

    # -- writing -----------------------------------------------------------------
    async def publish(self) -> None:
        """Write what this replica stored and used since the last call, and
        the bad objects it found. On any failure (or cancellation) they go
        back for the next call."""
        task = self._publishing
        if task is not None and not task.done() and task is not asyncio.current_task():
            # The loop's publish first (the shutdown's comes while it is being
            # cancelled): what it took goes back, or out, before this one takes.
            await asyncio.gather(task, return_exceptions=True)
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
            with self._lock:
                self._published.extend(fps)
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
        ``extra`` in its header, and the bad records this replica knows:
        a replica that starts from it must not publish those from a 412),
        then prune all but the newest few."""
        live = await self._offload(self.manifest.fps.array)  # a merge: millions of keys
        bad = self.manifest.bad.header()
        if bad:
            extra = {**(extra or {}), "bad": bad}
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
        if not old:
            return
        try:
            await self.store.delete_many(old)
        except PermissionDenied as e:
            # A replica may run without s3:DeleteObject (gc prunes with its
            # own role): the snapshot is written, the pruning is not this
            # replica's to do. Failing here would fail the tick after it,
            # again at every try, and stop the manifest for good.
            self.counters.add("manifest_prune_denied")
            if not self._prune_denied:
                self._prune_denied = True
                log.warning("s3kv: may not delete old manifest snapshots (%s); leaving them to `s3kv gc`", e)

    # -- the loop ----------------------------------------------------------------
    def next_due(self) -> float:
        """When (``clock`` seconds) :meth:`tick` next has something to do."""
        return min(self._next_publish, self.chain.due if self.chain is not None else self._next_refresh)

    async def tick(self) -> None:
        """What is due now: a publish, a refresh (and maybe a snapshot);
        protocol "epochs": a publish, the epochs due."""
        now = self._clock()
        if now >= self._next_publish and not self._in_run:
            self._next_publish = now + self.s.publish_s
            await self.publish()
        self._publish_due()
        if self.chain is not None:
            if now >= self.chain.due:
                self.chain.due = now + self.s.epoch_retry_s  # unless it says when (S3 down: not at once)
                # A publish falls due between its epochs too: a first start's
                # catch-up of the lookback must not hold back this replica's
                # stores and bad records (a run shorter than it published none).
                await self.chain.advance(between=self._publish_due)
        elif now >= self._next_refresh:
            self._next_refresh = now + self.s.refresh_s
            await self.refresh()
            await self.maybe_snapshot()

    def _publish_due(self) -> None:
        """In :meth:`run`: a publish in a task of its own when one is due."""
        now = self._clock()
        if self._in_run and now >= self._next_publish:
            self._next_publish = now + self.s.publish_s
            if self._publishing is None or self._publishing.done():
                # One at a time: while one is slow, what comes waits for the next.
                self._publishing = asyncio.ensure_future(self._publish_logged())

    async def _publish_logged(self) -> None:
        """:meth:`publish`, its failure counted and logged (tried again at the next interval)."""
        try:
            await self.publish()
        except Exception as e:
            self.counters.add("manifest_errors")
            log.warning("s3kv: publishing the manifest failed (%s); trying again", e)

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
        if self.chain is not None:
            self.chain.due = now
        longest = min(self.s.publish_s, self.s.refresh_s)
        self._in_run = True
        try:
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
        finally:
            self._in_run = False
            task = self._publishing
            if task is not None and not task.done():
                task.cancel()  # what it was publishing goes back, for the shutdown's publish
                await asyncio.gather(task, return_exceptions=True)
            self._publishing = None
