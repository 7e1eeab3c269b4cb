"""What crosses between s3kv's scheduler side and its workers each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from s3kv.stats import merge
from s3kv.tiering.placement import Tier
from s3kv.tiering.planner import LoadPlan, StoreChunk


@dataclass
class S3KVMetadata(KVConnectorMetadata):
    """Scheduler -> workers: this step's loads (synchronous ones before the
    forward, asynchronous ones after it), stores (copied out as the forward
    writes each layer), and finished requests whose blocks wait for those
    copies. Every rank gets the same plan."""

    loads: list[LoadPlan] = field(default_factory=list)
    stores: list[StoreChunk] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    preempted: bool = False
    namespace: str | None = None
    """The namespace the plans are in; None (and no plans) until the
    scheduler side knows the model's identity."""
    signing_kid: bytes | None = None
    """The id of the fleet key the scheduler side signs with (never the key
    itself); None without a fleet secret. Each process reads the secret on
    its own: a worker whose key differs refuses every transfer."""
    writer: str | None = None
    """The scheduler side's manifest writer id (None without S3): each
    rank publishes its stores as ``{writer}r{rank}``."""
    clock_ms: int = 0
    """The newest manifest stamp the scheduler side has seen: ranks never
    stamp a segment before it."""


@dataclass
class S3KVWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler, summed over ranks."""

    written: dict[tuple[Tier, bytes], int] = field(default_factory=dict)
    """(tier, key) -> ranks that now hold their shard of key in that tier."""
    disk_sizes: dict[bytes, int] = field(default_factory=dict)
    """Key -> bytes of the NVMe files written, summed over ranks."""
    failed: dict[tuple[Tier, bytes], int] = field(default_factory=dict)
    """(tier, key) -> ranks whose write (store, promotion) was dropped or failed."""
    missing: set[tuple[Tier, bytes]] = field(default_factory=set)
    """Keys a tier turned out not to hold (absent or corrupt): forget them there."""
    released: dict[bytes, int] = field(default_factory=dict)
    """Store key -> ranks that no longer read its CPU slot."""
    sync_loaded: dict[str, int] = field(default_factory=dict)
    """Request -> ranks that finished its synchronous load (its CPU slots may go)."""
    load_failed: set[str] = field(default_factory=set)
    """Requests whose load failed in part: offer them no more hits."""
    tier_ok: dict[Tier, int] = field(default_factory=dict)
    """Tier -> transfers it served (for its breaker)."""
    tier_failed: dict[Tier, int] = field(default_factory=dict)
    """Tier -> transfers that failed for the tier's sake (for its breaker)."""
    bad: dict[tuple[bytes, int], str | None] = field(default_factory=dict)
    """(key, rank) -> ETag of a corrupt S3 object the rank could not delete."""
    existing: set[bytes] = field(default_factory=set)
    """Keys whose S3 store found the object already there."""
    disk_full: bool = False

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, S3KVWorkerMetadata)
        return S3KVWorkerMetadata(
            merge(self.written, other.written),
            merge(self.disk_sizes, other.disk_sizes),
            merge(self.failed, other.failed),
            self.missing | other.missing,
            merge(self.released, other.released),
            merge(self.sync_loaded, other.sync_loaded),
            self.load_failed | other.load_failed,
            merge(self.tier_ok, other.tier_ok),
            merge(self.tier_failed, other.tier_failed),
            {**self.bad, **other.bad},
            self.existing | other.existing,
            self.disk_full or other.disk_full,
        )

    def is_empty(self) -> bool:
        return not (
            self.written
            or self.failed
            or self.missing
            or self.released
            or self.sync_loaded
            or self.load_failed
            or self.tier_ok
            or self.tier_failed
            or self.bad
            or self.existing
            or self.disk_full
        )
