"""The worker's transfer engine: executes the scheduler's plans over this
rank's tier handlers (:mod:`s3kv.tiering.tiers`) in the background, and
reports what finished. It knows nothing of vLLM or torch, and no tier by
name: each handler says what its tier's trouble is and how it runs.

The connector hands it host buffers to store (already filled, or with a
``ready`` callable that waits for the copy) and a :class:`PageSink` that
writes loaded pages into the KV cache; it polls :meth:`poll` once per step. Nothing here
blocks the caller on I/O: write-through beyond ``max_inflight_bytes`` is
dropped and counted, not queued.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from s3kv.chunk_reader import PageFormat
from s3kv.errors import GaveUp, NotFound
from s3kv.frame_sinks import FrameSink, PageTarget
from s3kv.stats import Counters
from s3kv.stores.base import ObjectStore
from s3kv.tiering.chunks import ChunkCodec, ChunkData
from s3kv.tiering.loop import JobLoop
from s3kv.tiering.meter import Attempt, LoadMeter
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import LoadChunk, Place, StoreChunk, TierReport
from s3kv.tiering.tiers.handler import PageTierHandler, TierHandler, error_kind
from s3kv.tiering.tiers.registry import TIERS
from s3kv.tiering.tiers.report import RankReport
from s3kv.tiering.tiers.settings import EngineSettings, WorkerEnv
from s3kv.tiering.worker.gate import Gate, PageSink
from s3kv.tiering.worker.hostpool import HostPool

log = logging.getLogger("s3kv.transfer")


class _NoPages:
    """The pages of a prefetch: none, its layers go to the promotions only."""

    def write(self, chunk: LoadChunk, layer: int, data: np.ndarray) -> None:
        pass

    def target(self, chunk: LoadChunk, layer: int) -> PageTarget | None:
        return None


@dataclass
class _Promotion:
    """A loaded chunk's copy into a tier that is written from the object."""

    handler: TierHandler
    place: Place
    key: bytes
    blob: bytes

    def save(self, codec: ChunkCodec) -> Coroutine[Any, Any, None]:
        return self.handler.save(self.place, ChunkData(self.key, codec, blob=self.blob))


@dataclass
class Polled:
    report: TierReport
    """This rank's report since the last poll (counts of 1 per key)."""
    finished_loads: dict[str, list[LoadChunk]]
    """Job id -> the chunks that failed (empty list: all loaded)."""


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


