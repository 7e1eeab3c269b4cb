"""Publishing stored chunks from where their PUTs complete: the workers.

A chunk object is complete when its create-only PUT returns, and the worker
whose I/O loop made the PUT is the first to know it. Publishing from there
(rather than from the scheduler side, which hears of a store only with the
next engine step) means a replica that stops, however it stops, takes with
it at most what completed since its last segment: a :class:`ShardPublisher`
writes one every ``publish_s`` while there is something to say, and once
more on the worker's shutdown path (bounded by ``shutdown_flush_s``).

Each rank publishes its own shards. With one rank (TP 1) a rank segment is
an ordinary segment. With several, it says so in its header
(``meta["rank"]``, ``meta["ranks"]``) and readers count a chunk only once
every rank's segment has named it (:class:`RankTally`): a chunk is usable
only when every rank's shard is there.

Stamps follow the manifest's hybrid clock
(:class:`~s3kv.manifest.protocol.HybridClock`): never before the newest
stamp the replica's scheduler side has seen (it sends it with each step's
plans), so a worker with a late clock cannot hide a segment below other
readers' floors. The rank publisher's writer id is the scheduler side's with
``r{rank}`` appended, so replicas still elect one snapshot writer per
replica (:func:`~s3kv.manifest.protocol.replica_of`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable

import numpy as np

from s3kv.auth import FleetKeys
from s3kv.config import DEFAULTS
from s3kv.errors import AlreadyExists, CorruptManifest
from s3kv.manifest import format as mf
from s3kv.manifest.journal import RankJournal
from s3kv.manifest.keyset import as_sorted_unique
from s3kv.manifest.protocol import HybridClock, rank_writer, segment_name
from s3kv.stats import Counters
from s3kv.stores.base import ObjectStore, PutMode

log = logging.getLogger("s3kv.manifest")

REPUBLISH_MAX = 2
"""Times a segment is published again after a slow PUT, at most."""
MAX_RANKS = 64
"""A rank segment naming more ranks than this is garbage."""
PARTIAL_TTL_MS = 15 * 60 * 1000
"""A chunk some ranks published but the others never did after this long
is forgotten (a rank's PUT failed: the chunk is not whole)."""


class SegmentWriter:
    """Writes segments under one writer id: stamps from ``next_ts`` (the
    owner's hybrid clock), create-only PUTs, and publishing again under a
    fresh stamp when a PUT was so slow that readers' floors may have passed
    it."""

    def __init__(
        self,
        store: ObjectStore,
        base: str,
        writer: str,
        next_ts: Callable[[], int],
        *,
        keys: FleetKeys | None = None,
        skew_s: float = DEFAULTS.manifest_clock_skew_s,
        clock: Callable[[], float] = time.time,
        counters: Counters | None = None,
    ) -> None:
        self.store = store
        self.base = base
        self.writer = writer
        self.keys = keys
        self._next_ts = next_ts
        self._skew_s = skew_s
        self._clock = clock
        self.counters = counters or Counters()
        self._seq = 0

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    async def put(self, segment: mf.ManifestObject) -> list[tuple[str, int]]:
        """Write ``segment``; returns the (name, stamp) of each copy written."""
        body = mf.encode(segment, self.keys)
        written: list[tuple[str, int]] = []
        for _ in range(1 + REPUBLISH_MAX):
            ts = self._next_ts()
            name = segment_name(self.base, ts, self.writer, self.next_seq(), directory=self.store.directory)
            with contextlib.suppress(AlreadyExists):  # names are ours alone: a retried PUT
                await self.store.put(name, body, mode=PutMode.CREATE)
            written.append((name, ts))
            self.counters.add("manifest_segments_published")
            # A PUT slower than half the margin may land behind other readers'
            # floors: publish the same keys again under a fresh stamp (a
            # couple of times at most: S3 that slow delays every replica).
            if self._clock() * 1000 - ts <= self._skew_s * 500:
                return written
        log.warning(
            "s3kv: manifest segment PUTs keep taking over %.0f s; not publishing it again", self._skew_s / 2
        )
        return written


class ShardPublisher:
    """One rank's publisher, on the worker's I/O loop: the fingerprints of
    chunk objects this rank created, as rank segments."""

    def __init__(
        self,
        store: ObjectStore,
        base: str,
        writer: str,
        *,
        rank: int,
        ranks: int,
        keys: FleetKeys | None = None,
        publish_s: float = DEFAULTS.manifest_publish_s,
        skew_s: float = DEFAULTS.manifest_clock_skew_s,
        counters: Counters | None = None,
        clock: Callable[[], float] = time.time,
        journal: RankJournal | None = None,
    ) -> None:
        self.rank = rank
        self.journal = journal
        """Where each store is noted first, for the front end to publish if
        vLLM kills this process before a segment names it."""
        self.ranks = ranks
        self.publish_s = publish_s
        self.counters = counters or Counters()
        self._lock = threading.Lock()
        self._pending: list[int] = []
        self._in_flight = 0
        """Fingerprints the publish under way took (0 or one batch: see :meth:`publish`)."""
        self._publishing = asyncio.Lock()
        self._stamps = HybridClock(clock)
        self.segments = SegmentWriter(
            store,
            base,
            rank_writer(writer, rank),
            self._stamps.next,
            keys=keys,
            skew_s=skew_s,
            clock=clock,
            counters=self.counters,
        )

    # -- any thread ----------------------------------------------------------------
    def stored(self, fp: int) -> None:
        """This rank created a chunk object: publish its fingerprint."""
        with self._lock:
            self._pending.append(fp)
            if self.journal is not None:
                self.journal.stored(fp)

    def observe(self, ts_ms: int) -> None:
        """The newest stamp the replica has seen: never stamp before it."""
        self._stamps.observe(ts_ms)

    @property
    def pending(self) -> int:
        """Stores not in a segment yet: waiting, or in the publish under way."""
        with self._lock:
            return len(self._pending) + self._in_flight

    def close(self) -> int:
        """Done publishing (after the shutdown flush, and the cancellation
        of what was still running): the journal is closed, and removed if
        every store is in a segment. Returns the stores that are not."""
        left = self.pending
        if self.journal is not None:
            self.journal.close(all_published=left == 0)
        return left

    # -- the worker's I/O loop -------------------------------------------------------
    async def publish(self) -> int:
        """Write what was stored since the last segment as one segment; on
        any failure (or cancellation) it goes back for the next call.
        Returns the fingerprints published.

        Publishes never overlap: a call while another is under way (the
        shutdown flush while a periodic PUT is in flight) waits for it, then
        takes what is left, the other's fingerprints too if it failed. So
        what a publish takes is always the journal's whole unpublished tail,
        and the count the journal is told covers only fingerprints now in a
        segment: were a later publish to count past an earlier one still in
        flight, and that one be cancelled, the front end's replay would
        skip its fingerprints and no segment would name them."""
        async with self._publishing:
            with self._lock:
                fps, self._pending = self._pending, []
                self._in_flight = len(fps)
                upto = self.journal.appended if self.journal is not None else 0
            if not fps:
                return 0
            meta: dict[str, object] = {"writer": self.segments.writer}
            if self.ranks > 1:
                meta.update(rank=self.rank, ranks=self.ranks)
            written = False
            try:
                await self.segments.put(mf.ManifestObject("segment", as_sorted_unique(fps), meta=meta))
                written = True
                if self.journal is not None:
                    self.journal.published(upto, self._stamps.last_ms)
            finally:
                with self._lock:
                    self._in_flight = 0
                    if not written:  # its PUT may have landed all the same: published twice is harmless
                        self._pending[:0] = fps
            return len(fps)

    async def run(self) -> None:
        """Publish every ``publish_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.publish_s)
            try:
                await self.publish()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.counters.add("manifest_errors")
                log.warning("s3kv: publishing rank %d's stores failed (%s); trying again", self.rank, e)


def rank_fields(meta: dict[str, object]) -> tuple[int, int] | None:
    """A rank segment's (rank, ranks) when it has more than one rank; None
    for an ordinary segment. Raises CorruptManifest for nonsense."""
    if "ranks" not in meta and "rank" not in meta:
        return None
    rank, ranks = meta.get("rank"), meta.get("ranks")
    if (
        not isinstance(rank, int)
        or not isinstance(ranks, int)
        or isinstance(rank, bool)
        or isinstance(ranks, bool)
        or not 0 <= rank < ranks <= MAX_RANKS
    ):
        raise CorruptManifest(f"rank segment with rank {rank!r} of {ranks!r}")
    return (rank, ranks) if ranks > 1 else None


class RankTally:
    """Chunks named by some ranks' segments but not yet by all: a chunk
    becomes live once every rank has named it. Remembers, per chunk, the
    first segment that named it, so a snapshot's horizon stays before it
    (a reader starting from that snapshot reads that segment again)."""

    def __init__(self) -> None:
        self._partial: dict[int, tuple[int, int, str]] = {}
        """fingerprint -> (ranks' bit mask, ranks, first segment's name)."""

    def __len__(self) -> int:
        return len(self._partial)

    def add(self, name: str, rank: int, ranks: int, fps: Iterable[int]) -> np.ndarray:
        """Segment ``name`` of ``rank`` (of ``ranks``) named ``fps``: the
        fingerprints that are now whole."""
        full = (1 << ranks) - 1
        whole: list[int] = []
        for fp in fps:
            mask, _, first = self._partial.get(fp, (0, ranks, name))
            mask |= 1 << rank
            if mask == full:
                self._partial.pop(fp, None)
                whole.append(fp)
            else:
                self._partial[fp] = (mask, ranks, min(first, name))
        return as_sorted_unique(whole)

    def discard(self, fps: Iterable[int]) -> None:
        for fp in fps:
            self._partial.pop(fp, None)

    def oldest(self) -> str | None:
        """The name of the oldest segment a partial chunk depends on."""
        return min((first for _, _, first in self._partial.values()), default=None)

    def expire(self, before: str) -> int:
        """Forget chunks whose first segment sorts before ``before``."""
        old = [fp for fp, (_, _, first) in self._partial.items() if first < before]
        for fp in old:
            del self._partial[fp]
        return len(old)
