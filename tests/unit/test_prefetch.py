"""Prefetch at arrival, in the planner: what only S3 holds of an arriving
request's hit is fetched into the nearer tiers within a byte budget, and
the request's lookups wait for it (no vLLM, no I/O)."""

from s3kv.keys import chain_keys
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import TierReport
from s3kv.tiering.tiers.nvme import disk_estimate
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
    return p.prefetch(req_id, tokens, len(tokens))


def lookup(p, req_id="r", tokens=PROMPT, computed=0):
    return p.lookup(req_id, tokens, len(tokens), computed)


def test_an_arriving_requests_s3_chunks_are_fetched_into_the_nearer_tiers_and_its_lookup_waits():
    p, index, _ = prefetching(cpu_slots=8, disk_bytes=10 * disk_estimate(SHARD))
    index.update(KEYS)
    put_cpu(p, KEYS[:1])  # chunk 0 is local already
    assert arrive(p) == 3
    (job,) = p.plan_step([]).prefetch
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
    assert p.plan_step([]).prefetch == []  # handed out once


def test_the_byte_budget_bounds_chunks_in_flight_and_requests_queue_for_it_in_order():
    p, index, _ = prefetching(budget_chunks=2, cpu_slots=16)
    index.update(KEYS)
    other = list(range(5000, 5000 + 2 * CT + 3))
    other_keys = chain_keys(NS, other, CT)
    index.update(other_keys)
    assert arrive(p, "a") == 2  # 2 of its 4 chunks: the budget
    assert arrive(p, "b", other) == 0  # behind a
    (job,) = p.plan_step([]).prefetch
    assert [c.key for c in job.chunks] == KEYS[:2]
    assert p.counters.totals()["prefetch_chunks_queued"] == 2 + 2
    on_written(p, Tier.CPU, {k: 1 for k in KEYS[:2]})
    (job,) = p.plan_step([]).prefetch  # a's turn goes on first
    assert job.req_id == "a" and [c.key for c in job.chunks] == KEYS[2:4]
    on_written(p, Tier.CPU, {k: 1 for k in KEYS[2:4]})
    (job,) = p.plan_step([]).prefetch
    assert job.req_id == "b" and [c.key for c in job.chunks] == other_keys[:2]
    assert p.counters.totals()["prefetch_chunks_started"] == 6
    assert p.counters.totals().get("prefetch_chunks_skipped", 0) == 0


def test_a_request_scheduled_before_its_turn_loads_by_itself():
    p, index, _ = prefetching(budget_chunks=2, cpu_slots=16)
    index.update(KEYS)
    other = list(range(5000, 5000 + 2 * CT + 3))
    index.update(chain_keys(NS, other, CT))
    arrive(p, "a")
    arrive(p, "b", other)
    # vLLM reaches b while a's chunks are in flight: b loads from S3.
    assert lookup(p, "b", other) == (2 * CT, True)
    assert p.counters.totals()["prefetch_chunks_skipped"] == 2
    on_written(p, Tier.CPU, {k: 1 for k in KEYS[:2]})
    (job,) = p.plan_step([]).prefetch[-1:]
    assert job.req_id == "a"  # b left the queue: only a's rest follows
    assert all(c.key in KEYS for c in job.chunks)


def test_nothing_is_prefetched_that_is_local_or_from_a_tier_in_trouble_or_with_the_budget_off():
    p, index, _ = prefetching(cpu_slots=8)
    index.update(KEYS)
    put_cpu(p, KEYS)
    assert arrive(p) == 0
    p, index, _ = prefetching(cpu_slots=8)
    index.update(KEYS)
    on_load_results(p, set(), failed={Tier.S3: 1})  # S3's breaker opens
    assert arrive(p) == 0
    off, index = planner(cpu_slots=8, chunk_bytes=SHARD)  # prefetch_bytes 0
    index.update(KEYS)
    assert off.prefetch("r", PROMPT, len(PROMPT)) == 0
    assert lookup(off) == (4 * CT, True)
    remote_only, index, _ = prefetching()  # no nearer tier to fetch into
    index.update(KEYS)
    assert arrive(remote_only) == 0


def test_a_failed_prefetch_ends_the_wait_and_the_request_loads_from_s3():
    p, index, _ = prefetching(cpu_slots=8)
    index.update(KEYS)
    arrive(p)
    p.plan_step([])
    on_write_failed(p, Tier.CPU, {k: 1 for k in KEYS})
    assert lookup(p) == (4 * CT, True)  # from S3, as without a prefetch
    assert len(cpu(p)) == 0


def test_a_prefetch_whose_report_is_lost_stops_holding_the_request_back():
    p, index, clock = prefetching(cpu_slots=8)
    index.update(KEYS)
    arrive(p)
    assert lookup(p) == (None, False)
    clock.now += p.prefetch_wait_s + 1
    assert lookup(p) == (4 * CT, True)  # from S3
    # The lost copies' slots stay pending (as a lost promotion's do): no second prefetch.
    assert arrive(p, "again") == 0
    assert lookup(p, "again") == (4 * CT, True)


def test_every_rank_must_report_a_prefetched_copy():
    p, index, _ = prefetching(world_size=2, cpu_slots=8)
    index.update(KEYS)
    arrive(p)
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
    on_written(q, Tier.CPU, {k: 1 for k in KEYS})
    assert lookup(q, "x", exact) == (4 * CT - BS, False)
