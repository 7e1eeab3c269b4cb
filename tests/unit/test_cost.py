"""The load policy: the cost model's estimates and the prefix it offers, on
its own and inside the planner (no vLLM, no I/O)."""

import contextlib

import pytest

from s3kv.config import parse_config
from s3kv.errors import ConfigError
from s3kv.keys import chain_keys
from s3kv.tiering.meter import LoadMeter
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import LoadTiming, StepTiming, TierReport
from s3kv.tiering.scheduler.cost import EXPLORE_S, PRIORS, CostModel, Decision, context_bucket
from s3kv.tiering.tiers.registry import TIERS
from tests.unit.test_planner import CT, NS, SHARD, on_load_results, planner, put_cpu, sched

LONG = list(range(10, 10 + 40 * CT + 7))  # 40 full chunks
LONG_KEYS = chain_keys(NS, LONG, CT)
SHORT = LONG[: CT + 7]  # one full chunk, a prefix of LONG


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def model(policy="cost", clock=None):
    return CostModel(chunk_bytes=SHARD, policy=policy, clock=clock or Clock())


def cost_planner(policy="cost", clock=None, **kw):
    """A planner with a cost model (``SHARD`` raw bytes a chunk) over the tiers asked for."""
    clock = clock or Clock()
    return planner(cost=model(policy, clock), **kw)


def timed(p, *, prefill_tokens_per_s=None, s3=None, context=2048):
    """Feed the planner rank 0's timings: a prefill step at that rate
    (context ``context``) and an S3 load ``s3`` = (chunks, first_s, last_s)."""
    report = TierReport()
    if prefill_tokens_per_s is not None:
        report.step_timings.append(StepTiming(1024, context, 1024 / prefill_tokens_per_s))
    if s3 is not None:
        report.load_timings.append(LoadTiming("earlier", Tier.S3, *s3))
    p.on_report(report)


def offered(p, req_id, tokens):
    return p.lookup(req_id, tokens, len(tokens), 0)


def test_until_measured_every_hit_loads():
    """Start-up values: the prefill is assumed slower than any tier."""
    p, index = cost_planner()
    index.update(LONG_KEYS)
    assert offered(p, "short", SHORT) == (CT, True)
    assert offered(p, "long", LONG) == (40 * CT, True)
    # A fast engine measured: S3's start-up value (a slow bucket) now
    # declines one chunk, and still loads forty.
    timed(p, prefill_tokens_per_s=20000)
    assert offered(p, "short2", SHORT) == (0, False)
    assert offered(p, "long2", LONG) == (40 * CT, True)


def test_a_short_prefix_on_a_slow_s3_is_computed_and_a_long_one_loaded():
    p, index = cost_planner()
    index.update(LONG_KEYS)
    timed(p, prefill_tokens_per_s=1000, s3=(8, 0.5, 0.52))  # 1 ms a token; S3 half a second to first chunk
    assert offered(p, "short", SHORT) == (0, False)  # 64 ms of compute against 0.5 s
    assert offered(p, "long", LONG) == (40 * CT, True)  # 2.56 s against about 0.6 s
    totals = p.counters.totals()
    assert totals["load_policy_tokens_declined"] == CT
    assert totals["load_policy_tokens_offered"] == 40 * CT
    # ``always`` offers both, with the same estimates.
    a, index = cost_planner("always")
    index.update(LONG_KEYS)
    timed(a, prefill_tokens_per_s=1000, s3=(8, 0.5, 0.52))
    assert offered(a, "short", SHORT) == (CT, True)
    assert offered(a, "long", LONG) == (40 * CT, True)
    assert a.counters.totals().get("load_policy_tokens_declined", 0) == 0


def test_a_request_may_override_the_policy():
    p, index = cost_planner()
    index.update(LONG_KEYS)
    timed(p, prefill_tokens_per_s=1000, s3=(8, 0.5, 0.52))
    assert p.lookup("a", SHORT, len(SHORT), 0, policy="always") == (CT, True)
    assert p.lookup("b", SHORT, len(SHORT), 0, policy=None) == (0, False)
    a, index = cost_planner("always")
    index.update(LONG_KEYS)
    timed(a, prefill_tokens_per_s=1000, s3=(8, 0.5, 0.52))
    assert a.lookup("c", SHORT, len(SHORT), 0, policy="cost") == (0, False)


