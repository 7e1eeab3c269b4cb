"""The worker's transfer engine: runs loads and stores of chunk shards in the
background, against one object store, and reports what finished.

It knows nothing of vLLM or torch. The connector hands it page bytes to
store and a sink to receive loaded pages; it polls :meth:`poll` once per
step. Nothing here blocks the caller on I/O: stores beyond
``max_inflight_bytes`` are dropped and counted, not queued.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from s3kv.errors import CorruptChunk, NotFound, Transient
from s3kv.keys import object_key
from s3kv.stats import Counters
from s3kv.stores.base import ObjectStore
from s3kv.tiering.chunks import ChunkId, PageFormat, load_chunk, store_chunk
from s3kv.tiering.loop import BackgroundLoop

log = logging.getLogger("s3kv.transfer")


@dataclass(frozen=True)
class LoadRequest:
    """One chunk of a load job; ``tag`` is the caller's (e.g. block ids)."""

    key: bytes
    tag: Any


ChunkSink = Callable[[Any, int, np.ndarray], None]
"""sink(tag, layer index, page bytes): write one layer of a loaded chunk."""


@dataclass
class PollResult:
    finished_loads: dict[str, list[Any]] = field(default_factory=dict)
    """Job id -> tags of the chunks that failed (empty list: all loaded)."""
    stored: list[bytes] = field(default_factory=list)
    """Keys whose shard this rank has in the store now (written or found)."""
    missing: list[bytes] = field(default_factory=list)
    """Keys the store does not hold usably (absent or corrupt)."""
    store_failed: list[bytes] = field(default_factory=list)
    """Keys whose store was dropped or failed."""
    loaded: int = 0
    """Chunks loaded successfully."""
    unavailable: int = 0
    """Chunk loads that failed because the store did not answer (unreachable,
    throttling, timeout): a reason to stop asking it for a while."""


@dataclass(frozen=True)
class EngineSettings:
    namespace: str
    prefix: str
    rank: int
    num_layers: int
    codec: str = "zstd"
    zstd_level: int = 1
    range_bytes: int = 8 << 20
    max_inflight_bytes: int = 1 << 30
    load_timeout_s: float = 30.0
    threads: int = 4


