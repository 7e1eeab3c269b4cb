"""Load or compute: the scheduler side's live estimates of what a hit costs
to load, tier by tier, against what its tokens cost to compute, and the
prefix of a hit worth offering to vLLM (``load_policy: cost``).

A request whose first ``n`` chunks a tier holds waits, if they are loaded,
for the slowest tier's share of them (the chunks of one load are fetched
together, and an asynchronous load adds the scheduling round trip before the
request computes the rest); if they are computed, for their tokens at the
engine's prefill rate. The model offers the prefix that saves the most time,
or none.

Neither waits alone, and the model compares the two under the load the
request meets, as the scheduler side knows it now:

- a tier is shared by the loads in flight on it: their first-byte
  latencies pass side by side, but their bytes go through one link and one
  set of decoding threads. A load of ``n`` chunks while ``q`` chunks of
  other loads are in flight on the tier takes its first chunk's time plus
  ``n - 1 + q`` chunks at the tier's bandwidth (its chunks come in at its
  share of it, ``n / (n + q)``);
- the engine is shared by the prefills ahead of a request (vLLM schedules
  the requests it runs first): computed, the request waits for their ``P``
  tokens and then its own; loaded, its load runs while they compute, and
  what it computes after the load waits for them either way. So loading
  ``L`` tokens saves their prefill, less only the part of the load that
  outlasts ``P`` tokens' prefill.

Its figures, all measured on this replica and nothing else:

- per tier, the **first chunk** of a load that has the tier to itself
  (first-byte latency, plus one chunk's transfer and checks), and the
  **bandwidth**: raw KV bytes a second through the tier, shared by the loads
  on it. Each chunk's attempt at a tier is timed from when that tier was
  asked, and each timing says how many chunks of other loads shared the tier
  with it (:mod:`s3kv.tiering.meter`): :meth:`TierEstimate.observe` takes
  the sharing out with the same model;
- the **round trip** of an asynchronous load: from the plan to vLLM hearing
  it finished, less the load's own time (the steps a waiting request sits
  out; timed under the engine's real load, so the longer steps of a busy
  engine are in it);
- the engine's **prefill rate**, tokens a second of recent forward steps
  (every request's prefill in them together), by the context length they
  reached.

Each is the median of a window of recent observations, so that one slow
request moves nothing. Until a figure is measured it has a start-up value
chosen so that a replica behaves as ``always`` did where it knows nothing:
the prefill is assumed slow (1,000 tokens a second), so every hit loads
until the engine's first prefill is timed. A tier whose estimate has not
been refreshed for :data:`EXPLORE_S` gets a load offered anyway, once per
that time, so that an estimate from a bad minute does not last forever.

Nothing here imports vLLM or does I/O; the planner calls it from the
scheduling loop (``choose`` is O(chunks of the hit)).
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from s3kv.config import LOAD_POLICIES
from s3kv.stats import CONTEXT_BUCKETS
from s3kv.tiering.placement import Tier
from s3kv.tiering.tiers.registry import TIERS
from s3kv.tiering.tiers.spec import TierPrior

WINDOW = 16
"""Observations each estimate keeps (its median is the estimate)."""
EXPLORE_S = 60.0
"""A tier not measured for this long gets one load offered that the model
would decline, so that its estimate follows the tier again."""
MIN_STEP_TOKENS = 16
"""Forward steps computing fewer tokens (decode) say nothing of the prefill
rate; the planner raises the bar to a chunk (a step's fixed cost, spread
over a few tokens, would make a short step's rate look far slower than a
chunk's prefill is)."""

CONTEXT_LABELS = tuple(str(b) for b in CONTEXT_BUCKETS)


PRIORS: dict[Tier, TierPrior] = {spec.tier: spec.prior for spec in TIERS}
"""Start-up values, each tier's from its spec: slow ones of their kind (S3
as a slow regional bucket), so that a replica loads until it knows better."""
PREFILL_PRIOR_TOKENS_PER_S = 1000.0
"""Start-up prefill rate: slower than any GPU's, so hits load until the engine is timed."""


class Window:
    """The median of the last :data:`WINDOW` observations, or a start-up value."""

    def __init__(self, prior: float) -> None:
        self.prior = prior
        self._values: deque[float] = deque(maxlen=WINDOW)
        self._median: float | None = None
        self.updated_at: float | None = None

    def add(self, value: float, now: float) -> None:
        self._values.append(value)
        self._median = None
        self.updated_at = now

    @property
    def measured(self) -> bool:
        return bool(self._values)

    @property
    def value(self) -> float:
        if not self._values:
            return self.prior
        if self._median is None:
            self._median = statistics.median(self._values)
        return self._median


class TierEstimate:
    """How long a load of ``n`` chunks from one tier takes: the first chunk,
    then the rest, and the chunks of other loads in flight on the tier, at
    the tier's bandwidth."""

    def __init__(self, prior: TierPrior) -> None:
        self.first_s = Window(prior.first_s)
        """A load's first chunk when it has the tier to itself."""
        self.bytes_per_s = Window(prior.bytes_per_s)
        """The tier's bandwidth, shared by the loads on it."""
        self.explored_at: float | None = None

    def observe(
        self, chunks: int, chunk_bytes: int, first_s: float, last_s: float, now: float, others: float = 0.0
    ) -> None:
        """A load's ``chunks`` from this tier were in the KV cache ``first_s``
        (the first) and ``last_s`` (all) seconds after the tier was asked,
        ``others`` chunks of other loads in flight on it meanwhile (on
        average). At its share ``n / (n + m)`` of the bandwidth ``B``, its
        first chunk took ``m / n`` chunks' transfer more than alone, and the
        rest came ``(n - 1) (n + m) / n`` chunks' transfer later."""
        if chunks <= 0 or first_s < 0 or last_s < first_s or others < 0:
            return
        if chunks > 1:
            spread = (chunks - 1) * (chunks + others) / chunks
            self.bytes_per_s.add(spread * chunk_bytes / max(last_s - first_s, 1e-4), now)
        alone = first_s - others / chunks * chunk_bytes / self.bytes_per_s.value
        # Sharing cannot make a load more than (n + m) / n times slower.
        self.first_s.add(max(alone, first_s * chunks / (chunks + others)), now)

    def seconds(self, chunks: int, chunk_bytes: int, others: int = 0) -> float:
        """A load of ``chunks`` while ``others`` chunks of other loads are in flight on the tier."""
        if chunks <= 0:
            return 0.0
        return self.first_s.value + (chunks - 1 + others) * chunk_bytes / self.bytes_per_s.value

    def stale(self, now: float) -> bool:
        """Not measured (nor explored) for :data:`EXPLORE_S`."""
        last = max(self.first_s.updated_at or -1e18, self.explored_at or -1e18)
        return now - last > EXPLORE_S


def context_bucket(tokens: int) -> int:
    """Index of the prefill-rate bucket of a context of ``tokens``."""
    return min(bisect.bisect_left(CONTEXT_BUCKETS, tokens), len(CONTEXT_BUCKETS) - 1)


FIXED_STEP_TOKENS = 8
"""Steps computing at most this many tokens (decodes, a loaded prompt's last
token) time the step's fixed cost: kernel launches, sampling, the
scheduler's own work, paid whether a prefill is long or short."""


class PrefillEstimate:
    """Seconds a token of prefill costs, by the context length reached: a
    prefill step's time less the step's fixed cost (which a load does not
    save: the request's remaining tokens take a step either way), over its
    tokens."""

    def __init__(
        self, prior_tokens_per_s: float = PREFILL_PRIOR_TOKENS_PER_S, min_tokens: int = MIN_STEP_TOKENS
    ) -> None:
        self._buckets = [Window(1.0 / prior_tokens_per_s) for _ in CONTEXT_BUCKETS]
        self.min_tokens = min_tokens
        self.step_s = Window(0.0)
        """A step's fixed cost: the median of recent short steps (0 until one is timed)."""

    def observe(self, tokens: int, context: int, seconds: float, now: float) -> None:
        """A forward step computed ``tokens`` in ``seconds``, the longest of
        its prefills reaching ``context`` tokens (0: it prefilled nothing)."""
        if seconds <= 0:
            return
        if tokens <= FIXED_STEP_TOKENS:
            self.step_s.add(seconds, now)
        elif tokens >= self.min_tokens and context > 0:
            # At least half the step is its tokens', whatever short steps say.
            marginal = max(seconds - self.step_s.value, seconds / 2)
            self._buckets[context_bucket(context)].add(marginal / tokens, now)

    def seconds_per_token(self, context: int) -> float:
        """The bucket of ``context``, else the nearest measured one, else the start-up value."""
        i = context_bucket(context)
        measured = [j for j, w in enumerate(self._buckets) if w.measured]
        if not measured or self._buckets[i].measured:
            return self._buckets[i].value
        j = min(measured, key=lambda j: (abs(j - i), -j))  # a tie: the longer context (slower)
        return self._buckets[j].value

    def tokens_per_s(self) -> dict[str, float]:
        """Each measured bucket's rate, by its label."""
        return {
            label: round(1.0 / w.value, 1) for label, w in zip(CONTEXT_LABELS, self._buckets) if w.measured
        }


@dataclass(frozen=True)
class Decision:
    chunks: int
    """Chunks of the hit to offer, from its first."""
    explored: bool = False
    """Offered past what the model would, to measure a stale tier again."""


class CostModel:
    """The estimates of one replica's scheduler side, and its choice."""

    def __init__(
        self,
        *,
        chunk_bytes: int,
        policy: str = "cost",
        min_step_tokens: int = MIN_STEP_TOKENS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if policy not in LOAD_POLICIES:
            raise ValueError(f"load_policy must be one of {', '.join(LOAD_POLICIES)}, got {policy!r}")
        self.policy = policy
        self.chunk_bytes = chunk_bytes
        """Raw KV bytes of one chunk shard (each rank loads its own, side by side)."""
        self.clock = clock
        self.tiers = {t: TierEstimate(p) for t, p in PRIORS.items()}
        self.round_trip_s = Window(0.0)
        self.prefill = PrefillEstimate(min_tokens=min_step_tokens)
        """Timed from steps that compute at least ``min_step_tokens``."""

    # -- observations ------------------------------------------------------------
    def observe_load(
        self, tier: Tier, chunks: int, first_s: float, last_s: float, others: float = 0.0
    ) -> None:
        self.tiers[tier].observe(chunks, self.chunk_bytes, first_s, last_s, self.clock(), others)

    def observe_round_trip(self, seconds: float) -> None:
        self.round_trip_s.add(max(0.0, seconds), self.clock())

    def observe_step(self, tokens: int, context: int, seconds: float) -> None:
        self.prefill.observe(tokens, context, seconds, self.clock())

    # -- the choice ------------------------------------------------------------------
    def load_seconds(
        self, tiers: Sequence[Tier], sync: Sequence[bool], inflight: Mapping[Tier, int] | None = None
    ) -> float:
        """Estimated wait for loading chunks from ``tiers`` (one per chunk;
        ``sync``: copied during the forward, no round trip) while
        ``inflight`` chunks of other loads are in flight, by tier."""
        counts: dict[Tier, int] = {}
        for t in tiers:
            counts[t] = counts.get(t, 0) + 1
        return self._load_seconds(counts, any(not s for s in sync), inflight or {})

    def _load_seconds(self, counts: dict[Tier, int], has_async: bool, inflight: Mapping[Tier, int]) -> float:
        slowest = max(
            (self.tiers[t].seconds(n, self.chunk_bytes, inflight.get(t, 0)) for t, n in counts.items()),
            default=0.0,
        )
        return slowest + (self.round_trip_s.value if has_async else 0.0)

    def choose(
        self,
        tiers: Sequence[Tier],
        sync: Sequence[bool],
        *,
        first_token: int,
        chunk_tokens: int,
        local_tokens: int,
        context_tokens: int,
        end_tokens: int | None = None,
        policy: str | None = None,
        ahead_tokens: int = 0,
        inflight: Mapping[Tier, int] | None = None,
        full_parts: int = 1,
        windowed: Callable[[int], Mapping[Tier, int] | None] | None = None,
    ) -> Decision:
        """How many chunks of a hit to offer. ``tiers[i]`` (``sync[i]``:
        a synchronous tier) holds the chunk that starts at token
        ``first_token + i * chunk_tokens``; the request has ``local_tokens``
        already, ``context_tokens`` in all, and a load may end no later than
        ``end_tokens``. ``policy`` overrides the replica's for this request.
        The engine has ``ahead_tokens`` of prefill to compute before this
        request's, and ``inflight`` chunks of other loads are in flight, by tier.

        A model with several KV cache groups loads objects of parts: each
        chunk ``full_parts`` (its full-attention groups'), and the windowed
        groups' parts that a hit of ``k`` chunks needs, ``windowed(k)`` by
        tier (None: no whole hit ends there, so it is never the choice)."""
        n = len(tiers)
        if (policy or self.policy) == "always" or n == 0:
            return Decision(n)
        now = self.clock()
        per_token = self.prefill.seconds_per_token(context_tokens)
        hidden = ahead_tokens * per_token  # a load this long costs the request nothing
        inflight = inflight or {}
        best, best_gain = 0, 0.0
        counts: dict[Tier, int] = {}
        has_async = False
        cb, round_trip = self.chunk_bytes, self.round_trip_s.value
        # Each tier's first chunk, bandwidth and chunks in flight, read once.
        read: dict[Tier, tuple[float, float, int]] = {}
        loads: dict[Tier, float] = {}  # each tier's load of its chunks so far
        for k, t, s in zip(range(1, n + 1), tiers, sync):
            c = counts[t] = counts.get(t, 0) + 1
            if not s:
                has_async = True
            end = first_token + k * chunk_tokens
            if end_tokens is not None and end_tokens < end:
                end = end_tokens
            if windowed is None:
                # _load_seconds(counts, ...) with TierEstimate.seconds spelled
                # out (the same expression: the same floats; a test holds the
                # choice to load_seconds'), each tier's estimate read once and
                # only the chunk's tier updated, not every tier asked again for each k.
                e = read.get(t)
                if e is None:
                    te = self.tiers[t]
                    e = read[t] = (te.first_s.value, te.bytes_per_s.value, inflight.get(t, 0))
                load = loads[t] = e[0] + (c - 1 + e[2]) * cb / e[1]
                if len(loads) > 1:
                    load = max(loads.values())
                load += round_trip if has_async else 0.0
            else:
                extra = windowed(k)
                if extra is None:
                    continue
                parts = {t: full_parts * m for t, m in counts.items() if full_parts}
                for t, m in extra.items():  # not n: the hit's length, asked below
                    parts[t] = parts.get(t, 0) + m
                load = self._load_seconds(parts, has_async, inflight)
            gain = (end - local_tokens) * per_token - max(0.0, load - hidden)
            if gain > best_gain:
                best, best_gain = k, gain
        if best < n:
            stale = [self.tiers[t] for t in set(tiers[best:]) if self.tiers[t].stale(now)]
            if stale:
                for est in stale:
                    est.explored_at = now
                return Decision(n, explored=True)
        return Decision(best)

    # -- figures ---------------------------------------------------------------------
    def gauges(self) -> dict[str, float]:
        """The estimates, under their flat metric names (measured ones only
        for the prefill rate; the start-up values for tiers not yet measured)."""
        out: dict[str, float] = {}
        for tier, est in self.tiers.items():
            out[f"cost_first_chunk_seconds_{tier.value}"] = round(est.first_s.value, 6)
            out[f"cost_bandwidth_bytes_per_second_{tier.value}"] = round(est.bytes_per_s.value)
        out["cost_round_trip_seconds"] = round(self.round_trip_s.value, 6)
        out["cost_step_seconds"] = round(self.prefill.step_s.value, 6)
        for label, rate in self.prefill.tokens_per_s().items():
            out[f"cost_prefill_tokens_per_second_{label}"] = rate
        return out
