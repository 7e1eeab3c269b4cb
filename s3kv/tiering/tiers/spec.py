"""What makes a tier: a :class:`TierSpec` builds the tier's two halves from
the frozen config, the scheduler side's :class:`TierManager` and each
worker's :class:`TierHandler`, and says nothing else. Generic code (the
scheduler side, the planner, the transfer engine) goes through the specs in
:data:`s3kv.tiering.tiers.registry.TIERS` and names no tier.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, ClassVar

from s3kv.config import S3KVConfig
from s3kv.manifest.keyset import Manifest
from s3kv.stats import Counters
from s3kv.stores.s3 import S3Store
from s3kv.tiering.placement import Tier
from s3kv.tiering.tiers.handler import TierHandler
from s3kv.tiering.tiers.manager import TierManager
from s3kv.tiering.tiers.settings import WorkerEnv

Run = Callable[[Coroutine[Any, Any, Any], float], Any]
"""run(coroutine, timeout_s): its result, on the scheduler side's I/O loop."""


@dataclass(frozen=True)
class ManagerEnv:
    """What a tier's scheduler-side manager is built from (at start-up,
    before the model's identity and so the namespace are known)."""

    config: S3KVConfig
    world_size: int
    shard_bytes: int
    """Raw bytes one rank holds of a chunk (of each part: all its shards)."""
    counters: Counters
    """The scheduler side's counters."""
    manifest: Manifest | None = None
    """The fleet's manifest (None without S3)."""
    store: S3Store | None = None
    """The bucket (None without S3)."""
    run: Run | None = None
    shards: int = 1
    """Objects of each part in the tiers replicas share (NVMe, S3): the
    namespace's shards (:mod:`s3kv.shards`), one a rank unless its parts are
    cut by KV head or stored once; a part is whole there once every one is."""
    object_bytes: int = 0
    """Raw bytes of one of those objects; 0: :attr:`shard_bytes` (one a rank)."""


@dataclass(frozen=True)
class TierPrior:
    """The cost model's start-up estimates of a tier, until its loads are timed."""

    first_s: float
    """Start-up estimate of a load's first chunk from the tier."""
    bytes_per_s: float
    """Start-up estimate of the tier's bandwidth after the first chunk."""


FACTS = ("tier", "prior", "medium", "locality", "hit_source")
"""What every spec says of its tier (class attributes), checked when it is built."""


class TierSpec(ABC):
    """One tier: which it is, the facts generic code asks of it, and how its
    manager and handlers are built. A tier that is off in the config builds
    neither (None)."""

    tier: ClassVar[Tier]
    prior: ClassVar[TierPrior]
    """The cost model's start-up estimates (:mod:`s3kv.tiering.scheduler.cost`)."""
    medium: ClassVar[str]
    """vLLM's KV event medium of a chunk here (``"CPU"`` or ``"STORAGE"``;
    the connector passes it on, the core names no vLLM type)."""
    locality: ClassVar[str]
    """vLLM's KV event locality: ``"LOCAL"`` (this replica's) or ``"REMOTE"`` (shared)."""
    hit_source: ClassVar[str]
    """vLLM's cache hit source of tokens loaded from here (a ``CacheHitSource``
    value: ``"host"``, ``"disk"``, ``"external_unspecified"``)."""

    def __init__(self) -> None:
        missing = [name for name in FACTS if not hasattr(self, name)]
        if missing:
            raise TypeError(f"{type(self).__name__} does not say its {', '.join(missing)}")

    @abstractmethod
    def manager(self, env: ManagerEnv) -> TierManager | None:
        """The scheduler side's manager, or None where the tier is off. A
        config the tier cannot work with raises ConfigError here, at
        start-up; what depends on the namespace waits for
        :meth:`TierManager.activate`."""

    def settings(self, config: S3KVConfig) -> object | None:
        """This tier's worker-side settings, cut from ``config``: each worker
        gets them in :attr:`EngineSettings.wings
        <s3kv.tiering.tiers.settings.EngineSettings.wings>` and
        :meth:`handler` reads them back. None (the default): it needs none,
        or it is off."""
        return None

    @abstractmethod
    def handler(self, env: WorkerEnv) -> TierHandler | None:
        """This tier's handler for a worker, or None where it has none."""
