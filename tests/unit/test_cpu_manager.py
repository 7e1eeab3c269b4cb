"""The CPU wing's scheduler-side manager
(:mod:`s3kv.tiering.tiers.cpu.manager`): its pool from the config, and the
staging slot a store pins. The stack of tiers it sits in: test_tier_stack.py."""

import pytest

from s3kv.errors import ConfigError
from s3kv.keys import Namespace, chain_keys
from s3kv.manifest import Manifest
from s3kv.stats import Counters
from s3kv.tiering.placement import Tier, TierIndex
from s3kv.tiering.plan import Place
from s3kv.tiering.scheduler.stack import TierStack
from s3kv.tiering.tiers.cpu.manager import CpuTierManager
from s3kv.tiering.tiers.manager import TierEvents
from s3kv.tiering.tiers.s3.manager import S3TierManager

KEYS = chain_keys(Namespace.from_fields({"m": "tiers"}), list(range(256)), 64)


def stack(*tiers, events=False):
    return TierStack(tiers, Counters(), TierEvents(events))


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


def test_lookup_answers_per_key_whether_the_tier_holds_none_some_or_pending_ones():
    # A local tier's lookup: only ready, undoomed entries count; a range it holds none of is
    # answered in one pass (a fleet hit's new prefix), and must answer the same.
    cpu = CpuTierManager(TierIndex("cpu", 8, slots=True))
    idx = cpu.index
    assert cpu.lookup(KEYS, None, 0, 4) == [False] * 4
    idx.insert_ready(KEYS[1])
    idx.reserve(KEYS[2])  # being written: not loadable yet
    idx.insert_ready(KEYS[3])
    idx.pin(KEYS[3])
    idx.remove(KEYS[3])  # doomed while pinned
    assert cpu.lookup(KEYS, None, 0, 4) == [False, True, False, False]
    assert cpu.lookup(KEYS, None, 2, 4) == [False, False]
    assert cpu.lookup(KEYS, None, 0, 1) == [False]
    idx.commit(KEYS[2])
    assert cpu.lookup(KEYS, None, 1, 3) == [True, True]
