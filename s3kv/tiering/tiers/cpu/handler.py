"""The CPU tier's worker side: the pinned host pool's slots."""

from __future__ import annotations

import asyncio
import concurrent.futures

import numpy as np

from s3kv.errors import NotFound
from s3kv.frame_sinks import FrameInto, FrameSink
from s3kv.stats import Counters
from s3kv.tiering.chunks import ChunkData
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import Place
from s3kv.tiering.tiers.handler import PageTierHandler
from s3kv.tiering.tiers.report import RankReport
from s3kv.tiering.worker.hostpool import HostPool


class CpuHandler(PageTierHandler):
    """The host pool's slots, one chunk shard each (the place's slot, chosen
    by the scheduler side). Stores arrive as pages: the connector copies
    them out of the KV cache into the slot, and the write-through to the
    farther tiers reads them from there; a promotion fills the slot as the
    load's layers arrive."""

    tier = Tier.CPU
    label = "CPU"

    def __init__(
        self,
        pool: HostPool,
        executor: concurrent.futures.Executor | None = None,
        report: RankReport | None = None,
        counters: Counters | None = None,
    ) -> None:
        super().__init__(report, counters)
        self.pool = pool
        self._executor = executor
        """Threads that copy slots out (the engine's codec threads)."""
        self._staged: set[int] = set()
        """Slots the connector is copying a store's pages into (:meth:`stage`)."""

    async def read(
        self,
        place: Place,
        key: bytes,
        sink: FrameInto,
        *,
        deadline: float | None = None,
        keep_blob: bool = False,
    ) -> tuple[int, bytes | None]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._read, place.slot, key, sink), None

    def _read(self, slot: int | None, key: bytes, sink: FrameInto) -> int:
        pool = self.pool
        if not pool.holds(pool.check_slot(slot), key):
            raise NotFound(f"{key.hex()} (host pool slot {slot})")
        for i in range(pool.num_layers):
            sink.write(i, pool.layer_view(slot, i))  # type: ignore[arg-type]
        return pool.slot_bytes

    def pages(self, place: Place, key: bytes) -> list[np.ndarray] | None:
        pool = self.pool
        if place.slot is None or not pool.holds(place.slot, key):
            return None
        return pool.layer_views(place.slot)

    def stage(self, place: Place) -> list[np.ndarray]:
        slot = self.pool.check_slot(place.slot)
        self.pool.claim(slot, None)  # being overwritten
        self._staged.add(slot)
        return self.pool.layer_views(slot)

    async def write(self, place: Place, chunk: ChunkData, start: float | None = None) -> int:
        """Claim the slot for ``chunk``; its pages are copied in first unless
        the connector copied them there (:meth:`stage`)."""
        pool = self.pool
        slot = pool.check_slot(place.slot)
        layers = chunk.layers
        if len(layers) != pool.num_layers:
            raise ValueError(f"host pool: chunk has {len(layers)} layers, slots hold {pool.num_layers}")
        views = pool.layer_views(slot)
        if slot in self._staged:
            self._staged.discard(slot)
        else:
            pool.claim(slot, None)
            for i, (view, data) in enumerate(zip(views, layers)):
                flat = np.asarray(data).reshape(-1).view(np.uint8)
                if flat.size != pool.layer_bytes:
                    raise ValueError(
                        f"host pool: layer {i} is {flat.size} bytes, slots hold {pool.layer_bytes}"
                    )
                np.copyto(view, flat)
        pool.claim(slot, chunk.key)
        self.counters.add("store_chunks_cpu")
        return pool.slot_bytes

    async def delete(self, place: Place, key: bytes) -> None:
        slot = self.pool.check_slot(place.slot)
        self.pool.release(slot, key)
        self._staged.discard(slot)

    def missed(self, key: bytes) -> None:
        """The slot no longer holds ``key``: forgotten, and no breaker hears of host memory."""
        self.report.missing(self.tier, key)

    async def bytes_used(self) -> int:
        return self.pool.buffer.nbytes

    def open_fill(self, place: Place, key: bytes) -> FrameSink:
        pool, slot = self.pool, self.pool.check_slot(place.slot)
        pool.claim(slot, None)
        self._staged.discard(slot)

        def fill(layer: int, data: np.ndarray) -> None:
            np.copyto(pool.layer_view(slot, layer), data.reshape(-1))

        return fill

    def close_fill(self, place: Place, key: bytes) -> int:
        self.pool.claim(self.pool.check_slot(place.slot), key)
        return self.pool.slot_bytes
