"""What a worker's tier handlers are built from: the transfer settings cut
from the config (:class:`EngineSettings`, with each tier's own slice, cut
by its spec) and the worker's shared parts (:class:`WorkerEnv`)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from s3kv.auth import FleetKeys
from s3kv.config import DEFAULTS, S3KVConfig
from s3kv.manifest.publish import Published
from s3kv.stats import Counters
from s3kv.stores.base import ObjectStore
from s3kv.tiering.chunks import ChunkCodec
from s3kv.tiering.placement import Tier
from s3kv.tiering.tiers.report import RankReport
from s3kv.tiering.worker.hostpool import HostPool

if TYPE_CHECKING:
    from s3kv.tiering.codec_choice import TierChoice


@dataclass(frozen=True)
class EngineSettings:
    """A worker's transfer settings, cut from the config by :meth:`from_config`;
    tests and benchmarks may build one (the defaults are the config's)."""

    namespace: str | None
    """None until the model's identity is known (:meth:`TransferEngine.set_namespace`)."""
    prefix: str
    """The fleet's prefix in the bucket, where its chunks and manifest live."""
    rank: int
    """The shard this engine moves (:class:`~s3kv.shards.ShardRole`): its
    objects' ``r{rank}`` and their headers' rank; with one shard per rank
    (the default cut), the rank itself."""
    num_layers: int
    codec: str = DEFAULTS.codec
    zstd_level: int = DEFAULTS.zstd_level
    max_inflight_bytes: int = DEFAULTS.max_inflight_bytes
    load_timeout_s: float = DEFAULTS.load_timeout_s
    threads: int = 4
    """The engine's codec threads (not a config key)."""
    wings: Mapping[Tier, object] = field(default_factory=dict)
    """Each tier's own worker-side settings, by tier, as its spec cut them
    from the config (:meth:`~s3kv.tiering.tiers.spec.TierSpec.settings`)
    and its handler reads them; a tier with none is absent (its spec says
    what that means: the NVMe tier is off, S3 takes its defaults)."""
    keys: FleetKeys | None = None
    """The fleet secret: sign what is stored, read only what is signed (on
    every tier: the chunk codec checks it)."""
    writes: bool = True
    """Writes its shard to the tiers that hold encoded objects (NVMe, S3);
    False where another rank holds the same bytes and writes them: this
    engine's writes there are that rank's, and count as done."""
    observes: bool | None = None
    """Times its loads for the cost model (one engine of the replica does;
    None: the engine of rank 0)."""

    @property
    def timing(self) -> bool:
        return self.observes if self.observes is not None else self.rank == 0

    @classmethod
    def from_config(
        cls, config: S3KVConfig, *, rank: int, num_layers: int, keys: FleetKeys | None = None
    ) -> EngineSettings:
        """Rank ``rank``'s settings in ``config`` (no namespace yet)."""
        return cls(
            namespace=None,
            prefix=config.prefix,
            rank=rank,
            num_layers=num_layers,
            codec=config.codec,
            zstd_level=config.zstd_level,
            max_inflight_bytes=config.max_inflight_bytes,
            load_timeout_s=config.load_timeout_s,
            wings=wing_settings(config),
            keys=keys,
        )


def wing_settings(config: S3KVConfig) -> dict[Tier, object]:
    """Every tier's worker-side settings in ``config``, by its spec."""
    from s3kv.tiering.tiers.registry import TIERS  # the specs import this module

    return {spec.tier: s for spec in TIERS if (s := spec.settings(config)) is not None}


@dataclass
class WorkerEnv:
    """What a worker's handlers are built from (:meth:`~s3kv.tiering.tiers.spec.TierSpec.handler`)."""

    settings: EngineSettings
    codec: ChunkCodec
    report: RankReport
    counters: Counters
    threads: concurrent.futures.Executor
    """The engine's codec threads (decoding, slot copies)."""
    pool: HostPool | None
    store: ObjectStore | None
    published: Published | None = None
    """Who hears of the chunk PUTs (the rank's publisher; None: nobody)."""
    choices: Mapping[Tier, TierChoice] = field(default_factory=dict)
    """The codec choice of each tier whose codec is ``auto``: its writer encodes as it says."""
