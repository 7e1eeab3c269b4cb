"""Each tier's scheduler-side manager on its own, and the pieces the planner
composes (chain keys, rank count, the stack of tiers): what the planner tests
cover only through the planner."""

import pytest

from s3kv.errors import ConfigError
from s3kv.keys import Namespace, chain_keys, fingerprint, object_key
from s3kv.manifest import Manifest
from s3kv.manifest.keyset import fingerprints
from s3kv.stats import Counters
from s3kv.tiering.placement import Tier, TierIndex
from s3kv.tiering.plan import Place, TierReport
from s3kv.tiering.scheduler.ranks import RankCount
from s3kv.tiering.scheduler.stack import TierStack
from s3kv.tiering.tiers.cpu.manager import CpuTierManager
from s3kv.tiering.tiers.manager import TierEvents, store_owner
from s3kv.tiering.tiers.nvme.manager import NvmeTierManager, disk_estimate
from s3kv.tiering.tiers.nvme.report import NvmeReport
from s3kv.tiering.tiers.s3.manager import BAD_KEY_RETRY_S, S3TierManager
from s3kv.tiering.tiers.s3.report import S3Report

KEYS = chain_keys(Namespace.from_fields({"m": "tiers"}), list(range(256)), 64)
FPS = fingerprints(KEYS)


def stack(*tiers, events=False):
    return TierStack(tiers, Counters(), TierEvents(events))


def test_rank_count_waits_for_every_rank():
    ranks = RankCount(world_size=2)
    assert not ranks.count(("release", KEYS[0]), 1) and ranks.count(("release", KEYS[0]), 1)
    assert not ranks.count(("release", KEYS[0]), 1)  # counted afresh after every rank reported
    assert (
        ranks.outcome((Tier.CPU, KEYS[0]), 1, 0) is None and ranks.outcome((Tier.CPU, KEYS[0]), 0, 1) is False
    )
    report = TierReport(
        written={(Tier.S3, KEYS[1]): 2, (Tier.S3, KEYS[2]): 1}, failed={(Tier.DISK, KEYS[1]): 2}
    )
    assert ranks.writes(report) == {Tier.S3: [(KEYS[1], True)], Tier.DISK: [(KEYS[1], False)]}
    assert ranks.writes(TierReport(failed={(Tier.S3, KEYS[2]): 1})) == {Tier.S3: [(KEYS[2], False)]}


def test_cpu_tier_from_config():
    assert CpuTierManager.open(0, 1000) is None
    with pytest.raises(ConfigError, match="cpu_bytes: .* holds no chunk"):
        CpuTierManager.open(999, 1000)
    cpu = CpuTierManager.open(4000, 1000, world_size=2)
    assert cpu.index.capacity == 4 and cpu.slot_bytes == 2000
    with pytest.raises(ValueError, match="must count slots"):
        CpuTierManager(TierIndex("cpu", 1000))
    s = stack(cpu)
    assert s.store(KEYS[0]) == ((Place(Tier.CPU, cpu.index.get(KEYS[0]).slot),), False)
    assert cpu.gauges() == {"tier_used_bytes_cpu": 2000, "tier_capacity_bytes_cpu": 8000}


def test_a_store_pins_the_staging_slot_only_for_farther_writes():
    cpu, s3 = CpuTierManager(TierIndex("cpu", 4, slots=True)), S3TierManager(Manifest())
    s = stack(cpu, s3)
    (slot, remote), pinned = s.store(KEYS[0])
    assert (slot.tier, remote) == (Tier.CPU, Place(Tier.S3)) and cpu.index.get(KEYS[0]).pins == 1
    assert pinned  # the plan says so: every rank reports the slot released
    s3.manifest.add(KEYS[1])
    targets, pinned = s.store(KEYS[1])
    assert [p.tier for p in targets] == [Tier.CPU] and cpu.index.get(KEYS[1]).pins == 0 and not pinned
    s.released(KEYS[0])
    assert cpu.index.get(KEYS[0]).pins == 0


def test_hits_come_from_the_nearest_tier_up_to_the_first_gap():
    cpu = CpuTierManager(TierIndex("cpu", 4, slots=True))
    disk = NvmeTierManager(TierIndex("disk", 10**6))
    s3 = S3TierManager(Manifest())
    s = stack(cpu, disk, s3)
    cpu.index.insert_ready(KEYS[0])
    disk.index.insert_ready(KEYS[0], 10)
    disk.index.insert_ready(KEYS[1], 10)
    s3.manifest.update([KEYS[0], KEYS[1], KEYS[3]])
    assert s.hits("r", KEYS, FPS, 0, 4) == [cpu, disk]  # chunk 2 is nowhere
    assert s.hits("r", KEYS, FPS, 1, 4) == [disk]
    s3.down = True
    assert s.hits("r", KEYS, FPS, 3, 4) == []


