"""The transfer engine's stores: a chunk shard's pages copied into the tiers
that hold pages and written through, encoded, to the others, as a job on the
engine's loop; and the byte budget of the write-throughs under way
(``max_inflight_bytes``: past it a write-through is dropped and counted, not
queued)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from s3kv.tiering import codec_choice
from s3kv.tiering.chunks import ChunkData
from s3kv.tiering.codec_choice import Calibration
from s3kv.tiering.loop import JobLoop
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import Place

if TYPE_CHECKING:
    from s3kv.tiering.worker.transfer import TransferEngine

log = logging.getLogger("s3kv.transfer")


@dataclass
class StoreJob:
    key: bytes
    layers: Sequence[np.ndarray]
    """Host copies of the chunk's pages, one per layer (slot views or private)."""
    targets: tuple[Place, ...] = ()
    """Where it goes: a tier that takes pages gets ``layers``, the others the encoded chunk."""
    ready: Callable[[], None] | None = None
    """Blocks until ``layers`` hold the pages (a device copy may be in flight)."""
    pinned: bool = False
    """Report the first target released once the pages are read (:attr:`StoreChunk.pinned`)."""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.layers)


class Stores:
    """The stores of ``engine`` (its handlers, codec, settings, report and
    counters), run as jobs on its ``loop``, and the bytes their
    write-throughs hold until they end."""

    def __init__(self, engine: TransferEngine, loop: JobLoop) -> None:
        self._e = engine
        self._loop = loop
        self._lock = threading.Lock()
        self._inflight_bytes = 0
        self._closed = False
        self._calibration_failed = False
        """A calibration failed already (logged once, not per chunk)."""

    @property
    def closed(self) -> bool:
        """The engine is stopping: no store starts any more."""
        return self._closed

    def close(self) -> bool:
        """Take no write-through from now on; False if that was so already."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            return True

    def accepts(self, nbytes: int) -> bool:
        """Would a write-through of ``nbytes`` fit in the byte budget now?"""
        with self._lock:
            return not self._closed and self._inflight_bytes + nbytes <= self._e.s.max_inflight_bytes

    def reserve(self, nbytes: int) -> bool:
        """Hold ``nbytes`` of the budget for a write-through until its job
        ends; False (counted as dropped) once closed or past the budget."""
        with self._lock:
            if self._closed or self._inflight_bytes + nbytes > self._e.s.max_inflight_bytes:
                self._e.counters.add("store_dropped_backpressure")
                return False
            self._inflight_bytes += nbytes
            self._e.counters.set("inflight_bytes", self._inflight_bytes)
            return True

    async def job(
        self, job: StoreJob, pages: list[Place], encoded: list[Place], pins: bool, nbytes: int
    ) -> None:
        """Copy ``job``'s pages into the tiers at ``pages`` once ``ready``,
        then encode them and write the object to those at ``encoded`` (their
        ``nbytes`` reserved: given back at the end). With ``pins``, the
        first target is reported released once the pages are read."""
        e = self._e
        key = job.key
        try:
            if job.ready is not None:
                try:
                    await self._loop.in_threads(job.ready)
                except Exception as err:  # the copy out of the KV cache failed
                    log.error("s3kv: copying chunk %s out of the KV cache failed: %s", key.hex(), err)
                    for p in pages + encoded:
                        e.report.failed(p.tier, key)
                    return
            chunk = ChunkData(key, e.codec, layers=job.layers)  # type: ignore[arg-type]
            for p in pages:
                try:
                    await e.handlers[p.tier].write(p, chunk)
                except Exception as err:
                    log.error("s3kv: copying chunk %s into the %s tier failed: %s", key.hex(), p, err)
                    e.report.failed(p.tier, key)
                    continue
                e.report.written(p.tier, key)
            if not encoded:
                return
            start = time.perf_counter()
            # Each tier's codec, as its writer picks now (codec: auto), kept
            # on the chunk for its write; encoded here, off the loop.
            for p in encoded:
                picked = e.handlers[p.tier].store_codec()
                if picked is not None:
                    chunk.picked[p.tier] = picked
            codecs = list(chunk.picked.values()) or [chunk.codec]
            calibrate = bool(e.codec_choices) and e.calibrations.due()

            def encode() -> Calibration | None:
                for c in codecs:
                    chunk.blob_for(c)
                return self._calibrate(chunk) if calibrate else None

            try:
                calibration = await self._loop.in_background(encode)
            except Exception as err:
                log.error("s3kv: encoding chunk %s failed: %s", key.hex(), err)
                for p in encoded:
                    e.report.failed(p.tier, key)
                return
            finally:
                if pins:  # the slot is read: the scheduler may reuse it
                    e.report.released(key)
                    pins = False
            if calibration is not None:
                e.calibrations.add(calibration)
            e.counters.add("store_raw_bytes", chunk.raw_bytes)
            # One figure a chunk, as the compression ratio reads it: its
            # object in S3's codec (the shared copy), else the first tier's.
            counted = chunk.picked.get(Tier.S3) or codecs[0]
            e.counters.add("store_encoded_bytes", len(chunk.blob_for(counted)))
            await asyncio.gather(*(self._save(p, chunk, start) for p in encoded))
        finally:
            if pins:
                e.report.released(key)
            if encoded:
                with self._lock:
                    self._inflight_bytes -= nbytes
                    e.counters.set("inflight_bytes", self._inflight_bytes)

    def _calibrate(self, chunk: ChunkData) -> Calibration | None:
        """A calibration of ``codec: auto`` on ``chunk`` (off the loop), or
        None if it failed: its extra encodes and decodes (a MemoryError)
        cost the choice one sample, never the store. The first failure is
        logged, the later ones only at debug level."""
        try:
            return codec_choice.calibrate(chunk.key, chunk.layers, chunk.codec, self._e.s.zstd_level)
        except Exception as err:
            level = logging.DEBUG if self._calibration_failed else logging.WARNING
            self._calibration_failed = True
            log.log(
                level,
                "s3kv: codec calibration on chunk %s failed, the store goes on: %s: %s",
                chunk.key.hex(),
                type(err).__name__,
                err,
            )
            return None

    async def _save(self, place: Place, chunk: ChunkData, start: float) -> None:
        """Write ``chunk`` to ``place``'s tier, timed for its codec choice (``codec: auto``)."""
        e = self._e
        handler = e.handlers[place.tier]
        choice = e.codec_choices.get(place.tier)
        if choice is None:
            await handler.save(place, chunk, start)
            return
        with choice.transfer() as moved:
            n = await handler.save(place, chunk, start)
            if n is not None:
                moved[0] = n
