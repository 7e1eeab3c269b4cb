"""The wings' specs and the registry: what each tier builds from the config,
the life of its scheduler-side manager (opened for the namespace, closed),
and what the abstract halves make a new tier provide."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Hashable, Sequence

import numpy as np
import pytest

from s3kv.config import parse_config
from s3kv.errors import ConfigError
from s3kv.keys import Namespace, chain_keys
from s3kv.manifest import Manifest
from s3kv.stats import Counters
from s3kv.stores.factory import make_store
from s3kv.stores.memory import MemoryStore
from s3kv.tiering.loop import BackgroundLoop
from s3kv.tiering.placement import Tier, TierIndex
from s3kv.tiering.plan import Place
from s3kv.tiering.scheduler.stack import TierStack
from s3kv.tiering.tiers.cpu.manager import CpuTierManager
from s3kv.tiering.tiers.handler import PageTierHandler
from s3kv.tiering.tiers.manager import TierEvents, TierManager, store_owner
from s3kv.tiering.tiers.nvme import files as disk
from s3kv.tiering.tiers.nvme.manager import NvmeTierManager, disk_estimate
from s3kv.tiering.tiers.nvme.settings import NvmeSettings
from s3kv.tiering.tiers.nvme.spec import NvmeSpec
from s3kv.tiering.tiers.registry import TIERS
from s3kv.tiering.tiers.report import RankReport
from s3kv.tiering.tiers.s3.manager import S3TierManager
from s3kv.tiering.tiers.s3.settings import S3Settings
from s3kv.tiering.tiers.s3.spec import S3Spec
from s3kv.tiering.tiers.settings import EngineSettings, WorkerEnv
from s3kv.tiering.tiers.spec import ManagerEnv, TierPrior, TierSpec
from tests.conftest import wait_until

NS = Namespace.from_fields({"m": "specs"}).id
KEYS = chain_keys(Namespace.from_fields({"m": "specs"}), list(range(256)), 64)
SHARD = 100


def config(**cfg):
    return parse_config({"region": "us-east-1", "write_policy": "local_only", **cfg})


def env(cfg, *, manifest=None, store=None, run=None, counters=None):
    return ManagerEnv(cfg, 1, SHARD, counters or Counters(), manifest, store, run)


def test_the_registry_lists_every_tier_once_nearest_first():
    assert [spec.tier for spec in TIERS] == list(Tier)


def test_each_spec_says_the_facts_generic_code_asks_of_its_tier():
    for spec in TIERS:
        assert spec.prior.first_s > 0 and spec.prior.bytes_per_s > 0
        assert spec.medium in ("CPU", "STORAGE") and spec.locality in ("LOCAL", "REMOTE")
    assert [s.locality for s in TIERS] == ["LOCAL", "LOCAL", "REMOTE"]
    assert [s.hit_source for s in TIERS] == ["host", "disk", "external_unspecified"]


def test_a_spec_that_does_not_say_its_facts_fails_when_built():
    class Unsaid(TierSpec):
        tier = Tier.DISK
        prior = TierPrior(0.01, 1e9)

        def manager(self, env):
            return None

        def handler(self, env):
            return None

    with pytest.raises(TypeError, match="Unsaid does not say its medium, locality, hit_source"):
        Unsaid()


def test_the_nvme_spec_cuts_its_worker_settings_and_reads_only_its_own(tmp_path):
    """The NVMe wing's slice of the config travels to each worker in
    EngineSettings.wings, keyed by its tier, and its handler reads it back."""
    cfg = config(disk_path=str(tmp_path), disk_codec="zstd", disk_fsync="never", disk_timeout_s="4s")
    settings = EngineSettings.from_config(cfg, rank=0, num_layers=1)
    assert settings.wings == {
        Tier.DISK: NvmeSettings(str(tmp_path), "zstd", False, 4.0),
        Tier.S3: S3Settings(),
    }
    no_disk = EngineSettings.from_config(config(cpu_bytes=SHARD), rank=0, num_layers=1)
    assert no_disk.wings == {Tier.S3: S3Settings()}  # no disk: no NVMe settings
    off = WorkerEnv(dataclasses.replace(settings, wings={}), None, RankReport(), Counters(), None, None, None)  # type: ignore[arg-type]
    assert NvmeSpec().handler(off) is None
    wrong = dataclasses.replace(off, settings=dataclasses.replace(settings, wings={Tier.DISK: str(tmp_path)}))
    with pytest.raises(TypeError, match="NVMe tier's settings are str, not NvmeSettings"):
        NvmeSpec().handler(wrong)


def test_the_nvme_handler_probes_page_cache_reads_on_the_disks_threads(tmp_path, monkeypatch):
    """The handler is made on vLLM's thread: the probe of ``disk_path`` (disk
    I/O that a stalled disk holds) is left to the disk's own threads."""
    import threading

    from tests.tiers.conformance import make_codec

    ran_on = []
    monkeypatch.setattr(disk, "NOWAIT_READS", True)
    monkeypatch.setattr(
        disk, "probe_direct", lambda root: ran_on.append(threading.current_thread()) or disk.DIRECT_OFF
    )
    cfg = config(disk_path=str(tmp_path))
    env = WorkerEnv(
        EngineSettings.from_config(cfg, rank=0, num_layers=1),
        make_codec("none"),
        RankReport(),
        Counters(),
        None,
        None,
        None,
    )  # type: ignore[arg-type]
    handler = NvmeSpec().handler(env)
    assert handler is not None and handler.probe is not None
    handler.probe.result(60)
    assert len(ran_on) == 1 and ran_on[0] is not threading.current_thread()
    assert ran_on[0].name.startswith("s3kv-disk-write")
    handler.close()


