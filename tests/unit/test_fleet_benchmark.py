"""benchmarks/fleet.py at a tiny N: the real loops of a few replicas on a
virtual-time loop publish, read and count what S3 would be sent, and what
one replica published every other one sees."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks import fleet
from s3kv.manifest import SyncSettings


def _model(**kw):
    base = dict(warmup_s=12.0, measure_s=12.0, skew_fraction=0.9, slow_put_fraction=0.1)
    base.update(kw)
    return fleet.Model(**base)


def test_a_small_fleet_sees_every_store_and_counts_requests():
    sim = fleet.run_model(_model(n=4, tp=2), fleet.ListBytes())
    rates = fleet.rates_of(sim)
    s = SyncSettings()
    # Every rank of every replica writes a segment per publish interval (it
    # always has stores), and the scheduler side an access record.
    assert rates.by_dir["put:seg"] == pytest.approx(2 / s.publish_s, rel=0.35)
    assert rates.get > 0 and rates.list > 0
    assert sim["keys"] > 100
    assert sim["lost"] == 0
    assert sim["stores_unseen"] == 0
    assert len(sim["stale_all"]) == sim["stores_checked"] > 0
    # Staleness is at least a publish interval's wait away from zero, and the
    # busiest second on seg/ saw requests.
    assert float(sim["stale_fast"].min()) > 0 and float(sim["stale_all"].max()) < 60
    assert sim["traffic"].peak("get", 0, 1e9)[1] > 0
    assert sim["boot"]["keys"] >= sim["keys"] * 0.9 and sim["boot"]["s"] > 0
    assert fleet.row(sim)[0] == "segments"


def test_sampled_readers_stand_for_the_fleet():
    full = fleet.rates_of(fleet.run_model(_model(n=6, slow_put_fraction=0.0), fleet.ListBytes()))
    sampled_sim = fleet.run_model(_model(n=6, readers=3, slow_put_fraction=0.0), fleet.ListBytes())
    sampled = fleet.rates_of(sampled_sim)
    assert sampled_sim["n_read"] == 3
    assert sampled.get == pytest.approx(full.get, rel=0.25)
    assert sampled.by_dir["put:seg"] == pytest.approx(full.by_dir["put:seg"], rel=0.25)
    assert sampled_sim["lost"] == 0


def test_latency_delays_the_requests_in_virtual_time():
    import asyncio

    from s3kv.stats import Counters
    from s3kv.testing import virtual_loop

    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        store = fleet.ModelStore(fleet.Bucket(), Counters(), fleet.ListBytes(), latency=fleet.LATENCY)
        t = loop.time()
        await store.put(fleet.BASE + "seg/x", b"1")
        put = loop.time() - t
        t = loop.time()
        await store.get(fleet.BASE + "seg/x")
        return put, loop.time() - t

    put, get = virtual_loop.run(main())
    assert put == pytest.approx(fleet.LATENCY["put"])
    assert get == pytest.approx(fleet.LATENCY["get"])


def test_an_unknown_protocol_is_refused():
    with pytest.raises(SystemExit, match="protocol"):
        fleet.settings_for("gossip")


def test_quick_run_reports_both_protocols_side_by_side(tmp_path):
    result = fleet.run(tmp_path, True, fleet.Options(crosscheck=False))
    protocols = [p for p in fleet.PROTOCOLS if fleet.has_protocol(p)]
    assert [row[0] for row in result.rows] == [p for p in protocols for _ in fleet.QUICK]
    assert all(len(row) == len(result.columns) for row in result.rows)
    assert all(" of " in row[7] for row in result.rows)  # keys lost, of those stored


def test_epochs_lose_no_key_with_skewed_clocks_and_slow_puts():
    sim = fleet.run_model(
        _model(n=8, tp=2, protocol="epochs", warmup_s=15.0, measure_s=20.0), fleet.ListBytes()
    )
    assert sim["lost"] == 0


def test_epochs_publish_one_segment_per_replica_not_per_rank():
    # Under "epochs" the scheduler side publishes every chunk stored on all
    # ranks and acknowledges it to its ranks with each step, so the ranks
    # (holding for 3 intervals) write no segment of their own.
    sim = fleet.run_model(
        _model(n=4, tp=2, protocol="epochs", skew_fraction=0.0, slow_put_fraction=0.0), fleet.ListBytes()
    )
    rates = fleet.rates_of(sim)
    s = SyncSettings()
    assert rates.by_dir["put:seg"] == pytest.approx(1 / s.publish_s, rel=0.2)
    assert sim["lost"] == 0


def test_the_verdict_judges_the_goals_on_epochs_at_1000_replicas_tp8():
    small = fleet.run_model(_model(n=4, tp=1, protocol="epochs"), fleet.ListBytes())
    big = fleet.run_model(_model(n=4, tp=2, protocol="epochs"), fleet.ListBytes())
    assert fleet.verdict([small, big]) == "no goal"  # no N=1,000 TP 8 (a quick run)
    small["model"] = dataclasses.replace(small["model"], n=10)
    big["model"] = dataclasses.replace(big["model"], n=1000, tp=8)
    said = fleet.verdict([small, big])
    assert said.startswith(("met at N=1,000 TP 8: ", "missed (")) and "busiest prefix" in said
    big["lost"] = 3
    assert fleet.verdict([small, big]).startswith("missed (3 keys lost")