class TransferEngine:
    def __init__(
        self,
        s3: ObjectStore | None,
        settings: EngineSettings,
        counters: Counters | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.s3 = s3
        self.s = settings
        self.counters = counters or Counters()
        self.clock = clock
        """The worker's time: its loads' deadlines, its tiers' timeouts (each
        handler's :attr:`~TierHandler.clock`), its loop's timers, the loads'
        timings and the bounds of :meth:`drain` and :meth:`close` (a test
        drives them all with one fake clock)."""
        self.meter = LoadMeter(clock)
        """Times each load's chunks, tier by tier, for the cost model."""
        self._loop = JobLoop("s3kv-transfer", settings.threads, clock)
        self.report = RankReport()
        self.handlers: dict[Tier, TierHandler] = {}
        """The tiers this rank holds, nearest first (built once the namespace is known)."""
        self._lock = threading.Lock()
        self._inflight_bytes = 0
        self._closed = False
        if s3 is not None:
            self._loop.track(s3.open())  # connect before the first load
        self.namespace: str | None = settings.namespace
        self.codec: ChunkCodec | None = None
        self._pool: HostPool | None = None
        self._fmt: PageFormat | None = None
        self.on_s3_storing: Callable[[bytes], None] | None = None
        """Told of each chunk PUT as it starts (the worker's journal)."""
        self.on_s3_stored: Callable[[bytes], None] | None = None
        """Told of each chunk object this engine created in S3 (the worker publishes it)."""
        self.on_s3_settled: Callable[[bytes], None] | None = None
        """Told of each chunk PUT answered without creating an object (a 412: another's)."""

    def configure(self, fmt: PageFormat, pool: HostPool | None = None) -> None:
        """The KV cache is known: loads must match ``fmt``, stores record it."""
        self._fmt = fmt
        self._pool = pool
        if self.namespace is not None:
            self.set_namespace(self.namespace)

    def set_namespace(self, namespace: str) -> None:
        """The namespace of every chunk shard of this engine (known once the model's identity is)."""
        self.namespace = namespace
        if self._fmt is None:
            return
        s = self.s
        codec = ChunkCodec(namespace, s.rank, s.num_layers, self._fmt, s.codec, s.zstd_level, s.keys)
        self.codec = codec
        env = WorkerEnv(
            s,
            codec,
            self.report,
            self.counters,
            self._loop.threads,
            self._pool,
            self.s3,
            storing=lambda key: self.on_s3_storing(key) if self.on_s3_storing else None,
            stored=lambda key: self.on_s3_stored(key) if self.on_s3_stored else None,
            settled=lambda key: self.on_s3_settled(key) if self.on_s3_settled else None,
        )
        handlers = [h for spec in TIERS if (h := spec.handler(env)) is not None]
        for h in handlers:
            h.clock = self.clock
        for old in self.handlers.values():
            old.close()
        self.handlers = {h.tier: h for h in handlers}

    def takes_pages(self, place: Place) -> bool:
        """Does ``place``'s tier store a chunk's pages as they are (a store's are copied straight in)?"""
        h = self.handlers.get(place.tier)
        return isinstance(h, PageTierHandler)

    # -- loads -----------------------------------------------------------------
    def submit_load(self, job_id: str, chunks: Sequence[LoadChunk], pages: PageSink) -> None:
        """Load ``chunks`` into ``pages`` in the background; the job (a
        request: it is ``load_failed`` if a chunk fails) shows up in a later
        :meth:`poll`. Each attempt writes through a :class:`Gate` of its own."""
        self._loop.track(self._load_job(job_id, list(chunks), pages))

    def submit_prefetch(self, chunks: Sequence[LoadChunk]) -> None:
        """Fetch ``chunks`` into the tiers they are promoted to, and nowhere
        else (no KV pages): only their writes are reported, not the job."""
        self._loop.track(self._load_job(None, list(chunks), _NoPages()))

    async def _load_job(self, job_id: str | None, chunks: list[LoadChunk], pages: PageSink) -> None:
        clock = self.clock
        start = clock()
        # A request's copies into tiers written from the object (NVMe) start
        # once its last chunk is in: their decoding, encoding and writes would
        # take the cores its other chunks' reads and decodes need. A
        # prefetch (no job, no pages) writes each copy at once: that is its point.
        later: list[_Promotion] | None = [] if job_id is not None else None
        try:
            attempts = await asyncio.gather(*(self._load_one(c, pages, later) for c in chunks))
        except BaseException:  # cancelled (the engine is closing): the copies never start
            for promotion in later or ():
                self.report.failed(promotion.place.tier, promotion.key, started=False)
            raise
        failed = [c for c, a in zip(chunks, attempts) if a is None]
        if not failed and self.s.rank == 0:  # one observation per request, not per rank
            took = clock() - start
            if job_id is not None:
                self.counters.observe("request_load_seconds", took)
            done = [a for a in attempts if a is not None]
            for timing in self.meter.timings(job_id or "", done, took):  # ranks load alike
                self.report.timed(timing)
        if job_id is not None:
            self.report.finished(job_id, failed)
        for promotion in later or ():
            self._loop.track(promotion.save(self.codec))  # type: ignore[arg-type]

    async def _load_one(
        self,
        chunk: LoadChunk,
        pages: PageSink,
        later: list[_Promotion] | None = None,
    ) -> Attempt | None:
        """Load one chunk: the attempt at the tier it came from, or None if it
        failed. Its copies into tiers written from the object go to ``later``
        (the job starts them), or start now."""
        key = chunk.key
        promote = [(self.handlers.get(p.tier), p) for p in chunk.promote]
        fills = [(h, p) for h, p in promote if isinstance(h, PageTierHandler)]  # filled as layers load
        copies = [(h, p) for h, p in promote if not isinstance(h, PageTierHandler)]  # written from the object
        sinks: list[FrameSink] = [h.open_fill(p, key) for h, p in fills]
        try:
            deadline = self.clock() + self.s.load_timeout_s
            source, nbytes, blob, attempt = await self._load_from_sources(
                chunk, pages, sinks, bool(copies), deadline
            )
        except Exception as e:  # every failure becomes a recompute, never an engine error
            kind = error_kind(e)
            if kind not in ("missing", "corrupt", "denied"):  # those were counted per tier
                self.counters.add(f"load_errors_{kind}")
                log.warning("s3kv: load of chunk %s failed (%s): %s", key.hex(), kind, e)
            for h, p in promote:  # the promotions are off
                # A fill may have written some layers; one from the object never began.
                self.report.failed(p.tier, key, started=(h, p) in fills)
            return None
        tier = source.tier.value
        self.report.tier_ok(source.tier)
        self.counters.add(f"load_chunks_{tier}")
        self.counters.add(f"load_bytes_{tier}", nbytes)
        self.counters.observe(f"load_seconds_{tier}", attempt.ended - attempt.started)
        for h, p in fills:
            h.close_fill(p, key)
            self.report.written(p.tier, key)
            self.counters.add(f"promote_chunks_{p.tier.value}")
        for h, p in copies:
            if blob is None or h is None:
                self.report.failed(p.tier, key)
            elif later is not None:
                later.append(_Promotion(h, p, key, blob))
            else:
                self._loop.track(_Promotion(h, p, key, blob).save(self.codec))  # type: ignore[arg-type]
        return attempt

    async def _load_from_sources(
        self,
        chunk: LoadChunk,
        pages: PageSink,
        fills: list[FrameSink],
        keep_blob: bool,
        deadline: float,
    ) -> tuple[TierHandler, int, bytes | None, Attempt]:
        """(handler it came from, bytes read, the object if asked to keep it,
        the attempt there: timed by itself, not from the load's start).
        A tier that lacks the chunk (absent, corrupt, a 403 on the object) is
        reported and the next source tried; so is one whose handler falls
        through on its own trouble (a disk that errs, is too slow or has no
        thread free). Other errors end the load, and so does the deadline
        (GaveUp: no tier's fault)."""
        last: Exception | None = None
        for i, place in enumerate(chunk.sources):
            tier = place.tier
            if deadline - self.clock() <= 0:  # an earlier source took the time: this one is not to blame
                raise GaveUp(f"{tier.value}: given up, no time left before the load's deadline")
            h = self.handlers.get(tier)
            # Each attempt writes the KV cache through a gate of its own: once
            # it is over (done, failed, timed out, given up) no late write of
            # a decoding thread reaches blocks that are vLLM's again, or that
            # the next source is writing.
            gate = Gate(pages, chunk, fills)
            try:
                if h is None:
                    raise NotFound(f"no {tier.value} tier here")
                with self.meter.attempt(tier) as attempt:
                    nbytes, blob = await h.read(
                        place, chunk.key, gate, deadline=deadline, keep_blob=keep_blob
                    )
                return h, nbytes, blob, attempt
            except Exception as e:
                last = e
                if h is None:
                    self.counters.add("load_errors_missing")
                    self.report.missing(tier, chunk.key)
                elif not h.read_failed(chunk.key, e, last=i == len(chunk.sources) - 1):
                    raise
            finally:
                gate.close()
        raise last if last is not None else NotFound(chunk.key.hex())

    # -- stores ------------------------------------------------------------------
    def accepts(self, nbytes: int) -> bool:
        """Would a write-through of ``nbytes`` fit in the byte budget now?"""
        with self._lock:
            return not self._closed and self._inflight_bytes + nbytes <= self.s.max_inflight_bytes

    def drop(self, store: StoreChunk) -> None:
        """A planned store that is not even copied out (over the byte budget)."""
        self.counters.add("store_dropped_backpressure")
        for p in store.targets:
            if not self.takes_pages(p):
                self.report.failed(p.tier, store.key)

    def submit_store(self, job: StoreJob) -> bool:
        """Take one chunk shard into the tiers the job names. A tier that
        takes pages holds it once ``ready``; the write-through to the others
        runs in the background, or is dropped (False) past the byte budget."""
        if self.codec is None:
            raise RuntimeError("configure() must be called before storing")
        for p in job.targets:
            if p.tier not in self.handlers:  # not a tier of this rank's
                self.report.failed(p.tier, job.key)
        pages = [p for p in job.targets if p.tier in self.handlers and self.takes_pages(p)]
        encoded = [p for p in job.targets if p.tier in self.handlers and not self.takes_pages(p)]
        through = bool(encoded)
        nbytes = job.nbytes
        with self._lock:
            if through and (self._closed or self._inflight_bytes + nbytes > self.s.max_inflight_bytes):
                through = False
                self.counters.add("store_dropped_backpressure")
            elif through:
                self._inflight_bytes += nbytes
                self.counters.set("inflight_bytes", self._inflight_bytes)
        if not through:
            for p in encoded:
                self.report.failed(p.tier, job.key)
        if self._closed:  # stopping: nothing new starts
            for p in pages:
                self.report.failed(p.tier, job.key)
            return False
        pins = job.pinned  # the write-through reads the pages' slot
        self._loop.track(self._store(job, pages, encoded if through else [], pins, nbytes))
        return through or not encoded

    async def _store(
        self, job: StoreJob, pages: list[Place], encoded: list[Place], pins: bool, nbytes: int
    ) -> None:
        key = job.key
        try:
            if job.ready is not None:
                try:
                    await self._loop.in_threads(job.ready)
                except Exception as e:  # the copy out of the KV cache failed
                    log.error("s3kv: copying chunk %s out of the KV cache failed: %s", key.hex(), e)
                    for p in pages + encoded:
                        self.report.failed(p.tier, key)
                    return
            chunk = ChunkData(key, self.codec, layers=job.layers)  # type: ignore[arg-type]
            for p in pages:
                try:
                    await self.handlers[p.tier].write(p, chunk)
                except Exception as e:
                    log.error("s3kv: copying chunk %s into the %s tier failed: %s", key.hex(), p, e)
                    self.report.failed(p.tier, key)
                    continue
                self.report.written(p.tier, key)
            if not encoded:
                return
            start = time.perf_counter()
            try:
                await self._loop.in_background(lambda: chunk.blob)
            except Exception as e:
                log.error("s3kv: encoding chunk %s failed: %s", key.hex(), e)
                for p in encoded:
                    self.report.failed(p.tier, key)
                return
            finally:
                if pins:  # the slot is read: the scheduler may reuse it
                    self.report.released(key)
                    pins = False
            self.counters.add("store_raw_bytes", chunk.raw_bytes)
            self.counters.add("store_encoded_bytes", len(chunk.blob))
            await asyncio.gather(*(self.handlers[p.tier].save(p, chunk, start) for p in encoded))
        finally:
            if pins:
                self.report.released(key)
            if encoded:
                with self._lock:
                    self._inflight_bytes -= nbytes
                    self.counters.set("inflight_bytes", self._inflight_bytes)

    # -- results and lifecycle -----------------------------------------------------
    def poll(self) -> Polled:
        """What finished since the last poll."""
        return Polled(*self.report.take())

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` (on :attr:`clock`) for queued work; True if all of it finished."""
        return self._loop.drain(timeout_s)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Run ``coro`` on the engine's loop until it ends or :meth:`close`
        cancels it; :meth:`drain` does not wait for it."""
        return self._loop.submit(coro)

    def close(
        self, timeout_s: float = 10.0, flush: Callable[[], Coroutine[Any, Any, Any]] | None = None
    ) -> None:
        """Stop taking stores, let those under way finish, then ``flush``
        (publish what they stored), all within ``timeout_s`` on :attr:`clock`; what is still
        running then is cancelled (a multipart upload is aborted, a single
        PUT never completes: no incomplete object under a real name)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # submit_store drops write-throughs from here
        self._loop.close(timeout_s, flush, self.s3.close if self.s3 is not None else None)
        for h in self.handlers.values():
            h.close()
        self._pool = None