def test_the_s3_spec_cuts_its_worker_settings_and_reads_only_its_own():
    """The S3 wing's slice of the config (``range_bytes``) travels to each
    worker in EngineSettings.wings; its handler reads it back (the config's
    defaults where the worker was given none) and the engine's prefix."""
    settings = EngineSettings.from_config(
        config(range_bytes="1MiB", prefix="pre", bucket="some-bucket", write_policy="write_through"),
        rank=0,
        num_layers=1,
    )
    assert settings.wings[Tier.S3] == S3Settings(range_bytes=1 << 20)

    def handler(s: EngineSettings, store=None):
        return S3Spec().handler(WorkerEnv(s, None, RankReport(), Counters(), None, None, store))  # type: ignore[arg-type]

    assert handler(settings) is None  # no store: no S3 handler
    h = handler(settings, MemoryStore())
    assert (h.range_bytes, h.prefix) == (1 << 20, "pre")
    assert (
        handler(dataclasses.replace(settings, wings={}), MemoryStore()).range_bytes
        == S3Settings().range_bytes
    )
    assert S3Settings().range_bytes == config(cpu_bytes=SHARD).range_bytes != 1 << 20
    with pytest.raises(TypeError, match="S3 tier's settings are int, not S3Settings"):
        handler(dataclasses.replace(settings, wings={Tier.S3: 1 << 20}), MemoryStore())


def test_a_tier_that_is_off_builds_no_manager():
    s3_only = config(bucket="some-bucket", write_policy="write_through")
    assert [spec.manager(env(s3_only)) for spec in TIERS] == [None, None, None]  # no manifest: S3 is off too


def test_each_spec_builds_its_manager_from_its_slice_of_the_config(tmp_path):
    cfg = config(
        cpu_bytes=4 * SHARD, disk_path=str(tmp_path), bucket="some-bucket", write_policy="write_through"
    )
    cpu, nvme, s3 = (spec.manager(env(cfg, manifest=Manifest())) for spec in TIERS)
    assert isinstance(cpu, CpuTierManager) and cpu.index.capacity == 4 and cpu.describe() == "4 slots"
    assert isinstance(nvme, NvmeTierManager) and nvme.reserve_bytes == disk_estimate(SHARD)
    assert isinstance(s3, S3TierManager) and s3.describe() == "s3://some-bucket/" + cfg.prefix and not s3.down
    with pytest.raises(ConfigError, match="cpu_bytes: .* holds no chunk"):
        TIERS[0].manager(env(config(cpu_bytes=SHARD - 1)))


def test_a_manager_that_forgets_to_say_where_a_store_goes_fails_when_built():
    class Forgetful(TierManager):
        tier = Tier.DISK

        def lookup(self, keys: Sequence[bytes], fps: np.ndarray, start: int, end: int) -> list[bool]:
            return [False] * (end - start)

        def prepare_promotion(self, key: bytes) -> Place | None:
            return None

    with pytest.raises(TypeError, match="prepare_store"):
        Forgetful()

    class Storing(Forgetful):
        def prepare_store(self, key: bytes, owner: Hashable) -> Place | None:
            return Place(self.tier)

    assert Storing().prepare_store(KEYS[0], store_owner(KEYS[0])) == Place(Tier.DISK)


def test_a_spec_without_a_handler_and_a_page_tier_without_fills_fail_when_built():
    class ManagerOnly(TierSpec):
        tier = Tier.DISK

        def manager(self, env):
            return None

    with pytest.raises(TypeError, match="handler"):
        ManagerOnly()

    class NoFills(PageTierHandler):
        tier = Tier.CPU
        label = "test"

        async def read(self, place, key, sink, *, deadline=None, keep_blob=False):
            return 0, None

        async def write(self, place, chunk, start=None):
            return 0

        async def delete(self, place, key):
            pass

        async def bytes_used(self):
            return 0

    with pytest.raises(TypeError, match="close_fill"):
        NoFills()


