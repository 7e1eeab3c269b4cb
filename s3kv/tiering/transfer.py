"""The worker's transfer engine: executes the scheduler's plans against this
rank's tiers (host pool, NVMe directory, S3) in the background, and reports
what finished.

It knows nothing of vLLM or torch. The connector hands it host buffers to
store (already filled, or with a ``ready`` callable that waits for the copy)
and a sink that writes loaded pages into the KV cache; it polls :meth:`poll`
once per step. Nothing here blocks the caller on I/O: write-through beyond
``max_inflight_bytes`` is dropped and counted, not queued.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from s3kv.auth import FleetKeys
from s3kv.errors import (
    AlreadyExists,
    CorruptChunk,
    NotFound,
    PermissionDenied,
    Precondition,
    StorageFull,
    Throttled,
    Transient,
)
from s3kv.keys import object_key
from s3kv.stats import Counters
from s3kv.stores.base import ObjectStore, PutMode
from s3kv.tiering.chunks import (
    ChunkCodec,
    ChunkData,
    ChunkId,
    PageFormat,
    load_chunk,
    read_header,
)
from s3kv.tiering.disk import DiskTier
from s3kv.tiering.hostpool import HostPool
from s3kv.tiering.loop import BackgroundLoop, unbind_thread
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import LoadChunk, StoreChunk

log = logging.getLogger("s3kv.transfer")

ChunkSink = Callable[[LoadChunk, int, np.ndarray], None]
"""sink(chunk, layer index, page bytes): write one layer of a loaded chunk."""


@dataclass
class PollResult:
    finished_loads: dict[str, list[LoadChunk]] = field(default_factory=dict)
    """Job id -> the chunks that failed (empty list: all loaded)."""
    written: dict[Tier, dict[bytes, int]] = field(default_factory=dict)
    """Tier -> key -> bytes: this rank's shard of the key is in the tier now
    (stored, promoted, or found already there)."""
    failed: dict[Tier, set[bytes]] = field(default_factory=dict)
    """Tier -> keys whose write was dropped or failed."""
    missing: dict[Tier, set[bytes]] = field(default_factory=dict)
    """Tier -> keys a load found absent or corrupt there."""
    released: list[bytes] = field(default_factory=list)
    """Stores that no longer read their CPU slot."""
    tier_ok: dict[Tier, int] = field(default_factory=dict)
    """Tier -> transfers (loads, writes) it answered: served, or said the
    object is absent, corrupt, in the way (a 412) or not ours to read (a 403
    on that object). A working tier's answers: what closes its breaker."""
    tier_failed: dict[Tier, int] = field(default_factory=dict)
    """Tier -> transfers that failed because the tier itself is in trouble
    (S3 not answering, throttling, refusing our credentials, a timeout; the
    disk erring or too slow): what its breaker hears."""
    bad: dict[bytes, str | None] = field(default_factory=dict)
    """Key -> ETag of this rank's S3 object of it, found corrupt and not
    deleted (no permission): to be reported to the fleet as bad."""
    existing: set[bytes] = field(default_factory=set)
    """Keys whose S3 store found the object already there (a 412)."""
    disk_full: bool = False


@dataclass(frozen=True)
class EngineSettings:
    namespace: str | None
    """None until the model's identity is known (:meth:`TransferEngine.set_namespace`)."""
    prefix: str
    rank: int
    num_layers: int
    codec: str = "zstd"
    zstd_level: int = 1
    range_bytes: int = 8 << 20
    max_inflight_bytes: int = 1 << 30
    load_timeout_s: float = 30.0
    threads: int = 4
    disk_path: str | None = None
    disk_fsync: bool = False
    disk_timeout_s: float = 5.0
    """A chunk read or write on the NVMe tier slower than this, from when a
    thread starts it, counts as a disk failure (a read falls back to S3). A
    read that waits this long for a thread goes to the next source, blaming
    the disk only if its threads are stuck (busy is not failing)."""
    keys: FleetKeys | None = None
    """The fleet secret: sign what is stored, read only what is signed."""


@dataclass
class StoreJob:
    key: bytes
    layers: Sequence[np.ndarray]
    """Host copies of the chunk's pages, one per layer (slot views or private)."""
    slot: int | None = None
    disk: bool = False
    s3: bool = False
    ready: Callable[[], None] | None = None
    """Blocks until ``layers`` hold the pages (a device copy may be in flight)."""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.layers)


