"""The stack of tiers the planner composes (:mod:`s3kv.tiering.scheduler.stack`)
and the rank count (:mod:`s3kv.tiering.scheduler.ranks`), on their own: hits,
sources, promotions and events across the tiers, what the planner tests cover
only through the planner. Each wing's manager on its own: test_cpu_manager.py,
test_nvme_manager.py, test_s3_manager.py."""

from s3kv.keys import Namespace, chain_keys
from s3kv.manifest import Manifest
from s3kv.manifest.keyset import fingerprints
from s3kv.stats import Counters
from s3kv.tiering.placement import Tier, TierIndex
from s3kv.tiering.plan import Place, TierReport
from s3kv.tiering.scheduler.ranks import RankCount
from s3kv.tiering.scheduler.stack import TierStack
from s3kv.tiering.tiers.cpu.manager import CpuTierManager
from s3kv.tiering.tiers.manager import TierEvents
from s3kv.tiering.tiers.nvme.manager import NvmeTierManager, disk_estimate
from s3kv.tiering.tiers.s3.manager import S3TierManager

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


def test_hits_of_a_prefix_only_farther_tiers_hold():
    """The nearer tiers holding none of a prefix (another replica stored it)
    answer no chunk; the others still split it nearest first."""
    cpu = CpuTierManager(TierIndex("cpu", 4, slots=True))
    disk = NvmeTierManager(TierIndex("disk", 10**6))
    s3 = S3TierManager(Manifest())
    s = stack(cpu, disk, s3)
    assert s.hits("r", KEYS, FPS, 0, 4) == []
    s3.manifest.update(KEYS[:3])
    assert s.hits("r", KEYS, FPS, 0, 4) == [s3, s3, s3]  # chunk 3 is nowhere
    disk.index.insert_ready(KEYS[1], 10)
    assert s.hits("r", KEYS, FPS, 0, 4) == [s3, disk, s3]
    disk.index.insert_ready(KEYS[3], 10)
    assert s.hits("r", KEYS, FPS, 0, 4) == [s3, disk, s3, disk]
    assert s.hits("r", KEYS, FPS, 2, 4) == [s3, disk]


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