def test_only_the_prefix_worth_loading_is_offered_tier_by_tier():
    """The first chunks in the CPU tier, the rest in a slow S3: the CPU
    prefix loads (synchronously), S3's part of a short prompt is computed."""
    p, index = cost_planner(cpu_slots=8)
    index.update(LONG_KEYS)
    prompt = LONG[: 4 * CT + 7]
    put_cpu(p, LONG_KEYS[:2])
    timed(p, prefill_tokens_per_s=1000, s3=(8, 0.5, 0.52))
    assert offered(p, "r", prompt) == (2 * CT, False)  # sync: the CPU tier alone
    # The same split on a long prompt: S3's 38 chunks are worth their wait.
    put_cpu(p, [])
    assert offered(p, "long", LONG) == (40 * CT, True)


def test_estimates_are_medians_so_one_slow_load_changes_nothing():
    m = model()
    for _ in range(5):
        m.observe_load(Tier.S3, 4, 0.05, 0.08)
    before = m.load_seconds([Tier.S3] * 4, [False] * 4)
    m.observe_load(Tier.S3, 4, 30.0, 31.0)
    assert m.load_seconds([Tier.S3] * 4, [False] * 4) == pytest.approx(before)
    # Bandwidth after the first chunk: 3 chunks in 30 ms.
    assert m.tiers[Tier.S3].bytes_per_s.value == pytest.approx(3 * SHARD / 0.03)
    assert before == pytest.approx(0.05 + 3 * SHARD / (3 * SHARD / 0.03))


def test_a_load_waits_for_its_slowest_tier_and_the_round_trip():
    m = model()
    m.observe_load(Tier.DISK, 2, 0.01, 0.02)
    m.observe_load(Tier.S3, 2, 0.2, 0.3)
    m.observe_round_trip(0.05)
    s3_alone = m.tiers[Tier.S3].seconds(2, SHARD)
    both = m.load_seconds([Tier.DISK, Tier.DISK, Tier.S3, Tier.S3], [False] * 4)
    assert both == pytest.approx(s3_alone + 0.05)
    cpu_only = m.load_seconds([Tier.CPU] * 3, [True] * 3)  # synchronous: no round trip
    assert cpu_only == pytest.approx(m.tiers[Tier.CPU].seconds(3, SHARD))


def test_prefill_rate_by_context_falls_back_to_the_nearest_measured_bucket():
    m = model()
    prior = m.prefill.seconds_per_token(300)
    m.observe_step(2000, 2000, 1.0)  # 2k context: 2,000 tokens a second
    m.observe_step(2000, 8000, 2.0)  # 8k context: 1,000
    m.observe_step(8, 8000, 10.0)  # decode steps say nothing of the prefill
    assert prior == pytest.approx(1 / 1000)
    assert m.prefill.seconds_per_token(2048) == pytest.approx(1 / 2000)
    assert m.prefill.seconds_per_token(8192) == pytest.approx(1 / 1000)
    assert m.prefill.seconds_per_token(300) == pytest.approx(1 / 2000)  # nearest: 2k
    assert m.prefill.seconds_per_token(4096) == pytest.approx(1 / 1000)  # a tie: the slower, longer one
    assert context_bucket(100) == 0 and context_bucket(10**6) == context_bucket(65536)
    assert m.gauges()["cost_prefill_tokens_per_second_2048"] == 2000


def test_steps_shorter_than_a_chunk_do_not_time_the_prefill():
    """A step that computes the tail of a loaded prompt (a few tokens at a
    long context) costs mostly the step's fixed time: it would make the
    prefill look many times slower than a chunk's."""
    m = CostModel(chunk_bytes=SHARD, min_step_tokens=256)
    m.observe_step(2048, 8000, 2.0)
    m.observe_step(64, 8000, 0.5)  # 128 tokens/s, if it counted
    assert m.prefill.seconds_per_token(8000) == pytest.approx(2.0 / 2048)


