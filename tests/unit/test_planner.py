"""The scheduler side's decisions, without vLLM: tiers per chunk, sync or
async loads, stores and where they go, evictions, reports from ranks."""

import hashlib

from s3kv.keys import Namespace, chain_keys, fingerprint, hash_key_mask, hash_keys
from s3kv.manifest import Manifest
from s3kv.manifest.keyset import fingerprints
from s3kv.tiering.placement import Tier, TierIndex
from s3kv.tiering.plan import Place, ScheduledRequest, TierReport
from s3kv.tiering.scheduler.keychain import BlockHashes, HashScheme
from s3kv.tiering.scheduler.planner import Planner
from s3kv.tiering.tiers.cpu.manager import CpuTierManager
from s3kv.tiering.tiers.nvme.manager import NvmeTierManager, disk_estimate
from s3kv.tiering.tiers.nvme.report import NvmeReport
from s3kv.tiering.tiers.s3.manager import BAD_KEY_RETRY_S, S3TierManager
from s3kv.tiering.tiers.s3.report import S3Report

NS = Namespace.from_fields({"model": "m"})
CT, BS = 64, 32  # 2 blocks a chunk
PROMPT = list(range(10, 10 + 300))  # 4 full chunks + 44 tokens
KEYS = chain_keys(NS, PROMPT, CT)
SHARD = 1000  # raw bytes of one rank's shard of a chunk


def planner(
    world_size=1,
    clock=None,
    *,
    cpu_slots=0,
    disk_bytes=0,
    s3=True,
    store_retry_s=120.0,
    backoff_s=(5.0, 60.0),
    probe_timeout_s=60.0,
    **kw,
):
    """A planner over the tiers asked for, nearest first (as the scheduler side builds it)."""
    index = Manifest() if s3 else None
    breaker = {
        "backoff_s": backoff_s,
        "probe_timeout_s": probe_timeout_s,
        **({"clock": clock} if clock else {}),
    }
    tiers = []
    if cpu_slots:
        tiers.append(CpuTierManager(TierIndex("cpu", cpu_slots, slots=True)))
    if disk_bytes:
        disk_index = TierIndex("disk", disk_bytes)
        tiers.append(NvmeTierManager(disk_index, shards=world_size, object_bytes=SHARD, **breaker))
    if index is not None:
        tiers.append(S3TierManager(index, store_retry_s=store_retry_s, **breaker))
    p = Planner(
        namespace=NS,
        chunk_tokens=CT,
        block_size=BS,
        tiers=tiers,
        world_size=world_size,
        **({"clock": clock} if clock else {}),
        **kw,
    )
    return p, index


def cpu(p):
    return p.tier(Tier.CPU).index


def disk(p):
    return p.tier(Tier.DISK).index


def nvme(p):
    return p.tier(Tier.DISK)


def s3(p):
    return p.tier(Tier.S3)


def tiers_of(places):
    return tuple(place.tier for place in places)


def goes_to(places, tier):
    return tier in tiers_of(places)


def cpu_slot(places):
    """The CPU slot among ``places``, or None."""
    return next((place.slot for place in places if place.tier is Tier.CPU), None)


# What the workers report, one field at a time (each a TierReport of its own).
def on_written(p, tier, counts, sizes=None):
    sections = {Tier.DISK: NvmeReport(sizes=dict(sizes))} if sizes else {}
    p.on_report(TierReport(written={(tier, k): n for k, n in counts.items()}, sections=sections))


def on_write_failed(p, tier, counts):
    p.on_report(TierReport(failed={(tier, k): n for k, n in counts.items()}))


def on_missing(p, tier, keys):
    p.on_report(TierReport(missing={(tier, k) for k in keys}))


def on_existing(p, keys):
    p.on_report(TierReport(sections={Tier.S3: S3Report(existing=set(keys))}))


def on_released(p, counts):
    p.on_report(TierReport(released=dict(counts)))


def on_sync_loaded(p, counts):
    p.on_report(TierReport(sync_loaded=dict(counts)))


def on_disk_full(p):
    p.on_report(TierReport(sections={Tier.DISK: NvmeReport(full=True)}))


def on_load_results(p, failed_req_ids, *, ok=None, failed=None):
    p.on_report(
        TierReport(load_failed=set(failed_req_ids), tier_ok=dict(ok or {}), tier_failed=dict(failed or {}))
    )


def sched(req_id, computed, scheduled, blocks):
    return ScheduledRequest(req_id, computed, scheduled, lambda: blocks)


def lookup(p, req_id="r", computed=0, tokens=PROMPT, **kw):
    return p.lookup(req_id, tokens, len(tokens), computed, **kw)


def put_cpu(p, keys):
    for k in keys:
        cpu(p).reserve(k)
        cpu(p).commit(k)


