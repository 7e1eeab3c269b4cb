"""The two halves every tier implements: a :class:`TierManager` on the scheduler side
(what the tier holds, where a chunk goes, what it evicts, its breaker) and a
:class:`TierHandler` in each worker (the bytes: read a chunk into a sink, write one).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from s3kv.auth import FleetKeys
from s3kv.chunk_reader import FrameRead, FrameSink, PageTarget, scatter, scratch_buffer
from s3kv.config import DEFAULTS, S3KVConfig
from s3kv.errors import CorruptChunk, GaveUp, NotFound, PermissionDenied, Throttled, Transient
from s3kv.stats import Counters
from s3kv.stores.base import ObjectStore
from s3kv.tiering.breaker import Breaker
from s3kv.tiering.chunks import ChunkCodec, ChunkData
from s3kv.tiering.placement import Tier, TierIndex
from s3kv.tiering.plan import LoadChunk, LoadTiming, Place, TierEvent, TierReport
from s3kv.tiering.worker.hostpool import HostPool

# -- scheduler side ---------------------------------------------------------------


def store_owner(key: bytes) -> tuple[str, bytes]:
    """Who holds a breaker's probe for a planned store of ``key`` (a store may be the probe)."""
    return ("store", key)


class TierEvents:
    """The KV events of every tier, in the order they happened (one stream for
    vLLM's routers). Off unless vLLM's KV events are on."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self._events: list[TierEvent] = []
        self._info: OrderedDict[bytes, tuple[bytes | None, tuple[int, ...]]] = OrderedDict()
        """Parent key and tokens of chunks being written, for their events."""

    def remember(self, key: bytes, parent: bytes | None, token_ids: tuple[int, ...]) -> None:
        """Keep what a chunk's BlockStored event needs until it is written."""
        self._info[key] = (parent, token_ids)
        self._info.move_to_end(key)
        while len(self._info) > 1 << 14:
            self._info.popitem(last=False)

    def stored(self, tier: Tier, key: bytes) -> None:
        if self.enabled:
            parent, tokens = self._info.get(key, (None, ()))
            self._events.append(TierEvent(True, tier, key, parent, tokens))

    def removed(self, tier: Tier, key: bytes) -> None:
        if self.enabled:
            self._events.append(TierEvent(False, tier, key))

    def take(self) -> list[TierEvent]:
        out, self._events = self._events, []
        return out