def test_a_stale_estimate_is_explored_once_a_minute():
    clock = Clock()
    p, index = cost_planner(clock=clock)
    index.update(LONG_KEYS)
    timed(p, prefill_tokens_per_s=1000, s3=(8, 0.5, 0.52))
    assert offered(p, "a", SHORT) == (0, False)
    clock.now += EXPLORE_S + 1
    assert offered(p, "b", SHORT) == (CT, True)  # offered to measure S3 again
    assert offered(p, "c", SHORT) == (0, False)  # once
    assert p.counters.totals()["load_policy_explored"] == 1


def test_round_trip_is_the_wait_beyond_the_loads_own_time():
    clock = Clock()
    p, index = cost_planner(clock=clock)
    index.update(LONG_KEYS)
    n, _ = offered(p, "r", LONG)
    p.on_alloc("r", list(range(200)), n)
    clock.now += 0.8
    p.on_report(TierReport(load_timings=[LoadTiming("r", Tier.S3, 40, 0.3, 0.6)]))
    p.on_recved(["r"])
    assert p.cost.round_trip_s.value == pytest.approx(0.2)
    assert p.cost.tiers[Tier.S3].first_s.value == pytest.approx(0.3)
    assert p.cost.gauges()["cost_round_trip_seconds"] == pytest.approx(0.2)


def test_decisions_are_counted_once_per_request():
    p, index = cost_planner()
    index.update(LONG_KEYS)
    timed(p, prefill_tokens_per_s=1000, s3=(8, 0.5, 0.52))
    for _ in range(3):  # vLLM asks again while the request waits
        offered(p, "r", SHORT)
    assert p.counters.totals()["load_policy_tokens_declined"] == CT


def test_every_step_that_computes_is_timed_and_says_whether_it_prefills():
    p, _ = cost_planner(cpu_slots=4)
    offered(p, "r", SHORT)
    offered(p, "d", SHORT)
    plan = p.plan_step([sched("r", 0, CT, list(range(4))), sched("d", len(SHORT), 1, list(range(4, 8)))])
    assert plan.step is not None and (plan.step.tokens, plan.step.context) == (CT + 1, CT)
    decode = p.plan_step([sched("d", len(SHORT) + 1, 1, list(range(4, 8)))]).step
    assert decode is not None and (decode.tokens, decode.context) == (1, 0)
    assert p.plan_step([]).step is None  # nothing computed
    plain, _ = planner(cpu_slots=4)  # no cost model: nothing to time
    offered(plain, "r", SHORT)
    assert plain.plan_step([sched("r", 0, CT, list(range(4)))]).step is None


def test_a_steps_fixed_cost_is_not_counted_as_prefill():
    """A load saves its tokens' compute, not the step (the rest of the
    prompt takes one either way): short steps time the fixed part."""
    m = model()
    m.observe_step(2048, 2048, 1.0)  # no short step timed yet: all of it is the tokens'
    assert m.prefill.seconds_per_token(2048) == pytest.approx(1.0 / 2048)
    for _ in range(3):
        m.observe_step(1, 0, 0.2)  # decode steps
    m.observe_step(4, 2100, 0.25)  # a loaded prompt's last tokens: a short step too
    m.observe_step(1024, 2048, 0.6)
    m.observe_step(1024, 2048, 0.6)
    assert m.prefill.step_s.value == pytest.approx(0.2)
    assert m.gauges()["cost_step_seconds"] == pytest.approx(0.2)
    assert m.prefill.seconds_per_token(2048) == pytest.approx(0.4 / 1024)  # median of 3
    m.observe_step(1024, 512, 0.3)  # at most half a step is fixed
    assert m.prefill.seconds_per_token(512) == pytest.approx(0.15 / 1024)


def test_a_probe_of_a_tier_the_policy_declines_is_given_back():
    """S3's breaker half-open: a short hit the policy computes must not keep
    the one probe, or the next long hit could not load from S3."""
    clock = Clock()
    p, index = planner(clock=clock, cost=model(clock=clock))
    index.update(LONG_KEYS)
    timed(p, prefill_tokens_per_s=1000, s3=(8, 0.5, 0.52))
    on_load_results(p, set(), failed={Tier.S3: 1})  # S3 failed: paused for 5 s
    assert offered(p, "paused", LONG) == (0, False)
    p.request_finished("paused", [], 0)  # computed, and over by the time S3 may be probed
    clock.now += 5.5
    assert offered(p, "short", SHORT) == (0, False)  # would have been the probe
    assert offered(p, "long", LONG) == (40 * CT, True)  # so this one is


