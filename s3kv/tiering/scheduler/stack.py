"""The tiers in order, nearest first: what the planner asks of all of them
at once, without naming any (each tier's own rules are in its manager)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from s3kv.stats import Counters
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import Place, TierReport
from s3kv.tiering.tiers.manager import TierEvents, TierManager, store_owner


class TierStack:
    def __init__(self, tiers: Sequence[TierManager], counters: Counters, events: TierEvents) -> None:
        self.tiers = tuple(tiers)
        """The managers, nearest tier first."""
        self._by_tier = {m.tier: m for m in self.tiers}
        self._staged: dict[bytes, list[TierManager]] = {}
        """Stores whose first place the farther writes read, until released."""
        for m in self.tiers:
            m.attach(counters, events)

    def get(self, tier: Tier) -> TierManager | None:
        return self._by_tier.get(tier)

    def release(self, owner: Hashable, keep: Iterable[TierManager] = ()) -> None:
        """``owner`` uses no tier but those in ``keep``: a half-open breaker's
        probe slot it holds on another goes to the next that asks."""
        keep = set(keep)
        for m in self.tiers:
            if m not in keep:
                m.release(owner)

    def hits(
        self, owner: Hashable, keys: Sequence[bytes], fps: np.ndarray, start: int, end: int
    ) -> list[TierManager]:
        """The tier to load each of chunks [start, end) from, the nearest that
        has it, up to the first chunk that none has. Half-open tiers it hits
        take ``owner`` as their probe; the others let a probe of it go."""
        # Loops, not comprehensions: a new prefix's lookup pays each one's call.
        asked: list[TierManager] = []
        held: list[list[bool]] = []
        for m in self.tiers:
            if m.allows(owner, take=False):
                has = m.lookup(keys, fps, start, end)
                # A tier holding none of them answers no chunk (the local
                # tiers, on a prefix another replica stored): left out of the rows.
                if True in has:
                    asked.append(m)
                    held.append(has)
        hit: list[TierManager]
        if not held:
            hit = []
        elif len(held) == 1:  # one tier holds any (a remote-only replica): the prefix it holds
            has = held[0]
            hit = asked * (has.index(False) if False in has else len(has))
        else:
            hit = []
            for row in zip(*held):  # chunk by chunk: the nearest tier that holds it
                if True not in row:
                    break
                hit.append(asked[row.index(True)])
        for m in self.tiers:
            m.probe(owner, m in hit)
        return hit

    def where(
        self, owner: Hashable, keys: Sequence[bytes], fps: np.ndarray, start: int, end: int
    ) -> list[TierManager | None]:
        """The nearest tier holding each of chunks [start, end), None where
        none does (every chunk, not a prefix: a windowed group's parts). The
        caller settles the probes (:meth:`settle_probes`)."""
        asked = [m for m in self.tiers if m.allows(owner, take=False)]
        held = [m.lookup(keys, fps, start, end) for m in asked]
        if not held:
            return [None] * (end - start)
        return [asked[row.index(True)] if True in row else None for row in zip(*held)]

    def settle_probes(self, owner: Hashable, used: set[TierManager]) -> None:
        """Half-open tiers in ``used`` take ``owner`` as their probe; the others let a probe of it go."""
        for m in self.tiers:
            m.probe(owner, m in used)

    def load(self, key: bytes, m: TierManager, place: Place, promote: bool) -> tuple[tuple[Place, ...], ...]:
        """(sources, promotions) of a load of ``key`` from ``m`` at ``place``:
        farther tiers that have it back ``m`` up where ``m`` may lose it
        (:meth:`TierManager.fallbacks`), and with ``promote`` the nearer
        tiers take a copy."""
        i = self.tiers.index(m)
        sources = (place, *m.fallbacks(key, self.tiers[i + 1 :]))
        up: tuple[Place, ...] = ()
        if promote:
            up = tuple(p for n in self.tiers[:i] if (p := n.prepare_promotion(key)) is not None)
        return sources, up

    def store(self, key: bytes) -> tuple[tuple[Place, ...], bool]:
        """Where a store of ``key`` goes: every tier that lacks it and has
        room (a tier whose breaker is half-open takes it as its probe); and
        whether the first place is pinned for the farther writes to read."""
        targets = tuple(p for m in self.tiers if (p := m.prepare_store(key, store_owner(key))) is not None)
        pinned = False
        if len(targets) > 1:
            first = self._by_tier[targets[0].tier]
            pinned = first.stage(key)  # the farther writes read its place
            if pinned:
                self._staged.setdefault(key, []).append(first)
        return targets, pinned

    def on_report(self, report: TierReport, decided: dict[Tier, list[tuple[bytes, bool]]]) -> None:
        """Each tier hears its writes that every rank reported, and what it lacks."""
        missing: dict[Tier, list[bytes]] = {}
        for tier, key in report.missing:
            missing.setdefault(tier, []).append(key)
        for m in self.tiers:
            m.on_report(report, decided.get(m.tier, ()), missing.get(m.tier, ()))

    def released(self, key: bytes) -> None:
        """Every rank is done reading the staging place of a store of ``key``."""
        staged = self._staged.get(key)
        if staged:
            staged.pop().unstage(key)
            if not staged:
                del self._staged[key]

    def end_report(self, report: TierReport) -> None:
        for m in self.tiers:
            m.end_report(report)

    def gauges(self) -> dict[str, int]:
        return {name: value for m in self.tiers for name, value in m.gauges().items()}
