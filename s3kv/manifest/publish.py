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
every rank's segment has named it (:class:`~s3kv.manifest.ranks.RankTally`): a chunk is usable
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
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from s3kv.auth import FleetKeys
from s3kv.config import DEFAULTS
from s3kv.keys import fingerprint
from s3kv.manifest import format as mf
from s3kv.manifest.arrays import as_sorted_unique
from s3kv.manifest.journal import RankJournal
from s3kv.manifest.protocol import HybridClock, rank_writer
from s3kv.manifest.writer import SegmentWriter
from s3kv.stats import Counters
from s3kv.stores.base import ObjectStore

log = logging.getLogger("s3kv.manifest")


class Published(Protocol):
    """Who hears what a rank's create-only chunk PUTs did, from the tier
    handler that makes them as they happen (the rank's
    :class:`ShardPublisher`; a test's recorder). One route for every PUT:
    it starts, then it is answered, having created the object or found one
    already there (a 412). Called from the worker's I/O loop."""

    def putting(self, key: bytes) -> None:
        """A PUT of ``key``'s object starts."""

    def answered(self, key: bytes, *, created: bool) -> None:
        """The PUT of ``key``'s object returned: it ``created`` the object,
        or found one in the way (a 412: not this rank's to publish; the
        scheduler side decides whether the replica publishes it)."""


class ShardPublisher:
    """One rank's publisher, on the worker's I/O loop: the fingerprints of
    chunk objects this rank created, as rank segments. It is the
    :class:`Published` of the rank's S3 handler: each PUT goes to the
    journal as it starts and as it is answered, before a created object's
    fingerprint waits for the next segment."""

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
    def putting(self, key: bytes) -> None:
        """A PUT of ``key``'s object starts: journaled, so that the front end
        checks for its object if the process dies before the answer."""
        if self.journal is not None:
            self.journal.storing(key)

    def answered(self, key: bytes, *, created: bool) -> None:
        """The PUT of ``key``'s object returned: a created object is
        published; one found in the way (a 412) is only journaled as
        answered (another's object, maybe one the fleet was told is bad)."""
        if created:
            self.stored(fingerprint(key))
        elif self.journal is not None:
            self.journal.settled(key)

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
