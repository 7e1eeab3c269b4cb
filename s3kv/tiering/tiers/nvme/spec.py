"""The NVMe tier's spec: chunk files under ``disk_path``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from s3kv.config import S3KVConfig
from s3kv.tiering.placement import Tier, TierIndex
from s3kv.tiering.tiers.manager import probe_timeout_s
from s3kv.tiering.tiers.nvme.directory import Directory
from s3kv.tiering.tiers.nvme.files import DiskTier
from s3kv.tiering.tiers.nvme.handler import NvmeHandler
from s3kv.tiering.tiers.nvme.manager import NvmeTierManager
from s3kv.tiering.tiers.nvme.residency import DIRECT_OFF
from s3kv.tiering.tiers.nvme.settings import NvmeSettings
from s3kv.tiering.tiers.settings import WorkerEnv
from s3kv.tiering.tiers.spec import ManagerEnv, TierPrior, TierSpec


class NvmeSpec(TierSpec):
    tier = Tier.DISK
    prior = TierPrior(0.005, 1e9)
    medium = "STORAGE"
    locality = "LOCAL"
    hit_source = "disk"

    def manager(self, env: ManagerEnv) -> NvmeTierManager | None:
        """The directory is opened (checked, locked, scanned) once the
        namespace is known (:meth:`NvmeTierManager.activate`)."""
        c = env.config
        if c.disk_path is None:
            return None
        return NvmeTierManager(
            TierIndex("disk", 0),
            shards=env.shards,
            object_bytes=env.object_bytes or env.shard_bytes,
            probe_timeout_s=probe_timeout_s(c),
            directory=Directory(c.disk_path, c.disk_bytes, env.shards, env.counters),
        )

    def settings(self, config: S3KVConfig) -> NvmeSettings | None:
        return NvmeSettings.from_config(config)

    def handler(self, env: WorkerEnv) -> NvmeHandler | None:
        s = env.settings.wings.get(self.tier)
        if s is None:
            return None
        if not isinstance(s, NvmeSettings):
            raise TypeError(f"the NVMe tier's settings are {type(s).__name__}, not NvmeSettings")
        choice = env.choices.get(self.tier)
        files_codec = dataclasses.replace(env.codec, codec=choice.codec if choice is not None else s.codec)
        return NvmeHandler(
            DiskTier(Path(s.path), files_codec, fsync=s.fsync, choice=choice, direct=DIRECT_OFF),
            timeout_s=s.timeout_s,
            write_queue_s=env.settings.load_timeout_s,
            report=env.report,
            counters=env.counters,
            probe_reads=True,
        )