def test_lookup_counts_hits_beyond_local():
    p, index = planner()
    assert lookup(p) == (0, False)
    index.update(KEYS[:3])
    assert lookup(p) == (3 * CT, True)
    assert lookup(p, computed=2 * BS) == (3 * CT - 2 * BS, True)
    assert lookup(p, computed=4 * BS * 2) == (0, False)  # local hit is longer
    index.discard(KEYS[1])  # a gap ends the hit
    assert lookup(p) == (CT, True)
    # Chunks held locally need not be in any tier: the hit starts past them.
    assert lookup(p, computed=2 * CT) == (CT, True)


def test_cpu_only_hits_are_sync_and_leave_the_last_block_to_vllm():
    p, index = planner(cpu_slots=8)
    put_cpu(p, KEYS[:3])
    assert lookup(p) == (3 * CT, False)
    exact = PROMPT[: 4 * CT]  # the prompt is whole chunks, all in the CPU tier
    put_cpu(p, KEYS[3:4])
    assert lookup(p, "whole", tokens=exact) == (4 * CT - BS, False)
    index.add(KEYS[3])
    cpu(p).remove(KEYS[3])
    assert lookup(p) == (4 * CT, True)  # one chunk from S3: the whole load is async


def test_load_plan_per_tier_skips_local_blocks_and_pins_sources():
    p, index = planner(cpu_slots=4, disk_bytes=10 * disk_estimate(SHARD))
    put_cpu(p, KEYS[:1])
    disk(p).insert_ready(KEYS[1], 900)
    index.update(KEYS[1:3])
    local = BS  # half of the first chunk is held locally
    n, is_async = lookup(p, computed=local)
    assert (n, is_async) == (3 * CT - BS, True)
    blocks = list(range(100, 110))
    p.on_alloc("r", blocks, n)
    assert p.hit_sources("r") == {Tier.CPU: CT - BS, Tier.DISK: CT, Tier.S3: CT}
    (load,) = p.plan_step([]).loads
    c0, c1, c2 = load.chunks
    assert (tiers_of(c0.sources), c0.block_ids, c0.first_block, c0.write_ids) == (
        (Tier.CPU,),
        (100, 101),
        1,
        (101,),
    )
    assert c0.sources[0].slot == cpu(p).get(KEYS[0]).slot and c0.promote == ()
    assert tiers_of(c1.sources) == (Tier.DISK, Tier.S3) and cpu_slot(c1.promote) is not None
    assert tiers_of(c1.promote) == (Tier.CPU,)  # not to the disk it came from
    assert tiers_of(c2.sources) == (Tier.S3,) and cpu_slot(c2.promote) is not None
    assert tiers_of(c2.promote) == (Tier.CPU, Tier.DISK)
    assert not load.sync
    # What the load reads cannot be evicted until vLLM reports it done.
    assert cpu(p).get(KEYS[0]).pins == 1 and disk(p).get(KEYS[1]).pins == 1
    p.on_recved(["r"])
    assert cpu(p).get(KEYS[0]).pins == 0 and disk(p).get(KEYS[1]).pins == 0
    assert p.plan_step([]).loads == []  # handed out once


def test_sync_load_pins_until_every_rank_copied():
    p, _ = planner(world_size=2, cpu_slots=2)
    put_cpu(p, KEYS[:2])
    n, is_async = lookup(p)
    p.on_alloc("r", list(range(10)), n)
    plan = p.plan_step([sched("other", 0, 0, [])])
    assert plan.loads[0].sync and cpu(p).get(KEYS[0]).pins == 1
    on_sync_loaded(p, {"r": 1})
    assert cpu(p).get(KEYS[0]).pins == 1  # one rank may still copy from the slot
    on_sync_loaded(p, {"r": 1})
    assert cpu(p).get(KEYS[0]).pins == 0


def test_stores_go_to_every_tier_that_lacks_them_once():
    p, index = planner(cpu_slots=8, disk_bytes=100 * disk_estimate(SHARD))
    blocks = list(range(10))
    lookup(p, "a")
    lookup(p, "b")
    s1 = p.plan_step([sched("a", 0, 100, blocks)])
    (st,) = s1.stores
    assert st.key == KEYS[0] and st.block_ids == (0, 1) and cpu_slot(st.targets) is not None
    assert tiers_of(st.targets) == (Tier.CPU, Tier.DISK, Tier.S3)
    assert st.pinned  # the farther writes read the CPU slot
    s2 = p.plan_step([sched("a", 100, 200, blocks), sched("b", 0, 300, list(range(20, 30)))])
    assert [s.key for s in s2.stores] == KEYS[1:4]  # b shares a's prefix: planned once
    assert p.plan_step([sched("a", 300, 1, blocks)]).stores == []
    # Written where it lacks: only the disk, for a chunk in the CPU tier and in S3.
    p2, index2 = planner(cpu_slots=8, disk_bytes=100 * disk_estimate(SHARD))
    put_cpu(p2, KEYS[:1])
    index2.add(KEYS[0])
    lookup(p2, "c", computed=0)
    (only,) = p2.plan_step([sched("c", 0, 64, blocks)]).stores
    assert only.targets == (Place(Tier.DISK),) and not only.pinned


