"""The transfer engine's stores (:mod:`s3kv.tiering.worker.stores`): the byte
budget of the write-throughs under way, and a store job that ends early
giving back what it held. The stores' writes into each tier are tested
through the engine in test_transfer.py."""

import numpy as np
import pytest

from s3kv.chunk_reader import PageFormat
from s3kv.tiering.loop import JobLoop
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import Place
from s3kv.tiering.worker.stores import StoreJob, Stores
from s3kv.tiering.worker.transfer import EngineSettings, TransferEngine

LAYERS = 2
PAGE = 64
FMT = PageFormat(dtype="uint8", itemsize=1, page_shape=(PAGE,), tokens=16, layer_bytes=PAGE)


def engine(budget):
    """An engine without tiers (no store, no pool), ``budget`` bytes of write-through."""
    settings = EngineSettings(
        namespace="n" * 32, prefix="p", rank=0, num_layers=LAYERS, max_inflight_bytes=budget
    )
    e = TransferEngine(None, settings)
    e.configure(FMT)
    return e


@pytest.fixture
def loop():
    loop = JobLoop("test-stores", 1)
    yield loop
    loop.close(5.0)


def test_write_throughs_hold_the_budget_and_those_past_it_are_dropped_and_counted(loop):
    e = engine(100)
    stores = Stores(e, loop)
    assert stores.reserve(60)
    assert e.counters.totals()["inflight_bytes"] == 60
    assert stores.accepts(40) and not stores.accepts(41)
    assert not stores.reserve(41)  # past the budget: nothing held
    assert stores.reserve(40)
    totals = e.counters.totals()
    assert totals["inflight_bytes"] == 100 and totals["store_dropped_backpressure"] == 1
    e.close()


def test_a_store_whose_copy_out_of_the_kv_cache_fails_reports_it_and_gives_everything_back(loop):
    e = engine(200)
    stores = Stores(e, loop)
    key = b"k" * 16

    def copy_failed():
        raise RuntimeError("device copy failed")

    job = StoreJob(
        key, [np.zeros(PAGE, np.uint8)] * LAYERS, (Place(Tier.CPU, 0), Place(Tier.S3)), copy_failed, True
    )
    assert stores.reserve(job.nbytes)
    loop.run(stores.job(job, [Place(Tier.CPU, 0)], [Place(Tier.S3)], True, job.nbytes), timeout=60)
    report, _ = e.report.take()
    assert report.failed == {(Tier.CPU, key): 1, (Tier.S3, key): 1}
    assert report.released == {key: 1}  # the pinned slot is the scheduler's again
    assert e.counters.totals()["inflight_bytes"] == 0 and stores.accepts(200)  # its bytes are back
    e.close()


def test_closed_stores_take_no_write_through(loop):
    e = engine(100)
    stores = Stores(e, loop)
    assert not stores.closed
    assert stores.close() and stores.closed
    assert not stores.close()  # closed once only
    assert not stores.accepts(1) and not stores.reserve(1)
    assert e.counters.totals()["store_dropped_backpressure"] == 1
    e.close()