STORE_NICE = 10
"""Niceness of the write-through threads (Linux: per thread)."""


def _background_priority() -> None:
    unbind_thread()
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), STORE_NICE)


DISK_THREADS = 2
"""Threads for NVMe reads, and as many again for writes: a slow or hung
disk ties up these, never the ones that decode S3 loads or encode stores,
and writes queued behind slow writes never hold up a read."""

UNREADABLE_SIZE = 1 << 16
"""Keys remembered whose S3 object this rank may not read (~100 bytes each)."""


class GaveUp(Transient):
    """A transfer abandoned because another one on its tier failed for the
    tier's sake, it waited too long for a thread, or its load's deadline
    came first. Not itself news to the tier's breaker."""


class _Began:
    """When a worker thread took a job up: set from that thread, awaited on
    the event loop (a tier's time starts then, not while the job is queued).
    ``running``: the jobs of its threads under way, shared by them."""

    def __init__(self, running: set[_Began]) -> None:
        self._loop = asyncio.get_running_loop()
        self._running = running
        self.event = asyncio.Event()
        self.at: float | None = None

    def wrap(self, fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
        def job() -> Any:
            self.at = time.monotonic()
            self._running.add(self)
            with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown)
                self._loop.call_soon_threadsafe(self.event.set)
            try:
                return fn(*args)
            finally:
                self._running.discard(self)

        return job

    def threads_stuck(self, timeout_s: float) -> bool:
        """Is a job that holds a thread this one waits for under way for
        longer than ``timeout_s`` (the tier hung, not merely busy)?"""
        now = time.monotonic()
        return any(now - job.at > timeout_s for job in list(self._running) if job.at is not None)


class _Gate:
    """One load attempt's way into the KV cache (and its CPU promotion slot):
    open until :meth:`close`, which waits for a write in progress."""

    def __init__(self, chunk: LoadChunk, sink: ChunkSink, pool: HostPool | None) -> None:
        self._chunk, self._sink, self._pool = chunk, sink, pool
        self._lock = threading.Lock()
        self._open = True

    def sink(self, layer: int, data: np.ndarray) -> None:
        with self._lock:
            if self._open:
                self._sink(self._chunk, layer, data)
                if self._pool is not None:
                    np.copyto(self._pool.layer_view(self._chunk.promote_slot, layer), data.reshape(-1))  # type: ignore[arg-type]

    def close(self) -> None:
        with self._lock:
            self._open = False


