"""What a worker's tier handlers are built from: the transfer settings cut
from the config (:class:`EngineSettings`) and the worker's shared parts
(:class:`WorkerEnv`)."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

from s3kv.auth import FleetKeys
from s3kv.config import DEFAULTS, S3KVConfig
from s3kv.manifest.publish import Published
from s3kv.stats import Counters
from s3kv.stores.base import ObjectStore
from s3kv.tiering.chunks import ChunkCodec
from s3kv.tiering.tiers.report import RankReport
from s3kv.tiering.worker.hostpool import HostPool


@dataclass(frozen=True)
class EngineSettings:
    """A worker's transfer settings, cut from the config by :meth:`from_config`;
    tests and benchmarks may build one (the defaults are the config's)."""

    namespace: str | None
    """None until the model's identity is known (:meth:`TransferEngine.set_namespace`)."""
    prefix: str
    rank: int
    num_layers: int
    codec: str = DEFAULTS.codec
    zstd_level: int = DEFAULTS.zstd_level
    range_bytes: int = DEFAULTS.range_bytes
    max_inflight_bytes: int = DEFAULTS.max_inflight_bytes
    load_timeout_s: float = DEFAULTS.load_timeout_s
    threads: int = 4
    """The engine's codec threads (not a config key)."""
    disk_path: str | None = DEFAULTS.disk_path
    disk_codec: str = DEFAULTS.disk_codec
    disk_fsync: bool = DEFAULTS.disk_fsync == "always"
    disk_timeout_s: float = DEFAULTS.disk_timeout_s
    """A chunk read or write on the NVMe tier slower than this, from when a
    thread starts it, counts as a disk failure (a read falls back to S3). A
    read that waits this long for a thread goes to the next source, blaming
    the disk only if its threads are stuck (busy is not failing)."""
    keys: FleetKeys | None = None
    """The fleet secret: sign what is stored, read only what is signed."""

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
            range_bytes=config.range_bytes,
            max_inflight_bytes=config.max_inflight_bytes,
            load_timeout_s=config.load_timeout_s,
            disk_path=config.disk_path,
            disk_codec=config.disk_codec,
            disk_fsync=config.disk_fsync == "always",
            disk_timeout_s=config.disk_timeout_s,
            keys=keys,
        )


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
