"""Worker reports summed over TP ranks: a chunk counts as stored in a tier
only when every rank reports its shard there."""

import pytest

from s3kv.keys import Namespace
from s3kv.manifest import Manifest
from s3kv.tiering.placement import Tier, TierIndex
from s3kv.tiering.plan import TierReport
from s3kv.tiering.scheduler.planner import Planner
from s3kv.tiering.tiers.nvme.manager import NvmeTierManager
from s3kv.tiering.tiers.nvme.report import NvmeReport
from s3kv.tiering.tiers.s3.manager import S3TierManager
from s3kv.tiering.tiers.s3.report import S3Report

K1, K2 = b"1" * 16, b"2" * 16


def test_aggregate_over_ranks_then_index():
    rank0 = TierReport(
        written={(Tier.S3, K1): 1, (Tier.S3, K2): 1, (Tier.DISK, K1): 1},
        load_failed={"r"},
        tier_ok={Tier.S3: 2},
        released={K1: 1},
        sync_loaded={"s": 1},
        sections={Tier.DISK: NvmeReport(sizes={K1: 100}), Tier.S3: S3Report(bad={(K2, 0): '"etag0"'})},
    )
    rank1 = TierReport(
        written={(Tier.S3, K1): 1, (Tier.DISK, K1): 1},
        missing={(Tier.S3, K2)},
        failed={(Tier.CPU, K2): 1},
        sync_loaded={"s": 1},
        tier_ok={Tier.CPU: 1},
        tier_failed={Tier.S3: 1},
        sections={
            Tier.DISK: NvmeReport(sizes={K1: 120}, full=True),
            Tier.S3: S3Report(bad={(K2, 1): None}, existing={K1}),
        },
    )
    total = rank0.aggregate(rank1)
    assert total.written == {(Tier.S3, K1): 2, (Tier.S3, K2): 1, (Tier.DISK, K1): 2}
    disk_total, s3_total = total.section(Tier.DISK, NvmeReport), total.section(Tier.S3, S3Report)
    assert disk_total.sizes == {K1: 220} and total.released == {K1: 1}
    assert total.missing == {(Tier.S3, K2)} and total.failed == {(Tier.CPU, K2): 1}
    assert total.sync_loaded == {"s": 2}
    assert total.load_failed == {"r"} and disk_total.full
    assert total.tier_ok == {Tier.S3: 2, Tier.CPU: 1} and total.tier_failed == {Tier.S3: 1}
    assert s3_total.bad == {(K2, 0): '"etag0"', (K2, 1): None} and s3_total.existing == {K1}
    index = Manifest()
    disk = TierIndex("disk", 10_000)
    disk.reserve(K1, 5000)
    planner = Planner(
        namespace=Namespace.from_fields({}),
        chunk_tokens=64,
        block_size=32,
        tiers=[NvmeTierManager(disk, shards=2), S3TierManager(index)],
        world_size=2,
    )
    planner.on_report(total)  # the planner takes the whole report, summed over ranks
    assert K1 in index and K2 not in index
    assert K1 in disk and disk.get(K1).size == 220
    assert TierReport().is_empty() and not total.is_empty()


def test_vllm_metadata_wraps_the_report():
    pytest.importorskip("vllm")
    from s3kv.connector.metadata import S3KVWorkerMetadata

    a = S3KVWorkerMetadata(TierReport(written={(Tier.S3, K1): 1}))
    b = S3KVWorkerMetadata(
        TierReport(written={(Tier.S3, K1): 1}, sections={Tier.DISK: NvmeReport(full=True)})
    )
    total = a.aggregate(b)
    assert isinstance(total, S3KVWorkerMetadata)
    assert total.report.written == {(Tier.S3, K1): 2} and total.report.section(Tier.DISK, NvmeReport).full
    assert S3KVWorkerMetadata().is_empty() and not total.is_empty()


def test_every_field_and_section_is_summed_and_counts_for_emptiness():
    """No list of fields to keep in step: a report with any field or any
    non-empty section set is not empty, and each sums by its kind."""
    assert not TierReport(unstarted={(Tier.DISK, K1): 1}).is_empty()
    assert not TierReport(sections={Tier.DISK: NvmeReport(full=True)}).is_empty()
    assert TierReport(sections={Tier.S3: S3Report()}).is_empty()  # said nothing
    merged = TierReport(
        unstarted={(Tier.DISK, K1): 1}, sections={Tier.S3: S3Report(existing={K1})}
    ).aggregate(TierReport(unstarted={(Tier.DISK, K1): 1}, sections={Tier.DISK: NvmeReport(sizes={K2: 5})}))
    assert merged.unstarted == {(Tier.DISK, K1): 2}
    assert merged.section(Tier.S3, S3Report).existing == {K1} and merged.section(
        Tier.DISK, NvmeReport
    ).sizes == {K2: 5}
    assert merged.section(Tier.CPU, NvmeReport) is None
