"""The CPU tier's scheduler side: the host pool's slot index."""

from __future__ import annotations

from collections.abc import Sequence

from s3kv.errors import ConfigError
from s3kv.tiering.placement import Tier, TierIndex
from s3kv.tiering.plan import Place
from s3kv.tiering.tiers.manager import IndexedTierManager, TierManager
from s3kv.tiering.worker.hostpool import slots_for
from s3kv.units import format_size


class CpuTierManager(IndexedTierManager):
    """The CPU pool's slots: loads from it are synchronous (copied during the
    forward, layer by layer, and never lost: a pinned slot stays), a store's
    slot is what its farther writes read from. No breaker: memory does not
    go away."""

    tier = Tier.CPU
    sync_load = True

    def __init__(self, index: TierIndex, slot_bytes: int = 0) -> None:
        if not index.slots:
            raise ValueError("the CPU tier's index must count slots")
        super().__init__(index)
        self.slot_bytes = slot_bytes
        """Bytes of one slot over all ranks, for the stats."""

    @classmethod
    def open(cls, cpu_bytes: int, shard_bytes: int, world_size: int = 1) -> CpuTierManager | None:
        """The CPU tier for ``cpu_bytes`` per worker, or None when it is 0."""
        if not cpu_bytes:
            return None
        slots = slots_for(cpu_bytes, shard_bytes)
        if slots == 0:
            raise ConfigError(
                f"cpu_bytes: {format_size(cpu_bytes)} holds no chunk of this model (one chunk takes "
                f"{format_size(shard_bytes)} per worker); use at least {shard_bytes} or 0 to turn it off"
            )
        return cls(TierIndex("cpu", slots, slots=True), shard_bytes * world_size)

    def _reserve(self, key: bytes) -> Place | None:
        """A pending slot for ``key``, evicting the least recently used."""
        got = self.index.reserve(key)
        if got is None:
            return None
        for old, _ in got[1]:
            self.counters.add("evict_chunks_cpu")
            self.events.removed(self.tier, old)  # type: ignore[arg-type]
        return Place(self.tier, got[0].slot)

    def describe(self) -> str:
        return f"{self.index.capacity} slots"

    def fallbacks(self, key: bytes, farther: Sequence[TierManager]) -> tuple[Place, ...]:
        """None: a slot a load reads is pinned, never lost."""
        return ()

    def stage(self, key: bytes) -> bool:
        """A store's farther writes read its pages from the slot."""
        self.index.pin(key)
        return True

    def unstage(self, key: bytes) -> None:
        self.index.unpin(key)

    def prepare_store(self, key: bytes, owner: object) -> Place | None:
        if self.index.has(key):
            return None
        place = self._reserve(key)
        if place is None:
            self.counters.add("store_dropped_no_slot")
        return place

    def prepare_promotion(self, key: bytes) -> Place | None:
        return self._reserve(key)

    def complete_store(self, key: bytes, ok: bool) -> None:
        super().complete_store(key, ok)
        if ok:
            self.index.commit(key)
        else:
            self.index.abort(key)

    def forget(self, key: bytes) -> None:
        self.index.remove(key)
        super().forget(key)

    def gauges(self) -> dict[str, int]:
        return {
            "tier_used_bytes_cpu": self.index.used * self.slot_bytes,
            "tier_capacity_bytes_cpu": self.index.capacity * self.slot_bytes,
        }