class TransferEngine:
    def __init__(
        self, store: ObjectStore, settings: EngineSettings, counters: Counters | None = None
    ) -> None:
        self.store = store
        self.s = settings
        self.counters = counters or Counters()
        self._loop = BackgroundLoop("s3kv-transfer")
        self._executor = concurrent.futures.ThreadPoolExecutor(
            settings.threads, thread_name_prefix="s3kv-codec"
        )
        self._lock = threading.Lock()
        self._results = PollResult()
        self._inflight_bytes = 0
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._closed = False
        self._track(self._loop.submit(store.open()))  # connect before the first load
        self.page_format: PageFormat | None = None
        """Set once the KV cache is known; loads must match it, stores record it."""

    # -- identity -----------------------------------------------------------
    def chunk_id(self, key: bytes) -> ChunkId:
        return ChunkId(
            object_key(self.s.prefix, self.s.namespace, key, self.s.rank),
            self.s.namespace,
            key.hex(),
            self.s.rank,
        )

    # -- loads --------------------------------------------------------------
    def submit_load(self, job_id: str, chunks: Sequence[LoadRequest], sink: ChunkSink) -> None:
        """Load ``chunks`` in the background; the job shows up in a later
        :meth:`poll` with the tags of the chunks that failed."""
        self._track(self._loop.submit(self._load_job(job_id, list(chunks), sink)))

    async def _load_job(self, job_id: str, chunks: list[LoadRequest], sink: ChunkSink) -> None:
        outcomes = await asyncio.gather(*(self._load_one(c, sink) for c in chunks))
        failed = [c.tag for c, ok in zip(chunks, outcomes) if not ok]
        with self._lock:
            self._results.finished_loads[job_id] = failed

    async def _load_one(self, chunk: LoadRequest, sink: ChunkSink) -> bool:
        cid = self.chunk_id(chunk.key)
        start = time.perf_counter()
        # Decoding runs in executor threads that a timeout cannot stop. Once
        # this load is over (done, failed or timed out) its blocks belong to
        # vLLM again: the gate makes sure no late write reaches them.
        gate = threading.Lock()
        open_ = [True]

        def gated_sink(layer: int, data: np.ndarray) -> None:
            with gate:
                if open_[0]:
                    sink(chunk.tag, layer, data)

        def close_gate() -> None:
            with gate:
                open_[0] = False

        try:
            fetched = await asyncio.wait_for(
                load_chunk(
                    self.store,
                    cid,
                    gated_sink,
                    num_layers=self.s.num_layers,
                    range_bytes=self.s.range_bytes,
                    expect=self.page_format,
                    executor=self._executor,
                ),
                self.s.load_timeout_s,
            )
        except Exception as e:  # every failure becomes a recompute, never an engine error
            close_gate()
            kind = self._classify(e)
            self.counters.add(f"load_errors_{kind}")
            if kind in ("unavailable", "timeout"):
                with self._lock:
                    self._results.unavailable += 1
            log.warning("s3kv: load of %s failed (%s): %s", cid.object_key, kind, e)
            if kind in ("missing", "corrupt"):
                with self._lock:
                    self._results.missing.append(chunk.key)
            if kind == "corrupt":
                # The object is ours (our namespace and key) and unusable:
                # remove it so that a later store can write a good one.
                try:
                    await self.store.delete(cid.object_key)
                except Exception as de:
                    log.warning("s3kv: could not delete corrupt %s: %s", cid.object_key, de)
            return False
        close_gate()
        with self._lock:
            self._results.loaded += 1
        self.counters.add("load_chunks")
        self.counters.add("load_bytes", fetched)
        self.counters.add("load_seconds", time.perf_counter() - start)
        return True

    @staticmethod
    def _classify(e: BaseException) -> str:
        if isinstance(e, NotFound):
            return "missing"
        if isinstance(e, CorruptChunk):
            return "corrupt"
        if isinstance(e, asyncio.TimeoutError):
            return "timeout"
        if isinstance(e, Transient):
            return "unavailable"
        return "other"

    # -- stores -------------------------------------------------------------
    def submit_store(self, key: bytes, layers: Sequence[np.ndarray]) -> bool:
        """Queue one chunk shard for upload; False if dropped for backpressure.
        ``layers`` must be private copies: the caller may reuse the pages."""
        fmt = self.page_format
        if fmt is None:
            raise RuntimeError("page_format must be set before storing")
        nbytes = sum(a.nbytes for a in layers)
        with self._lock:
            if self._closed or self._inflight_bytes + nbytes > self.s.max_inflight_bytes:
                self.counters.add("store_dropped_backpressure")
                self._results.store_failed.append(key)
                return False
            self._inflight_bytes += nbytes
        self._track(self._loop.submit(self._store_one(key, layers, fmt, nbytes)))
        return True

    async def _store_one(
        self, key: bytes, layers: Sequence[np.ndarray], fmt: PageFormat, nbytes: int
    ) -> None:
        cid = self.chunk_id(key)
        start = time.perf_counter()
        try:
            raw, stored, written = await store_chunk(
                self.store,
                cid,
                layers,
                fmt,
                codec_name=self.s.codec,
                level=self.s.zstd_level,
                executor=self._executor,
            )
        except Exception as e:
            self.counters.add("store_errors")
            log.warning("s3kv: store of %s failed: %s", cid.object_key, e)
            with self._lock:
                self._results.store_failed.append(key)
            return
        finally:
            with self._lock:
                self._inflight_bytes -= nbytes
        if written:
            self.counters.add("store_chunks")
            self.counters.add("store_raw_bytes", raw)
            self.counters.add("store_bytes", stored)
        else:
            self.counters.add("store_chunks_existing")
        self.counters.add("store_seconds", time.perf_counter() - start)
        with self._lock:
            self._results.stored.append(key)

    # -- results and lifecycle ---------------------------------------------
    @property
    def inflight_bytes(self) -> int:
        return self._inflight_bytes

    def _track(self, fut: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._untrack)

    def _untrack(self, fut: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._pending.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            log.error("s3kv: background task failed: %r", fut.exception())

    def poll(self) -> PollResult:
        """What finished since the last poll."""
        with self._lock:
            result, self._results = self._results, PollResult()
        return result

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for queued work; True if all of it finished."""
        with self._lock:
            pending = list(self._pending)
        done, not_done = concurrent.futures.wait(pending, timeout=timeout_s)
        return not not_done

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush pending stores for up to ``timeout_s``, then abandon the rest."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if not self.drain(timeout_s):
            log.warning("s3kv: abandoning unfinished transfers at shutdown")
        with contextlib.suppress(Exception):
            self._loop.run(self.store.close(), timeout=5)
        self._loop.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)
