"""Prefetch at arrival (:mod:`s3kv.tiering.scheduler.prefetch`): what only
S3 holds of an arriving request's hit is fetched into the nearer tiers
within a byte budget, and the request's lookups wait for it (no vLLM, no
I/O). The prefetcher on its own, and inside the planner as vLLM drives it:
vLLM tells of an arrival (``on_new_request``), then schedules a step: its
lookups, then the step's plan; a prefetch starts with the plan of a step
that left the request waiting."""

from s3kv.keys import chain_keys
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import TierReport
from s3kv.tiering.tiers.nvme.manager import disk_estimate
from tests.unit.test_planner import (
    BS,
    CT,
    KEYS,
    NS,
    PROMPT,
    SHARD,
    cpu,
    on_load_results,
    on_write_failed,
    on_written,
    planner,
    put_cpu,
    tiers_of,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def prefetching(budget_chunks=16, **kw):
    clock = kw.pop("clock", None) or Clock()
    p, index = planner(chunk_bytes=SHARD, prefetch_bytes=budget_chunks * SHARD, clock=clock, **kw)
    return p, index, clock


def arrive(p, req_id="r", tokens=PROMPT):
    p.prefetch(req_id, tokens, len(tokens))


def step(p):
    """vLLM plans a step (requests that arrived wait in its queue): the prefetches handed out."""
    return p.plan_step([]).prefetch


def lookup(p, req_id="r", tokens=PROMPT, computed=0):
    return p.lookup(req_id, tokens, len(tokens), computed)


def test_an_arriving_requests_s3_chunks_are_fetched_into_the_nearer_tiers_and_its_lookup_waits():
    p, index, _ = prefetching(cpu_slots=8, disk_bytes=10 * disk_estimate(SHARD))
    index.update(KEYS)
    put_cpu(p, KEYS[:1])  # chunk 0 is local already
    arrive(p)
    (job,) = step(p)
    assert job.req_id == "r" and [c.key for c in job.chunks] == KEYS[1:4]
    for c in job.chunks:
        assert c.block_ids == () and c.write_ids == ()  # no KV pages: the promotions only
        assert tiers_of(c.sources) == (Tier.S3,)
        assert tiers_of(c.promote) == (Tier.CPU, Tier.DISK)
    assert lookup(p) == (None, False)  # vLLM asks again next step
    assert p.counters.totals()["prefetch_waits"] == 1
    on_written(p, Tier.CPU, {k: 1 for k in KEYS[1:4]})
    assert lookup(p) == (None, False)  # the NVMe copies are not reported yet
    on_written(p, Tier.DISK, {k: 1 for k in KEYS[1:4]}, {k: 900 for k in KEYS[1:4]})
    # Every chunk is in the CPU tier now: a synchronous load.
    assert lookup(p) == (4 * CT, False)
    assert p.counters.totals()["prefetch_chunks_started"] == 3
    assert p.counters.totals()["prefetch_waits"] == 1  # once per request
    assert step(p) == []  # handed out once


def test_the_byte_budget_bounds_chunks_in_flight_and_requests_queue_for_it_in_order():
    p, index, _ = prefetching(budget_chunks=2, cpu_slots=16)
    index.update(KEYS)
    other = list(range(5000, 5000 + 2 * CT + 3))
    other_keys = chain_keys(NS, other, CT)
    index.update(other_keys)
    arrive(p, "a")
    arrive(p, "b", other)
    (job,) = step(p)  # 2 of a's 4 chunks (the budget); b waits behind a
    assert job.req_id == "a" and [c.key for c in job.chunks] == KEYS[:2]
    assert p.counters.totals()["prefetch_chunks_queued"] == 2 + 2
    on_written(p, Tier.CPU, {k: 1 for k in KEYS[:2]})
    (job,) = step(p)  # a's turn goes on first
    assert job.req_id == "a" and [c.key for c in job.chunks] == KEYS[2:4]
    on_written(p, Tier.CPU, {k: 1 for k in KEYS[2:4]})
    (job,) = step(p)
    assert job.req_id == "b" and [c.key for c in job.chunks] == other_keys[:2]
    assert p.counters.totals()["prefetch_chunks_started"] == 6
    assert p.counters.totals().get("prefetch_chunks_skipped", 0) == 0


def b_behind_a(p, index):
    """Requests a (4 chunks in S3) and b (2) arrive; a step hands out a's
    prefetch of 2 chunks (the budget) and b waits its turn. b's tokens."""
    index.update(KEYS)
    other = list(range(5000, 5000 + 2 * CT + 3))
    index.update(chain_keys(NS, other, CT))
    arrive(p, "a")
    arrive(p, "b", other)
    step(p)
    return other


def test_a_request_scheduled_before_its_turn_loads_by_itself():
    p, index, _ = prefetching(budget_chunks=2, cpu_slots=16)
    other = b_behind_a(p, index)
    # vLLM reaches b while a's chunks are in flight: b loads from S3.
    assert lookup(p, "b", other) == (2 * CT, True)
    assert p.counters.totals()["prefetch_chunks_skipped"] == 2
    on_written(p, Tier.CPU, {k: 1 for k in KEYS[:2]})
    (job,) = step(p)
    assert job.req_id == "a"  # b left the queue: only a's rest follows
    assert all(c.key in KEYS for c in job.chunks)


def test_nothing_is_prefetched_that_is_local_or_from_a_tier_in_trouble_or_with_the_budget_off():
    p, index, _ = prefetching(cpu_slots=8)
    index.update(KEYS)
    put_cpu(p, KEYS)
    arrive(p)
    assert step(p) == []
    p, index, _ = prefetching(cpu_slots=8)
    index.update(KEYS)
    on_load_results(p, set(), failed={Tier.S3: 1})  # S3's breaker opens
    arrive(p)
    assert step(p) == []
    off, index = planner(cpu_slots=8, chunk_bytes=SHARD)  # prefetch_bytes 0
    index.update(KEYS)
    arrive(off)
    assert step(off) == []
    assert lookup(off) == (4 * CT, True)
    remote_only, index, _ = prefetching()  # no nearer tier to fetch into
    index.update(KEYS)
    arrive(remote_only)
    assert step(remote_only) == []


def test_a_failed_prefetch_ends_the_wait_and_the_request_loads_from_s3():
    p, index, _ = prefetching(cpu_slots=8)
    index.update(KEYS)
    arrive(p)
    step(p)
    on_write_failed(p, Tier.CPU, {k: 1 for k in KEYS})
    assert lookup(p) == (4 * CT, True)  # from S3, as without a prefetch
    assert len(cpu(p)) == 0


def test_a_prefetch_whose_report_is_lost_stops_holding_the_request_back():
    p, index, clock = prefetching(cpu_slots=8)
    index.update(KEYS)
    arrive(p)
    step(p)
    assert lookup(p) == (None, False)
    clock.now += p.prefetcher.wait_s + 1
    assert lookup(p) == (4 * CT, True)  # from S3
    # The lost copies' slots stay pending (as a lost promotion's do): no second prefetch.
    arrive(p, "again")
    assert step(p) == []
    assert lookup(p, "again") == (4 * CT, True)


def test_every_rank_must_report_a_prefetched_copy():
    p, index, _ = prefetching(world_size=2, cpu_slots=8)
    index.update(KEYS)
    arrive(p)
    step(p)
    on_written(p, Tier.CPU, {k: 1 for k in KEYS})
    assert lookup(p) == (None, False)  # one rank of two
    on_written(p, Tier.CPU, {k: 1 for k in KEYS})
    assert lookup(p) == (4 * CT, False)


def test_arrival_alone_is_not_a_lookup():
    p, index, _ = prefetching(cpu_slots=8)
    index.update(KEYS)
    arrive(p)
    assert not p.knows("r")
    p.on_report(TierReport())
    lookup(p)
    assert p.knows("r")
    # A CPU-tier copy made by a prefetch is the promotions' slot: loading
    # it leaves vLLM the last block, like any synchronous hit.
    q, index, _ = prefetching(cpu_slots=8)
    index.update(KEYS)
    exact = PROMPT[: 4 * CT]
    arrive(q, "x", exact)
    step(q)
    on_written(q, Tier.CPU, {k: 1 for k in KEYS})
    assert lookup(q, "x", exact) == (4 * CT - BS, False)


def test_a_request_vllm_schedules_in_the_step_it_arrived_in_loads_at_once_with_nothing_prefetched():
    """An idle replica looks an arriving request up in that very step: a
    prefetch would only put a copy into the nearer tiers, the wait for every
    rank's report of it and a second load before the first token. The
    request loads from S3 at once (its promotions fill the nearer tiers as
    any load's do), and nothing is fetched for it."""
    p, index, _ = prefetching(cpu_slots=8, disk_bytes=10 * disk_estimate(SHARD))
    index.update(KEYS)
    arrive(p)
    assert lookup(p) == (4 * CT, True)  # from S3, no "not yet"
    p.on_alloc("r", list(range(10)), 4 * CT)
    plan = p.plan_step([])
    assert plan.prefetch == []
    (load,) = plan.loads
    for c in load.chunks:
        assert tiers_of(c.sources) == (Tier.S3,)
        assert tiers_of(c.promote) == (Tier.CPU, Tier.DISK)
    totals = p.counters.totals()
    assert totals.get("prefetch_chunks_started", 0) == 0 and totals.get("prefetch_waits", 0) == 0
    # One whose every chunk vLLM's own cache holds needs nothing fetched either.
    other = list(range(5000, 5000 + 2 * CT + 3))
    index.update(chain_keys(NS, other, CT))
    arrive(p, "cached", other)
    assert lookup(p, "cached", other, computed=2 * CT) == (0, False)
    assert step(p) == []


def test_the_prefetcher_plans_within_its_budget_and_frees_it_as_copies_are_reported():
    """The prefetcher by itself, over a planner's requests and tiers."""
    p, index, clock = prefetching(budget_chunks=3, cpu_slots=16)
    index.update(KEYS)
    pf = p.prefetcher
    assert pf.enabled and pf.take() == [] and pf.in_flight == 0
    arrive(p)  # the planner knows the request; the prefetcher queued it
    pf.start_arrived()
    (job,) = pf.take()
    assert [c.key for c in job.chunks] == KEYS[:3] and pf.take() == []
    assert pf.in_flight == 3 and p.counters.totals()["prefetch_chunks_queued"] == 1
    assert pf.in_flight_by_tier() == {Tier.S3: 3}  # read from S3, they share it with the loads
    assert pf.awaits(KEYS, 0, 4) and pf.awaits(KEYS, 2, 3) and not pf.awaits(KEYS, 3, 4)
    pf.reported({Tier.CPU: [(KEYS[0], True), (KEYS[1], True)]})  # two copies over: the last chunk starts
    (job,) = pf.take()
    assert [c.key for c in job.chunks] == KEYS[3:] and pf.in_flight == 2
    assert pf.in_flight_by_tier() == {Tier.S3: 2}
    assert not pf.awaits(KEYS, 0, 2)
    clock.now += pf.wait_s + 1  # the other reports are lost
    assert not pf.awaits(KEYS, 0, 4)
    pf.leave("r")  # nothing was left to fetch
    assert p.counters.totals().get("prefetch_chunks_skipped", 0) == 0
    off, _ = planner(cpu_slots=8, chunk_bytes=SHARD)  # no budget: nothing is queued
    off.prefetcher.arrive("r")
    off.prefetcher.start_arrived()
    assert not off.prefetcher.enabled and off.prefetcher.take() == []


def test_a_request_loading_beside_prefetches_is_offered_its_whole_hit_under_the_cost_policy():
    """As above, under the load policy ``cost`` (the default): the chunks
    prefetches have in flight weigh on S3's estimate, and do not become the
    number of tokens offered (a count of chunks in flight once stood in for
    the hit's tokens)."""
    from s3kv.tiering.scheduler.cost import CostModel

    clock = Clock()
    p, index, _ = prefetching(
        budget_chunks=2,
        cpu_slots=16,
        clock=clock,
        cost=CostModel(chunk_bytes=SHARD, policy="always", clock=clock),
    )
    other = b_behind_a(p, index)
    assert p.prefetcher.in_flight == 2
    assert p.lookup("b", other, len(other), 0, policy="cost") == (2 * CT, True)
