"""The NVMe wing's scheduler-side manager
(:mod:`s3kv.tiering.tiers.nvme.manager`): the files of failed, forgotten or
unstarted chunks, deleted before a rewrite. Its files on disk: test_nvme_files.py."""

from s3kv.keys import Namespace, chain_keys
from s3kv.stats import Counters
from s3kv.tiering.placement import Tier, TierIndex
from s3kv.tiering.plan import Place, TierReport
from s3kv.tiering.scheduler.ranks import RankCount
from s3kv.tiering.scheduler.stack import TierStack
from s3kv.tiering.tiers.manager import TierEvents, store_owner
from s3kv.tiering.tiers.nvme.manager import NvmeTierManager, disk_estimate
from s3kv.tiering.tiers.nvme.report import NvmeReport

KEYS = chain_keys(Namespace.from_fields({"m": "tiers"}), list(range(256)), 64)


def stack(*tiers, events=False):
    return TierStack(tiers, Counters(), TierEvents(events))


def test_nvme_files_of_failed_or_forgotten_chunks_are_deleted_before_a_rewrite():
    disk = NvmeTierManager(TierIndex("disk", 10 * disk_estimate(100)), object_bytes=100)
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
    disk = NvmeTierManager(TierIndex("disk", 10 * disk_estimate(100)), shards=2, object_bytes=100)
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
