"""The work in flight that the cost model (:mod:`s3kv.tiering.scheduler.cost`)
weighs a load against: the loads the planner planned and that are not
over yet (the chunks each tier has in flight: a new load shares the tier
with them; the round trip of an asynchronous load, from its plan to when
vLLM hears it is over, less rank 0's own time loading it), and the
prefill backlog a new request waits behind."""

from __future__ import annotations

from collections.abc import Sequence

from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import TierReport
from s3kv.tiering.scheduler.cost import CostModel

FORGET_AFTER = 4096
"""Loads remembered at most: beyond them, vLLM never told the end of some."""


class LoadsInFlight:
    """Loads in flight, by request, for ``cost`` (None: nothing is counted)."""

    def __init__(self, cost: CostModel | None) -> None:
        self.cost = cost
        self._started: dict[str, float] = {}
        """Asynchronous loads planned, by request: when (the cost model's clock)."""
        self._took: dict[str, float] = {}
        """Asynchronous loads' own time on rank 0, by request, until vLLM hears they finished."""
        self._loading: dict[str, dict[Tier, int]] = {}
        """Chunks of each planned load by tier, until it is over on every rank."""
        self.by_tier: dict[Tier, int] = {}
        """Their sum: the chunks a new load shares each tier with."""

    def planned(self, req_id: str, tiers: Sequence[Tier], asynchronous: bool) -> None:
        """A load of the request's chunks from ``tiers`` was planned."""
        self._forget(req_id)
        if self.cost is None:
            return
        if len(self._loading) > FORGET_AFTER:
            self._loading.clear()
            self.by_tier.clear()
        counts: dict[Tier, int] = {}
        for t in tiers:
            counts[t] = counts.get(t, 0) + 1
            self.by_tier[t] = self.by_tier.get(t, 0) + 1
        self._loading[req_id] = counts
        if asynchronous:
            if len(self._started) > FORGET_AFTER:
                self._started.clear()
            self._started[req_id] = self.cost.clock()

    def over(self, req_id: str) -> None:
        """The request's load is over on every rank (and vLLM heard it): its
        round trip is observed."""
        self._forget(req_id)
        started = self._started.pop(req_id, None)
        took = self._took.pop(req_id, None)
        if self.cost is not None and started is not None and took is not None:
            self.cost.observe_round_trip(self.cost.clock() - started - took)

    def _forget(self, req_id: str) -> None:
        for tier, n in self._loading.pop(req_id, {}).items():
            self.by_tier[tier] -= n

    def observe(self, report: TierReport) -> None:
        """Rank 0's timings, into the cost model."""
        if self.cost is None:
            return
        for t in report.load_timings:
            self.cost.observe_load(t.tier, t.chunks, t.first_s, t.last_s, t.others)
            if t.req_id in self._started:  # its round trip ends when vLLM hears of it
                took = t.last_s if t.load_s is None else t.load_s
                self._took[t.req_id] = max(self._took.get(t.req_id, 0.0), took)
        for st in report.step_timings:
            self.cost.observe_step(st.tokens, st.context, st.seconds)


class PrefillBacklog:
    """Prompt tokens each request vLLM runs, or looked up, has yet to
    compute: the prefill a request looked up after them waits behind."""

    def __init__(self) -> None:
        self._left: dict[str, int] = {}

    def set(self, req_id: str, tokens: int) -> None:
        """The request has ``tokens`` left to compute (none: it is off the backlog)."""
        if tokens > 0:
            self._left[req_id] = tokens
        else:
            self._left.pop(req_id, None)

    def ahead_of(self, req_id: str) -> int:
        """Tokens the other requests have left to compute."""
        return sum(self._left.values()) - self._left.get(req_id, 0)