def test_load_policy_is_checked_at_start_up():
    assert parse_config({"bucket": "bkt"}).load_policy == "cost"
    assert parse_config({"bucket": "bkt", "load_policy": "ALWAYS"}).load_policy == "always"
    with pytest.raises(ConfigError, match="load_policy: must be one of cost, always; got 'sometimes'"):
        parse_config({"bucket": "bkt", "load_policy": "sometimes"})
    with pytest.raises(ValueError, match="load_policy"):
        CostModel(chunk_bytes=1, policy="never")


def test_start_up_values_are_the_documented_ones():
    m = model()
    g = m.gauges()
    for tier, prior in PRIORS.items():
        assert g[f"cost_first_chunk_seconds_{tier.value}"] == pytest.approx(prior.first_s)
        assert g[f"cost_bandwidth_bytes_per_second_{tier.value}"] == pytest.approx(prior.bytes_per_s)
    assert not any(k.startswith("cost_prefill") for k in g)  # none measured yet
    assert {spec.tier: spec.prior for spec in TIERS} == PRIORS  # each tier's from its spec
    assert [t for t, _ in sorted(PRIORS.items(), key=lambda tp: tp[1].first_s)] == list(
        Tier
    )  # nearest fastest
    p, _ = cost_planner(cpu_slots=4)
    put_cpu(p, LONG_KEYS[:1])
    assert offered(p, "r", SHORT) == (CT, False)  # a CPU hit of one chunk loads


# -- loads that share a tier, prefills that share the engine ------------------------
# A tier whose first chunk takes 20 ms alone and that moves a chunk shard in
# 20 ms, however many loads share it; the engine prefills 1,000 tokens a second.
FIRST_S, CHUNK_S = 0.02, 0.02
FOUR = [[1000 * (r + 1) + t for t in range(4 * CT + 7)] for r in range(10)]  # 4 chunks each, distinct
FOUR_KEYS = [chain_keys(NS, prompt, CT) for prompt in FOUR]


def shared_load(n, others):
    """(first_s, last_s) of a load of ``n`` chunks at its share n / (n + others) of that tier."""
    return FIRST_S + others / n * CHUNK_S, FIRST_S + (n - 1 + others) * CHUNK_S


def test_loads_timed_while_others_shared_the_tier_are_taken_as_one_loads_cost():
    """Issue 26.6: a fresh replica's first 8 loads, all at once, each measured
    at an eighth of the tier. Taken as they came (first chunk 160 ms, 3
    chunks in 480 ms after it), a later 4-chunk hit would seem to take 640
    ms against 256 ms of compute, and every later hit was computed."""
    p, index = cost_planner()
    for keys in FOUR_KEYS:
        index.update(keys)
    timed(p, prefill_tokens_per_s=1000)
    report = TierReport()
    for r in range(8):
        first, last = shared_load(4, 7 * 4)
        report.load_timings.append(LoadTiming(f"burst{r}", Tier.S3, 4, first, last, others=7 * 4))
    p.on_report(report)
    est = p.cost.tiers[Tier.S3]
    assert est.first_s.value == pytest.approx(FIRST_S)
    assert est.bytes_per_s.value == pytest.approx(SHARD / CHUNK_S)
    # Alone, 4 chunks load in 80 ms: offered.
    assert offered(p, "alone", FOUR[8]) == (4 * CT, True)
    assert p.cost.load_seconds([Tier.S3] * 4, [False] * 4) == pytest.approx(FIRST_S + 3 * CHUNK_S)
    p.request_finished("alone", [], 0)
    # Beside 7 loads of 4 chunks, it waits for 31 chunks: 640 ms, sooner computed...
    for r in range(7):  # (``always``: the policy would compute some of these too)
        n, _ = p.lookup(f"load{r}", FOUR[r], len(FOUR[r]), 0, policy="always")
        p.on_alloc(f"load{r}", list(range(8 * r, 8 * r + 8)), n)
    assert offered(p, "shared", FOUR[9]) == (0, False)
    # ... unless the engine has prefill to compute first: the load runs meanwhile.
    p.request_finished("shared", [], 0)
    offered(p, "computing", LONG[: 10 * CT + 7])  # 647 tokens, nothing in the tiers: computed
    assert offered(p, "behind", FOUR[9]) == (4 * CT, True)
    # Their loads over (and the prefill), the next one has the tier to itself again.
    p.on_recved([f"load{r}" for r in range(7)] + ["behind"])
    for req_id in ("computing", "behind"):
        p.request_finished(req_id, [], 0)
    assert offered(p, "later", FOUR[9]) == (4 * CT, True)


