"""The work in flight the cost model weighs a load against
(:mod:`s3kv.tiering.scheduler.loads`), on their own; inside the planner,
see test_cost.py."""

import pytest

from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import LoadTiming, StepTiming, TierReport
from s3kv.tiering.scheduler.cost import CostModel
from s3kv.tiering.scheduler.loads import LoadsInFlight, PrefillBacklog
from tests.unit.test_cost import Clock
from tests.unit.test_planner import SHARD


def test_chunks_in_flight_are_counted_by_tier_until_each_load_is_over():
    loads = LoadsInFlight(CostModel(chunk_bytes=SHARD, clock=Clock()))
    loads.planned("a", [Tier.S3, Tier.S3, Tier.DISK], asynchronous=True)
    loads.planned("b", [Tier.S3], asynchronous=False)
    assert loads.by_tier == {Tier.S3: 3, Tier.DISK: 1}
    loads.planned("b", [Tier.DISK], asynchronous=False)  # planned again: counted once
    assert loads.by_tier == {Tier.S3: 2, Tier.DISK: 2}
    loads.over("a")
    loads.over("gone")  # never planned: nothing to take back
    assert loads.by_tier == {Tier.S3: 0, Tier.DISK: 1}
    loads.over("b")
    assert loads.by_tier == {Tier.S3: 0, Tier.DISK: 0}


def test_an_asynchronous_loads_round_trip_is_its_wait_beyond_its_own_time():
    clock = Clock()
    cost = CostModel(chunk_bytes=SHARD, clock=clock)
    loads = LoadsInFlight(cost)
    loads.planned("a", [Tier.S3], asynchronous=True)
    loads.planned("s", [Tier.S3], asynchronous=False)  # a synchronous load has no round trip
    clock.now += 0.8
    loads.observe(
        TierReport(
            load_timings=[LoadTiming("a", Tier.S3, 1, 0.3, 0.6), LoadTiming("s", Tier.S3, 1, 0.3, 0.7)],
            step_timings=[StepTiming(256, 256, 0.1)],
        )
    )
    loads.over("s")
    assert not cost.round_trip_s.measured
    loads.over("a")
    assert cost.round_trip_s.value == pytest.approx(0.2)
    assert cost.tiers[Tier.S3].first_s.value == pytest.approx(0.3)


def test_without_a_cost_model_nothing_is_counted():
    loads = LoadsInFlight(None)
    loads.planned("a", [Tier.S3], asynchronous=True)
    loads.observe(TierReport(load_timings=[LoadTiming("a", Tier.S3, 1, 0.3, 0.6)]))
    loads.over("a")
    assert loads.by_tier == {}


def test_the_prefill_backlog_is_what_the_other_requests_have_left_to_compute():
    backlog = PrefillBacklog()
    backlog.set("a", 300)
    backlog.set("b", 200)
    assert backlog.ahead_of("a") == 200 and backlog.ahead_of("b") == 300 and backlog.ahead_of("new") == 500
    backlog.set("a", 100)  # a step computed some of it
    assert backlog.ahead_of("b") == 100
    backlog.set("a", 0)  # all of it
    backlog.set("gone", 0)
    assert backlog.ahead_of("b") == 0 and backlog.ahead_of("new") == 200
