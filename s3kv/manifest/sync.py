"""Keeping a replica's manifest in step with the fleet's, through S3.

A :class:`ManifestSync` runs on the scheduler side's background event loop:
at start-up it loads the newest snapshot and the segments after it; then,
every ``publish_s``, it writes a segment with the keys this replica stored
(and an access record of the keys it used), and every ``refresh_s`` it lists
segments newer than the newest it has seen, less a clock-skew margin, and
applies the ones it has not. Nothing here runs in vLLM's scheduling loop:
the loop only reads the in-memory :class:`~s3kv.manifest.keyset.Manifest`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from s3kv.errors import AlreadyExists, NotFound
from s3kv.manifest import format as mf
from s3kv.manifest.keyset import Manifest, as_sorted_unique
from s3kv.stats import Counters
from s3kv.stores.base import ByteRange, ObjectStore, PutMode

log = logging.getLogger("s3kv.manifest")

RANGE_BYTES = 8 << 20


@dataclass(frozen=True)
class SyncSettings:
    publish_s: float = 5.0
    refresh_s: float = 5.0
    skew_s: float = 60.0
    """Replicas' clocks may disagree by this much without missing segments."""
    snapshot_every: int = 256
    """Segments past the newest snapshot before a replica writes a new one..."""
    snapshot_interval_s: float = 600.0
    """... and no sooner than this after the newest snapshot."""
    snapshots_kept: int = 3
    fetch_concurrency: int = 16