def test_prefetches_in_flight_share_the_tier_they_read_from_with_the_loads():
    """Chunks prefetched from S3 take their share of it as loads do: a hit
    that loads alone is computed while 28 prefetched chunks are in flight."""
    p, index = cost_planner(cpu_slots=64, chunk_bytes=SHARD, prefetch_bytes=28 * SHARD)
    for keys in FOUR_KEYS:
        index.update(keys)
    timed(p, prefill_tokens_per_s=1000)
    p.cost.observe_load(Tier.S3, 4, *shared_load(4, 0))
    assert offered(p, "alone", FOUR[8]) == (4 * CT, True)  # 80 ms against 256 ms of compute
    p.request_finished("alone", [], 0)
    for r in range(7):
        p.prefetch(f"pre{r}", FOUR[r], len(FOUR[r]))
    assert sum(len(job.chunks) for job in p.plan_step([]).prefetch) == 28
    assert p.prefetcher.in_flight_by_tier() == {Tier.S3: 28}
    assert offered(p, "shared", FOUR[9]) == (0, False)  # 31 chunks' wait: sooner computed


def test_a_load_timed_alone_and_one_timed_shared_give_the_same_estimates():
    m, shared = model(), model()
    m.observe_load(Tier.S3, 4, *shared_load(4, 0))
    shared.observe_load(Tier.S3, 4, *shared_load(4, 12), others=12)
    for est in (m, shared):
        assert est.tiers[Tier.S3].first_s.value == pytest.approx(FIRST_S)
        assert est.tiers[Tier.S3].bytes_per_s.value == pytest.approx(SHARD / CHUNK_S)
    # One chunk beside 5 others: its first (and only) chunk waited for theirs.
    shared.observe_load(Tier.S3, 1, *shared_load(1, 5), others=5)
    assert shared.tiers[Tier.S3].first_s.value == pytest.approx(FIRST_S)
    # A load predicted with others in flight is the shared one's time.
    assert shared.load_seconds([Tier.S3] * 4, [False] * 4, {Tier.S3: 12}) == pytest.approx(
        shared_load(4, 12)[1]
    )
    # Sharing explains no more than (n + m) / n times a load's time.
    m.observe_load(Tier.S3, 1, 0.001, 0.001, others=100)
    m.observe_load(Tier.S3, 1, 0.001, 0.001, others=100)
    assert m.tiers[Tier.S3].first_s.value == pytest.approx(0.001 / 101)


def test_a_load_hidden_behind_the_prefill_ahead_costs_the_request_nothing():
    m = model()
    m.observe_step(1024, 2048, 1.024)  # 1 ms a token
    m.observe_load(Tier.S3, 2, 0.5, 0.52)  # S3 half a second to its first chunk
    hit = dict(
        tiers=[Tier.S3], sync=[False], first_token=0, chunk_tokens=CT, local_tokens=0, context_tokens=CT + 7
    )
    assert m.choose(**hit).chunks == 0  # 64 ms of compute against 0.5 s
    assert m.choose(**hit, ahead_tokens=300).chunks == 0  # still 0.2 s more than 64 ms
    assert m.choose(**hit, ahead_tokens=500).chunks == 1  # waiting anyway: loaded meanwhile


