"""Keeping a replica's manifest in step with the fleet's, through S3.

A :class:`ManifestSync` runs on the scheduler side's background event loop:
at start-up it loads the newest snapshot and the segments after it; then,
every ``publish_s``, it writes a segment with the keys this replica stored
(and an access record of the keys it used), and every ``refresh_s`` it lists
segments newer than the newest it has seen, less a clock-skew margin, and
applies the ones it has not. Nothing here runs in vLLM's scheduling loop:
the loop only reads the in-memory :class:`~s3kv.manifest.keyset.Manifest`.

A bucket holds more than s3kv wrote, and the manifest must survive it.
Listed objects are skipped, counted once each (``manifest_skipped`` by
reason) and never fatal:

- *marker*: a folder marker (a key ending in '/');
- *foreign*: a name that is no segment's or snapshot's (never fetched);
- *future*: stamped beyond now plus the skew margin; not applied (and so
  moving neither the listing floor nor this writer's clock) until time
  catches up with it;
- *oversize*: larger than ``max_object_bytes``, by the listing's size or
  by a GET bounded to one byte more;
- *garbage*: too short, or failing to decode;
- *denied*: the store refused the GET;
- *unsigned*: with the fleet secret set, no valid MAC (a forgery, or a
  replica without the secret).

A GET that fails otherwise is tried again at the next refreshes, at most
``get_attempts`` times in all, then skipped. Only segments that were
applied move the listing floor.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from s3kv.auth import FleetKeys
from s3kv.config import DEFAULTS, S3KVConfig
from s3kv.errors import (
    CorruptManifest,
    NotFound,
    PermissionDenied,
    RangeNotSatisfiable,
    S3KVError,
    TooLarge,
    UnsignedManifest,
)
from s3kv.manifest import format as mf
from s3kv.manifest.arrays import as_sorted_unique
from s3kv.manifest.keyset import Manifest
from s3kv.manifest.listing import SegmentLister
from s3kv.manifest.protocol import (
    SEGMENTS,
    SNAPSHOTS,
    Horizon,
    HybridClock,
    access_hour,
    access_name,
    name_ts,
    new_writer_id,
    parse_name,
    replica_of,
    snapshot_name,
)
from s3kv.manifest.ranks import PARTIAL_TTL_MS, RankTally, rank_fields
from s3kv.manifest.writer import SegmentWriter
from s3kv.stats import Counters
from s3kv.stores.base import ByteRange, ObjectMeta, ObjectStore, PutMode

log = logging.getLogger("s3kv.manifest")

RANGE_BYTES = DEFAULTS.range_bytes
"""A manifest object larger than twice this is read in ranged GETs of this
size: the chunks' default GET size, not the configured ``range_bytes``
(which tunes chunk loads)."""


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
    snapshots_kept: int = 3
    fetch_concurrency: int = 16
    max_object_bytes: int = DEFAULTS.manifest_max_bytes
    """A segment or snapshot larger than this is refused unread (``manifest_max_bytes``)."""
    get_attempts: int = 3
    """GETs of one object that fail otherwise (not denied, missing or
    corrupt: throttled, reset, timed out) before it is skipped."""

    @classmethod
    def from_config(cls, config: S3KVConfig) -> SyncSettings:
        """The ``manifest_*`` keys of ``config``; the rest are not keys."""
        return cls(
            publish_s=config.manifest_publish_s,
            refresh_s=config.manifest_refresh_s,
            skew_s=config.manifest_clock_skew_s,
            max_object_bytes=config.manifest_max_bytes,
        )


SKIP_REASONS = ("marker", "foreign", "garbage", "denied", "future", "oversize", "unsigned")
"""The ``manifest_skipped`` reasons this module counts."""
_DIRS = {"segment": SEGMENTS, "snapshot": SNAPSHOTS}


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
    ) -> None:
        self.store = store
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
        self._retry: dict[str, int | None] = {}
        """Segments listed whose GET failed, with their listed sizes: fetched
        by name next time, even once the listing floor has passed them."""
        self._failures: dict[str, int] = {}
        """GETs failed so far (not counting skips), by name."""
        self._skipped: dict[str, str] = {}
        """Names skipped for good, with the reason; forgotten once a listing
        of their directory no longer shows them."""
        self._future: set[str] = set()
        """Names stamped in the future at the last listings (counted once)."""
        self._since_snapshot = 0
        self._snapshot_ts = 0
        self.loaded = False
        self.refreshed_at: float | None = None
        """Wall time the manifest was last up to date with S3 (every segment listed was read)."""
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

    def _skip(self, name: str, reason: str, detail: object = "") -> None:
        """Skip ``name`` for good, counted once: as ``manifest_skipped`` for
        the :data:`SKIP_REASONS`, and as ``manifest_errors`` for a read that
        failed (garbage, denied, gone)."""
        self._retry.pop(name, None)
        self._failures.pop(name, None)
        if name in self._skipped:
            return
        self._skipped[name] = reason
        if reason in SKIP_REASONS:
            self.counters.add(f"manifest_skipped_{reason}")
        if reason in ("garbage", "denied", "gone", "unsigned"):
            self.counters.add("manifest_errors")
        (log.debug if reason == "marker" else log.warning)(
            "s3kv: skipping manifest object %s (%s)%s", name, reason, f": {detail}" if detail else ""
        )

    def _sift(self, listed: list[ObjectMeta], kind: str, now_ms: int) -> list[ObjectMeta]:
        """The listed objects worth a GET: new, named as a ``kind`` is, not
        stamped in the future, of a plausible size. The rest are skipped
        (the future ones only until time catches up with them)."""
        out: list[ObjectMeta] = []
        future: set[str] = set()
        limit = now_ms + int(self.s.skew_s * 1000)
        for meta in listed:
            name = meta.key
            if name in self._seen or name in self._skipped or name in self._retry:
                continue
            parsed = parse_name(self.base, name, directory=self.store.directory)
            if name.endswith("/"):
                self._skip(name, "marker")
            elif parsed is None or parsed.kind != kind:
                self._skip(name, "foreign")
            elif parsed.ts > limit:
                if name not in self._future:
                    self.counters.add("manifest_skipped_future")
                    log.warning("s3kv: manifest object %s is stamped in the future; not applied yet", name)
                future.add(name)
            elif meta.size > self.s.max_object_bytes:
                self._skip(name, "oversize", f"{meta.size} bytes listed")
            elif meta.size < mf.MIN_BYTES:
                self._skip(name, "garbage", f"{meta.size} bytes listed")
            else:
                out.append(meta)
        # Forget what this directory's listing no longer shows (below the
        # floor now, or deleted): memory stays bounded by what the bucket holds.
        directory = self.base + _DIRS[kind]
        shown = {m.key for m in listed}
        self._future = {n for n in self._future if not n.startswith(directory)} | future
        self._skipped = {n: r for n, r in self._skipped.items() if n in shown or not n.startswith(directory)}
        return out

    async def _get(self, name: str, size: int | None = None) -> mf.ManifestObject:
        """Read and decode one object, never more than ``max_object_bytes``
        + 1 bytes of it, whatever it became since it was listed."""
        bound = self.s.max_object_bytes
        if size is not None and size > bound:
            raise TooLarge(f"{name}: {size} bytes, more than {bound}")
        if size is not None and size > 2 * RANGE_BYTES:
            parts = await asyncio.gather(
                *(
                    self.store.get(name, ByteRange(start, min(start + RANGE_BYTES, size)))
                    for start in range(0, size, RANGE_BYTES)
                )
            )
            data = b"".join(parts)
        else:
            data = await self.store.get(name, ByteRange(0, bound + 1))
        if len(data) > bound:
            raise TooLarge(f"{name}: more than {bound} bytes")
        return mf.decode(data, name=name, keys=self.keys)

    async def _read(self, name: str, size: int | None, kind: str) -> mf.ManifestObject | None:
        """One object, or None when it is skipped (counted) or left for a retry."""
        try:
            obj = await self._get(name, size)
            if obj.kind != kind:
                raise CorruptManifest(f"{name}: a {obj.kind}, not a {kind}")
            if kind == "segment":
                rank_fields(obj.meta)  # nonsense there is garbage
        except UnsignedManifest as e:
            self._skip(name, "unsigned", e)
        except (CorruptManifest, RangeNotSatisfiable) as e:  # a 416: emptied since it was listed
            self._skip(name, "garbage", e)
        except PermissionDenied as e:
            if e.credentials:  # S3 refuses this replica, not the object: retried with the listing
                raise
            self._skip(name, "denied", e)
        except TooLarge as e:
            self._skip(name, "oversize", e)
        except NotFound:  # removed by gc since it was listed
            self._skip(name, "gone")
        except Exception as e:
            self.counters.add("manifest_errors")
            failures = self._failures[name] = self._failures.get(name, 0) + 1
            if failures >= self.s.get_attempts:
                self._skip(name, "failed", f"{failures} GETs failed, the last: {e}")
            else:
                log.warning("s3kv: fetching manifest object %s failed (%s); retrying later", name, e)
                self._retry[name] = size
        else:
            self._retry.pop(name, None)
            self._failures.pop(name, None)
            return obj
        return None

    async def _fetch_all(self, items: list[tuple[str, int | None]]) -> list[tuple[str, mf.ManifestObject]]:
        """Fetch segments: the ones that read, in name order."""
        sem = asyncio.Semaphore(self.s.fetch_concurrency)

        async def one(name: str, size: int | None) -> tuple[str, mf.ManifestObject] | None:
            async with sem:
                obj = await self._read(name, size, "segment")
            return None if obj is None else (name, obj)

        got = await asyncio.gather(*(one(n, s) for n, s in items))
        return sorted((g for g in got if g is not None), key=lambda g: g[0])

    async def _apply(self, fetched: list[tuple[str, mf.ManifestObject]]) -> int:
        """Apply segments in name order (a later removal beats an earlier
        add), all at once and off the event loop: numpy work on millions
        of keys. A rank segment's chunks count once every rank named them."""
        if not fetched:
            return 0
        changes = []
        for name, obj in fetched:
            ranks = rank_fields(obj.meta)
            added = obj.added if ranks is None else self._tally.add(name, *ranks, obj.added.tolist())
            if len(obj.removed):
                self._tally.discard(obj.removed.tolist())
            changes.append((added, obj.removed))
        await asyncio.to_thread(self.manifest.fps.update_many, changes)
        keys = 0
        for (name, obj), (added, _) in zip(fetched, changes):
            bad = obj.meta.get("bad")
            if bad and isinstance(bad, list) and len(obj.removed) <= len(bad):
                self.manifest.bad.update(obj.removed.tolist())  # never republished from a 412
            ts = name_ts(name) or 0
            self._seen[name] = ts
            self._stamps.observe(ts)
            keys += len(added)
        self.counters.add("manifest_segments_loaded", len(fetched))
        self._since_snapshot += len(fetched)
        return keys

    async def _load_snapshot(self) -> tuple[int, str | None]:
        """The newest snapshot that reads: (its keys, where the segments after
        it start). When none reads, the segments are read from the start
        instead."""
        now_ms = self._now_ms()
        limit = now_ms + int(self.s.skew_s * 1000)
        listed = [m async for m in self.store.list(self.base + SNAPSHOTS)]
        for meta in sorted(self._sift(listed, "snapshot", now_ms), key=lambda m: m.key, reverse=True):
            try:
                snap = await self._read(meta.key, meta.size, "snapshot")
            finally:
                self._retry.pop(meta.key, None)  # snapshots are retried by loading again
            if snap is None:
                if self._failures.get(meta.key):
                    raise S3KVError(f"reading manifest snapshot {meta.key} failed; loading again later")
                continue
            last = Horizon.last_of(snap.meta)
            parsed = parse_name(self.base, last, directory=self.store.directory) if last else None
            if parsed is not None and parsed.ts > limit:
                # Written by a replica that trusted a stamp in the future:
                # what it covers cannot be told. An older one, then.
                self._skip(meta.key, "future", f"its horizon {last} is in the future")
                continue
            horizon = Horizon.of(snap.meta)
            self.manifest.fps.replace(snap.added)
            self._snapshot_ts = name_ts(meta.key) or 0
            for name in horizon.recent:
                n = parse_name(self.base, name, directory=self.store.directory)
                if n is not None and n.kind == "segment" and n.ts <= limit:
                    self._seen[name] = n.ts
            if parsed is None or parsed.kind != "segment":
                return len(snap.added), None
            self._stamps.observe(parsed.ts)
            return len(snap.added), self._segment_floor()
        return 0, None

    async def load(self) -> int:
        """Start-up: the newest snapshot, then every segment after it.
        Returns the fingerprints loaded."""
        keys, start_after = await self._load_snapshot()
        self._lister.restart()
        listed = await self._lister.after(start_after)
        todo = [(m.key, m.size) for m in self._sift(listed, "segment", self._now_ms())]
        self._since_snapshot = 0
        keys += await self._apply(await self._fetch_all(todo))
        self._lister.done()
        await asyncio.to_thread(self.manifest.fps.merge)
        self.loaded = True
        self.refreshed_at = time.time()
        return keys

    def _segment_floor(self) -> str:
        return self._lister.floor(self.clock_ms, int(self.s.skew_s * 1000))

    async def refresh(self) -> int:
        """New segments of other replicas since the last look."""
        start_after = self._segment_floor() if self.clock_ms else None
        listed = await self._lister.after(start_after)
        todo = dict(self._retry)
        todo.update((m.key, m.size) for m in self._sift(listed, "segment", self._now_ms()))
        keys = await self._apply(await self._fetch_all(sorted(todo.items()))) if todo else 0
        self._lister.done()
        if not self._retry:
            self.refreshed_at = time.time()
        floor = self.clock_ms - 2 * int(self.s.skew_s * 1000)
        self._seen = {n: ts for n, ts in self._seen.items() if ts >= floor}
        if len(self._tally):
            self._tally.expire(self._lister.floor(self.clock_ms, PARTIAL_TTL_MS))
        if self.manifest.fps.needs_merge():
            await asyncio.to_thread(self.manifest.fps.merge)
        return keys

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
        meta = {**horizon.meta(), "writer": self.writer}

        def build() -> tuple[int, bytes]:
            fps = self.manifest.fps.array()
            return len(fps), mf.encode(mf.ManifestObject("snapshot", fps, meta=meta), self.keys)

        count, body = await asyncio.to_thread(build)  # off the loop: it holds millions of keys
        ts = self._stamps.next()
        name = snapshot_name(self.base, ts, self.writer)
        await self.store.put(name, body, mode=PutMode.CREATE)
        self._since_snapshot, self._snapshot_ts = 0, ts
        self.counters.add("manifest_snapshots_written")
        log.info("s3kv: manifest snapshot %s (%d keys)", name, count)
        # Only snapshots by name, none stamped in the future: junk is neither
        # counted among the newest nor deleted.
        limit = self._now_ms() + int(self.s.skew_s * 1000)
        ours = []
        async for m in self.store.list(self.base + SNAPSHOTS):
            n = parse_name(self.base, m.key)
            if n is not None and n.kind == "snapshot" and n.ts <= limit:
                ours.append(m.key)
        old = sorted(ours)[: -self.s.snapshots_kept]
        if old:
            await self.store.delete_many(old)
        return True

    # -- the loop ----------------------------------------------------------------
    async def run(self, on_loaded: Callable[[], None] | None = None) -> None:
        """Load, then publish and refresh forever (until cancelled)."""
        retry = self.s.refresh_s
        while not self.loaded:
            try:
                started = time.monotonic()
                n = await self.load()
                log.info("s3kv: manifest loaded: %d keys in %.2f s", n, time.monotonic() - started)
            except Exception as e:
                self.counters.add("manifest_errors")
                log.warning("s3kv: loading the manifest failed (%s); retrying in %.0f s", e, retry)
                await asyncio.sleep(retry)
                retry = min(retry * 2, 60.0)
        if on_loaded is not None:
            on_loaded()
        next_publish = time.monotonic() + self.s.publish_s
        next_refresh = time.monotonic() + self.s.refresh_s  # load() just looked
        while True:
            now = time.monotonic()
            try:
                if now >= next_publish:
                    next_publish = now + self.s.publish_s
                    await self.publish()
                if now >= next_refresh:
                    next_refresh = now + self.s.refresh_s
                    await self.refresh()
                    await self.maybe_snapshot()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.counters.add("manifest_errors")
                log.warning("s3kv: manifest sync failed (%s); trying again", e)
            await asyncio.sleep(max(0.05, min(next_publish, next_refresh) - time.monotonic()))
