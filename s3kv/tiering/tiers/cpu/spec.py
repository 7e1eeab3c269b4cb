"""The CPU tier's spec: ``cpu_bytes`` of pinned host memory per worker."""

from __future__ import annotations

from s3kv.tiering.placement import Tier
from s3kv.tiering.tiers.cpu.handler import CpuHandler
from s3kv.tiering.tiers.cpu.manager import CpuTierManager
from s3kv.tiering.tiers.settings import WorkerEnv
from s3kv.tiering.tiers.spec import ManagerEnv, TierPrior, TierSpec


class CpuSpec(TierSpec):
    tier = Tier.CPU
    prior = TierPrior(0.0005, 4e9)
    medium = "CPU"
    locality = "LOCAL"
    hit_source = "host"

    def manager(self, env: ManagerEnv) -> CpuTierManager | None:
        return CpuTierManager.open(env.config.cpu_bytes, env.shard_bytes, env.world_size)

    def handler(self, env: WorkerEnv) -> CpuHandler | None:
        if env.pool is None:
            return None
        return CpuHandler(env.pool, env.threads, env.report, env.counters)
