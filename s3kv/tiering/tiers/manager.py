"""The scheduler side of a tier: a :class:`TierManager` says what the tier
holds, where a chunk goes in it, what it evicts, and (for tiers that can be
in trouble) its breaker. The planner asks the managers, nearest tier first,
naming none of them; what differs between tiers is in each wing's manager.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import ClassVar

import numpy as np

from s3kv.config import S3KVConfig
from s3kv.stats import Counters
from s3kv.tiering.breaker import Breaker
from s3kv.tiering.placement import Tier, TierIndex
from s3kv.tiering.plan import Place, TierEvent, TierReport


def store_owner(key: bytes) -> tuple[str, bytes]:
    """Who holds a breaker's probe for a planned store of ``key`` (a store may be the probe)."""
    return ("store", key)


class TierEvents:
    """The KV events of every tier, in the order they happened (one stream for
    vLLM's routers). Off unless vLLM's KV events are on."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self._events: list[TierEvent] = []
        self._info: OrderedDict[bytes, tuple[bytes | None, tuple[int, ...]]] = OrderedDict()
        """Parent key and tokens of chunks being written, for their events."""
        self._hidden: OrderedDict[bytes, None] = OrderedDict()
        """Keys announced by no event (:meth:`hide`), the most recent kept."""

    def remember(self, key: bytes, parent: bytes | None, token_ids: tuple[int, ...]) -> None:
        """Keep what a chunk's BlockStored event needs until it is written."""
        self._info[key] = (parent, token_ids)
        self._info.move_to_end(key)
        while len(self._info) > 1 << 14:
            self._info.popitem(last=False)

    def hide(self, keys: Iterable[bytes]) -> None:
        """Announce nothing of these keys: parts of a chunk's KV cache groups
        after the first, which a router, knowing blocks by the chain's
        hashes, would take for blocks of no prefix (the chunk is announced
        by its first group's part, keyed by the chain)."""
        if self.enabled:
            for key in keys:
                self._hidden[key] = None
                self._hidden.move_to_end(key)
            while len(self._hidden) > 1 << 16:
                self._hidden.popitem(last=False)

    def stored(self, tier: Tier, key: bytes) -> None:
        if self.enabled and key not in self._hidden:
            parent, tokens = self._info.get(key, (None, ()))
            self._events.append(TierEvent(True, tier, key, parent, tokens))

    def removed(self, tier: Tier, key: bytes) -> None:
        if self.enabled and key not in self._hidden:
            self._events.append(TierEvent(False, tier, key))

    def take(self) -> list[TierEvent]:
        out, self._events = self._events, []
        return out


