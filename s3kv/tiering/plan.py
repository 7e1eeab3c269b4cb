"""What the scheduler side and the workers say to each other, free of vLLM.

The scheduler side decides (one :class:`StepPlan` per step, the same for
every TP rank); each worker executes the plan over its tier handlers and
answers with a :class:`TierReport`, which vLLM sums over ranks
(:meth:`TierReport.aggregate`) before the scheduler side hears it. Both sides
import this module and nothing else of each other; ``s3kv/connector/`` wraps
these in vLLM's metadata classes.

A chunk's place in a tier is a :class:`Place`: the tier, and the slot the
scheduler side chose in it for tiers that have slots (the CPU pool). Plans
name tiers only through places, so a new tier needs no new field here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Self, TypeVar

from s3kv.stats import merge
from s3kv.tiering.placement import Tier


@dataclass(frozen=True)
class Place:
    """Where a chunk is, or goes, in one tier."""

    tier: Tier
    slot: int | None = None
    """The slot in the tier, for tiers that have slots (the CPU pool)."""


@dataclass(frozen=True)
class LoadChunk:
    key: bytes
    block_ids: tuple[int, ...]
    """Block ids of the whole chunk, in order."""
    first_block: int
    """Pages before this index are already valid locally and are not written."""
    last_block: int
    """Pages from this index on are computed by vLLM and are not written."""
    sources: tuple[Place, ...]
    """Places to read from, in order: a later one is tried when an earlier one
    does not have the chunk (a file lost or corrupt)."""
    promote: tuple[Place, ...] = ()
    """Also write the loaded chunk here (nearer tiers), once it is checked."""
    group: int = 0
    """The KV cache group whose part of the chunk this is (``key`` is the
    part's, :func:`~s3kv.kvgroups.part_key`): its frames go to that group's
    layers, ``block_ids`` are from that group's block table."""

    @property
    def write_ids(self) -> tuple[int, ...]:
        return self.block_ids[self.first_block : self.last_block]


@dataclass(frozen=True)
class LoadPlan:
    req_id: str
    chunks: tuple[LoadChunk, ...]
    sync: bool
    """Copied from the CPU tier during this step's forward, layer by layer;
    otherwise loaded in the background while the request waits."""
    failed: tuple[int, ...] = ()
    """Blocks vLLM expects loaded that no tier holds (a part of a hit vLLM
    shortened, which its windows then needed): each rank reports them as
    load errors at once, and vLLM recomputes from the first."""


@dataclass(frozen=True)
class StoreChunk:
    key: bytes
    block_ids: tuple[int, ...]
    targets: tuple[Place, ...]
    """Where to write the chunk, nearest first. A CPU place gets the pages
    copied into its slot (the farther writes then read from it); without
    one the pages go to a private buffer."""
    pinned: bool = False
    """The scheduler side pinned the first target's place for the farther
    writes to read: each rank reports it released once they no longer do
    (whatever became of the writes, and whether or not the rank has the
    tiers)."""
    group: int = 0
    """The KV cache group whose part of the chunk this is (as :attr:`LoadChunk.group`)."""
    first_block: int = 0
    """Pages before this index are stored as zeros: no later hit reads them
    (a windowed group's pages its window never reaches again; vLLM may
    have freed their blocks already)."""


@dataclass(frozen=True)
class TierEvent:
    """A chunk entered (``stored``) or left a tier: vLLM KV events for routers."""

    stored: bool
    tier: Tier
    key: bytes
    parent: bytes | None = None
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepTokens:
    """What a step's forward computes, for the workers to time it against."""

    tokens: int
    """Tokens scheduled (prefills' and decodes')."""
    context: int
    """The longest context a prefill of the step reaches (0: decodes only)."""


@dataclass
class StepPlan:
    loads: list[LoadPlan] = field(default_factory=list)
    stores: list[StoreChunk] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    """Finished requests whose blocks vLLM keeps until this step's copies are done."""
    step: StepTokens | None = None
    """Set when the step computes tokens: rank 0 times its forward (the cost
    model's prefill rate, and a step's fixed cost)."""
    prefetch: list[LoadPlan] = field(default_factory=list)
    """Chunks of requests that just arrived, to fetch from a remote tier into
    the nearer ones (their promotions) while the requests wait: no KV pages
    are written, and vLLM hears nothing of these jobs."""


@dataclass(frozen=True)
class LoadTiming:
    """Rank 0's timing of a load's chunks from one tier, for the cost model."""

    req_id: str
    """The load's request ("" for a step's copies from the CPU tier, timed together)."""
    tier: Tier
    chunks: int
    first_s: float
    """The quickest of its chunks' attempts at this tier: from the tier
    being asked (after any nearer source failed) to the chunk in the KV cache."""
    last_s: float
    """The slowest of its chunks' attempts at this tier, timed the same way."""
    others: float = 0.0
    """Chunks of other loads in flight on the tier while these were, on
    average (they shared it: :mod:`s3kv.tiering.meter`)."""
    load_s: float | None = None
    """From the load's start to its last chunk of any tier (None: ``last_s``)."""


@dataclass(frozen=True)
class StepTiming:
    """Rank 0's timing of a step's forward."""

    tokens: int
    context: int
    seconds: float


@dataclass(frozen=True)
class ScheduledRequest:
    req_id: str
    num_computed_tokens: int
    """Tokens computed before this step."""
    num_scheduled_tokens: int
    block_ids: Callable[[], Sequence[int] | Sequence[Sequence[int]]]
    """The request's block ids, or each KV cache group's (called only when a store is planned)."""


class TierSection(ABC):
    """One tier's own part of a :class:`TierReport` (what only that tier's
    handlers say, read only by its manager): each wing defines its type."""

    @abstractmethod
    def merge(self, other: Self) -> Self:
        """This section summed with another rank's."""

    @abstractmethod
    def __bool__(self) -> bool:
        """Does it say anything?"""


S = TypeVar("S", bound=TierSection)


@dataclass
class TierReport:
    """Workers -> scheduler side: what the transfers since the last report
    did, counted in ranks (one rank's report counts 1 per key; vLLM sums the
    ranks' reports with :meth:`aggregate`). The fields say what every tier
    may say; a tier's own figures are in its section."""

    written: dict[tuple[Tier, bytes], int] = field(default_factory=dict)
    """(tier, key) -> ranks that now hold their shard of key in that tier."""
    failed: dict[tuple[Tier, bytes], int] = field(default_factory=dict)
    """(tier, key) -> ranks whose write (store, promotion) was dropped or failed."""
    unstarted: dict[tuple[Tier, bytes], int] = field(default_factory=dict)
    """(tier, key) -> ranks among ``failed`` whose promotion never began (the
    load failed first): that rank wrote nothing of it, so nothing is to be
    deleted for it, and a store of the key may follow at once (its recompute)."""
    missing: set[tuple[Tier, bytes]] = field(default_factory=set)
    """Keys a tier turned out not to hold (absent or corrupt): forget them there."""
    released: dict[bytes, int] = field(default_factory=dict)
    """Store key -> ranks that no longer read its staging place."""
    sync_loaded: dict[str, int] = field(default_factory=dict)
    """Request -> ranks that finished its synchronous load (its CPU slots may go)."""
    load_failed: set[str] = field(default_factory=set)
    """Requests whose load failed in part: offer them no more hits."""
    tier_ok: dict[Tier, int] = field(default_factory=dict)
    """Tier -> transfers it served (for its breaker)."""
    tier_failed: dict[Tier, int] = field(default_factory=dict)
    """Tier -> transfers that failed for the tier's sake (for its breaker)."""
    load_timings: list[LoadTiming] = field(default_factory=list)
    """Rank 0's timings of loads that finished (the others report none)."""
    step_timings: list[StepTiming] = field(default_factory=list)
    """Rank 0's timings of forward steps."""
    sections: dict[Tier, TierSection] = field(default_factory=dict)
    """Each tier's own part, of its wing's type."""

    def aggregate(self, other: TierReport) -> TierReport:
        """Both reports summed: every field by its kind (counts added, sets
        joined, timings listed), each tier's section by its own merge."""
        out = TierReport()
        for f in fields(self):
            if f.name != "sections":
                setattr(out, f.name, _summed(getattr(self, f.name), getattr(other, f.name)))
        sections = dict(self.sections)
        for tier, section in other.sections.items():
            mine = sections.get(tier)
            sections[tier] = section if mine is None else mine.merge(section)
        out.sections = sections
        return out

    def section(self, tier: Tier, kind: type[S]) -> S | None:
        """``tier``'s section, if it said anything."""
        section = self.sections.get(tier)
        return section if isinstance(section, kind) else None

    def is_empty(self) -> bool:
        return not any(getattr(self, f.name) for f in fields(self) if f.name != "sections") and not any(
            self.sections.values()
        )


def _summed(a: Any, b: Any) -> Any:
    """Two ranks' values of one report field: counts added, sets joined, lists joined."""
    if isinstance(a, set):
        return a | b
    if isinstance(a, list):
        return a + b
    return merge(a, b)