def test_chunk_is_stored_only_when_every_rank_reports():
    p, index = planner(world_size=2, cpu_slots=4, disk_bytes=100 * disk_estimate(SHARD))
    lookup(p, "a")
    plan = p.plan_step([sched("a", 0, 300, list(range(10)))])
    assert [s.key for s in plan.stores] == KEYS
    k = KEYS[1]
    for tier in Tier:
        on_written(p, tier, {k: 1}, {k: 500} if tier is Tier.DISK else None)
    assert k not in cpu(p) and k not in disk(p) and k not in index  # one of two ranks
    for tier in Tier:
        on_written(p, tier, {k: 1}, {k: 600} if tier is Tier.DISK else None)
    assert k in cpu(p) and k in disk(p) and k in index
    assert disk(p).get(k).size == 1100  # the real size replaces the reservation
    assert cpu(p).get(k).pins == 1  # the write-through still reads the slot
    on_released(p, {k: 2})
    assert cpu(p).get(k).pins == 0
    # One rank failed its write: undone only once the other rank is done too.
    k2 = KEYS[2]
    on_write_failed(p, Tier.DISK, {k2: 1})
    on_write_failed(p, Tier.CPU, {k2: 1})
    assert disk(p).has(k2) and cpu(p).has(k2) and nvme(p).take_evictions() == []
    on_written(p, Tier.DISK, {k2: 1}, {k2: 500})
    on_written(p, Tier.CPU, {k2: 1})
    assert not disk(p).has(k2) and not cpu(p).has(k2)
    assert nvme(p).take_evictions() == [k2]  # the file the other rank wrote goes too
    on_missing(p, Tier.S3, [k])
    assert k not in index


def test_lru_eviction_hands_disk_files_over_and_never_rewrites_while_deleting():
    est = disk_estimate(SHARD)
    p, _ = planner(disk_bytes=2 * est, s3=False)
    lookup(p, "a")
    plan = p.plan_step([sched("a", 0, 2 * CT, list(range(10)))])
    for s in plan.stores:
        on_written(p, Tier.DISK, {s.key: 1}, {s.key: est})
    plan = p.plan_step([sched("a", 2 * CT, 2 * CT, list(range(10)))])
    assert [s.key for s in plan.stores] == KEYS[2:4]
    assert nvme(p).take_evictions() == KEYS[:2]  # oldest first
    assert p.counters.totals()["evict_chunks_disk"] == 2
    lookup(p, "b")
    assert all(s.key not in KEYS[:2] for s in p.plan_step([sched("b", 0, 300, list(range(10)))]).stores)
    nvme(p).on_deleted(KEYS[:2])
    lookup(p, "c")
    assert [s.key for s in p.plan_step([sched("c", 0, 300, list(range(10)))]).stores] == []  # full, pending
    assert disk(p).used <= disk(p).capacity


def test_cpu_slots_are_reused_lru_but_never_while_pinned():
    p, _ = planner(cpu_slots=2, s3=False)
    put_cpu(p, KEYS[:2])
    n, _ = lookup(p, "reader", tokens=PROMPT[: 2 * CT + 1])
    p.on_alloc("reader", list(range(10)), n)  # pins both (sync: until the plan is out)
    lookup(p, "w", tokens=PROMPT)
    plan = p.plan_step([sched("w", 2 * CT, 2 * CT, list(range(10)))])
    assert plan.stores == []  # nothing could be evicted in this step
    assert p.counters.totals()["store_dropped_no_slot"] == 2
    on_sync_loaded(p, {"reader": 1})  # the copies are done: the next new chunks evict LRU
    lookup(p, "w2", tokens=PROMPT)
    plan = p.plan_step([sched("w2", 2 * CT, 2 * CT, list(range(10)))])
    assert len(plan.stores) == 2 and p.counters.totals()["evict_chunks_cpu"] == 2


def test_generated_chunks_are_stored_and_blocks_held_until_copied():
    p, index = planner()
    tokens = list(PROMPT[:100])  # one full prompt chunk; vLLM appends outputs to this list
    lookup(p, "chat", tokens=tokens)
    plan = p.plan_step([sched("chat", 0, 100, list(range(10)))])
    assert [s.key for s in plan.stores] == KEYS[:1]
    tokens += PROMPT[100:140]  # decoding: the list grows
    blocks = list(range(10))
    plan = p.plan_step([sched("chat", 100, 1, blocks)])  # chunk 1 not full yet
    assert plan.stores == []
    # It finishes with 139 tokens computed: chunk 1 (64..127) holds generated tokens.
    assert p.request_finished("chat", blocks, 139) is True
    plan = p.plan_step([])
    assert [s.key for s in plan.stores] == KEYS[1:2] and plan.held == ["chat"]
    p.on_sent(["chat"])
    assert not p.knows("chat")
    # Without save_generated only prompt chunks are stored, and nothing is held.
    p2, _ = planner(save_generated=False)
    tokens2 = list(PROMPT[:100])
    lookup(p2, "x", tokens=tokens2)
    p2.plan_step([sched("x", 0, 100, blocks)])
    tokens2 += PROMPT[100:140]
    assert p2.request_finished("x", blocks, 139) is False and not p2.knows("x")