class TierManager:
    """The scheduler side of one tier: what it holds, where a chunk goes in it,
    what it evicts, and (for tiers that can be in trouble) its breaker.

    The planner calls its managers nearest tier first and names none of them;
    what differs between tiers is here. Calls come from the scheduler's own
    thread only, must not block and do no I/O. The planner attaches its
    counters and event log (:meth:`attach`) before the first call.
    """

    tier: Tier
    sync_load = False
    """Loads from it are copies made during the step's forward (the CPU pool):
    a hit only from such tiers is loaded synchronously."""
    may_lose = True
    """A chunk it holds may turn out lost or corrupt when read: a load from it
    names farther tiers that have the chunk as fallbacks (:meth:`fallback`)."""
    stages_writes = False
    """A store's farther writes read the chunk from this tier's place (the CPU
    slot): it stays pinned until every rank released it."""
    remote = False
    """Far and slow (S3): chunks a waiting request will load from it are
    prefetched into the nearer tiers when the request arrives."""

    def __init__(self, breaker: Breaker | None = None) -> None:
        self.breaker = breaker
        """While the tier is in trouble, offer none of its hits and plan no
        writes to it; the other tiers go on (see :class:`Breaker`)."""
        self.counters = Counters()
        self.events = TierEvents()

    def attach(self, counters: Counters, events: TierEvents) -> None:
        self.counters, self.events = counters, events

    def _breaker(
        self, backoff_s: tuple[float, float], probe_timeout_s: float, clock: Callable[[], float]
    ) -> Breaker:
        """A breaker whose trips count as ``breaker_trips_<tier>``."""
        return Breaker(
            backoff_s,
            probe_timeout_s=probe_timeout_s,
            clock=clock,
            on_trip=lambda: self.counters.add(f"breaker_trips_{self.tier.value}"),
        )

    # -- use -------------------------------------------------------------------
    def allows(self, owner: Hashable, *, take: bool = True) -> bool:
        """May ``owner`` (a request, a store) use the tier now? With ``take``,
        a half-open breaker makes the first to ask its probe."""
        return self.breaker is None or self.breaker.allow(owner, take=take)

    def release(self, owner: Hashable) -> None:
        """``owner`` will not use the tier after all: a probe slot it holds
        goes to the next that asks."""
        if self.breaker is not None and not self.breaker.closed:
            self.breaker.release(owner)

    def probe(self, owner: Hashable, hit: bool) -> None:
        """A lookup of ``owner`` found (``hit``) or did not find chunks here:
        half-open, a request that hits the tier probes it."""
        if self.breaker is not None and not self.breaker.closed:
            if hit:
                self.allows(owner)
            else:
                self.breaker.release(owner)

    # -- loads -----------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes], fps: np.ndarray, start: int, end: int) -> list[bool]:
        """Which of chunks [start, end) of a request (``keys``, their
        fingerprints ``fps``) the tier can load now."""
        raise NotImplementedError

    def prepare_load(self, key: bytes) -> Place:
        """A load of ``key`` from this tier is planned: keep it (no eviction)
        until :meth:`complete_load`, and say where it is."""
        return Place(self.tier)

    def complete_load(self, key: bytes) -> None:
        """The load of ``key`` is over on every rank."""

    def fallback(self, key: bytes) -> Place | None:
        """Where to read ``key`` if a nearer tier's copy turns out lost, or None."""
        return None

    def record_use(self, keys: Sequence[bytes]) -> None:
        """Loads of these chunks are planned (from any tier): access records, for tiers that keep them."""

    # -- stores ----------------------------------------------------------------
    def prepare_store(self, key: bytes, owner: Hashable) -> Place | None:
        """Where a store of ``key`` from the KV cache goes in this tier, or None
        (held already, no room, in trouble). ``owner`` may become the probe."""
        return None

    def prepare_promotion(self, key: bytes) -> Place | None:
        """Where ``key``, loaded from a farther tier, is copied up in this one, or None."""
        return None

    def complete_store(self, key: bytes, ok: bool) -> None:
        """Every rank reported its write of ``key`` here (a store or a
        promotion): ``ok`` if all of them succeeded. A failed write gives a
        probe slot it held back."""
        if ok:
            self.events.stored(self.tier, key)
        elif self.breaker is not None:
            self.breaker.release(store_owner(key))

    def forget(self, key: bytes) -> None:
        """Workers found ``key`` absent or corrupt here."""
        self.events.removed(self.tier, key)

    def pin(self, key: bytes) -> None:
        """Keep ``key``'s place from eviction (a store's farther writes read it)."""

    def unpin(self, key: bytes) -> None:
        """Every rank let go of ``key``'s place."""

    # -- reports ---------------------------------------------------------------
    def on_report(
        self, report: TierReport, decided: Iterable[tuple[bytes, bool]], missing: Iterable[bytes]
    ) -> None:
        """A report from the workers: ``decided`` are this tier's writes every
        rank reported (key, all succeeded), ``missing`` the keys it lacks.
        Tiers that read more of the report override this."""
        for key, ok in decided:
            self.complete_store(key, ok)
        for key in missing:
            self.forget(key)

    def end_report(self, report: TierReport) -> None:
        """After the report's outcomes: the breaker hears the tier's own
        transfers, and no other tier's."""
        if self.breaker is not None:
            self.breaker.report(report.tier_ok.get(self.tier, 0), report.tier_failed.get(self.tier, 0))

    def gauges(self) -> dict[str, int]:
        """Figures for the step's stats."""
        if self.breaker is None:
            return {}
        return {f"breaker_open_{self.tier.value}": 0 if self.breaker.closed else 1}


