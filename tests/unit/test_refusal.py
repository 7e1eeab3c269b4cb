"""A worker rank whose fleet key is not the scheduler side's
(:mod:`s3kv.tiering.worker.refusal`), on its own: what it answers to the
plans. Through the worker side, with vLLM's CPU build: test_connector_worker_keys.py."""

import logging

from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import LoadChunk, LoadPlan, Place, StoreChunk, TierReport
from s3kv.tiering.worker.refusal import Refusal

K = [bytes([i]) * 16 for i in range(4)]


def test_a_rank_with_the_scheduler_sides_key_id_refuses_nothing(caplog):
    assert Refusal.check(b"k" * 8, b"k" * 8, 0) is None and Refusal.check(None, None, 0) is None
    assert not caplog.records


def test_a_rank_with_another_key_id_says_so_once_and_fails_every_transfer(caplog):
    caplog.set_level(logging.ERROR, logger="s3kv")
    refusal = Refusal.check(None, b"\x01" * 8, 3)
    assert (
        refusal is not None
        and refusal.reason == "fleet key id none here, 0101010101010101 on the scheduler side"
    )
    (record,) = caplog.records
    assert "rank 3" in record.getMessage() and "S3KV_AUTH_KEY" in record.getMessage()
    report = TierReport()
    loads = [
        LoadPlan("async", (LoadChunk(K[0], (0, 1), 0, 2, (Place(Tier.S3),), (Place(Tier.CPU, 0),)),), False),
        LoadPlan("sync", (LoadChunk(K[1], (2, 3), 1, 2, (Place(Tier.CPU, 1),), ()),), True),
    ]
    prefetch = [LoadPlan("p", (LoadChunk(K[2], (), 0, 0, (Place(Tier.S3),), (Place(Tier.DISK),)),), False)]
    errors, sync = refusal.loads(loads, prefetch, report)
    assert errors == {0, 1, 3} and sync == ["sync"]
    assert report.load_failed == {"async", "sync"}
    assert refusal.take_finished() == {"async"} and refusal.take_finished() == set()
    refusal.stores([StoreChunk(K[3], (4, 5), (Place(Tier.CPU, 2), Place(Tier.S3)), True)], report)
    assert report.failed == {
        (Tier.CPU, K[0]): 1,
        (Tier.DISK, K[2]): 1,
        (Tier.CPU, K[3]): 1,
        (Tier.S3, K[3]): 1,
    }
    assert report.released == {K[3]: 1} and not report.written