def test_failed_or_stale_stores_are_planned_again():
    now = [0.0]
    p, index = planner(clock=lambda: now[0])
    for r in "abc":
        lookup(p, r)
    assert len(p.plan_step([sched("a", 0, 300, list(range(10)))]).stores) == 4
    on_write_failed(p, Tier.S3, {KEYS[0]: 1})
    assert [s.key for s in p.plan_step([sched("b", 0, 300, list(range(10)))]).stores] == [KEYS[0]]
    now[0] = 1000.0  # never reported: retried after store_retry_s
    assert len(p.plan_step([sched("c", 0, 300, list(range(10)))]).stores) == 4


def test_extras_change_keys_per_chunk():
    p, index = planner()
    index.update(KEYS)
    salted = lookup(p, "salted", extras=lambda s, e: ("cache_salt", "x") if s == 0 else None)
    assert salted == (0, False)
    assert lookup(p, "plain", extras=lambda s, e: None) == (4 * CT, True)


def test_failed_request_gets_no_more_hits():
    p, index = planner()
    index.update(KEYS)
    assert lookup(p) == (4 * CT, True)
    on_load_results(p, {"r"})
    assert lookup(p) == (0, False)  # vLLM asks again after a failure
    assert lookup(p, "other") == (4 * CT, True)


def test_unreachable_s3_pauses_s3_hits_and_writes_with_growing_backoff():
    now = [0.0]
    p, index = planner(clock=lambda: now[0], cpu_slots=4)
    index.update(KEYS)
    put_cpu(p, KEYS[:1])
    on_load_results(p, set(), failed={Tier.S3: 1})
    assert s3(p).paused and lookup(p, "a") == (CT, False)  # the CPU tier still serves
    lookup(p, "w")
    assert all(
        not goes_to(s.targets, Tier.S3) for s in p.plan_step([sched("w", 0, 300, list(range(10)))]).stores
    )
    now[0] = 5.1
    assert lookup(p, "b") == (4 * CT, True)
    on_load_results(p, set(), failed={Tier.S3: 1})  # still down: 10 s now
    now[0] = 14.0
    assert s3(p).paused
    now[0] = 15.2
    assert not s3(p).paused
    on_load_results(p, set(), ok={Tier.S3: 3})  # back: next pause is short again
    on_load_results(p, set(), failed={Tier.S3: 1})
    now[0] = 20.3
    assert not s3(p).paused
    s3(p).down = True  # unreachable since start-up: paused until the caller says otherwise
    now[0] = 1e6
    assert s3(p).paused


def test_hits_from_other_tiers_never_close_the_s3_breaker():
    now = [0.0]
    p, index = planner(clock=lambda: now[0], cpu_slots=4)
    index.update(KEYS)
    put_cpu(p, KEYS[:1])
    on_load_results(p, set(), failed={Tier.S3: 1})  # open for 5 s, then 10 s
    for t in range(1, 5):
        now[0] = t
        assert lookup(p, f"cpu{t}") == (CT, False)
        on_load_results(p, set(), ok={Tier.CPU: 1, Tier.DISK: 2})
        assert s3(p).paused
    now[0] = 5.5
    on_load_results(p, set(), ok={Tier.CPU: 1})
    assert lookup(p, "probe") == (4 * CT, True)  # the one probe
    assert s3(p).paused and lookup(p, "another") == (CT, False)  # half-open: nobody else
    assert lookup(p, "probe") == (4 * CT, True)  # the probe itself, asked again
    on_load_results(p, set(), failed={Tier.S3: 1})  # the probe failed: 10 s
    now[0] = 15.0
    assert s3(p).paused
    now[0] = 15.6
    assert lookup(p, "probe2") == (4 * CT, True)
    on_load_results(p, set(), ok={Tier.S3: 1})
    assert not s3(p).paused and lookup(p, "after") == (4 * CT, True)
    assert p.counters.totals()["breaker_trips_s3"] == 2


def test_a_probe_that_never_answers_reopens_the_breaker():
    now = [0.0]
    p, index = planner(clock=lambda: now[0], probe_timeout_s=30.0)
    index.update(KEYS)
    on_load_results(p, set(), failed={Tier.S3: 1})
    now[0] = 6.0
    assert lookup(p, "probe") == (4 * CT, True)
    assert lookup(p, "other") == (0, False)
    now[0] = 37.0  # no word from the probe: as good as a failure (10 s more)
    assert lookup(p, "other") == (0, False)
    now[0] = 47.5
    assert lookup(p, "other") == (4 * CT, True)