def test_sources_and_promotions_follow_the_order_of_the_tiers():
    cpu = CpuTierManager(TierIndex("cpu", 4, slots=True))
    disk = NvmeTierManager(TierIndex("disk", 10 * disk_estimate(0)))
    s3 = S3TierManager(Manifest())
    s = stack(cpu, disk, s3)
    s3.manifest.update(KEYS[:3])
    cpu.index.insert_ready(KEYS[0])
    disk.index.insert_ready(KEYS[0], 10)
    disk.index.insert_ready(KEYS[1], 10)
    # A CPU hit is never lost (its slot is pinned): no fallback, nothing nearer.
    assert s.load(KEYS[0], cpu, cpu.prepare_load(KEYS[0]), True) == ((Place(Tier.CPU, 0),), ())
    sources, up = s.load(KEYS[1], disk, Place(Tier.DISK), True)
    assert sources == (Place(Tier.DISK), Place(Tier.S3)) and [p.tier for p in up] == [Tier.CPU]
    sources, up = s.load(KEYS[2], s3, Place(Tier.S3), True)
    assert sources == (Place(Tier.S3),) and [p.tier for p in up] == [Tier.CPU, Tier.DISK]
    assert s.load(KEYS[2], s3, Place(Tier.S3), False) == ((Place(Tier.S3),), ())
    assert s.load(KEYS[0], disk, Place(Tier.DISK), True)[1] == ()  # in the CPU tier already
    s3.breaker.failure()  # S3 in trouble: no fallback to it, the disk alone serves
    assert s.load(KEYS[0], disk, Place(Tier.DISK), False)[0] == (Place(Tier.DISK),)


def test_s3_store_in_flight_and_bad_key_retry():
    now = [0.0]
    s3 = S3TierManager(Manifest(), store_retry_s=100.0, clock=lambda: now[0])
    stack(s3)
    assert s3.prepare_store(KEYS[0], store_owner(KEYS[0])) == Place(Tier.S3)
    assert s3.prepare_store(KEYS[0], store_owner(KEYS[0])) is None  # in flight
    now[0] = 100.0
    assert s3.prepare_store(KEYS[0], store_owner(KEYS[0])) == Place(Tier.S3)  # never reported: again
    s3.manifest.quarantine(KEYS[0], "p/bad", '"e"')
    s3.complete_store(KEYS[0], False)  # a store that found the bad object in the way
    now[0] += BAD_KEY_RETRY_S - 1
    assert s3.prepare_store(KEYS[0], store_owner(KEYS[0])) is None
    now[0] += 1
    assert s3.prepare_store(KEYS[0], store_owner(KEYS[0])) == Place(Tier.S3)
    s3.complete_store(KEYS[0], True)
    assert KEYS[0] in s3.manifest
    s3.down = True
    assert s3.paused and not s3.allows("r", take=False)
    s3.forget(KEYS[0])
    assert KEYS[0] not in s3.manifest and s3.counters.totals()["manifest_dropped"] == 1


def test_nvme_files_of_failed_or_forgotten_chunks_are_deleted_before_a_rewrite():
    disk = NvmeTierManager(TierIndex("disk", 10 * disk_estimate(100)), shard_bytes=100)
    stack(disk)
    assert disk.prepare_store(KEYS[0], store_owner(KEYS[0])) == Place(Tier.DISK)
    assert disk.prepare_store(KEYS[0], store_owner(KEYS[0])) is None  # being written
    disk.complete_store(KEYS[0], False)
    assert disk.take_evictions() == [KEYS[0]] and disk.take_evictions() == []
    assert disk.prepare_store(KEYS[0], store_owner(KEYS[0])) is None  # its old files are going
    assert disk.prepare_promotion(KEYS[0]) is None
    disk.on_deleted([KEYS[0]])
    assert disk.prepare_promotion(KEYS[0]) == Place(Tier.DISK)
    disk.on_report(
        TierReport(written={(Tier.DISK, KEYS[0]): 1}, sections={Tier.DISK: NvmeReport(sizes={KEYS[0]: 300})}),
        [(KEYS[0], True)],
        [],
    )
    assert disk.index.get(KEYS[0]).size == 300 and KEYS[0] in disk.index
    disk.forget(KEYS[0])
    assert KEYS[0] not in disk.index and disk.take_evictions() == [KEYS[0]]
    disk.end_report(TierReport(sections={Tier.DISK: NvmeReport(full=True)}, tier_failed={Tier.DISK: 1}))
    assert disk.index.capacity == disk.reserve_bytes and not disk.breaker.closed
    assert disk.gauges()["breaker_open_disk"] == 1 and disk.counters.totals()["breaker_trips_disk"] == 1


