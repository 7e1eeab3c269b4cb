"""The worker's transfer engine: executes the scheduler's plans over this
rank's tier handlers (:mod:`s3kv.tiering.tiers`) in the background, and
reports what finished. It knows nothing of vLLM or torch, and no tier by
name: each handler says what its tier's trouble is and how it runs.

The connector hands it host buffers to store (already filled, or with a
``ready`` callable that waits for the copy) and a :class:`PageSink` that
writes loaded pages into the KV cache (the loads run in
:mod:`s3kv.tiering.worker.loads`, the stores in
:mod:`s3kv.tiering.worker.stores`); it polls :meth:`poll` once per step.
Nothing here blocks the caller on I/O: write-through beyond
``max_inflight_bytes`` is dropped and counted, not queued.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from s3kv.chunk_reader import PageFormat
from s3kv.manifest.publish import Published
from s3kv.stats import Counters
from s3kv.stores.base import ObjectStore
from s3kv.tiering.chunks import ChunkCodec
from s3kv.tiering.codec_choice import AUTO, Calibrations, TierChoice, default_machine_cores
from s3kv.tiering.loop import JobLoop
from s3kv.tiering.meter import LoadMeter
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import LoadChunk, Place, StoreChunk, TierReport
from s3kv.tiering.tiers.handler import PageTierHandler, TierHandler
from s3kv.tiering.tiers.registry import TIERS
from s3kv.tiering.tiers.report import RankReport
from s3kv.tiering.tiers.settings import EngineSettings, WorkerEnv
from s3kv.tiering.worker.gate import PageSink
from s3kv.tiering.worker.hostpool import HostPool
from s3kv.tiering.worker.loads import NO_PAGES, Loads
from s3kv.tiering.worker.stores import StoreJob, Stores


@dataclass
class Polled:
    report: TierReport
    """This rank's report since the last poll (counts of 1 per key)."""
    finished_loads: dict[str, list[LoadChunk]]
    """Job id -> the chunks that failed (empty list: all loaded)."""