def new_writer_id() -> str:
    return f"{uuid.uuid4().hex[:10]}{os.getpid() % 100:02d}"


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
    ) -> None:
        self.store = store
        self.base = base
        self.manifest = manifest
        self.s = settings or SyncSettings()
        self.counters = counters or Counters()
        self.writer = writer or new_writer_id()
        self._clock = clock
        self._lock = threading.Lock()
        self._to_publish: list[int] = []
        self._used: set[int] = set()
        self._used_published: set[int] = set()
        self._used_hour = ""
        self._seq = 0
        self._seen: dict[str, int] = {}
        """Segment names applied (or written) recently, with their stamps."""
        self._retry: set[str] = set()
        """Segments listed whose GET failed: fetched by name next time, even
        once the listing floor has passed them."""
        self._max_seen_ts = 0
        self._since_snapshot = 0
        self._snapshot_ts = 0
        self.loaded = False
        self.refreshed_at: float | None = None
        """Wall time the manifest was last up to date with S3 (every segment listed was read)."""
        manifest.journal = self

    # -- what the scheduler side tells us (any thread) ---------------------------
    def stored(self, fp: int) -> None:
        with self._lock:
            self._to_publish.append(fp)

    def used(self, fps: np.ndarray) -> None:
        with self._lock:
            self._used.update(fps.tolist())

    # -- reading -----------------------------------------------------------------
    async def _get(self, name: str, size: int | None = None) -> mf.ManifestObject:
        if size is not None and size > 2 * RANGE_BYTES:
            parts = await asyncio.gather(
                *(
                    self.store.get(name, ByteRange(start, min(start + RANGE_BYTES, size)))
                    for start in range(0, size, RANGE_BYTES)
                )
            )
            data = b"".join(parts)
        else:
            data = await self.store.get(name)
        return mf.decode(data, name=name)

    async def _fetch_all(self, names: list[str]) -> list[tuple[str, mf.ManifestObject | None]]:
        """Fetch segments. A corrupt or vanished one comes back as None (and is
        skipped for good); one whose GET failed otherwise is left for a retry."""
        sem = asyncio.Semaphore(self.s.fetch_concurrency)

        async def one(name: str) -> tuple[str, mf.ManifestObject | None] | None:
            async with sem:
                try:
                    return name, await self._get(name)
                except (mf.CorruptManifest, NotFound) as e:
                    self.counters.add("manifest_errors")
                    log.warning("s3kv: skipping manifest segment %s: %s", name, e)
                    return name, None
                except Exception as e:
                    self.counters.add("manifest_errors")
                    log.warning("s3kv: fetching manifest segment %s failed (%s); retrying later", name, e)
                    self._retry.add(name)
                    return None

        got = await asyncio.gather(*(one(n) for n in names))
        return [g for g in got if g is not None]

    def _apply(self, fetched: list[tuple[str, mf.ManifestObject | None]]) -> int:
        """Apply segments in name order (a later removal beats an earlier add)."""
        keys = 0
        for name, obj in sorted(fetched, key=lambda f: f[0]):
            ts = mf.name_ts(name) or 0
            self._seen[name] = ts
            self._retry.discard(name)
            self._max_seen_ts = max(self._max_seen_ts, ts)
            if obj is None:
                continue
            self.manifest.fps.update(obj.added, obj.removed)
            keys += len(obj.added)
            self.counters.add("manifest_segments_loaded")
        self._since_snapshot += len(fetched)
        return keys

    async def _load_snapshot(self) -> tuple[int, str | None, set[str]]:
        """The newest snapshot that reads: (its keys, where the segments after
        it start, the recent segments it includes). When none reads, the
        segments are read from the start instead."""
        snaps = sorted(
            [m async for m in self.store.list(self.base + "snap/")], key=lambda m: m.key, reverse=True
        )
        for meta in snaps:
            try:
                snap = await self._get(meta.key, meta.size)
            except (mf.CorruptManifest, NotFound) as e:
                self.counters.add("manifest_errors")
                log.warning("s3kv: manifest snapshot %s unusable (%s); trying an older one", meta.key, e)
                continue
            self.manifest.fps.replace(snap.added)
            self._snapshot_ts = mf.name_ts(meta.key) or 0
            recent = {str(n) for n in snap.meta.get("recent", ())}
            for name in recent:
                self._seen[name] = mf.name_ts(name) or 0
            horizon = str(snap.meta.get("horizon", ""))
            horizon_ts = mf.name_ts(horizon) if horizon else None
            if horizon_ts is None:
                return len(snap.added), None, recent
            self._max_seen_ts = max(self._max_seen_ts, horizon_ts)
            return len(snap.added), self._segment_floor(), recent
        return 0, None, set()

    async def load(self) -> int:
        """Start-up: the newest snapshot, then every segment after it.
        Returns the fingerprints loaded."""
        keys, start_after, recent = await self._load_snapshot()
        names = [
            m.key
            async for m in self.store.list(self.base + "seg/", start_after=start_after)
            if m.key not in recent
        ]
        self._since_snapshot = 0
        keys += self._apply(await self._fetch_all(names))
        self.manifest.fps.merge()
        self.loaded = True
        self.refreshed_at = time.time()
        return keys

    def _segment_floor(self) -> str:
        return self.base + "seg/" + mf.stamp(max(0, self._max_seen_ts - int(self.s.skew_s * 1000)))

    async def refresh(self) -> int:
        """New segments of other replicas since the last look."""
        start_after = self._segment_floor() if self._max_seen_ts else None
        listed = {
            m.key
            async for m in self.store.list(self.base + "seg/", start_after=start_after)
            if m.key not in self._seen
        }
        names = sorted(listed | self._retry)
        keys = self._apply(await self._fetch_all(names)) if names else 0
        if not self._retry:
            self.refreshed_at = time.time()
        floor = self._max_seen_ts - 2 * int(self.s.skew_s * 1000)
        self._seen = {n: ts for n, ts in self._seen.items() if ts >= floor}
        if self.manifest.fps.needs_merge():
            await asyncio.to_thread(self.manifest.fps.merge)
        return keys

    # -- writing -----------------------------------------------------------------
    def _next_ts(self) -> int:
        """A stamp not before anything seen: a late clock cannot hide a segment."""
        ts = max(int(self._clock() * 1000), self._max_seen_ts + 1)
        self._max_seen_ts = ts
        return ts

    async def publish(self) -> None:
        """Write what this replica stored and used since the last call. On any
        failure (or cancellation) the fingerprints go back for the next call."""
        with self._lock:
            fps, self._to_publish = self._to_publish, []
        if fps:
            try:
                await self._put_segment(as_sorted_unique(fps))
            except BaseException:
                with self._lock:
                    self._to_publish[:0] = fps
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

    async def _put_segment(self, fps: np.ndarray) -> None:
        body = mf.encode(mf.ManifestObject("segment", fps))
        while True:
            ts = self._next_ts()
            self._seq += 1
            name = mf.segment_name(self.base, ts, self.writer, self._seq)
            with contextlib.suppress(AlreadyExists):  # names are ours alone: a retried PUT
                await self.store.put(name, body, mode=PutMode.CREATE)
            self._seen[name] = ts
            self._since_snapshot += 1
            self.counters.add("manifest_segments_published")
            # A PUT slower than half the margin may land behind other readers'
            # floors: publish the same keys again under a fresh stamp.
            if self._clock() * 1000 - ts <= self.s.skew_s * 500:
                return

    async def _publish_access(self, used: set[int]) -> None:
        now_ms = int(self._clock() * 1000)
        hour = time.strftime("%Y%m%d%H", time.gmtime(now_ms / 1000))
        if hour != self._used_hour:
            self._used_hour, self._used_published = hour, set()
        new = used - self._used_published
        if not new:
            return
        self._seq += 1
        name = mf.access_name(self.base, now_ms, self.writer, self._seq)
        body = mf.encode(mf.ManifestObject("access", as_sorted_unique(new)))
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
        writers = {n.rsplit("/", 1)[-1].split("-")[1] for n in self._seen if n.count("-") >= 2}
        if writers and min(writers | {self.writer}) != self.writer:
            return False
        horizon = max(self._seen) if self._seen else ""
        horizon_ts = mf.name_ts(horizon) or 0
        recent = sorted(n for n, ts in self._seen.items() if ts >= horizon_ts - int(self.s.skew_s * 1000))
        meta = {"horizon": horizon, "recent": recent, "writer": self.writer}

        def build() -> tuple[int, bytes]:
            fps = self.manifest.fps.array()
            return len(fps), mf.encode(mf.ManifestObject("snapshot", fps, meta=meta))

        count, body = await asyncio.to_thread(build)  # off the loop: it holds millions of keys
        ts = self._next_ts()
        name = mf.snapshot_name(self.base, ts, self.writer)
        await self.store.put(name, body, mode=PutMode.CREATE)
        self._since_snapshot, self._snapshot_ts = 0, ts
        self.counters.add("manifest_snapshots_written")
        log.info("s3kv: manifest snapshot %s (%d keys)", name, count)
        old = sorted([m.key async for m in self.store.list(self.base + "snap/")])[: -self.s.snapshots_kept]
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