def test_the_nvme_wing_opens_its_directory_and_deletes_its_own_evicted_files(tmp_path):
    """Nobody but the wing deletes its files: evicted and failed entries go
    to its cleaner as they happen, and a key is written again once its old
    files are gone."""
    left = disk.shard_path(tmp_path, NS, KEYS[0], 0)
    left.parent.mkdir(parents=True)
    left.write_bytes(b"x" * 5000)  # what an earlier run left
    counters = Counters()
    m = NvmeSpec().manager(env(config(disk_path=str(tmp_path), disk_bytes=20000), counters=counters))
    assert m is not None
    TierStack([m], counters, TierEvents())
    try:
        assert m.activate(NS) and m.describe() == str(tmp_path)
        assert KEYS[0] in m.index
        # A store's reservation (16.1 KiB) does not fit beside the old file: it goes.
        assert m.prepare_store(KEYS[1], store_owner(KEYS[1])) == Place(Tier.DISK)
        assert KEYS[0] not in m.index
        wait_until("the evicted file deleted", lambda: not left.exists())
        m.complete_store(KEYS[1], False)  # a rank may have written some of it: its files go
        wait_until(
            "the failed key written again once its files are gone",
            lambda: m.prepare_store(KEYS[1], store_owner(KEYS[1])) is not None,
        )
        assert m.take_evictions() == []  # nothing is left for a caller to delete
        assert counters.totals()["evict_chunks_disk"] == 1
    finally:
        m.close()
    fd = disk.try_lock(tmp_path)  # closing let go of the directory's lock
    assert fd is not None
    os.close(fd)


@pytest.mark.parametrize("world_size, shards", [(2, 4), (2, 1)], ids=["4-shards-by-head", "1-replicated"])
def test_the_nvme_wing_counts_a_chunks_shards_not_the_ranks(tmp_path, world_size, shards):
    """A namespace that replicas of every TP size share cuts each part into
    shards that are no rank's: a chunk on the disk is whole with a file of
    each, its reservation is one estimate a shard, and evicting it deletes
    every shard's file (a file of a shard the parts do not have is not its)."""
    files = [disk.shard_path(tmp_path, NS, KEYS[0], s) for s in range(shards + 1)]
    half = [disk.shard_path(tmp_path, NS, KEYS[2], s) for s in range(shards - 1)]
    for f in files + half:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"x" * 1000)
    counters = Counters()
    cfg = config(disk_path=str(tmp_path), disk_bytes=1 << 20)
    m = NvmeSpec().manager(
        ManagerEnv(cfg, world_size, 2 * SHARD, counters, shards=shards, object_bytes=SHARD * 2 // shards)
    )
    assert m is not None and m.reserve_bytes == shards * disk_estimate(SHARD * 2 // shards)
    TierStack([m], counters, TierEvents())
    try:
        assert m.activate(NS)
        assert KEYS[0] in m.index and m.index.get(KEYS[0]).size == shards * 1000
        assert KEYS[2] not in m.index  # a shard short
        m.forget(KEYS[0])
        wait_until("every shard's file deleted", lambda: not any(f.exists() for f in files[:shards]))
        assert files[shards].exists() and all(f.exists() for f in half)
    finally:
        m.close()


def test_an_unusable_nvme_directory_leaves_the_tier_out(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"")
    m = NvmeSpec().manager(env(config(disk_path=str(not_a_dir))))
    assert m is not None and not m.activate(NS)
    m.close()


def test_the_s3_wing_pauses_its_tier_while_the_bucket_does_not_answer():
    """The bucket check is the S3 wing's; its manager alone keeps the down state."""
    cfg = config(
        bucket="some-bucket",
        write_policy="write_through",
        endpoint_url="http://127.0.0.1:9",  # nothing listens
        s3_connect_timeout_s=1,
        s3_max_attempts=1,
    )
    loop = BackgroundLoop("test-s3-spec")
    store = make_store(cfg)
    try:
        m = S3Spec().manager(
            env(cfg, manifest=Manifest(), store=store, run=lambda c, t: loop.run(c, timeout=t))
        )
        assert isinstance(m, S3TierManager) and m.down and m.paused
        assert not m.allows("r", take=False)
        m.resume()  # the manifest loaded from the bucket
        assert not m.down and m.allows("r", take=False)
    finally:
        loop.run(store.close(), timeout=30)
        loop.stop(timeout=30)


def test_the_stack_unstages_only_what_a_store_staged():
    cpu, s3 = CpuTierManager(TierIndex("cpu", 4, slots=True)), S3TierManager(Manifest())
    stack = TierStack([cpu, s3], Counters(), TierEvents())
    targets, pinned = stack.store(KEYS[0])
    assert pinned and cpu.index.get(KEYS[0]).pins == 1
    s3.manifest.add(KEYS[1])
    assert stack.store(KEYS[1]) == ((Place(Tier.CPU, cpu.index.get(KEYS[1]).slot),), False)
    cpu.index.pin(KEYS[1])  # a load reads it
    stack.released(KEYS[1])  # never staged: the load's pin stays
    assert cpu.index.get(KEYS[1]).pins == 1
    stack.released(KEYS[0])
    stack.released(KEYS[0])  # reported twice: unpinned once
    assert cpu.index.get(KEYS[0]).pins == 0
