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
    """Raw bytes of one rank's shard of a chunk."""
    counters: Counters
    """The scheduler side's counters."""
    manifest: Manifest | None = None
    """The fleet's manifest (None without S3)."""
    store: S3Store | None = None
    """The bucket (None without S3)."""
    run: Run | None = None


class TierSpec(ABC):
    """One tier: which it is, and how its manager and handlers are built.
    A tier that is off in the config builds neither (None)."""

    tier: ClassVar[Tier]

    @abstractmethod
    def manager(self, env: ManagerEnv) -> TierManager | None:
        """The scheduler side's manager, or None where the tier is off. A
        config the tier cannot work with raises ConfigError here, at
        start-up; what depends on the namespace waits for
        :meth:`TierManager.activate`."""

    @abstractmethod
    def handler(self, env: WorkerEnv) -> TierHandler | None:
        """This tier's handler for a worker, or None where it has none."""