def test_a_store_can_be_the_s3_probe():
    now = [0.0]
    p, _ = planner(clock=lambda: now[0])
    on_load_results(p, set(), failed={Tier.S3: 1})
    now[0] = 6.0
    lookup(p, "w")
    stores = p.plan_step([sched("w", 0, 300, list(range(10)))]).stores
    assert [goes_to(s.targets, Tier.S3) for s in stores] == [
        True
    ]  # one probe, not a flood (the other 3 have no tier)
    on_written(p, Tier.S3, {stores[0].key: 1})
    on_load_results(p, set(), ok={Tier.S3: 1})
    lookup(p, "w2", tokens=list(range(500, 800)))
    assert all(
        goes_to(s.targets, Tier.S3) for s in p.plan_step([sched("w2", 0, 300, list(range(10, 20)))]).stores
    )


def half_open_s3(**kw):
    """A planner whose S3 breaker opened at 0 s and is half-open now (6 s)."""
    now = [0.0]
    p, index = planner(clock=lambda: now[0], **kw)
    index.update(KEYS)
    on_load_results(p, set(), failed={Tier.S3: 1})
    now[0] = 6.0
    return p, index, now


def test_a_probe_whose_s3_part_vllm_trimmed_gives_the_slot_back():
    p, _, _ = half_open_s3(disk_bytes=100 * disk_estimate(SHARD))
    for k in KEYS[:2]:
        disk(p).insert_ready(k, 100)
    assert lookup(p, "a") == (4 * CT, True)  # the S3 probe
    assert lookup(p, "b") == (2 * CT, True)  # the disk only: S3 has its probe
    p.on_alloc("a", list(range(10)), 2 * CT)  # vLLM loads only the disk's part
    assert p.hit_sources("a") == {Tier.DISK: 2 * CT}
    assert lookup(p, "b") == (4 * CT, True)  # the next request probes S3 instead


def test_a_finished_request_gives_its_probe_slot_back():
    p, _, _ = half_open_s3()
    assert lookup(p, "a") == (4 * CT, True)
    assert lookup(p, "b") == (0, False)
    p.request_finished("a", [], 0)  # never allocated: it will not probe
    assert lookup(p, "b") == (4 * CT, True)


def test_a_load_over_without_news_for_the_tier_gives_the_probe_slot_back():
    p, _, _ = half_open_s3()
    assert lookup(p, "a") == (4 * CT, True)
    p.on_alloc("a", list(range(10)), 4 * CT)
    on_load_results(p, {"a"})  # it failed, not for S3's sake (a chunk refused, given up)
    assert lookup(p, "b") == (0, False)
    p.on_recved(["a"])
    assert lookup(p, "b") == (4 * CT, True)


def test_a_store_that_failed_gives_its_probe_slot_back():
    p, index, _ = half_open_s3()
    lookup(p, "w", tokens=list(range(500, 800)))
    (store,) = [
        s for s in p.plan_step([sched("w", 0, 300, list(range(10)))]).stores if goes_to(s.targets, Tier.S3)
    ]
    assert lookup(p, "r") == (0, False)  # the store is the probe
    on_write_failed(p, Tier.S3, {store.key: 1})  # dropped (the byte budget): S3 said nothing
    assert lookup(p, "r") == (4 * CT, True)


def test_failures_while_open_count_one_trip():
    now = [0.0]
    p, index = planner(clock=lambda: now[0])
    for t in (0.0, 1.0, 2.0):  # loads in flight when it opened fail one by one
        now[0] = t
        on_load_results(p, set(), failed={Tier.S3: 2})
    assert p.counters.totals()["breaker_trips_s3"] == 1
    now[0] = 5.1  # and the backoff is still the first one
    assert not s3(p).paused


def test_a_412_on_a_bad_key_is_not_stored_again_for_a_while():
    now = [0.0]
    p, index = planner(clock=lambda: now[0], store_retry_s=100.0)
    index.quarantine(KEYS[0], "p/bad-object", '"etag"')  # some replica could not delete it
    for bad_outcome in ("existing", "failed"):
        lookup(p, "w")
        stores = p.plan_step([sched("w", 0, 300, list(range(10)))]).stores
        assert [s.key for s in stores if goes_to(s.targets, Tier.S3)][:1] == [KEYS[0]]
        if bad_outcome == "existing":  # the 412 found the bad object: not published
            on_existing(p, [KEYS[0]])
            on_written(p, Tier.S3, {s.key: 1 for s in stores})
        else:  # a store that found it in the way and could not verify it
            on_write_failed(p, Tier.S3, {KEYS[0]: 1})
        assert KEYS[0] not in index and all(k in index for k in KEYS[1:4])
        for step in range(3):  # not every step
            lookup(p, f"again{step}")
            assert p.plan_step([sched(f"again{step}", 0, 300, list(range(10)))]).stores == []
            p.request_finished(f"again{step}", [], 0)
        now[0] += BAD_KEY_RETRY_S - 1
        lookup(p, "soon")
        assert p.plan_step([sched("soon", 0, 300, list(range(10)))]).stores == []
        p.request_finished("soon", [], 0)
        now[0] += 1  # BAD_KEY_RETRY_S later it is tried again (gc may have removed it)
        p.request_finished("w", [], 0)


