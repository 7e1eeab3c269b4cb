"""A rank's shard engines' reports combined into the rank's one report, and
its publisher told of a chunk once every shard's object was answered."""

from __future__ import annotations

import pytest

from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import LoadChunk, LoadTiming, Place, TierReport
from s3kv.tiering.worker.shard_reports import PublishedShards, ShardReports
from s3kv.tiering.worker.transfer import Polled

K1, K2 = b"\x01" * 16, b"\x02" * 16


def polled(**fields) -> Polled:
    finished = fields.pop("finished", {})
    return Polled(TierReport(**fields), finished)


def test_a_write_is_the_ranks_once_every_shard_said_so_in_any_poll():
    c = ShardReports(2)
    first = c.combine([polled(written={(Tier.S3, K1): 1}), polled()])
    assert first.report.written == {} and first.report.failed == {}
    second = c.combine([polled(), polled(written={(Tier.S3, K1): 1})])
    assert second.report.written == {(Tier.S3, K1): 1}


def test_a_write_fails_if_any_shard_failed():
    c = ShardReports(2)
    got = c.combine([polled(written={(Tier.DISK, K1): 1}), polled(failed={(Tier.DISK, K1): 1})])
    assert got.report.written == {} and got.report.failed == {(Tier.DISK, K1): 1}
    assert got.report.unstarted == {}  # one shard wrote: something to delete


def test_unstarted_only_when_no_shard_began():
    c = ShardReports(2)
    both = {(Tier.DISK, K2): 1}
    got = c.combine([polled(failed=both, unstarted=both), polled(failed=both, unstarted=both)])
    assert got.report.failed == both and got.report.unstarted == both


def test_releases_and_loads_wait_for_every_shard():
    c = ShardReports(3)
    chunk = LoadChunk(K1, (1,), 0, 1, (Place(Tier.S3),))
    got = c.combine(
        [
            polled(released={K1: 1}, finished={"r": []}),
            polled(released={K1: 1}, finished={"r": [chunk]}),
            polled(),
        ]
    )
    assert got.report.released == {} and got.finished_loads == {}
    got = c.combine([polled(), polled(), polled(released={K1: 1}, finished={"r": [chunk]})])
    assert got.report.released == {K1: 1}
    assert list(got.finished_loads) == ["r"] and got.finished_loads["r"] == [chunk]  # once, not twice


def test_sets_and_timings_pass_through_and_breaker_counts_are_not_multiplied():
    c = ShardReports(2)
    t = LoadTiming("r", Tier.S3, 1, 0.1, 0.2)
    got = c.combine(
        [
            polled(missing={(Tier.S3, K1)}, tier_ok={Tier.S3: 1}, load_timings=[t]),
            polled(missing={(Tier.S3, K2)}, tier_ok={Tier.S3: 1}, tier_failed={Tier.DISK: 1}),
        ]
    )
    assert got.report.missing == {(Tier.S3, K1), (Tier.S3, K2)}
    assert got.report.tier_ok == {Tier.S3: 1} and got.report.tier_failed == {Tier.DISK: 1}
    assert got.report.load_timings == [t]


def test_one_shard_is_passed_through_and_wrong_poll_counts_refused():
    c = ShardReports(1)
    p = polled(written={(Tier.S3, K1): 1})
    assert c.combine([p]) is p
    with pytest.raises(ValueError, match="1 polls of 2 shards"):
        ShardReports(2).combine([p])


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def putting(self, key: bytes) -> None:
        self.calls.append(("putting", key))

    def answered(self, key: bytes, *, created: bool) -> None:
        self.calls.append(("answered", key, created))


def test_publisher_hears_of_a_chunk_once_every_shard_was_answered():
    r = Recorder()
    p = PublishedShards(r, 2)
    p.putting(K1)
    p.putting(K1)
    p.answered(K1, created=True)
    assert r.calls == [("putting", K1)]  # journaled at the first PUT; not published with a shard missing
    p.answered(K1, created=True)
    assert r.calls[-1] == ("answered", K1, True)
    p.putting(K2)
    p.putting(K2)
    p.answered(K2, created=True)
    p.answered(K2, created=False)  # a 412 on one shard: the scheduler side decides
    assert r.calls[-1] == ("answered", K2, False)
