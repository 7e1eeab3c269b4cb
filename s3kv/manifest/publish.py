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
from collections.abc import Callable, Iterable
from typing import Protocol

from s3kv.auth import FleetKeys
from s3kv.config import DEFAULTS, S3KVConfig
from s3kv.keys import fingerprint
from s3kv.manifest import format as mf
from s3kv.manifest.arrays import as_sorted_unique
from s3kv.manifest.journal import RankJournal
from s3kv.manifest.protocol import HybridClock, rank_writer
from s3kv.manifest.writer import SegmentWriter
from s3kv.stats import Counters
from s3kv.stores.base import ObjectStore

log = logging.getLogger("s3kv.manifest")

HOLD_INTERVALS = 3
"""Publish intervals a holding rank waits for its scheduler side's segment."""


def replica_segments(config: S3KVConfig) -> bool:
    """Whether a replica publishes one segment for all its ranks (protocol
    "epochs"), its ranks holding their stores for it, or each rank its own
    (protocol "segments", as before epochs)."""
    return config.manifest_protocol == "epochs"


def hold_s(config: S3KVConfig) -> float | None:
    """How long a rank holds a store for its scheduler side's segment (None:
    it publishes each itself)."""
    return HOLD_INTERVALS * config.manifest_publish_s if replica_segments(config) else None


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
    fingerprint waits for the next segment.

    With ``hold_s`` (protocol "epochs": one segment per replica, not per
    rank) the rank only *holds* what it created: its scheduler side, which
    hears of every rank's stores, publishes each whole chunk in the
    replica's one segment and says so in the next step's plans
    (:meth:`acked`). The rank publishes as a rank segment only what it has
    held longer than ``hold_s`` unacknowledged (the chunk did not complete
    on every rank, or the scheduler side cannot reach S3) and, at shutdown,
    whatever it still holds. Its journal counts a fingerprint as published
    once a segment names it, whoever wrote that segment."""

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
        hold_s: float | None = None,
    ) -> None:
        self.rank = rank
        self.journal = journal
        """Where each store is noted first, for the front end to publish if
        vLLM kills this process before a segment names it."""
        self.ranks = ranks
        self.publish_s = publish_s
        self.hold_s = hold_s
        """None: publish every store (rank segments); else hold each for the
        scheduler side's segment this long, at most."""
        self.counters = counters or Counters()
        self._clock = clock
        self._lock = threading.Lock()
        self._open: dict[int, tuple[int, float]] = {}
        """Stores no segment names yet, by their place in the journal's
        order: (fingerprint, when stored). Python dicts keep insertion
        order, so the first is the oldest."""
        self._by_fp: dict[int, list[int]] = {}
        """Places in ``_open`` of each fingerprint (a chunk stored again)."""
        self._appended = 0
        """Stores so far: the next one's place."""
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
            place = self._appended
            self._appended += 1
            self._open[place] = (fp, self._clock())
            self._by_fp.setdefault(fp, []).append(place)
            if self.journal is not None:
                self.journal.stored(fp)

    def acked(self, fps: Iterable[int]) -> None:
        """The scheduler side's segment now names ``fps``: no need to publish
        them here (any still held, or taken by a publish under way, which
        then names them twice: harmless)."""
        with self._lock:
            for fp in fps:
                for place in self._by_fp.pop(fp, ()):
                    self._open.pop(place, None)
            self._journal_published()

    def observe(self, ts_ms: int) -> None:
        """The newest stamp the replica has seen: never stamp before it."""
        self._stamps.observe(ts_ms)

    @property
    def pending(self) -> int:
        """Stores not in a segment yet: waiting, or in the publish under way."""
        with self._lock:
            return len(self._open)

    def close(self) -> int:
        """Done publishing (after the shutdown flush, and the cancellation
        of what was still running): the journal is closed, and removed if
        every store is in a segment. Returns the stores that are not."""
        left = self.pending
        if self.journal is not None:
            self.journal.close(all_published=left == 0)
        return left

    def _journal_published(self) -> None:
        """Tell the journal how many stores, from the first, segments name
        (under the lock): those before the oldest still open."""
        if self.journal is not None:
            upto = next(iter(self._open), self._appended)
            self.journal.published(upto, self._stamps.last_ms)

    def _forget(self, places: Iterable[int]) -> None:
        """``places`` are in a segment now (under the lock)."""
        for place in places:
            entry = self._open.pop(place, None)
            if entry is not None:
                left = [p for p in self._by_fp.get(entry[0], ()) if p != place]
                if left:
                    self._by_fp[entry[0]] = left
                else:
                    self._by_fp.pop(entry[0], None)

    # -- the worker's I/O loop -------------------------------------------------------
    async def publish(self, *, held_s: float | None = None) -> int:
        """Write what was stored and is still open as one segment (with
        ``held_s``: only what has been held at least that long); on any
        failure (or cancellation) it stays open for the next call. Returns
        the fingerprints published.

        Publishes never overlap: a call while another is under way (the
        shutdown flush while a periodic PUT is in flight) waits for it, then
        takes what is left, the other's fingerprints too if it failed. The
        count the journal is told covers only fingerprints now in a segment:
        were a later publish to count past an earlier one still in flight,
        and that one be cancelled, the front end's replay would skip its
        fingerprints and no segment would name them."""
        async with self._publishing:
            with self._lock:
                cutoff = None if held_s is None else self._clock() - held_s
                taken = {p: fp for p, (fp, at) in self._open.items() if cutoff is None or at <= cutoff}
            if not taken:
                return 0
            meta: dict[str, object] = {"writer": self.segments.writer}
            if self.ranks > 1:
                meta.update(rank=self.rank, ranks=self.ranks)
            # On failure (or cancellation) they stay open; the PUT may have
            # landed all the same: published twice is harmless.
            await self.segments.put(
                mf.ManifestObject("segment", as_sorted_unique(list(taken.values())), meta=meta)
            )
            with self._lock:
                self._forget(taken)
                self._journal_published()
            return len(taken)

    async def run(self) -> None:
        """Publish every ``publish_s`` until cancelled (holding: only what
        was held past ``hold_s``)."""
        while True:
            await asyncio.sleep(self.publish_s)
            try:
                await self.publish(held_s=self.hold_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.counters.add("manifest_errors")
                log.warning("s3kv: publishing rank %d's stores failed (%s); trying again", self.rank, e)
