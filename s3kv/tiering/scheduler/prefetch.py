"""Prefetch at arrival: what only a remote tier (S3) holds of an arriving
request's hit is fetched into the nearer tiers (as a load's promotions
are), so that once vLLM schedules the request its hit is local.

A prefetch is planned with a step, after vLLM's lookups: a request that
vLLM looks up in the step it arrived in (an idle replica schedules it at
once) leaves the queue and loads by itself, for a prefetch would only put
a copy and a second load before its first token. No more than a byte
budget of chunk shards is in flight: requests queue for it in arrival
order (the head of vLLM's queue first), and one vLLM schedules before its
turn loads by itself. Its lookups wait for chunks in flight
(:meth:`Prefetcher.awaits`). Nothing here does I/O: the planner hands the
prefetches out with its step's plan.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from s3kv.config import DEFAULTS
from s3kv.stats import Counters
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import LoadChunk, LoadPlan
from s3kv.tiering.scheduler.keychain import ChainKeys, Keyed
from s3kv.tiering.scheduler.parts import GroupParts, PartKeys
from s3kv.tiering.scheduler.stack import TierStack
from s3kv.tiering.tiers.manager import TierManager


class Arrival(Keyed, Protocol):
    """What the prefetcher reads of a request the planner knows."""

    num_prompt_tokens: int
    load_failed: bool
    """A load of it failed: it is recomputed, and fetches nothing more."""
    parts: PartKeys


@dataclass
class _InFlight:
    started: float
    source: Tier
    """The tier it is read from (its load shares that tier with the loads)."""
    tiers: set[Tier]
    """The nearer tiers whose copy every rank has yet to report."""


class Prefetcher:
    """The prefetches of the requests in ``requests`` (the planner's, by id),
    over ``stack``: ``budget_bytes`` of ``chunk_bytes`` shards at most in
    flight (no prefetch unless both are positive). One that no report
    ended after ``wait_s`` on ``clock`` (a lost report) is forgotten.
    ``remember(request, chunk)`` keeps what a chunk's KV event needs."""

    def __init__(
        self,
        stack: TierStack,
        chain: ChainKeys,
        requests: Mapping[str, Arrival],
        remember: Callable[[Arrival, int], None],
        *,
        chunk_bytes: int = 0,
        budget_bytes: int = 0,
        wait_s: float = DEFAULTS.load_timeout_s + 5.0,
        counters: Counters | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stack = stack
        self.chain = chain
        self._requests = requests
        self._remember = remember
        self.chunk_bytes = chunk_bytes
        self.budget_bytes = budget_bytes
        self.wait_s = wait_s
        self.counters = counters or Counters()
        self._clock = clock
        self._in_flight: dict[bytes, _InFlight] = {}
        """Chunks being prefetched into nearer tiers, by key."""
        self._planned: list[LoadPlan] = []
        """Prefetches planned since the last :meth:`take`."""
        self._queue: dict[str, int] = {}
        """Requests with chunks to prefetch once the budget allows, oldest
        first: the chunks each waits with (as last counted)."""
        self._arrived: list[str] = []
        """Requests queued since the last step was planned."""
        self.parts: GroupParts | None = None
        """A model's KV cache groups: each hit's parts are fetched (None: one group)."""

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0 and self.chunk_bytes > 0

    @property
    def in_flight(self) -> int:
        """Chunks being prefetched."""
        return len(self._in_flight)

    def in_flight_by_tier(self) -> dict[Tier, int]:
        """Chunks being prefetched, by the tier they are read from (they
        share it with the loads)."""
        out: dict[Tier, int] = {}
        for f in self._in_flight.values():
            out[f.source] = out.get(f.source, 0) + 1
        return out

    def arrive(self, req_id: str) -> None:
        """A request arrived: queue its prefetch, planned with the next step."""
        if self.enabled:
            self._queue.setdefault(req_id, 0)
            self._arrived.append(req_id)

    def take(self) -> list[LoadPlan]:
        """The prefetches planned since the last call (the step's)."""
        planned, self._planned = self._planned, []
        return planned

    def start_arrived(self) -> None:
        """Plan the prefetches of the requests that arrived since the last
        step and are still waiting (vLLM did not schedule them); count the
        chunks that wait for the budget."""
        if not self._arrived:
            return
        arrived, self._arrived = self._arrived, []
        self._start()
        for req_id in arrived:
            req = self._requests.get(req_id)
            if req is None or req_id not in self._queue:  # scheduled, finished, or all started
                continue
            if not self._queue[req_id]:  # (behind another request: not looked at yet)
                _, self._queue[req_id] = self._chunks(req_id, req, 0, self._clock())
            self.counters.add("prefetch_chunks_queued", self._queue[req_id])

    def _start(self) -> None:
        """Plan the queued requests' chunks, first come first served, while
        the budget lasts."""
        now = self._clock()
        for key in [k for k, f in self._in_flight.items() if now - f.started > self.wait_s]:
            del self._in_flight[key]  # its report never came
        budget = self.budget_bytes // self.chunk_bytes - len(self._in_flight)
        for req_id in list(self._queue):
            req = self._requests.get(req_id)
            if req is None or req.load_failed:
                del self._queue[req_id]
                continue
            chunks, left = self._chunks(req_id, req, budget, now)
            budget -= len(chunks)
            if chunks:
                self._planned.append(LoadPlan(req_id, tuple(chunks), False))
                self.counters.add("prefetch_chunks_started", len(chunks))
            self._queue[req_id] = left
            if left:
                break  # its turn is not over: the next wait behind it
            del self._queue[req_id]

    def _chunks(self, req_id: str, req: Arrival, budget: int, now: float) -> tuple[list[LoadChunk], int]:
        """(up to ``budget`` chunks of the request's hit to prefetch now,
        chunks left to prefetch beyond them)."""
        ct = self.chain.chunk_tokens
        n_chunks = min(len(req.token_ids), req.num_prompt_tokens) // ct
        keys = self.chain.extend(req, n_chunks)
        n_chunks = min(n_chunks, len(keys))  # what block hashes cover, under the block scheme
        owner = ("prefetch", req_id)
        wanted: list[tuple[int, int, bytes, TierManager]]
        if self.parts is None:
            hit = self.stack.hits(owner, keys, req.fps, 0, n_chunks)
            wanted = [(c, 0, keys[c], m) for c, m in enumerate(hit)]
        else:  # every part the longest whole hit needs
            parts = self.parts
            ghit = parts.hit(self.stack, owner, keys, req.fps, req.parts, 0, n_chunks, n_chunks * ct + 1)
            wanted = [
                (c, g, parts.part(req, c, g), m)
                for c, g in ghit.needed.get(ghit.longest, ())
                if (m := ghit.tier(c, g)) is not None
            ]
        self.stack.release(owner)  # a prefetch is never a breaker's probe
        chunks: list[LoadChunk] = []
        left = 0
        for c, g, key, m in wanted:
            if not m.prefetches(key) or key in self._in_flight:
                continue
            if len(chunks) >= budget:
                left += 1
                continue
            sources, up = self.stack.load(key, m, m.prepare_load(key), True)
            if not up:  # no room nearer
                continue
            self._in_flight[key] = _InFlight(now, m.tier, {p.tier for p in up})
            if g == 0:
                self._remember(req, c)
            chunks.append(LoadChunk(key, (), 0, 0, sources, up, group=g))
        return chunks, left

    def leave(self, req_id: str) -> None:
        """vLLM scheduled (or dropped) the request: what it did not prefetch it loads itself."""
        queued = self._queue.pop(req_id, None)
        if queued:
            self.counters.add("prefetch_chunks_skipped", queued)

    def awaits(self, keys: Sequence[bytes], start: int, end: int) -> bool:
        """Is a chunk ``start`` to ``end`` of ``keys`` being prefetched (a lookup waits for it)?"""
        if not self._in_flight:
            return False
        now = self._clock()
        for c in range(start, end):
            f = self._in_flight.get(keys[c])
            if f is not None and now - f.started <= self.wait_s:
                return True
        return False

    def reported(self, decided: Mapping[Tier, list[tuple[bytes, bool]]]) -> None:
        """Copies every rank reported: a prefetch is over once each of its
        tiers heard, and its budget goes to the requests queued."""
        if not self._in_flight:
            return
        for tier, writes in decided.items():
            for key, _ in writes:
                f = self._in_flight.get(key)
                if f is not None:
                    f.tiers.discard(tier)
                    if not f.tiers:
                        del self._in_flight[key]
        if self._queue:
            self._start()
