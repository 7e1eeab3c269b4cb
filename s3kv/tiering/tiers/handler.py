"""The worker side of a tier: a :class:`TierHandler` holds the bytes (reads
a chunk into a sink, writes one) and says what its tier's trouble is, so
that the transfer engine runs loads and stores over it without naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import numpy as np

from s3kv.errors import CorruptChunk, GaveUp, NotFound, PermissionDenied, Throttled, Transient
from s3kv.frame_sinks import FrameInto, FrameSink
from s3kv.stats import Counters
from s3kv.tiering.chunks import ChunkCodec, ChunkData
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import Place
from s3kv.tiering.tiers.report import RankReport

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

    @abstractmethod
    async def read(
        self,
        place: Place,
        key: bytes,
        sink: FrameInto,
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
        tier lacks the chunk), False if it ends with ``e`` (a tier whose
        own trouble should not end a load overrides this)."""
        name, kind = self.tier.value, error_kind(e)
        if isinstance(e, (NotFound, CorruptChunk)):
            self.counters.add(f"load_errors_{kind}")
            log.warning("s3kv: chunk %s %s in %s: %s", key.hex(), kind, name, e)
            self.missed(key)
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
        return False

    def missed(self, key: bytes) -> None:
        """A read found ``key`` absent or corrupt here: the tier forgets it,
        and the tier answered, so it works (news for its breaker)."""
        self.report.tier_ok(self.tier)
        self.report.missing(self.tier, key)

    def store_codec(self) -> ChunkCodec | None:
        """The codec this tier writes a chunk in now (its writer's pick
        under ``codec: auto``); None: it holds pages, not objects."""
        return None

    async def save(self, place: Place, chunk: ChunkData, start: float | None = None) -> int | None:
        """:meth:`write` ``chunk`` (a store's write-through, or a promotion)
        and report how it went; the bytes written, or None."""
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
        return n

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


class PageTierHandler(TierHandler):
    """A tier stored from the pages themselves, not from the encoded chunk
    (the host pool): a store's pages are copied straight into its place by
    the connector (:meth:`stage`), and the farther targets of the store read
    them from there; a promotion fills it as the load's layers arrive; a
    synchronous load copies its :meth:`pages` straight into the KV cache."""

    @abstractmethod
    def pages(self, place: Place, key: bytes) -> list[np.ndarray] | None:
        """``key``'s pages at ``place``, one array a layer, for the connector
        to copy into the KV cache; None where ``place`` does not hold it."""

    @abstractmethod
    def stage(self, place: Place) -> list[np.ndarray]:
        """Claim ``place`` for a store whose pages the connector copies in
        (one writable array a layer): the store's :meth:`write` then takes
        them where they are."""

    @abstractmethod
    def open_fill(self, place: Place, key: bytes) -> FrameSink:
        """Start writing ``key`` at ``place`` as its layers are loaded: the
        sink takes each one."""

    @abstractmethod
    def close_fill(self, place: Place, key: bytes) -> int:
        """The fill's layers are all checked and written: ``key`` is there
        now; returns the bytes it takes."""
