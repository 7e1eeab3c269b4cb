"""The scheduler side's runtime (tiering/scheduler/runtime.py), without vLLM:
what start-up builds for the model's namespace (the tiers' managers, the
planner), what a config fails start-up with, a model whose identity cannot
be known, and shutdown letting go of the loop and the tiers."""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest

from s3kv.config import parse_config
from s3kv.connector.layout import EngineLayout
from s3kv.errors import ConfigError
from s3kv.identity import DigestCache, ModelSource, resolve_identity
from s3kv.shards import HEADS, Slicing
from s3kv.stats import Counters
from s3kv.tiering.placement import Tier
from s3kv.tiering.scheduler import runtime
from s3kv.tiering.scheduler.runtime import SchedulerRuntime

STARTUP_BOUND_S = 120
"""How long a test lets start-up take: a bound for a busy machine."""

LAYOUT = EngineLayout(
    {"model": "unit"},
    ModelSource("unit", digest="unit-test-weights"),
    block_size=32,
    layer_names=("l0",),
    tp_size=1,
    world_size=1,
    page_size_bytes=16 << 10,
)


def parts():
    """The runtime's parts besides the config and the model, fresh for each."""
    return {"model_name": "unit", "counters": Counters("scheduler"), "digests": DigestCache()}


def start(**cfg) -> SchedulerRuntime:
    config = parse_config({"region": "us-east-1", "s3_connect_timeout_s": 1, "s3_max_attempts": 1, **cfg})
    return SchedulerRuntime(config, LAYOUT, **parts())


@pytest.fixture
def patient_startup(monkeypatch):
    """The constructor waits for start-up (the identity, the tiers, the
    manifest) until it is done, not STARTUP_WAIT_S (5 s): a test that reads
    what start-up made needs it done, however busy the machine."""
    monkeypatch.setattr(runtime, "STARTUP_WAIT_S", STARTUP_BOUND_S)


def scheduler_loops() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "s3kv-scheduler"}


def test_local_only_needs_no_bucket_and_rebuilds_its_disk_index(tmp_path, patient_startup):
    from s3kv.tiering.tiers.nvme.files import shard_path

    key = b"\x07" * 16
    namespace = LAYOUT.namespace(resolve_identity(LAYOUT.model))
    path = shard_path(tmp_path, namespace.id, key, 0)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"x" * 1000)  # what an earlier run left
    s = start(write_policy="local_only", disk_path=str(tmp_path), disk_bytes="1MiB", cpu_bytes="1MiB")
    try:
        assert s.namespace == namespace
        assert s.index is None and s.store is None  # S3 untouched
        disk = s.planner.tier(Tier.DISK).index
        assert key in disk and disk.used == 1000
        assert s.planner.tier(Tier.CPU).index.capacity == (1 << 20) // (
            256 // 32 * (16 << 10)
        )  # 8 blocks a chunk
    finally:
        s.shutdown()


def test_the_disk_tier_counts_a_chunk_by_the_namespaces_shards(tmp_path, patient_startup):
    """Parts cut into 4 shards by KV head at TP 2 (each rank holds two): the
    NVMe tier finds a chunk whole with its 4 files, whichever rank wrote
    them, and reserves one estimate of a shard's object for each."""
    from s3kv.tiering.tiers.nvme.files import shard_path
    from s3kv.tiering.tiers.nvme.manager import disk_estimate

    layout = dataclasses.replace(LAYOUT, tp_size=2, world_size=2, cut=Slicing(HEADS, 4, 1), total_kv_heads=4)
    key = b"\x07" * 16
    namespace = layout.namespace(resolve_identity(layout.model))
    for shard in range(4):
        path = shard_path(tmp_path, namespace.id, key, shard)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 1000)
    config = parse_config({"write_policy": "local_only", "disk_path": str(tmp_path), "disk_bytes": "1MiB"})
    s = SchedulerRuntime(config, layout, **parts())
    try:
        disk = s.planner.tier(Tier.DISK)
        assert key in disk.index and disk.index.get(key).size == 4000
        assert layout.object_bytes(256) == layout.shard_bytes(256) // 2
        assert disk.reserve_bytes == 4 * disk_estimate(layout.object_bytes(256))
    finally:
        s.shutdown()