def test_a_promotion_whose_load_failed_before_it_began_leaves_no_files_to_wait_for():
    """A chunk whose load failed (corrupt, missing) is recomputed and stored
    at once: its NVMe promotion never began on any rank, so nothing is to be
    deleted and the store is not refused while a delete is pending. One rank
    that did begin (or may have) still sends the key's files to be deleted."""
    disk = NvmeTierManager(TierIndex("disk", 10 * disk_estimate(100)), world_size=2, shard_bytes=100)
    stack(disk)
    ranks = RankCount(world_size=2)
    for k, unstarted in ((KEYS[0], 2), (KEYS[1], 1)):
        assert disk.prepare_promotion(k) == Place(Tier.DISK)
        for rank in range(2):
            report = TierReport(
                failed={(Tier.DISK, k): 1}, unstarted={(Tier.DISK, k): 1} if rank < unstarted else {}
            )
            disk.on_report(report, ranks.writes(report).get(Tier.DISK, ()), [])
    assert KEYS[0] not in disk.index and KEYS[1] not in disk.index
    assert disk.take_evictions() == [KEYS[1]]
    assert disk.prepare_store(KEYS[0], store_owner(KEYS[0])) == Place(Tier.DISK)  # the recompute's store
    assert disk.prepare_store(KEYS[1], store_owner(KEYS[1])) is None  # its files are going first
    merged = TierReport(failed={(Tier.DISK, KEYS[2]): 1}, unstarted={(Tier.DISK, KEYS[2]): 1}).aggregate(
        TierReport(failed={(Tier.DISK, KEYS[2]): 1})
    )
    assert merged.unstarted == {(Tier.DISK, KEYS[2]): 1} and merged.failed == {(Tier.DISK, KEYS[2]): 2}


def test_events_of_every_tier_keep_the_order_they_happened_in():
    cpu = CpuTierManager(TierIndex("cpu", 1, slots=True))
    disk = NvmeTierManager(TierIndex("disk", 10**6))
    s = stack(cpu, disk, events=True)
    events = cpu.events
    events.remember(KEYS[1], KEYS[0], (1, 2))
    disk.complete_store(KEYS[1], True)
    cpu.complete_store(KEYS[1], True)
    disk.forget(KEYS[1])
    assert [(e.stored, e.tier, e.parent) for e in events.take()] == [
        (True, Tier.DISK, KEYS[0]),
        (True, Tier.CPU, KEYS[0]),
        (False, Tier.DISK, None),
    ]
    assert s.gauges().keys() == {
        "tier_used_bytes_cpu",
        "tier_capacity_bytes_cpu",
        "breaker_open_disk",
        "tier_used_bytes_disk",
        "tier_capacity_bytes_disk",
    }


def test_the_s3_manager_tells_the_fleet_of_bad_objects_its_ranks_reported():
    """Corrupt objects a rank could not delete arrive in the S3 wing's own
    section of the report: the manager quarantines them in the manifest,
    under the object's name in the namespace it was activated for, before
    it decides the stores of the same report (a 412 on a bad object is not
    published)."""
    told = []

    class Sync:  # what the manifest tells the fleet (the Sync protocol)
        def stored(self, fp):
            told.append(("stored", fp))

        def used(self, fps):
            pass

        def bad(self, fp, name, etag):
            told.append(("bad", fp, name, etag))

    manifest = Manifest()
    manifest.sync = Sync()
    s3 = S3TierManager(manifest, prefix="p/")
    stack(s3)
    assert s3.activate("ns0")
    assert s3.prepare_store(KEYS[0], store_owner(KEYS[0])) == Place(Tier.S3)
    report = TierReport(
        written={(Tier.S3, KEYS[0]): 1},
        sections={Tier.S3: S3Report(bad={(KEYS[0], 1): '"e"'}, existing={KEYS[0]})},
    )
    s3.on_report(report, [(KEYS[0], True)], [])
    assert manifest.is_bad(KEYS[0]) and KEYS[0] not in manifest  # the 412 found the bad object: not published
    assert told == [("bad", fingerprint(KEYS[0]), object_key("p/", "ns0", KEYS[0], 1), '"e"')]