class IndexedTierManager(TierManager):
    """A local tier whose placement is a :class:`TierIndex` (the CPU pool, the NVMe directory)."""

    def __init__(self, index: TierIndex, breaker: Breaker | None = None) -> None:
        super().__init__(breaker)
        self.index = index

    def lookup(self, keys: Sequence[bytes], fps: np.ndarray, start: int, end: int) -> list[bool]:
        index = self.index
        return [k in index for k in keys[start:end]]

    def prepare_load(self, key: bytes) -> Place:
        self.index.touch(key)
        self.index.pin(key)
        entry = self.index.get(key)
        return Place(self.tier, entry.slot if entry is not None else None)

    def complete_load(self, key: bytes) -> None:
        self.index.unpin(key)

    def pin(self, key: bytes) -> None:
        self.index.pin(key)

    def unpin(self, key: bytes) -> None:
        self.index.unpin(key)


# -- worker side -------------------------------------------------------------------

log = logging.getLogger("s3kv.transfer")


def error_kind(e: BaseException) -> str:
    """What kind of failure ``e`` is, as load errors are counted (``load_errors_{kind}``)."""
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


PROBE_SLACK_S = 10.0


def probe_timeout_s(config: S3KVConfig) -> float:
    """A tier's probe that never reports (its request gone) counts as failed
    once any load of it would have timed out."""
    return config.load_timeout_s + PROBE_SLACK_S


@dataclass(frozen=True)
class EngineSettings:
    """A worker's transfer settings, cut from the config by :meth:`from_config`;
    tests and benchmarks may build one (the defaults are the config's)."""

    namespace: str | None
    """None until the model's identity is known (:meth:`TransferEngine.set_namespace`)."""
    prefix: str
    rank: int
    num_layers: int
    codec: str = DEFAULTS.codec
    zstd_level: int = DEFAULTS.zstd_level
    range_bytes: int = DEFAULTS.range_bytes
    max_inflight_bytes: int = DEFAULTS.max_inflight_bytes
    load_timeout_s: float = DEFAULTS.load_timeout_s
    threads: int = 4
    """The engine's codec threads (not a config key)."""
    disk_path: str | None = DEFAULTS.disk_path
    disk_codec: str = DEFAULTS.disk_codec
    disk_fsync: bool = DEFAULTS.disk_fsync == "always"
    disk_timeout_s: float = DEFAULTS.disk_timeout_s
    """A chunk read or write on the NVMe tier slower than this, from when a
    thread starts it, counts as a disk failure (a read falls back to S3). A
    read that waits this long for a thread goes to the next source, blaming
    the disk only if its threads are stuck (busy is not failing)."""
    keys: FleetKeys | None = None
    """The fleet secret: sign what is stored, read only what is signed."""

    @classmethod
    def from_config(
        cls, config: S3KVConfig, *, rank: int, num_layers: int, keys: FleetKeys | None = None
    ) -> EngineSettings:
        """Rank ``rank``'s settings in ``config`` (no namespace yet)."""
        return cls(
            namespace=None,
            prefix=config.prefix,
            rank=rank,
            num_layers=num_layers,
            codec=config.codec,
            zstd_level=config.zstd_level,
            range_bytes=config.range_bytes,
            max_inflight_bytes=config.max_inflight_bytes,
            load_timeout_s=config.load_timeout_s,
            disk_path=config.disk_path,
            disk_codec=config.disk_codec,
            disk_fsync=config.disk_fsync == "always",
            disk_timeout_s=config.disk_timeout_s,
            keys=keys,
        )


@dataclass
class WorkerEnv:
    """What a worker's handlers are built from (:meth:`TierHandler.for_worker`)."""

    settings: EngineSettings
    codec: ChunkCodec
    report: RankReport
    counters: Counters
    threads: concurrent.futures.Executor
    """The engine's codec threads (decoding, slot copies)."""
    pool: HostPool | None
    store: ObjectStore | None
    storing: Callable[[bytes], None] | None = None
    stored: Callable[[bytes], None] | None = None
    settled: Callable[[bytes], None] | None = None


