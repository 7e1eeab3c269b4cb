"""What a worker measures of its loads for the cost model (:mod:`s3kv.tiering.scheduler.cost`).

Each chunk's attempt at a tier is timed by itself: from when that tier was
asked to when it answered. A chunk that falls back from a failing nearer
tier (a disk past its timeout) is timed from the farther tier's start, and
the failed attempt is timed for nobody: its tier's breaker hears of the
failure, and a read cut off by a timeout says nothing of the tier's speed.

A load also shares its tier with the other loads in flight (their GETs
take the same link, their frames the same decoding threads), so beside its
times each timing says how many other chunks of the tier were in flight
while it ran, on average: the cost model takes the sharing out of the
figures and puts back what a new load will share.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import LoadTiming


@dataclass
class Attempt:
    """One chunk's attempt at one tier."""

    tier: Tier
    started: float
    area_before: float
    """The tier's chunk-seconds in flight (:class:`LoadMeter`) when it started."""
    ended: float = 0.0
    area_after: float = 0.0


class LoadMeter:
    """The chunks each tier has in flight on this rank, and their sum over
    time (chunk-seconds): over a window, its growth less a load's own
    chunks' time is how many other chunks shared the tier with it. Used
    from one thread (the transfer engine's event loop)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._inflight: dict[Tier, int] = {}
        self._area: dict[Tier, float] = {}
        self._at: dict[Tier, float] = {}

    def _area_at(self, tier: Tier, now: float) -> float:
        area = self._area.get(tier, 0.0) + self._inflight.get(tier, 0) * (now - self._at.get(tier, now))
        self._area[tier], self._at[tier] = area, now
        return area

    @contextlib.contextmanager
    def attempt(self, tier: Tier) -> Iterator[Attempt]:
        """Time the block as one chunk's attempt at ``tier`` (ended however the block ends)."""
        now = self.clock()
        a = Attempt(tier, now, self._area_at(tier, now))
        self._inflight[tier] = self._inflight.get(tier, 0) + 1
        try:
            yield a
        finally:
            a.ended = self.clock()
            a.area_after = self._area_at(tier, a.ended)
            self._inflight[tier] -= 1

    @staticmethod
    def timings(req_id: str, attempts: Sequence[Attempt], load_s: float) -> list[LoadTiming]:
        """One timing per tier of a load whose chunks came in by ``attempts``
        (the successful ones), the whole load having taken ``load_s``."""
        by_tier: dict[Tier, list[Attempt]] = {}
        for a in attempts:
            by_tier.setdefault(a.tier, []).append(a)
        out = []
        for tier, group in by_tier.items():
            own = [a.ended - a.started for a in group]
            start, end = min(a.started for a in group), max(a.ended for a in group)
            shared = max(a.area_after for a in group) - min(a.area_before for a in group) - sum(own)
            others = max(0.0, shared) / (end - start) if end > start else 0.0
            out.append(LoadTiming(req_id, tier, len(group), min(own), max(own), others, load_s))
        return out
