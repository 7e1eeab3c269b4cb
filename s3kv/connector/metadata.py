"""What crosses between s3kv's scheduler side and its workers each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from s3kv.tiering.planner import LoadPlan, StoreChunk


@dataclass
class S3KVMetadata(KVConnectorMetadata):
    """Scheduler -> workers: this step's loads (start after the forward) and
    stores (copy out at the end of the step). Every rank gets the same plan."""

    loads: list[LoadPlan] = field(default_factory=list)
    stores: list[StoreChunk] = field(default_factory=list)


@dataclass
class S3KVWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler, summed over ranks."""

    stored: dict[bytes, int] = field(default_factory=dict)
    """Key -> ranks that now hold their shard of it."""
    store_failed: set[bytes] = field(default_factory=set)
    missing: set[bytes] = field(default_factory=set)
    """Keys found absent or corrupt: drop them from the index."""
    load_failed: set[str] = field(default_factory=set)
    """Requests whose load failed in part: offer them no more hits."""
    loaded: int = 0
    unavailable: int = 0
    """Loads that failed because the store did not answer."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, S3KVWorkerMetadata)
        stored = dict(self.stored)
        for k, n in other.stored.items():
            stored[k] = stored.get(k, 0) + n
        return S3KVWorkerMetadata(
            stored,
            self.store_failed | other.store_failed,
            self.missing | other.missing,
            self.load_failed | other.load_failed,
            self.loaded + other.loaded,
            self.unavailable + other.unavailable,
        )

    def is_empty(self) -> bool:
        return not (
            self.stored
            or self.store_failed
            or self.missing
            or self.load_failed
            or self.loaded
            or self.unavailable
        )
