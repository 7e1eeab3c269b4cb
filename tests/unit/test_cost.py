"""The load policy: the cost model's estimates and the prefix it offers, on
its own and inside the planner (no vLLM, no I/O)."""

import pytest

from s3kv.config import parse_config
from s3kv.errors import ConfigError
from s3kv.keys import chain_keys
from s3kv.tiering.cost import EXPLORE_S, PRIORS, CostModel, context_bucket
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import LoadTiming, StepTiming, TierReport
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
    p, _ = cost_planner(cpu_slots=4)
    put_cpu(p, LONG_KEYS[:1])
    assert offered(p, "r", SHORT) == (CT, False)  # a CPU hit of one chunk loads