class TierManager(ABC):
    """The scheduler side of one tier: what it holds, where a chunk goes in it,
    what it evicts, and (for tiers that can be in trouble) its breaker.

    The planner calls its managers nearest tier first and names none of them;
    what differs between tiers is here. Calls come from the scheduler's own
    thread only, must not block and do no I/O (a tier that deletes files
    hands them to a thread of its own). The planner attaches its counters
    and event log (:meth:`attach`) before the first call.

    A tier must say what it holds (:meth:`lookup`) and where a store and a
    promotion go in it (:meth:`prepare_store`, :meth:`prepare_promotion`):
    those are abstract, so a tier that forgets one fails when it is built.
    """

    tier: ClassVar[Tier]
    sync_load: ClassVar[bool] = False
    """Loads from it are copies the worker makes during the step's forward
    (the CPU pool): a hit only from such tiers is loaded synchronously, and
    the cost model times it so."""

    def __init__(self, breaker: Breaker | None = None) -> None:
        self.breaker = breaker
        """While the tier is in trouble, offer none of its hits and plan no
        writes to it; the other tiers go on (see :class:`Breaker`)."""
        self.counters = Counters()
        self.events = TierEvents()

    def attach(self, counters: Counters, events: TierEvents) -> None:
        self.counters, self.events = counters, events

    # -- life ------------------------------------------------------------------
    def activate(self, namespace: str) -> bool:
        """The model's namespace is known: set up for it (before the first
        lookup). False: the tier cannot serve after all and is left out."""
        return True

    def describe(self) -> str:
        """The tier as the start-up log line names it."""
        return "on"

    def resume(self) -> None:  # noqa: B027 (optional hook)
        """The bucket answered (the fleet's manifest loaded): a tier that
        waited for it since start-up goes on."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """The scheduler side is shutting down: let go of threads and locks."""

    def _breaker(
        self, backoff_s: tuple[float, float], probe_timeout_s: float, clock: Callable[[], float]
    ) -> Breaker:
        """A breaker whose trips count as ``breaker_trips_<tier>``."""
        return Breaker(
            backoff_s,
            probe_timeout_s=probe_timeout_s,
            clock=clock,
            on_trip=lambda: self.counters.add(f"breaker_trips_{self.tier.value}"),
        )

    # -- use -------------------------------------------------------------------
    def allows(self, owner: Hashable, *, take: bool = True) -> bool:
        """May ``owner`` (a request, a store) use the tier now? With ``take``,
        a half-open breaker makes the first to ask its probe."""
        return self.breaker is None or self.breaker.allow(owner, take=take)

    def release(self, owner: Hashable) -> None:
        """``owner`` will not use the tier after all: a probe slot it holds
        goes to the next that asks."""
        if self.breaker is not None and not self.breaker.closed:
            self.breaker.release(owner)

    def probe(self, owner: Hashable, hit: bool) -> None:
        """A lookup of ``owner`` found (``hit``) or did not find chunks here:
        half-open, a request that hits the tier probes it."""
        if self.breaker is not None and not self.breaker.closed:
            if hit:
                self.allows(owner)
            else:
                self.breaker.release(owner)

    # -- loads -----------------------------------------------------------------
    @abstractmethod
    def lookup(self, keys: Sequence[bytes], fps: np.ndarray, start: int, end: int) -> list[bool]:
        """Which of chunks [start, end) of a request (``keys``, their
        fingerprints ``fps``) the tier can load now."""

    def prepare_load(self, key: bytes) -> Place:
        """A load of ``key`` from this tier is planned: keep it (no eviction)
        until :meth:`complete_load`, and say where it is."""
        return Place(self.tier)

    def complete_load(self, key: bytes) -> None:  # noqa: B027 (optional hook)
        """The load of ``key`` is over on every rank."""

    def fallback(self, key: bytes) -> Place | None:
        """Where to read ``key`` if a nearer tier's copy turns out lost, or None."""
        return None

    def fallbacks(self, key: bytes, farther: Sequence[TierManager]) -> tuple[Place, ...]:
        """Where to read ``key`` if this tier's copy turns out lost or
        corrupt when read: the ``farther`` tiers that have it."""
        return tuple(p for m in farther if (p := m.fallback(key)) is not None)

    def prefetches(self, key: bytes) -> bool:
        """Is a waiting request's chunk that only this tier holds worth
        copying into the nearer tiers before vLLM schedules the request
        (the tier is far and slow, and working)?"""
        return False

    def record_use(self, keys: Sequence[bytes]) -> None:  # noqa: B027 (optional hook)
        """Loads of these chunks are planned (from any tier): access records, for tiers that keep them."""

    # -- stores ----------------------------------------------------------------
    @abstractmethod
    def prepare_store(self, key: bytes, owner: Hashable) -> Place | None:
        """Where a store of ``key`` from the KV cache goes in this tier, or None
        (held already, no room, in trouble). ``owner`` may become the probe."""

    @abstractmethod
    def prepare_promotion(self, key: bytes) -> Place | None:
        """Where ``key``, loaded from a farther tier, is copied up in this one,
        or None (the farthest tier is never promoted into)."""

    def stage(self, key: bytes) -> bool:
        """``key`` is stored here first and in farther tiers too: True if
        their writes read it from this tier's place, which then stays
        (pinned) until :meth:`unstage`."""
        return False

    def unstage(self, key: bytes) -> None:  # noqa: B027 (optional hook)
        """Every rank is done reading ``key``'s place for the farther writes."""

    def complete_store(self, key: bytes, ok: bool) -> None:
        """Every rank reported its write of ``key`` here (a store or a
        promotion): ``ok`` if all of them succeeded. A failed write gives a
        probe slot it held back."""
        if ok:
            self.events.stored(self.tier, key)
        elif self.breaker is not None:
            self.breaker.release(store_owner(key))

    def forget(self, key: bytes) -> None:
        """Workers found ``key`` absent or corrupt here."""
        self.events.removed(self.tier, key)

    # -- reports ---------------------------------------------------------------
    def on_report(
        self, report: TierReport, decided: Iterable[tuple[bytes, bool]], missing: Iterable[bytes]
    ) -> None:
        """A report from the workers: ``decided`` are this tier's writes every
        rank reported (key, all succeeded), ``missing`` the keys it lacks.
        Tiers that read more of the report override this."""
        for key, ok in decided:
            self.complete_store(key, ok)
        for key in missing:
            self.forget(key)

    def end_report(self, report: TierReport) -> None:
        """After the report's outcomes: the breaker hears the tier's own
        transfers, and no other tier's."""
        if self.breaker is not None:
            self.breaker.report(report.tier_ok.get(self.tier, 0), report.tier_failed.get(self.tier, 0))

    def gauges(self) -> dict[str, int]:
        """Figures for the step's stats."""
        if self.breaker is None:
            return {}
        return {f"breaker_open_{self.tier.value}": 0 if self.breaker.closed else 1}


class IndexedTierManager(TierManager):
    """A local tier whose placement is a :class:`TierIndex` (the CPU pool, the NVMe directory)."""

    def __init__(self, index: TierIndex, breaker: Breaker | None = None) -> None:
        super().__init__(breaker)
        self.index = index

    def lookup(self, keys: Sequence[bytes], fps: np.ndarray, start: int, end: int) -> list[bool]:
        index = self.index
        wanted = keys[start:end]
        if index.holds_none(wanted):
            return [False] * len(wanted)  # a prefix this tier never saw (a fleet hit): one C-level pass
        return [k in index for k in wanted]

    def prepare_load(self, key: bytes) -> Place:
        self.index.touch(key)
        self.index.pin(key)
        entry = self.index.get(key)
        return Place(self.tier, entry.slot if entry is not None else None)

    def complete_load(self, key: bytes) -> None:  # noqa: B027 (optional hook)
        self.index.unpin(key)


PROBE_SLACK_S = 10.0


def probe_timeout_s(config: S3KVConfig) -> float:
    """A tier's probe that never reports (its request gone) counts as failed
    once any load of it would have timed out."""
    return config.load_timeout_s + PROBE_SLACK_S