def test_unwritable_disk_path_turns_the_tier_off_with_a_warning(tmp_path, caplog, patient_startup):
    caplog.set_level(logging.WARNING, logger="s3kv")
    (tmp_path / "a-file").write_text("")
    s = start(write_policy="local_only", disk_path=str(tmp_path / "a-file" / "kv"), cpu_bytes="1MiB")
    try:
        assert s.planner.tier(Tier.DISK) is None
        assert "is not writable" in caplog.text
    finally:
        s.shutdown()


def test_cpu_bytes_smaller_than_a_chunk_fails_startup_leaving_no_loop_running():
    before = scheduler_loops()
    with pytest.raises(ConfigError, match="cpu_bytes: .* holds no chunk"):
        start(write_policy="local_only", cpu_bytes="10KiB")
    assert scheduler_loops() == before


def test_a_prefetch_budget_smaller_than_a_chunk_fails_startup_naming_the_smallest():
    """One chunk shard here is 8 blocks of 16 KiB: a 100 KiB budget never
    lets a prefetch start (it was accepted, and prefetching was off)."""
    shard = LAYOUT.shard_bytes(256)
    with pytest.raises(
        ConfigError, match=rf"prefetch_bytes: 100.0 KiB holds no chunk .* use at least {shard} "
    ):
        start(write_policy="local_only", cpu_bytes="1MiB", prefetch_bytes="100KiB")
    s = start(write_policy="local_only", cpu_bytes="1MiB", prefetch_bytes=shard)  # one chunk: enough
    s.shutdown()
    assert s.config.prefetch_bytes == shard


def test_a_default_prefetch_budget_smaller_than_a_chunk_becomes_one_chunk(tmp_path, caplog, patient_startup):
    caplog.set_level(logging.WARNING, logger="s3kv")
    big = dataclasses.replace(LAYOUT, page_size_bytes=512 << 20)  # 4 GiB chunks: more than the 1 GiB default
    config = parse_config({"write_policy": "local_only", "disk_path": str(tmp_path)})
    s = SchedulerRuntime(config, big, **parts())
    try:
        assert s.planner.prefetcher.budget_bytes == big.shard_bytes(256) == 4 << 30
        assert "prefetch_bytes' default (1.0 GiB) holds no chunk" in caplog.text
    finally:
        s.shutdown()


def test_an_unknowable_identity_leaves_no_planner(caplog):
    caplog.set_level(logging.ERROR, logger="s3kv")
    layout = EngineLayout({"m": 2}, ModelSource("s3://models/x"), 32, ("l0",), 1, 1, 16 << 10)
    config = parse_config({"write_policy": "local_only", "cpu_bytes": "4MiB", "chunk_tokens": 64})
    r = SchedulerRuntime(config, layout, **parts())
    try:
        r.start_task.result(STARTUP_BOUND_S)
        assert r.ready.is_set() and r.planner is None and r.namespace is None
        assert "set model_digest" in caplog.text
    finally:
        r.shutdown()


def test_shutdown_stops_start_up_the_loop_and_the_tiers(tmp_path, patient_startup):
    cfg = {
        "write_policy": "local_only",
        "disk_path": str(tmp_path),
        "disk_bytes": "1MiB",
        "cpu_bytes": "1MiB",
    }
    before = scheduler_loops()
    r = start(**cfg)
    assert r.planner is not None and r.planner.tier(Tier.DISK) is not None and scheduler_loops() - before
    r.shutdown(budget_s=STARTUP_BOUND_S)
    assert r.start_task.done() and scheduler_loops() == before
    again = start(**cfg)  # the NVMe tier let its directory go: another runtime opens it
    try:
        assert again.planner.tier(Tier.DISK) is not None
    finally:
        again.shutdown()


def test_gauges_are_the_tiers_and_the_manifests(tmp_path, patient_startup):
    r = start(write_policy="local_only", cpu_bytes="1MiB")
    try:
        r.gauges()
        taken = r.counters.take()["gauges"]["scheduler"]
        assert all(v == 0 for k, v in taken.items() if k.startswith("breaker_open_"))
        assert any(k.startswith("breaker_open_") for k in taken)
        assert "manifest_keys" not in taken  # no S3: no manifest
    finally:
        r.shutdown()