def test_the_meter_counts_the_chunks_that_shared_a_tier_with_a_load():
    clock = Clock()
    clock.now = 0.0
    meter = LoadMeter(clock)
    with contextlib.ExitStack() as mine, contextlib.ExitStack() as theirs:
        a = mine.enter_context(meter.attempt(Tier.S3))
        b = theirs.enter_context(meter.attempt(Tier.S3))
        disk = meter.attempt(Tier.DISK)  # another tier shares nothing
        with disk:
            clock.now = 0.5
        c = theirs.enter_context(meter.attempt(Tier.S3))
        clock.now = 1.0
        mine.close()  # mine: one chunk, 0..1 s, beside b all the time and c for half of it
        clock.now = 2.0
    (t,) = LoadMeter.timings("mine", [a], 1.0)
    assert (t.tier, t.chunks, t.first_s, t.last_s, t.load_s) == (Tier.S3, 1, 1.0, 1.0, 1.0)
    assert t.others == pytest.approx(1.5)
    (t,) = LoadMeter.timings("theirs", [b, c], 2.0)  # 0..2 s: beside a for 1 s
    assert (t.chunks, t.first_s, t.last_s) == (2, 1.5, 2.0)
    assert t.others == pytest.approx(0.5)


def first_choice(
    m,
    tiers,
    sync,
    *,
    first_token,
    chunk_tokens,
    local_tokens,
    context_tokens,
    end_tokens,
    ahead_tokens,
    inflight,
):
    """The choice as first written: every tier's load asked again for each
    prefix of the hit (``load_seconds``), the best gain's first prefix."""
    per_token = m.prefill.seconds_per_token(context_tokens)
    hidden = ahead_tokens * per_token
    best, best_gain = 0, 0.0
    for k in range(1, len(tiers) + 1):
        end = min(first_token + k * chunk_tokens, end_tokens)
        load = m.load_seconds(tiers[:k], sync[:k], inflight)
        gain = (end - local_tokens) * per_token - max(0.0, load - hidden)
        if gain > best_gain:
            best, best_gain = k, gain
    return best


def test_the_choice_is_the_prefix_with_the_best_gain_on_random_estimates():
    """choose keeps each tier's load as the hit grows (not every tier's asked
    again for each prefix): the same floats, the same choice, on random
    estimates, hits, flights and backlogs."""
    import random

    rng = random.Random(5)
    tiers = list(PRIORS)
    chosen = set()
    for _ in range(400):
        clock = Clock()
        m = model(clock=clock)
        for t in tiers:  # every tier measured now: none is stale (no exploring)
            for _ in range(rng.randrange(1, 4)):
                first = rng.uniform(1e-4, 0.3)
                m.observe_load(t, rng.randrange(1, 20), first, first + rng.uniform(0, 2), rng.randrange(0, 8))
        m.observe_round_trip(rng.uniform(0, 0.05))
        for _ in range(rng.randrange(0, 4)):
            m.observe_step(rng.randrange(CT, 8 * CT), rng.randrange(1, 40 * CT), rng.uniform(0.01, 2))
        n = rng.randrange(1, 41)
        hit = [rng.choice(tiers) for _ in range(n)]
        sync = [t is Tier.CPU for t in hit]
        local = rng.randrange(0, 2) * CT
        kw = dict(
            first_token=local,
            chunk_tokens=CT,
            local_tokens=local,
            context_tokens=local + n * CT + rng.randrange(0, CT),
            ahead_tokens=rng.choice([0, rng.randrange(0, 50_000)]),
            inflight={t: rng.randrange(0, 30) for t in tiers if rng.random() < 0.5},
        )
        kw["end_tokens"] = kw["context_tokens"] - 1
        got = m.choose(hit, sync, **kw)
        assert not got.explored
        assert got.chunks == first_choice(m, hit, sync, **kw)
        chosen.add(got.chunks == n)
    assert chosen == {True, False}  # whole hits and shorter ones both chosen


def test_exploring_a_windowed_hit_offers_all_of_it():
    """A hit with windowed parts whose tiers are stale is offered whole to
    measure them: all its chunks, not the count of the last prefix's parts."""
    m = model()
    m.observe_step(8 * CT, 8 * CT, 0.001)  # a prefill far faster than any load: no prefix is worth it
    d = m.choose(
        [Tier.S3] * 3,
        [False] * 3,
        first_token=0,
        chunk_tokens=CT,
        local_tokens=0,
        context_tokens=3 * CT + 1,
        full_parts=1,
        windowed=lambda k: {Tier.S3: 5},
    )
    assert d == Decision(3, explored=True)
