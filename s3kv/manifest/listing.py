"""Listing segments after a floor, on either kind of bucket.

A general-purpose bucket lists in name order and takes StartAfter: one
listing from the floor on. A directory bucket (S3 Express One Zone) lists in
no order and ignores StartAfter, so its segments are filed under minute
prefixes (:func:`~s3kv.manifest.protocol.segment_dir`) and a reader lists
each minute from its floor's to the one ``skew_s`` ahead of its clock, whole,
cuts the names at the floor itself and sorts them.

A minute that ended ``2 * skew_s`` before the reader's clock is closed: no
writer whose clock is within the skew of the reader's still stamps into it,
and a PUT stamped in it has had a skew's time to land. Once a closed minute
has been listed and its names taken care of (:meth:`SegmentLister.done`),
later calls start after it, so a reader of a fleet that has gone quiet (its
floor stays put) still lists a few minutes a poll, not every minute since.
Names are the same strings in every comparison (the floor is in the
minute layout too), so the rest of the manifest is unchanged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from s3kv.config import DEFAULTS
from s3kv.manifest.protocol import MINUTE_MS, SEGMENTS, name_ts, segment_dir, segment_floor
from s3kv.stores.base import ObjectMeta, ObjectStore

MAX_PARALLEL = 8
"""Minute listings in flight at once."""
MAX_MINUTES = 30
"""More minutes than this to list (a start from an old snapshot, a reader
back after a long pause): one listing of every segment instead, cut at the
floor. Segments older than a snapshot do not stay long (gc compacts them)."""


class SegmentLister:
    """Segments named after a floor, sorted by name, on ``store``'s kind of
    bucket (:attr:`ObjectStore.directory`)."""

    def __init__(
        self,
        store: ObjectStore,
        base: str,
        *,
        skew_s: float = DEFAULTS.manifest_clock_skew_s,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.base = base
        self.directory = store.directory
        self.skew_ms = int(skew_s * 1000)
        self._clock = clock
        self.closed_through = -1
        """The newest closed minute listed, and its names taken care of
        (directory buckets): later calls start after it."""
        self._closing = -1
        """What :meth:`done` makes ``closed_through``."""

    def floor(self, ts_ms: int, margin_ms: int) -> str:
        """:func:`segment_floor` in this bucket's layout."""
        return segment_floor(self.base, ts_ms, margin_ms, directory=self.directory)

    async def after(self, floor: str | None) -> list[ObjectMeta]:
        """Every object under the segments' prefix named after ``floor``
        (None: all of them), in name order. Names outside the minute
        layout (a folder marker, junk) come too where a listing of the whole
        tree finds them, for the caller to skip."""
        prefix = self.base + SEGMENTS
        self._closing = self.closed_through
        if not self.directory:
            return [m async for m in self.store.list(prefix, start_after=floor)]
        if floor is None:  # a start with no snapshot: the whole tree, once
            return sorted([m async for m in self.store.list(prefix)], key=lambda m: m.key)
        now_ms = int(self._clock() * 1000)
        first = max((name_ts(floor) or 0) // MINUTE_MS, self.closed_through + 1)
        last = (now_ms + self.skew_ms) // MINUTE_MS
        closed = (now_ms - 2 * self.skew_ms) // MINUTE_MS - 1
        minutes = range(first, last + 1)
        if len(minutes) > MAX_MINUTES:
            listed = [[m async for m in self.store.list(prefix)]]
        else:
            sem = asyncio.Semaphore(MAX_PARALLEL)

            async def one(minute: int) -> list[ObjectMeta]:
                async with sem:
                    return [m async for m in self.store.list(segment_dir(self.base, minute * MINUTE_MS))]

            tasks = [asyncio.ensure_future(one(m)) for m in minutes]
            try:
                listed = await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:  # one listing failed: the others need not go on
                    t.cancel()
                raise
        self._closing = max(self.closed_through, min(closed, last))
        return sorted((m for part in listed for m in part if m.key > floor), key=lambda m: m.key)

    def done(self) -> None:
        """Every name the last :meth:`after` returned was taken care of
        (applied, skipped, or kept to fetch again): the closed minutes it
        listed need no listing again. Not called when handling them failed
        (a GET refused for the credentials, say), so that the next call lists
        them again, as a general-purpose bucket's listing from the same
        floor would."""
        self.closed_through = max(self.closed_through, self._closing)

    def restart(self) -> None:
        """List every minute from the floor again (a load from scratch,
        whose floor may be older than the last one's)."""
        self.closed_through = self._closing = -1