def test_a_failing_disk_pauses_only_the_disk():
    now = [0.0]
    p, index = planner(clock=lambda: now[0], disk_bytes=100 * disk_estimate(SHARD))
    index.update(KEYS)
    for k in KEYS[:2]:
        disk(p).insert_ready(k, 100)
    assert lookup(p, "a") == (4 * CT, True)
    p.on_alloc("a", list(range(10)), 4 * CT)
    assert p.hit_sources("a") == {Tier.DISK: 2 * CT, Tier.S3: 2 * CT}
    on_load_results(p, set(), ok={Tier.S3: 2}, failed={Tier.DISK: 1})
    assert lookup(p, "b") == (4 * CT, True)
    p.on_alloc("b", list(range(10, 20)), 4 * CT)
    assert p.hit_sources("b") == {Tier.S3: 4 * CT}
    assert not s3(p).paused  # S3 goes on
    lookup(p, "w", tokens=list(range(500, 800)))
    stores = p.plan_step([sched("w", 0, 300, list(range(10)))]).stores
    assert stores and all(tiers_of(s.targets) == (Tier.S3,) for s in stores)
    assert p.counters.totals()["breaker_trips_disk"] == 1 and "breaker_trips_s3" not in p.counters.totals()


def test_disk_full_shrinks_the_capacity_to_what_is_held():
    est = disk_estimate(SHARD)
    p, _ = planner(disk_bytes=10 * est, s3=False)
    lookup(p, "a")
    plan = p.plan_step([sched("a", 0, 300, list(range(10)))])
    on_written(p, Tier.DISK, {plan.stores[0].key: 1}, {plan.stores[0].key: est})
    on_write_failed(p, Tier.DISK, {s.key: 1 for s in plan.stores[1:]})
    on_disk_full(p)
    assert disk(p).capacity == est


def test_abort_during_an_async_load_stores_nothing_and_holds_nothing():
    p, index = planner(cpu_slots=4)
    index.update(KEYS)
    n, is_async = lookup(p)
    assert is_async
    p.on_alloc("r", list(range(10)), n)
    p.plan_step([])
    # vLLM counts the loading tokens as computed; the blocks are not valid yet.
    assert p.request_finished("r", list(range(10)), n) is False
    assert p.plan_step([]).stores == []
    p.on_recved(["r"])  # vLLM still reports the load's end: the promotion slots are settled by reports


def test_chunks_loaded_from_a_tier_are_not_stored_from_the_kv_cache():
    p, index = planner(cpu_slots=8, disk_bytes=100 * disk_estimate(SHARD))
    put_cpu(p, KEYS[:2])  # in the CPU tier only: disk and S3 lack them
    n, is_async = lookup(p, tokens=PROMPT[: 2 * CT + 10])
    p.on_alloc("r", list(range(10)), n)
    plan = p.plan_step([sched("r", n, 2 * CT + 10 - n, list(range(10)))])
    assert plan.stores == []  # a failed copy would otherwise spread garbage to disk and S3


def test_promotions_never_evict_a_later_chunk_of_the_same_hit():
    p, index = planner(cpu_slots=2)
    index.add(KEYS[0])  # chunk 0 only in S3, chunk 1 only in the CPU tier (the one slot in use)
    put_cpu(p, [b"other" * 3 + b"x", KEYS[1]])
    n, _ = lookup(p, tokens=PROMPT[: 2 * CT + 10])
    assert n == 2 * CT
    p.on_alloc("r", list(range(10)), n)
    (load,) = p.plan_step([]).loads
    c0, c1 = load.chunks
    assert tiers_of(c1.sources) == (Tier.CPU,) and c1.sources[0].slot is not None  # still there, pinned
    assert cpu_slot(c0.promote) is not None and cpu_slot(c0.promote) != c1.sources[0].slot


def test_a_hit_vllm_trims_stays_as_asynchronous_as_announced():
    p, index = planner(cpu_slots=4)
    put_cpu(p, KEYS[:1])
    index.update(KEYS[1:2])
    n, is_async = lookup(p)
    assert (n, is_async) == (2 * CT, True)
    p.on_alloc("r", list(range(10)), CT)  # vLLM took only the CPU chunk
    (load,) = p.plan_step([]).loads
    assert not load.sync and [tiers_of(c.sources) for c in load.chunks] == [(Tier.CPU,)]