class TransferEngine:
    def __init__(
        self, s3: ObjectStore | None, settings: EngineSettings, counters: Counters | None = None
    ) -> None:
        self.s3 = s3
        self.s = settings
        self.counters = counters or Counters()
        self._loop = BackgroundLoop("s3kv-transfer")
        self._executor = concurrent.futures.ThreadPoolExecutor(
            settings.threads, thread_name_prefix="s3kv-codec", initializer=unbind_thread
        )
        # Write-through (encode, NVMe writes) is background work: its threads
        # run at a lower CPU priority, so they never slow a forward or a load.
        self._store_executor = concurrent.futures.ThreadPoolExecutor(
            max(1, settings.threads // 2), thread_name_prefix="s3kv-store", initializer=_background_priority
        )
        self._disk_read_executor = concurrent.futures.ThreadPoolExecutor(
            DISK_THREADS, thread_name_prefix="s3kv-disk-read", initializer=unbind_thread
        )
        self._disk_write_executor = concurrent.futures.ThreadPoolExecutor(
            DISK_THREADS, thread_name_prefix="s3kv-disk-write", initializer=unbind_thread
        )
        self._disk_running: dict[bool, set[_Began]] = {False: set(), True: set()}
        """Reads (False) and writes (True) under way on the disk's threads."""
        self._aborts: dict[tuple[Tier, bool], asyncio.Event] = {}
        """Per (tier, loads?): set when a transfer on the tier failed for the
        tier's sake, so that the others in flight give up instead of waiting
        their timeout. A failed load stops loads and writes; a failed write
        only writes (loads that are going fine go on)."""
        self._unreadable: dict[bytes, None] = {}
        """Keys whose S3 object refused this rank (a 403 on that object): a
        store that finds it in the way (a 412) does not publish it."""
        self._lock = threading.Lock()
        self._results = PollResult()
        self._inflight_bytes = 0
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._closed = False
        if s3 is not None:
            self._track(self._loop.submit(s3.open()))  # connect before the first load
        self.namespace: str | None = settings.namespace
        self.codec: ChunkCodec | None = None
        self.pool: HostPool | None = None
        self.disk: DiskTier | None = None
        self._fmt: PageFormat | None = None
        self.on_s3_storing: Callable[[bytes], None] | None = None
        """Told of each chunk PUT as it starts (the worker's journal)."""
        self.on_s3_stored: Callable[[bytes], None] | None = None
        """Told of each chunk object this engine created in S3 (its PUT
        returned): the worker publishes them from here (manifest.publish)."""

    def configure(self, fmt: PageFormat, pool: HostPool | None = None) -> None:
        """The KV cache is known: loads must match ``fmt``, stores record it."""
        self._fmt = fmt
        self.pool = pool
        if self.namespace is not None:
            self.set_namespace(self.namespace)

    def set_namespace(self, namespace: str) -> None:
        """The namespace every chunk shard of this engine is in (known once
        the model's identity is): objects are named and checked by it."""
        self.namespace = namespace
        if self._fmt is None:
            return
        self.codec = ChunkCodec(
            namespace, self.s.rank, self.s.num_layers, self._fmt, self.s.codec, self.s.zstd_level, self.s.keys
        )
        if self.s.disk_path is not None:
            self.disk = DiskTier(Path(self.s.disk_path), self.codec, fsync=self.s.disk_fsync)

    def chunk_id(self, key: bytes) -> ChunkId:
        assert self.namespace is not None, "no namespace yet"
        return ChunkId(
            object_key(self.s.prefix, self.namespace, key, self.s.rank),
            self.namespace,
            key.hex(),
            self.s.rank,
        )

    # -- results ---------------------------------------------------------------
    def _written(self, tier: Tier, key: bytes, nbytes: int) -> None:
        with self._lock:
            self._results.written.setdefault(tier, {})[key] = nbytes

    def _failed(self, tier: Tier, key: bytes) -> None:
        with self._lock:
            self._results.failed.setdefault(tier, set()).add(key)

    def _missing(self, tier: Tier, key: bytes) -> None:
        with self._lock:
            self._results.missing.setdefault(tier, set()).add(key)

    def _released(self, key: bytes) -> None:
        with self._lock:
            self._results.released.append(key)

    def _tier_ok(self, tier: Tier) -> None:
        with self._lock:
            self._results.tier_ok[tier] = self._results.tier_ok.get(tier, 0) + 1

    def _tier_failed(self, tier: Tier, *, abort_loads: bool = True) -> None:
        """The tier failed a transfer for its own sake: the breaker hears it,
        and the tier's other writes in flight give up, and its loads too
        unless ``abort_loads`` is False (a write failed: loads of other
        requests that are going fine must not fail for it)."""
        with self._lock:
            self._results.tier_failed[tier] = self._results.tier_failed.get(tier, 0) + 1
        for loads in (False, True) if abort_loads else (False,):
            event = self._aborts.pop((tier, loads), None)
            if event is not None:
                event.set()

    @staticmethod
    def _tier_trouble(tier: Tier, e: BaseException) -> bool:
        """Does ``e`` say that ``tier`` itself is in trouble (news for its
        breaker), rather than something about one object or transfer?"""
        if isinstance(e, GaveUp):
            return False
        if isinstance(e, PermissionDenied):
            # S3: a 403 on one object (a bucket policy, a KMS key for its
            # prefix) is that object's; refused credentials are the tier's.
            return e.credentials or tier is not Tier.S3
        return isinstance(e, (Transient, asyncio.TimeoutError))

    async def _on_tier(
        self,
        tier: Tier,
        coro: Any,
        timeout_s: float,
        *,
        load: bool,
        began: _Began | None = None,
        queue_s: float | None = None,
        deadline: float | None = None,
    ) -> Any:
        """Run one transfer (a load, else a write) on ``tier``. It fails for
        the tier's sake (TimeoutError) when the tier takes longer than
        ``timeout_s``: from now, or where ``began`` is given from when a
        thread took the job up (time queued behind other work is not the
        tier's), or when no thread took it up within ``queue_s`` because
        they are stuck past ``timeout_s``. It gives up (GaveUp) when another
        transfer on the tier failed for the tier's sake, when no thread was
        free within ``queue_s`` (busy, not stuck), or at ``deadline`` (its
        load's) before the tier's time was up."""
        event = self._aborts.setdefault((tier, load), asyncio.Event())
        task = asyncio.ensure_future(coro)
        aborted = asyncio.ensure_future(event.wait())
        started = asyncio.ensure_future(began.event.wait()) if began is not None else None
        queued_at = time.monotonic()
        start = None if began is not None else queued_at
        try:
            while True:
                ends: dict[str, float] = {}  # on a tie the tier's own time counts first
                if start is not None:
                    ends["tier"] = start + timeout_s
                elif queue_s is not None:
                    ends["queue"] = queued_at + queue_s
                if deadline is not None:
                    ends["deadline"] = deadline
                first = min(ends, key=ends.__getitem__) if ends else None
                timeout = max(0.0, ends[first] - time.monotonic()) if first is not None else None
                waits = {task, aborted} if started is None or start is not None else {task, aborted, started}
                done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if task in done:
                    return task.result()
                if aborted in done:
                    raise GaveUp(f"{tier.value}: given up, another transfer found the tier failing")
                if start is None and started in done:
                    start = began.at  # type: ignore[union-attr]
                    continue
                if first == "tier":
                    raise asyncio.TimeoutError(f"{tier.value}: no answer within {timeout_s:.1f} s")
                if first == "queue":
                    if began.threads_stuck(timeout_s):  # type: ignore[union-attr]
                        raise asyncio.TimeoutError(
                            f"{tier.value}: its threads are stuck past {timeout_s:.1f} s"
                        )
                    raise GaveUp(f"{tier.value}: given up, no thread free within {queue_s:.1f} s")
                raise GaveUp(f"{tier.value}: given up, no time left before the load's deadline")
        finally:
            aborted.cancel()
            if started is not None:
                started.cancel()
            if not task.done():
                task.cancel()  # a queued disk job is dropped; a running one ends behind a closed gate

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _run_background(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._store_executor, fn, *args)

    async def _run_disk(self, fn: Callable[..., Any], *args: Any, write: bool = False) -> Any:
        """``fn(*args)`` on the NVMe tier's read (or write) threads."""
        executor = self._disk_write_executor if write else self._disk_read_executor
        return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(fn, *args))

    def _disk_op(self, fn: Callable[..., Any], *args: Any, write: bool = False) -> tuple[Any, _Began]:
        """(``fn(*args)`` on the disk's threads, to await; when a thread took it up)."""
        began = _Began(self._disk_running[write])
        return self._run_disk(began.wrap(fn, *args), write=write), began

    # -- loads -----------------------------------------------------------------
    def submit_load(self, job_id: str, chunks: Sequence[LoadChunk], sink: ChunkSink) -> None:
        """Load ``chunks`` in the background; the job shows up in a later
        :meth:`poll` with the chunks that failed."""
        self._track(self._loop.submit(self._load_job(job_id, list(chunks), sink)))

    async def _load_job(self, job_id: str, chunks: list[LoadChunk], sink: ChunkSink) -> None:
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(self._load_one(c, sink) for c in chunks))
        failed = [c for c, ok in zip(chunks, outcomes) if not ok]
        if not failed and self.s.rank == 0:  # one observation per request, not per rank
            self.counters.observe("request_load_seconds", time.perf_counter() - start)
        with self._lock:
            self._results.finished_loads[job_id] = failed

    async def _load_one(self, chunk: LoadChunk, sink: ChunkSink) -> bool:
        start = time.perf_counter()
        pool = self.pool if chunk.promote_slot is not None else None
        if pool is not None:
            pool.claim(chunk.promote_slot, None)  # type: ignore[arg-type]
        try:
            tier, nbytes, blob = await self._load_from_sources(
                chunk, sink, pool, time.monotonic() + self.s.load_timeout_s
            )
        except Exception as e:  # every failure becomes a recompute, never an engine error
            kind = self._classify(e)
            if kind not in ("missing", "corrupt", "denied"):  # those were counted per tier
                self.counters.add(f"load_errors_{kind}")
                log.warning("s3kv: load of chunk %s failed (%s): %s", chunk.key.hex(), kind, e)
            self._promotion_failed(chunk)
            return False
        self._tier_ok(tier)
        self.counters.add(f"load_chunks_{tier.value}")
        self.counters.add(f"load_bytes_{tier.value}", nbytes)
        self.counters.observe(f"load_seconds_{tier.value}", time.perf_counter() - start)
        if pool is not None:
            pool.claim(chunk.promote_slot, chunk.key)  # type: ignore[arg-type]
            self._written(Tier.CPU, chunk.key, pool.slot_bytes)
            self.counters.add("promote_chunks_cpu")
        if chunk.promote_disk:
            if blob is not None and self.disk is not None:
                self._track(self._loop.submit(self._write_disk(ChunkData(chunk.key, self.codec, blob=blob))))
            else:
                self._failed(Tier.DISK, chunk.key)
        return True

    def _promotion_failed(self, chunk: LoadChunk) -> None:
        if chunk.promote_slot is not None:
            self._failed(Tier.CPU, chunk.key)
        if chunk.promote_disk:
            self._failed(Tier.DISK, chunk.key)

    async def _load_from_sources(
        self, chunk: LoadChunk, sink: ChunkSink, pool: HostPool | None, deadline: float
    ) -> tuple[Tier, int, bytes | None]:
        """(tier it came from, bytes read, the object if asked to keep it).
        A tier that lacks the chunk (absent, corrupt, a 403 on the object) is
        reported and the next source tried; so is a disk that errs, is too
        slow or has no thread free. Other errors end the load, and so does
        the deadline (GaveUp: no tier's fault)."""
        last: Exception | None = None
        for i, tier in enumerate(chunk.sources):
            left = deadline - time.monotonic()
            if left <= 0:  # an earlier source took the time: this one is not to blame
                raise GaveUp(f"{tier.value}: given up, no time left before the load's deadline")
            # Each attempt writes the KV cache through a gate of its own: once
            # it is over (done, failed, timed out, given up) no late write of
            # a decoding thread reaches blocks that are vLLM's again, or that
            # the next source is writing.
            gate = _Gate(chunk, sink, pool)
            try:
                if tier is Tier.CPU:
                    if self.pool is None:
                        raise NotFound("no host pool")
                    nbytes = await self._run(self.pool.read, chunk.key, gate.sink, chunk.cpu_slot)
                    return tier, nbytes, None
                if tier is Tier.DISK:
                    if self.disk is None:
                        raise NotFound("no disk tier")
                    read, began = self._disk_op(self.disk.read, chunk.key, gate.sink)
                    timeout_s = self.s.disk_timeout_s
                    nbytes = await self._on_tier(
                        tier, read, timeout_s, load=True, began=began, queue_s=timeout_s, deadline=deadline
                    )
                    return tier, nbytes, None
                if self.s3 is None:
                    raise NotFound("no S3 tier")
                load = load_chunk(
                    self.s3,
                    self.chunk_id(chunk.key),
                    gate.sink,
                    chunk_codec=self.codec,  # type: ignore[arg-type]
                    range_bytes=self.s.range_bytes,
                    executor=self._executor,
                    keep_blob=chunk.promote_disk,
                )
                fetched, blob = await self._on_tier(tier, load, left, load=True)
                self._unreadable.pop(chunk.key, None)
                return tier, fetched, blob
            except (NotFound, CorruptChunk) as e:
                kind = self._classify(e)
                self.counters.add(f"load_errors_{kind}")
                log.warning("s3kv: chunk %s %s in %s: %s", chunk.key.hex(), kind, tier.value, e)
                if self._has(tier):  # the tier answered: it works
                    self._tier_ok(tier)
                self._missing(tier, chunk.key)
                if tier is Tier.S3 and isinstance(e, CorruptChunk):
                    await self._delete_corrupt(chunk.key, e.etag)
                last = e
            except Exception as e:
                if isinstance(e, PermissionDenied) and not self._tier_trouble(tier, e):
                    # A 403 on this object only: S3 works, the object is not
                    # ours to read. Dropped here (not reported bad: another
                    # replica's role may read it, and gc would delete it).
                    self.counters.add("load_errors_denied")
                    log.warning("s3kv: chunk %s not readable in %s: %s", chunk.key.hex(), tier.value, e)
                    self._tier_ok(tier)
                    self._missing(tier, chunk.key)
                    self._unreadable[chunk.key] = None
                    if len(self._unreadable) > UNREADABLE_SIZE:
                        self._unreadable.clear()
                    last = e
                    continue
                kind = self._classify(e)
                if self._tier_trouble(tier, e):
                    self._tier_failed(tier)
                if tier is not Tier.DISK or i == len(chunk.sources) - 1:
                    raise
                self.counters.add(f"load_errors_{kind}")  # the disk failed us: try the next source
                log.warning("s3kv: NVMe read of chunk %s failed (%s): %s", chunk.key.hex(), kind, e)
                last = e
            finally:
                gate.close()
        raise last if last is not None else NotFound(chunk.key.hex())

    async def _delete_corrupt(self, key: bytes, etag: str | None) -> None:
        """The object is ours (our namespace and key) and unusable: remove it
        so that a later store can write a good one, but only the version that
        was read (If-Match), never a good one written since. Without the
        permission (or a conditional delete), report it bad to the fleet."""
        cid = self.chunk_id(key)
        reason = "no ETag was read"
        if etag is not None:
            try:
                await self.s3.delete_if(cid.object_key, etag)  # type: ignore[union-attr]
                return
            except (NotFound, Precondition):
                return  # gone, or rewritten since: nothing of ours to remove
            except PermissionDenied as e:
                reason = f"no permission to delete it ({e})"
            except NotImplementedError:
                reason = "the store has no conditional delete"
            except Exception as e:
                log.warning("s3kv: could not delete corrupt %s: %s", cid.object_key, e)
                return
        log.warning("s3kv: corrupt %s is reported to the fleet as bad: %s", cid.object_key, reason)
        self.counters.add("quarantined_chunks")
        with self._lock:
            self._results.bad[key] = etag

    def _has(self, tier: Tier) -> bool:
        return (self.disk if tier is Tier.DISK else self.s3 if tier is Tier.S3 else None) is not None

    @staticmethod
    def _classify(e: BaseException) -> str:
        if isinstance(e, NotFound):
            return "missing"
        if isinstance(e, CorruptChunk):
            return "corrupt"
        if isinstance(e, asyncio.TimeoutError):
            return "timeout"
        if isinstance(e, GaveUp):
            return "gave_up"
        if isinstance(e, Throttled):
            return "throttled"
        if isinstance(e, PermissionDenied):
            return "unavailable" if e.credentials else "denied"
        if isinstance(e, Transient):
            return "unavailable"
        return "other"

    # -- stores ------------------------------------------------------------------
    def accepts(self, nbytes: int) -> bool:
        """Would a write-through of ``nbytes`` fit in the byte budget now?"""
        with self._lock:
            return not self._closed and self._inflight_bytes + nbytes <= self.s.max_inflight_bytes

    def drop(self, store: StoreChunk) -> None:
        """A planned store that is not even copied out (over the byte budget)."""
        self.counters.add("store_dropped_backpressure")
        if store.disk:
            self._failed(Tier.DISK, store.key)
        if store.s3:
            self._failed(Tier.S3, store.key)

    def submit_store(self, job: StoreJob) -> bool:
        """Take one chunk shard into the tiers the job names. Its CPU slot (if
        any) counts as written once ``ready``; the write-through to NVMe and S3
        runs in the background, or is dropped (False) past the byte budget."""
        if self.codec is None:
            raise RuntimeError("configure() must be called before storing")
        through = job.disk or job.s3
        nbytes = job.nbytes
        with self._lock:
            if through and (self._closed or self._inflight_bytes + nbytes > self.s.max_inflight_bytes):
                through = False
                self.counters.add("store_dropped_backpressure")
            elif through:
                self._inflight_bytes += nbytes
                self.counters.set("inflight_bytes", self._inflight_bytes)
        if job.disk and not through:
            self._failed(Tier.DISK, job.key)
        if job.s3 and not through:
            self._failed(Tier.S3, job.key)
        if self._closed:  # stopping: nothing new starts
            if job.slot is not None:
                self._failed(Tier.CPU, job.key)
            return False
        self._track(self._loop.submit(self._store(job, through, nbytes)))
        return through or not (job.disk or job.s3)

    async def _store(self, job: StoreJob, through: bool, nbytes: int) -> None:
        key = job.key
        pins_slot = job.slot is not None and (job.disk or job.s3)
        try:
            if job.ready is not None:
                try:
                    await self._run(job.ready)
                except Exception as e:  # the copy out of the KV cache failed
                    log.error("s3kv: copying chunk %s out of the KV cache failed: %s", key.hex(), e)
                    for tier, wanted in (
                        (Tier.CPU, job.slot is not None),
                        (Tier.DISK, through and job.disk),
                        (Tier.S3, through and job.s3),
                    ):
                        if wanted:
                            self._failed(tier, key)
                    return
            if job.slot is not None and self.pool is not None:
                self.pool.claim(job.slot, key)
                self._written(Tier.CPU, key, self.pool.slot_bytes)
                self.counters.add("store_chunks_cpu")
            if not through:
                return
            start = time.perf_counter()
            chunk = ChunkData(key, self.codec, layers=job.layers)  # type: ignore[arg-type]
            try:
                await self._run_background(lambda: chunk.blob)
            except Exception as e:
                log.error("s3kv: encoding chunk %s failed: %s", key.hex(), e)
                for tier, wanted in ((Tier.DISK, job.disk), (Tier.S3, job.s3)):
                    if wanted:
                        self._failed(tier, key)
                return
            finally:
                if pins_slot:  # the slot is read: the scheduler may reuse it
                    self._released(key)
                    pins_slot = False
            self.counters.add("store_raw_bytes", chunk.raw_bytes)
            self.counters.add("store_encoded_bytes", len(chunk.blob))
            writes = []
            if job.disk:
                writes.append(self._write_disk(chunk, start))
            if job.s3:
                writes.append(self._write_s3(chunk, start))
            await asyncio.gather(*writes)
        finally:
            if pins_slot:
                self._released(key)
            if through:
                with self._lock:
                    self._inflight_bytes -= nbytes
                    self.counters.set("inflight_bytes", self._inflight_bytes)

    async def _write_disk(self, chunk: ChunkData, start: float | None = None) -> None:
        if self.disk is None:
            self._failed(Tier.DISK, chunk.key)
            return
        try:
            write, began = self._disk_op(self.disk.write, chunk.key, chunk, write=True)
            # Write-through is background work: it may wait for a thread as
            # long as a load may take, then it is dropped (a disk failure
            # only if the threads are stuck).
            n = await self._on_tier(
                Tier.DISK,
                write,
                self.s.disk_timeout_s,
                load=False,
                began=began,
                queue_s=self.s.load_timeout_s,
            )
        except StorageFull as e:
            self.counters.add("store_dropped_disk_full")
            log.warning("s3kv: NVMe tier full, chunk not stored there: %s", e)
            with self._lock:
                self._results.disk_full = True
            self._failed(Tier.DISK, chunk.key)
            return
        except Exception as e:
            self.counters.add("store_errors_disk")
            if self._tier_trouble(Tier.DISK, e):
                self._tier_failed(Tier.DISK, abort_loads=False)
            log.warning("s3kv: NVMe write of chunk %s failed: %s", chunk.key.hex(), e)
            self._failed(Tier.DISK, chunk.key)
            return
        self._tier_ok(Tier.DISK)
        self.counters.add("store_chunks_disk")
        self.counters.add("store_bytes_disk", n)
        if start is not None:
            self.counters.observe("store_seconds_disk", time.perf_counter() - start)
        self._written(Tier.DISK, chunk.key, n)

    async def _write_s3(self, chunk: ChunkData, start: float) -> None:
        cid = self.chunk_id(chunk.key)
        blob = chunk.blob
        try:
            try:
                if self.on_s3_storing is not None:
                    self.on_s3_storing(chunk.key)
                await self.s3.put(cid.object_key, blob, mode=PutMode.CREATE)  # type: ignore[union-attr]
            except AlreadyExists:
                self.counters.add("store_chunks_existing")
                if chunk.key in self._unreadable or not await self._existing_is_ours(cid, blob):
                    self._tier_ok(Tier.S3)  # S3 answered; the object in the way is not one to publish
                    self._failed(Tier.S3, chunk.key)
                    return
                with self._lock:
                    self._results.existing.add(chunk.key)
            else:
                self.counters.add("store_chunks_s3")
                self.counters.add("store_bytes_s3", len(blob))
                self.counters.observe("store_seconds_s3", time.perf_counter() - start)
                if self.on_s3_stored is not None:
                    self.on_s3_stored(chunk.key)
        except Exception as e:
            self.counters.add("store_errors_s3")
            if self._tier_trouble(Tier.S3, e):
                self._tier_failed(Tier.S3, abort_loads=False)
            log.warning("s3kv: store of %s failed: %s", cid.object_key, e)
            self._failed(Tier.S3, chunk.key)
            return
        self._tier_ok(Tier.S3)
        self._written(Tier.S3, chunk.key, len(blob))

    async def _existing_is_ours(self, cid: ChunkId, blob: bytes) -> bool:
        """A create-only store found ``cid`` there. Without a fleet secret any
        object counts (its frames are checked when loaded). With one, only an
        object whose header carries a valid MAC does: one that fails is
        deleted (if it was not rewritten since) and ours written instead, or,
        without the permission to delete it, reported bad. The key is never
        published from an object that could not be verified."""
        if self.s.keys is None:
            return True
        assert self.s3 is not None and self.codec is not None
        try:
            await read_header(self.s3, cid, chunk_codec=self.codec, prefetch=self.codec.max_header + 64)
            return True
        except NotFound:
            pass  # deleted meanwhile (or of a newer format: the create-only PUT below finds it)
        except PermissionDenied as e:
            if e.credentials:
                raise
            log.warning("s3kv: %s exists but is not ours to read (%s): not published", cid.object_key, e)
            return False
        except CorruptChunk as e:  # only the object's own bytes: a network fault raises Transient
            log.warning("s3kv: %s exists but does not verify (%s)", cid.object_key, e)
            self._missing(Tier.S3, bytes.fromhex(cid.key_hex))
            await self._delete_corrupt(bytes.fromhex(cid.key_hex), e.etag)
        try:
            await self.s3.put(cid.object_key, blob, mode=PutMode.CREATE)
        except AlreadyExists:
            return False  # someone wrote it again first: not verified, not published by us
        self.counters.add("store_chunks_s3")
        return True

    # -- results and lifecycle -----------------------------------------------------
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
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                pending = list(self._pending)
            if not pending:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            concurrent.futures.wait(pending, timeout=left)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Run ``coro`` on the engine's loop until it ends or :meth:`close`
        cancels it; :meth:`drain` does not wait for it."""
        return self._loop.submit(coro)

    def close(
        self, timeout_s: float = 10.0, flush: Callable[[], Coroutine[Any, Any, Any]] | None = None
    ) -> None:
        """Stop taking stores, let those under way finish, then ``flush``
        (publish what they stored), all within ``timeout_s``; what is still
        running then is cancelled (a multipart upload is aborted, a single
        PUT never completes: no incomplete object under a real name)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # submit_store drops write-throughs from here
        deadline = time.monotonic() + timeout_s
        reserve = min(1.0, timeout_s / 4) if flush is not None else 0.0
        if not self.drain(max(0.0, timeout_s - reserve)):
            log.warning("s3kv: abandoning unfinished transfers at shutdown")
        if flush is not None:
            try:
                self._loop.run(flush(), timeout=max(0.1, deadline - time.monotonic()))
            except Exception as e:
                log.warning("s3kv: publishing the last stores at shutdown failed: %r", e)

        async def abandon() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # aborts run in their handlers
            if self.s3 is not None:
                await self.s3.close()

        with contextlib.suppress(Exception):
            self._loop.run(abandon(), timeout=max(0.1, deadline - time.monotonic()))
        self._loop.stop(timeout=max(0.1, deadline - time.monotonic()))
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._store_executor.shutdown(wait=False, cancel_futures=True)
        self._disk_read_executor.shutdown(wait=False, cancel_futures=True)
        self._disk_write_executor.shutdown(wait=False, cancel_futures=True)
        self.pool = None
