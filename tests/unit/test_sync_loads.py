"""A step's synchronous loads (:mod:`s3kv.tiering.worker.sync_loads`): what
the worker reports once the connector's copies out of CPU slots are over.
Through the worker side, with vLLM's CPU build and a real engine: the
end-to-end tests of the CPU tier."""

import logging

import pytest

from s3kv.stats import Counters
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import LoadChunk, LoadTiming, Place, TierReport
from s3kv.tiering.worker.sync_loads import SyncLoads

K = [bytes([i]) * 16 for i in range(3)]


class Copied:
    """The connector's copies, as a test tells them."""

    def __init__(self, nbytes=0, elapsed=None, error=None):
        self.nbytes, self._elapsed, self.error = nbytes, elapsed, error

    def elapsed_s(self):
        return self._elapsed


def chunk(key, blocks, first=0):
    return LoadChunk(key, blocks, first, len(blocks), (Place(Tier.CPU, 0),))


def started(rank, counters):
    loads = SyncLoads(rank, counters)
    loads.start()
    loads.reqs += ["a", "b"]
    loads.chunks += [chunk(K[0], (0, 1)), chunk(K[1], (2, 3), first=1)]
    return loads


@pytest.mark.parametrize("rank", [0, 1])
def test_copies_that_succeed_are_counted_and_rank_0_times_them(rank):
    counters, report, errors = Counters(), TierReport(), set()
    loads = started(rank, counters)
    loads.over(report, errors, Copied(nbytes=4096, elapsed=0.5))
    totals = counters.totals()
    assert report.sync_loaded == {"a": 1, "b": 1} and errors == set()
    assert totals["load_chunks_cpu"] == 2 and totals["load_bytes_cpu"] == 4096
    assert totals["load_seconds_cpu_count"] == 2 and report.tier_ok == {Tier.CPU: 2}
    if rank == 0:  # one observation per request; the chunks as if copied one after another
        assert totals["request_load_seconds_count"] == 2
        assert report.load_timings == [LoadTiming("", Tier.CPU, 2, 0.25, 0.5)]
    else:
        assert "request_load_seconds_count" not in totals and report.load_timings == []
    loads.over(report, errors, None)  # the next step: nothing started
    assert report.sync_loaded == {"a": 1, "b": 1} and counters.totals()["load_chunks_cpu"] == 2


def test_a_failed_copy_fails_every_chunks_blocks_and_counts_none(caplog):
    caplog.set_level(logging.ERROR, logger="s3kv")
    counters, report, errors = Counters(), TierReport(), set()
    loads = started(0, counters)
    loads.over(report, errors, Copied(nbytes=4096, elapsed=0.5, error=RuntimeError("copy failed")))
    assert errors == {0, 1, 3}  # the blocks each chunk writes
    assert report.sync_loaded == {"a": 1, "b": 1}  # the requests' loads are over, failed
    assert "load_chunks_cpu" not in counters.totals() and report.tier_ok == {} and not report.load_timings
    assert "copying from the CPU tier failed: copy failed" in caplog.text


def test_requests_whose_loads_were_decided_before_count_without_copies():
    counters, report = Counters(), TierReport()
    loads = SyncLoads(0, counters)
    loads.start(["refused"])  # a refusing rank: no copy started
    loads.over(report, set(), None)
    assert report.sync_loaded == {"refused": 1} and counters.totals() == {}