def test_tier_changes_become_events_with_tokens_and_parent():
    p, index = planner(cpu_slots=1, disk_bytes=100 * disk_estimate(SHARD), emit_events=True)
    lookup(p, "a")
    plan = p.plan_step([sched("a", 0, 2 * CT, list(range(10)))])
    k0, k1 = KEYS[0], KEYS[1]
    assert [s.key for s in plan.stores] == [k0, k1] and not goes_to(
        plan.stores[1].targets, Tier.CPU
    )  # one slot
    for tier in Tier:
        on_written(p, tier, {k0: 1}, {k0: 900} if tier is Tier.DISK else None)
    on_written(p, Tier.S3, {k1: 1})
    events = p.take_events()
    assert [(e.stored, e.tier) for e in events] == [
        (True, Tier.CPU),
        (True, Tier.DISK),
        (True, Tier.S3),
        (True, Tier.S3),
    ]
    first, last = events[0], events[-1]
    assert first.key == k0 and first.parent is None and first.token_ids == tuple(PROMPT[:CT])
    assert last.key == k1 and last.parent == k0 and last.token_ids == tuple(PROMPT[CT : 2 * CT])
    # The CPU slot goes to the next chunk (k0 is released): k0 leaves the CPU tier.
    on_released(p, {k0: 1})
    lookup(p, "b")
    p.plan_step([sched("b", 2 * CT, CT, list(range(10)))])
    on_missing(p, Tier.DISK, [k0])
    assert [(e.stored, e.tier, e.key) for e in p.take_events()] == [
        (False, Tier.CPU, k0),
        (False, Tier.DISK, k0),
    ]
    assert p.take_events() == []
    quiet, _ = planner(cpu_slots=1)
    lookup(quiet, "a")
    quiet.plan_step([sched("a", 0, CT, list(range(10)))])
    on_written(quiet, Tier.S3, {k0: 1})
    assert quiet.take_events() == []  # off unless vLLM's KV events are on


def test_prefix_ids_key_a_known_prefix_without_hashing(monkeypatch):
    """vLLM's block hashes name prefixes: a second request with a known
    prefix takes its chunk keys from the memo, and only hashes the rest."""
    import s3kv.tiering.scheduler.keychain as keychain_mod

    p, _ = planner()
    shared, tail_a, tail_b = list(range(3 * CT)), [7] * CT, [9] * CT
    a, b = shared + tail_a, shared + tail_b
    ids = {"a": [("s", 0), ("s", 1), ("s", 2), ("a", 3)], "b": [("s", 0), ("s", 1), ("s", 2), ("b", 3)]}
    hashed: list[int] = []
    real = keychain_mod.chain_keys
    monkeypatch.setattr(
        keychain_mod,
        "chain_keys",
        lambda ns, toks, *a, **k: hashed.append(len(toks)) or real(ns, toks, *a, **k),
    )
    p.lookup("a", a, len(a), 0, prefix_ids=ids["a"].__getitem__)
    p.lookup("b", b, len(b), 0, prefix_ids=ids["b"].__getitem__)
    assert hashed == [4 * CT, CT]  # b hashed only its own chunk
    assert p._requests["b"].keys == chain_keys(NS, b, CT)
    assert p._requests["a"].keys[:3] == p._requests["b"].keys[:3]
    assert len(p._requests["b"].fps) == 4
    # No ids (or unknown ones): hashed as before.
    p.lookup("c", b, len(b), 0)
    assert hashed[-1] == 4 * CT and p._requests["c"].keys == chain_keys(NS, b, CT)


def test_keys_seen_in_the_manifest_are_trusted_only_until_a_removal():
    p, m = planner()
    for k in KEYS:
        m.add(k)
    assert lookup(p, "a")[0] == 4 * CT
    p._requests.pop("a")
    m.discard(KEYS[2])  # e.g. its object turned out missing on another request
    assert lookup(p, "b")[0] == 2 * CT  # the chain stops at the removed key
    m.add(KEYS[2])
    p._requests.pop("b")
    assert lookup(p, "c")[0] == 4 * CT


class _Journal:
    """What the scheduler side publishes (manifest.keyset.Sync)."""

    def __init__(self):
        self.published = []

    def stored(self, fp):
        self.published.append(fp)

    def used(self, fps):
        pass

    def bad(self, fp, name, etag):
        pass


def test_the_ranks_publish_their_own_stores_the_scheduler_only_412s():
    """A store the workers' PUTs created is published by the workers
    (manifest.publish) the moment it completes: the scheduler side only adds
    it to its index. One found already there (a 412) it publishes itself,
    unless some replica reported that object bad."""
    p, index = planner()
    index.sync = journal = _Journal()
    lookup(p, "a")
    stores = p.plan_step([sched("a", 0, 3 * CT, list(range(10)))]).stores
    k0, k1, k2 = (s.key for s in stores)
    on_written(p, Tier.S3, {k0: 1})  # created by this replica's rank
    on_existing(p, [k1])
    on_written(p, Tier.S3, {k1: 1})  # found there
    index.bad.add(fingerprints([k2])[0].item())
    on_existing(p, [k2])
    on_written(p, Tier.S3, {k2: 1})  # found there, but reported bad
    assert k0 in index and k1 in index and k2 not in index
    assert journal.published == [fingerprints([k1])[0].item()]


