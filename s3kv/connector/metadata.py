"""What crosses between s3kv's scheduler side and its workers each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from s3kv.tiering.plan import LoadPlan, StepTokens, StoreChunk, TierReport


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
    published: list[int] = field(default_factory=list)
    """Fingerprints the replica's own segment now names since the last
    step (protocol "epochs"): ranks stop holding them for their own."""
    step: StepTokens | None = None
    """What this step computes (with the cost model): rank 0 times the forward."""
    prefetch: list[LoadPlan] = field(default_factory=list)
    """Chunks of waiting requests to fetch from S3 into the nearer tiers
    (their promotions), started with this step's loads: no KV pages are
    written and vLLM hears nothing of these jobs."""


@dataclass
class S3KVWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: vLLM's wrapper of a :class:`TierReport`, summed
    over ranks by vLLM through :meth:`aggregate`."""

    report: TierReport = field(default_factory=TierReport)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, S3KVWorkerMetadata)
        return S3KVWorkerMetadata(self.report.aggregate(other.report))

    def is_empty(self) -> bool:
        return self.report.is_empty()