class TransferEngine:
    def __init__(
        self,
        s3: ObjectStore | None,
        settings: EngineSettings,
        counters: Counters | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        loop: JobLoop | None = None,
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
        self._owns_loop = loop is None
        """False for a :meth:`sibling`: the loop, its threads and the store are the first engine's."""
        self._loop = loop if loop is not None else JobLoop("s3kv-transfer", settings.threads, clock)
        self._loads = Loads(self, self._loop)
        self._stores = Stores(self, self._loop)
        self.report = RankReport()
        self.handlers: dict[Tier, TierHandler] = {}
        """The tiers this rank holds, nearest first (built once the namespace is known)."""
        if s3 is not None and self._owns_loop:
            self._loop.track(s3.open())  # connect before the first load
        self.namespace: str | None = settings.namespace
        self.codec: ChunkCodec | None = None
        self.calibrations = Calibrations()
        """``codec: auto``'s decode rates and ratio, measured on this engine's chunks (its tiers share them)."""
        self.codec_choices: dict[Tier, TierChoice] = self._codec_choices()
        """The codec choice of each tier whose codec is ``auto``, fed by this engine's transfers."""
        for choice in self.codec_choices.values():
            self.counters.set(f"codec_compressed_{choice.label}", int(choice.codec != "none"))
        self._pool: HostPool | None = None
        self._fmt: PageFormat | None = None
        self._published: Published | None = None
        """Who the handlers tell of their chunk PUTs (:meth:`set_namespace`)."""

    def _codec_choices(self) -> dict[Tier, TierChoice]:
        s = self.s
        disk = s.wings.get(Tier.DISK)
        auto = [t for t, c in ((Tier.S3, s.codec), (Tier.DISK, getattr(disk, "codec", None))) if c == AUTO]
        cores = max(1, min(s.threads, default_machine_cores()))
        return {
            t: TierChoice(
                t.value,
                cores=cores,
                level=s.zstd_level,
                clock=self.clock,
                calibrations=self.calibrations,
                notify=self._codec_news,
            )
            for t in auto
        }

    def _codec_news(self, choice: TierChoice, switched_from: str | None) -> None:
        """A tier's codec choice made an estimate (and switched, from ``switched_from``)."""
        tier, est = choice.label, choice.last
        if switched_from is not None:
            self.counters.add(f"codec_switches_{tier}")
        self.counters.set(f"codec_compressed_{tier}", int(choice.codec != "none"))
        if est is not None and self.s.timing:  # one rank's estimates (the gauges add up over ranks)
            self.counters.set(f"codec_none_seconds_per_gb_{tier}", round(est.none_s, 4))
            self.counters.set(f"codec_compressed_seconds_per_gb_{tier}", round(est.compressed_s, 4))
            self.counters.set(f"codec_link_bytes_per_second_{tier}", round(est.link_bytes_per_s))

    def sibling(self, settings: EngineSettings) -> TransferEngine:
        """An engine for another shard of this rank (``settings.rank``): on
        this engine's loop and threads, with its store, counters and clock;
        :meth:`close` of this engine ends both (close the sibling after it)."""
        return TransferEngine(self.s3, settings, self.counters, self.clock, loop=self._loop)

    def configure(self, fmt: PageFormat, pool: HostPool | None = None) -> None:
        """The KV cache is known: loads must match ``fmt``, stores record it."""
        self._fmt = fmt
        self._pool = pool
        if self.namespace is not None:
            self.set_namespace(self.namespace, self._published)

    def set_namespace(self, namespace: str, published: Published | None = None) -> None:
        """The namespace of every chunk shard of this engine (known once the
        model's identity is); the handlers are built for it, and tell
        ``published`` (the rank's publisher) of their chunk PUTs."""
        self.namespace = namespace
        self._published = published
        if self._fmt is None:
            return
        s = self.s
        start = self.codec_choices[Tier.S3].codec if Tier.S3 in self.codec_choices else s.codec
        codec = ChunkCodec(namespace, s.rank, s.num_layers, self._fmt, start, s.zstd_level, s.keys)
        self.codec = codec
        env = WorkerEnv(
            s,
            codec,
            self.report,
            self.counters,
            self._loop.threads,
            self._pool,
            self.s3,
            published,
            self.codec_choices,
        )
        handlers = [h for spec in TIERS if (h := spec.handler(env)) is not None]
        for h in handlers:
            h.clock = self.clock
        for old in self.handlers.values():
            old.close()
        self.handlers = {h.tier: h for h in handlers}

    @property
    def chunk_raw_bytes(self) -> int:
        """KV bytes of one of this engine's chunk shards (0 before :meth:`configure`)."""
        return self._fmt.layer_bytes * self.s.num_layers if self._fmt is not None else 0

    def takes_pages(self, place: Place) -> bool:
        """Does ``place``'s tier store a chunk's pages as they are (a store's are copied straight in)?"""
        h = self.handlers.get(place.tier)
        return isinstance(h, PageTierHandler)

    # -- loads -----------------------------------------------------------------
    def submit_load(self, job_id: str, chunks: Sequence[LoadChunk], pages: PageSink) -> None:
        """Load ``chunks`` into ``pages`` in the background; the job (a
        request: it is ``load_failed`` if a chunk fails) shows up in a later
        :meth:`poll`. Each attempt writes through a
        :class:`~s3kv.tiering.worker.gate.Gate` of its own (see :class:`Loads`)."""
        self._loop.track(self._loads.job(job_id, list(chunks), pages))

    def submit_prefetch(self, chunks: Sequence[LoadChunk]) -> None:
        """Fetch ``chunks`` into the tiers they are promoted to, and nowhere
        else (no KV pages): only their writes are reported, not the job."""
        self._loop.track(self._loads.job(None, list(chunks), NO_PAGES))

    def page_tier(self, place: Place) -> PageTierHandler | None:
        """``place``'s tier where it holds pages as they are: the connector
        copies a synchronous load's pages out of it, a store's into it."""
        h = self.handlers.get(place.tier)
        return h if isinstance(h, PageTierHandler) else None

    # -- stores ------------------------------------------------------------------
    def accepts(self, nbytes: int) -> bool:
        """Would a write-through of ``nbytes`` fit in the byte budget now?"""
        return self._stores.accepts(nbytes)

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
        if not self.s.writes:  # another rank writes the same bytes there: its write is ours
            for p in encoded:
                self.report.written(p.tier, job.key)
            encoded = []
        nbytes = job.nbytes
        through = bool(encoded) and self._stores.reserve(nbytes)
        if not through:
            for p in encoded:
                self.report.failed(p.tier, job.key)
        if self._stores.closed:  # stopping: nothing new starts
            for p in pages:
                self.report.failed(p.tier, job.key)
            return False
        pins = job.pinned  # the write-through reads the pages' slot
        self._loop.track(self._stores.job(job, pages, encoded if through else [], pins, nbytes))
        return through or not encoded

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
        if not self._stores.close():  # submit_store drops write-throughs from here
            return
        if self._owns_loop:
            self._loop.close(timeout_s, flush, self.s3.close if self.s3 is not None else None)
        for h in self.handlers.values():
            h.close()
        self._pool = None