def test_with_replica_segments_the_scheduler_side_publishes_every_whole_chunk_once_all_ranks_stored_it():
    """Protocol "epochs": the replica's one segment names each chunk its
    ranks stored (created or found there), once every rank reported its
    shard: the ranks hold theirs for it. A bad object found in the way is
    still never published."""
    p, index = planner(world_size=2)
    s3(p).publishes_all = True
    index.sync = journal = _Journal()
    lookup(p, "a")
    stores = p.plan_step([sched("a", 0, 3 * CT, list(range(10)))]).stores
    k0, k1, k2 = (s.key for s in stores)
    on_written(p, Tier.S3, {k0: 1})  # one rank of two
    assert journal.published == [] and k0 not in index
    on_written(p, Tier.S3, {k0: 1})  # the other
    on_existing(p, [k1])
    on_written(p, Tier.S3, {k1: 2})  # found there by both
    index.bad.add(fingerprints([k2])[0].item())
    on_existing(p, [k2])
    on_written(p, Tier.S3, {k2: 2})  # found there, but reported bad
    assert k0 in index and k1 in index and k2 not in index
    assert journal.published == [fingerprints([k])[0].item() for k in (k0, k1)]


def _block_hashes(tokens, seed=b"vllm-none-hash"):
    """A stand-in for vLLM's block hashes: a sha256 chain over BS-token blocks."""
    out, prev = [], hashlib.sha256(seed).digest()
    for i in range(0, len(tokens) - BS + 1, BS):
        prev = hashlib.sha256(prev + repr(tokens[i : i + BS]).encode()).digest()
        out.append(prev)
    return out


def _hash_planner(index):
    return Planner(
        namespace=NS, chunk_tokens=CT, block_size=BS, tiers=[S3TierManager(index)], hash_scheme=HashScheme(BS)
    )


class _NoTokens(list):
    """A request's tokens that must not be read (the block scheme keys without them)."""

    def __getitem__(self, i):
        raise AssertionError("tokens read")

    def __iter__(self):
        raise AssertionError("tokens read")


def test_under_the_block_scheme_another_replica_finds_a_prefix_by_its_block_hashes():
    """Replica A stores a prompt keyed by vLLM's block hashes; replica B,
    which never saw it, finds every chunk at its first lookup without
    reading a token: the keys are the hashes of each chunk's last block
    (every second one here), masked by the namespace."""
    index = Manifest()
    a, b = _hash_planner(index), _hash_planner(index)
    hashes = _block_hashes(PROMPT)
    assert a.lookup("r", PROMPT, len(PROMPT), 0, block_hashes=BlockHashes(hashes)) == (0, False)
    stores = a.plan_step([sched("r", 0, len(PROMPT), list(range(10)))]).stores
    expected = hash_keys(hashes[CT // BS - 1 :: CT // BS][:4], hash_key_mask(NS), 32)[0]
    assert [st.key for st in stores] == expected
    assert expected != KEYS[:4]  # not the token scheme's keys
    on_written(a, Tier.S3, {k: 1 for k in expected})
    tokens = _NoTokens(PROMPT)
    assert b.lookup("q", tokens, len(PROMPT), 0, block_hashes=BlockHashes(hashes)) == (4 * CT, True)
    assert b._requests["q"].keys == expected and b._requests["q"].fps.tolist() == [
        fingerprint(k) for k in expected
    ]
    # Another adapter's (same name and path, so the same vLLM hashes): no hit.
    assert b.lookup("l", PROMPT, len(PROMPT), 0, block_hashes=BlockHashes(hashes, "adapter:other")) == (
        0,
        False,
    )
    assert set(b._requests["l"].keys).isdisjoint(expected)


def test_under_the_block_scheme_a_request_without_hashes_is_not_keyed_by_its_tokens():
    index = Manifest()
    index.update(KEYS)  # the token scheme's keys are there
    p = _hash_planner(index)
    assert p.lookup("r", PROMPT, len(PROMPT), 0) == (0, False)
    assert p._requests["r"].keys == []
    assert p.plan_step([sched("r", 0, len(PROMPT), list(range(10)))]).stores == []
    # Hashes of the first two chunks only: keys (and stores) for those alone.
    hashes = _block_hashes(PROMPT)
    p.lookup("s", PROMPT, len(PROMPT), 0, block_hashes=BlockHashes(hashes[:4]))
    assert len(p._requests["s"].keys) == 2
    assert len(p.plan_step([sched("s", 0, len(PROMPT), list(range(10)))]).stores) == 2


def test_under_the_block_scheme_chunks_filled_in_decode_are_keyed_as_hashes_grow():
    """vLLM appends a block hash as generated tokens fill a block (its live
    list): the chunks they complete are keyed and stored from them."""
    index = Manifest()
    p = _hash_planner(index)
    tokens = list(PROMPT[: 2 * CT])
    hashes = _block_hashes(tokens)
    p.lookup("r", tokens, len(tokens), 0, block_hashes=BlockHashes(hashes))
    assert len(p.plan_step([sched("r", 0, len(tokens), list(range(4)))]).stores) == 2
    tokens += PROMPT[2 * CT : 3 * CT]  # decode filled a third chunk
    hashes[:] = _block_hashes(tokens)
    stores = p.plan_step([sched("r", 2 * CT, CT, list(range(6)))]).stores
    mask = hash_key_mask(NS)
    assert [st.key for st in stores] == hash_keys([hashes[5]], mask, 32)[0]
