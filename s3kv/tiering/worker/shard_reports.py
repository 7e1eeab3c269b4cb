"""A rank's shards reported as the rank: where a rank holds several shards
of each part (KV head slices, :mod:`s3kv.shards`), one transfer engine
moves each, and their reports are combined here into the one report a rank
gives (the scheduler side counts ranks, 1 per key). A write, a slot's
release or a load is the rank's only once every shard's engine has said
so, whichever poll each said it in; a write failed if any shard's did.

A rank's publisher hears of its chunk PUTs the same way
(:class:`PublishedShards`): a chunk is the rank's to publish once every
shard's object was created."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import LoadChunk, TierReport

if TYPE_CHECKING:
    from s3kv.manifest.publish import Published
    from s3kv.tiering.worker.transfer import Polled


class ShardReports:
    """Combines the polls of a rank's ``shards`` engines (call :meth:`combine`
    with one poll of each, every time)."""

    def __init__(self, shards: int) -> None:
        if shards < 1:
            raise ValueError(f"{shards} shards")
        self.shards = shards
        self._writes: dict[tuple[Tier, bytes], list[int]] = {}
        """(tier, key) -> [shards written, shards failed, of those never started]."""
        self._released: dict[bytes, int] = {}
        self._loads: dict[str, tuple[int, list[LoadChunk]]] = {}
        """Job id -> (shard engines that finished it, the chunks that failed in any)."""

    def combine(self, polls: Sequence[Polled]) -> Polled:
        from s3kv.tiering.worker.transfer import Polled

        if len(polls) != self.shards:
            raise ValueError(f"{len(polls)} polls of {self.shards} shards")
        if self.shards == 1:
            return polls[0]
        # Sets, lists, sync loads and tier sections add up as over ranks
        # (TierReport.aggregate); what counts ranks is combined below.
        out = functools.reduce(TierReport.aggregate, (p.report for p in polls))
        out.written, out.failed, out.unstarted, out.released = {}, {}, {}, {}
        out.tier_ok = _most(
            p.report.tier_ok for p in polls
        )  # one transfer of the rank's is one of each shard
        out.tier_failed = _most(p.report.tier_failed for p in polls)
        for p in polls:
            r = p.report
            for (tier, key), n in r.written.items():
                self._write(out, tier, key, written=n)
            for (tier, key), n in r.failed.items():
                self._write(out, tier, key, failed=n, unstarted=r.unstarted.get((tier, key), 0))
            for key, n in r.released.items():
                seen = self._released.get(key, 0) + n
                if seen >= self.shards:
                    self._released.pop(key, None)
                    out.released[key] = 1
                else:
                    self._released[key] = seen
        finished: dict[str, list[LoadChunk]] = {}
        for p in polls:
            for job, failed in p.finished_loads.items():
                seen, bad = self._loads.get(job, (0, []))
                bad = bad + [c for c in failed if all(c is not b for b in bad)]
                if seen + 1 >= self.shards:
                    self._loads.pop(job, None)
                    finished[job] = bad
                else:
                    self._loads[job] = (seen + 1, bad)
        return Polled(out, finished)

    def _write(
        self, out: TierReport, tier: Tier, key: bytes, written: int = 0, failed: int = 0, unstarted: int = 0
    ) -> None:
        counts = self._writes.setdefault((tier, key), [0, 0, 0])
        counts[0] += written
        counts[1] += failed
        counts[2] += unstarted
        if counts[0] + counts[1] < self.shards:
            return
        del self._writes[(tier, key)]
        if counts[1] == 0:
            out.written[(tier, key)] = 1
            return
        out.failed[(tier, key)] = 1
        if counts[2] == self.shards:  # no shard's write began: nothing of it to delete
            out.unstarted[(tier, key)] = 1


def _most(counts: Iterable[dict[Tier, int]]) -> dict[Tier, int]:
    """Per tier, the most any one shard's engine counted."""
    out: dict[Tier, int] = {}
    for c in counts:
        for tier, n in c.items():
            out[tier] = max(out.get(tier, 0), n)
    return out


class PublishedShards:
    """The rank's publisher (``to``), told of a chunk's PUTs once every one
    of ``shards`` shard objects was answered: created if each of them was
    (a 412 on any: the scheduler side decides, as for one shard)."""

    def __init__(self, to: Published, shards: int) -> None:
        self.to = to
        self.shards = shards
        self._lock = threading.Lock()
        self._putting: dict[bytes, int] = {}
        self._answers: dict[bytes, tuple[int, bool]] = {}

    def putting(self, key: bytes) -> None:
        with self._lock:
            n = self._putting.get(key, 0) + 1
            first = n == 1
            if n >= self.shards:
                self._putting.pop(key, None)
            else:
                self._putting[key] = n
        if first:  # journaled once, when the first shard's PUT starts
            self.to.putting(key)

    def answered(self, key: bytes, *, created: bool) -> None:
        with self._lock:
            n, all_created = self._answers.get(key, (0, True))
            n, all_created = n + 1, all_created and created
            if n < self.shards:
                self._answers[key] = (n, all_created)
                return
            self._answers.pop(key, None)
        self.to.answered(key, created=all_created)