class RankReport:
    """This rank's :class:`TierReport` since the last :meth:`take`, filled
    from the engine's loop and threads (one rank counts 1 per key), and the
    loads that finished meanwhile."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._report = TierReport()
        self._loads: dict[str, list[LoadChunk]] = {}

    @contextlib.contextmanager
    def edit(self) -> Iterator[TierReport]:
        with self._lock:
            yield self._report

    def take(self) -> tuple[TierReport, dict[str, list[LoadChunk]]]:
        """(The report, job id -> the chunks that failed) since the last take."""
        with self._lock:
            report, self._report = self._report, TierReport()
            loads, self._loads = self._loads, {}
        return report, loads

    def finished(self, job_id: str, failed: list[LoadChunk]) -> None:
        """Load job ``job_id`` (a request's) is over; ``failed``: its chunks that did not load."""
        with self._lock:
            if failed:
                self._report.load_failed.add(job_id)
            self._loads[job_id] = failed

    def written(self, tier: Tier, key: bytes) -> None:
        with self._lock:
            self._report.written[(tier, key)] = 1

    def failed(self, tier: Tier, key: bytes, *, started: bool = True) -> None:
        """This rank's write of ``key`` to ``tier`` failed or was dropped;
        ``started=False``: it never began (a promotion whose load failed)."""
        with self._lock:
            self._report.failed[(tier, key)] = 1
            if not started:
                self._report.unstarted[(tier, key)] = 1

    def missing(self, tier: Tier, key: bytes) -> None:
        with self._lock:
            self._report.missing.add((tier, key))

    def released(self, key: bytes) -> None:
        with self._lock:
            self._report.released[key] = self._report.released.get(key, 0) + 1

    def tier_ok(self, tier: Tier) -> None:
        with self._lock:
            self._report.tier_ok[tier] = self._report.tier_ok.get(tier, 0) + 1

    def tier_failed(self, tier: Tier) -> None:
        with self._lock:
            self._report.tier_failed[tier] = self._report.tier_failed.get(tier, 0) + 1

    def timed(self, timing: LoadTiming) -> None:
        with self._lock:
            self._report.load_timings.append(timing)


class Began:
    """When a worker thread took a job up: set from that thread, awaited on
    the event loop (a tier's time starts then, not while the job is queued).
    ``running``: the jobs of its threads under way, shared by them;
    ``clock``: the tier's (:attr:`TierHandler.clock`)."""

    def __init__(self, running: set[Began], clock: Callable[[], float] = time.monotonic) -> None:
        self._loop = asyncio.get_running_loop()
        self._running = running
        self._clock = clock
        self.event = asyncio.Event()
        self.at: float | None = None

    def wrap(self, fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
        def job() -> Any:
            self.at = self._clock()
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
        now = self._clock()
        return any(now - job.at > timeout_s for job in list(self._running) if job.at is not None)


class Gate:
    """One load attempt's way into the KV cache (and the slots it promotes
    into): each layer goes to every sink while it is open; :meth:`close`
    waits for a write in progress, never for a disk (see :meth:`read_into`).
    ``target`` (where the first sink, the KV cache, can say) gives a
    layer's :class:`PageTarget` for :meth:`read_into`."""

    def __init__(
        self, sinks: list[FrameSink], target: Callable[[int], PageTarget | None] | None = None
    ) -> None:
        self._sinks = sinks
        self._target = target
        self._lock = threading.Lock()
        self._open = True

    def sink(self, layer: int, data: np.ndarray) -> None:
        with self._lock:
            if self._open:
                for sink in self._sinks:
                    sink(layer, data)

    __call__ = sink

    def read_into(self, layer: int, nbytes: int, read: FrameRead, *, may_stall: bool = False) -> None:
        """Have ``read`` put one layer's frame straight into its pages (or
        their pinned staging buffer), then commit it and hand it to the
        other sinks; without a target, into a scratch buffer handed to
        every sink. Nothing happens once the gate is closed.

        The contract a read straight into the pages relies on: ``read``
        checks the bytes after they were written there, so a frame that
        fails its checksum or MAC has already overwritten blocks of this
        load. That is safe because those blocks are this load's alone
        (allocated to the request, not yet computed, not yet in vLLM's
        prefix cache), and a failed frame fails the load: its blocks are
        reported as load errors, so vLLM recomputes them before any use,
        or the next source (S3) writes them again.

        ``may_stall``: ``read`` waits on a device that may never answer (a
        disk). It then runs outside the gate's lock, so that :meth:`close`
        (on the engine's loop, when the attempt timed out) does not wait for
        it, and into a buffer no other attempt or vLLM ever sees: the
        target's own (:attr:`PageTarget.private`), else this thread's
        scratch buffer, copied into the pages once checked, if the gate is
        still open. A read that returns after its load went on to the next
        source or gave its blocks back lands there, and goes no further."""
        if may_stall:
            self._read_aside(layer, nbytes, read)
            return
        with self._lock:
            if not self._open:
                return
            target = self._target(layer) if self._target is not None else None
            if target is None:
                buf = scratch_buffer(nbytes)
                read([buf])
                for sink in self._sinks:
                    sink(layer, buf)
                return
            read(target.buffers)
            self._commit(layer, nbytes, target, target.buffers)

    def _read_aside(self, layer: int, nbytes: int, read: FrameRead) -> None:
        """:meth:`read_into` for a read that may stall: read, then take the lock."""
        if not self._open:
            return
        target = self._target(layer) if self._target is not None else None
        parts = target.buffers if target is not None and target.private else [scratch_buffer(nbytes)]
        read(parts)
        with self._lock:
            if not self._open:  # the attempt is over: the bytes stay where they are
                return
            if target is None:
                for sink in self._sinks:
                    sink(layer, parts[0])
                return
            if not target.private:
                scatter(parts[0], target.buffers)
            self._commit(layer, nbytes, target, parts)

    def _commit(self, layer: int, nbytes: int, target: PageTarget, parts: list[np.ndarray]) -> None:
        """``target`` holds the checked frame (also in ``parts``): commit it,
        and the promotions copy it."""
        target.commit()
        if len(self._sinks) > 1:
            frame = parts[0] if len(parts) == 1 else np.concatenate(parts, out=scratch_buffer(nbytes))
            for sink in self._sinks[1:]:
                sink(layer, frame)

    def close(self) -> None:
        with self._lock:
            self._open = False


class TierHandler(ABC):
    """One tier's bytes in a worker, and its policy: what the transfer
    engine needs to run loads and stores over it without naming it.

    Methods run on the engine's event loop; a handler that blocks (files,
    codecs) runs that on threads of its own or the ones it was given. A
    handler reports what only it knows (a full disk, an object already
    there, a corrupt object it could not delete) into ``report`` and counts
    its own store counters; the engine reports the rest."""

    tier: ClassVar[Tier]
    label: ClassVar[str]
    """The tier's name in log messages."""
    takes_pages: ClassVar[bool] = False
    """Stored from the pages themselves (:meth:`open_fill`, a store's pages
    copied in by the connector), not from the encoded chunk; the farther
    targets of a store read the pages from it."""
    falls_through: ClassVar[bool] = False
    """A read that fails for the tier's sake goes on to the next source
    (instead of ending the load)."""
    misses_are_answers: ClassVar[bool] = True
    """A read that finds the chunk absent or corrupt counts as an answer of
    a working tier (for its breaker)."""

    def __init__(self, report: RankReport | None = None, counters: Counters | None = None) -> None:
        self.report = report if report is not None else RankReport()
        self.counters = counters if counters is not None else Counters()
        self._aborts: dict[bool, asyncio.Event] = {}
        """Per loads?: set when a transfer on the tier failed for the tier's
        sake, so that the others in flight give up instead of waiting their
        timeout."""
        self.clock: Callable[[], float] = time.monotonic
        """The tier's time: its transfers' timeouts, when its threads took
        them up and its loads' deadlines (the transfer engine sets its own
        clock here; a test may drive it)."""

    @classmethod
    @abstractmethod
    def for_worker(cls, env: WorkerEnv) -> TierHandler | None:
        """This tier's handler for a worker, or None where it has none."""

    @abstractmethod
    async def read(
        self,
        place: Place,
        key: bytes,
        sink: FrameSink,
        *,
        deadline: float | None = None,
        keep_blob: bool = False,
    ) -> tuple[int, bytes | None]:
        """Hand each checked layer of ``key`` to ``sink``; (bytes read, the
        encoded object if ``keep_blob`` and the tier has it). Raises
        NotFound, or CorruptChunk (and forgets the bad copy where it may),
        or what says the tier is in trouble (:meth:`trouble`); gives up
        (GaveUp) at ``deadline`` (on :attr:`clock`)."""

    @abstractmethod
    async def write(self, place: Place, chunk: ChunkData, start: float | None = None) -> int | None:
        """Store ``chunk``; the bytes it takes, or None when it was not
        stored and that is no error (said in ``report``). ``start``
        (``time.perf_counter()``): when the store began, for its timing."""

    @abstractmethod
    async def delete(self, place: Place, key: bytes) -> None:
        """Forget ``key``; absent is not an error."""

    @abstractmethod
    async def bytes_used(self) -> int:
        """Bytes this tier really holds (measured, not accounted)."""

    def read_failed(self, key: bytes, e: Exception, *, last: bool) -> bool:
        """Report what a failed :meth:`read` of ``key`` says (counted, logged,
        for the breaker); True if the load goes on to its next source (the
        tier lacks the chunk, or falls through on its own trouble and this
        is not the ``last`` source), False if it ends with ``e``."""
        name, kind = self.tier.value, error_kind(e)
        if isinstance(e, (NotFound, CorruptChunk)):
            self.counters.add(f"load_errors_{kind}")
            log.warning("s3kv: chunk %s %s in %s: %s", key.hex(), kind, name, e)
            if self.misses_are_answers:  # the tier answered: it works
                self.report.tier_ok(self.tier)
            self.report.missing(self.tier, key)
            return True
        if isinstance(e, PermissionDenied) and not self.trouble(e):
            # A 403 on this object only: the tier works, the object is not
            # ours to read. Dropped here (not reported bad: another replica's
            # role may read it, and gc would delete it).
            self.counters.add("load_errors_denied")
            log.warning("s3kv: chunk %s not readable in %s: %s", key.hex(), name, e)
            self.report.tier_ok(self.tier)
            self.report.missing(self.tier, key)
            return True
        if self.trouble(e):
            self.failing()
        if not self.falls_through or last:
            return False
        self.counters.add(f"load_errors_{kind}")  # the tier failed us: try the next source
        log.warning("s3kv: %s read of chunk %s failed (%s): %s", self.label, key.hex(), kind, e)
        return True

    async def save(self, place: Place, chunk: ChunkData, start: float | None = None) -> None:
        """:meth:`write` ``chunk`` (a store's write-through, or a promotion)
        and report how it went."""
        try:
            n = await self.write(place, chunk, start)
        except Exception as e:
            self.counters.add(f"store_errors_{self.tier.value}")
            if self.trouble(e):
                self.failing(loads=False)
            log.warning("s3kv: %s write of chunk %s failed: %s", self.label, chunk.key.hex(), e)
            n = None
        else:
            if n is not None:
                self.report.tier_ok(self.tier)
                self.report.written(self.tier, chunk.key)
        if n is None:  # failed, or not stored and the handler said why
            self.report.failed(self.tier, chunk.key)

    def open_fill(self, place: Place, key: bytes) -> FrameSink:
        """(``takes_pages`` tiers) Start writing ``key`` at ``place`` as its
        layers are loaded: the sink takes each one."""
        raise NotImplementedError(f"{self.label} is not filled from pages")

    def close_fill(self, place: Place, key: bytes) -> int:
        """The fill's layers are all checked and written: ``key`` is there
        now; returns the bytes it takes."""
        raise NotImplementedError(f"{self.label} is not filled from pages")

    def trouble(self, e: BaseException) -> bool:
        """Does ``e`` say that the tier itself is in trouble (news for its
        breaker), rather than something about one object or transfer?"""
        if isinstance(e, GaveUp):
            return False
        return isinstance(e, (PermissionDenied, Transient, asyncio.TimeoutError))

    def failing(self, *, loads: bool = True) -> None:
        """The tier failed a transfer for its own sake: its breaker hears it,
        its other writes in flight give up, and its loads too unless
        ``loads`` is False (a write failed: loads that are going fine must
        not fail for it)."""
        self.report.tier_failed(self.tier)
        for load in (False, True) if loads else (False,):
            event = self._aborts.pop(load, None)
            if event is not None:
                event.set()

    async def guard(
        self,
        coro: Awaitable[Any],
        timeout_s: float | None,
        *,
        load: bool,
        began: Began | None = None,
        queue_s: float | None = None,
        deadline: float | None = None,
    ) -> Any:
        """Run one transfer (a load, else a write) on the tier. It fails for
        the tier's sake (TimeoutError) when the tier takes longer than
        ``timeout_s``: from now, or where ``began`` is given from when a
        thread took the job up (time queued behind other work is not the
        tier's), or when no thread took it up within ``queue_s`` because
        they are stuck past ``timeout_s``. It gives up (GaveUp) when another
        transfer on the tier failed for the tier's sake, when no thread was
        free within ``queue_s`` (busy, not stuck), or at ``deadline`` (its
        load's) before the tier's time was up."""
        name = self.tier.value
        event = self._aborts.setdefault(load, asyncio.Event())
        task = asyncio.ensure_future(coro)
        aborted = asyncio.ensure_future(event.wait())
        started = asyncio.ensure_future(began.event.wait()) if began is not None else None
        queued_at = self.clock()
        start = None if began is not None else queued_at

        def left() -> dict[str, float]:
            """Seconds to each end that applies (on a tie the tier's own time counts first)."""
            now = self.clock()
            ends: dict[str, float] = {}
            if start is not None:
                if timeout_s is not None:
                    ends["tier"] = start + timeout_s - now
            elif queue_s is not None:
                ends["queue"] = queued_at + queue_s - now
            if deadline is not None:
                ends["deadline"] = deadline - now
            return ends

        try:
            while True:
                ends = left()
                first = min(ends, key=ends.__getitem__) if ends else None
                timeout = max(0.0, ends[first]) if first is not None else None
                waits = {task, aborted} if started is None or start is not None else {task, aborted, started}
                done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if task in done:
                    return task.result()
                if aborted in done:
                    raise GaveUp(f"{name}: given up, another transfer found the tier failing")
                if start is None and started in done:
                    start = began.at  # type: ignore[union-attr]
                    continue
                if first is None or left()[first] > 0:  # not yet, by the clock (a test's may stand still)
                    continue
                if first == "tier":
                    raise asyncio.TimeoutError(f"{name}: no answer within {timeout_s:.1f} s")
                if first == "queue":
                    if began.threads_stuck(timeout_s):  # type: ignore[union-attr,arg-type]
                        raise asyncio.TimeoutError(f"{name}: its threads are stuck past {timeout_s:.1f} s")
                    raise GaveUp(f"{name}: given up, no thread free within {queue_s:.1f} s")
                raise GaveUp(f"{name}: given up, no time left before the load's deadline")
        finally:
            aborted.cancel()
            if started is not None:
                started.cancel()
            if not task.done():
                task.cancel()  # a queued disk job is dropped; a running one ends behind a closed gate

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release the handler's threads (the engine is closing)."""
