"""An asyncio event loop in a daemon thread, for code that is not async itself
(vLLM calls connectors synchronously)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("s3kv.transfer")

try:
    _ALLOWED_CPUS = os.sched_getaffinity(0)
    """The process's cores when s3kv was first imported (its vLLM plugin is
    loaded before the CPU worker binds threads): a taskset or NUMA binding
    the user chose stays in force."""
except (AttributeError, OSError):
    _ALLOWED_CPUS = None


def unbind_thread() -> None:
    """Let the calling thread run on any core the process may use.

    vLLM's CPU worker binds its threads to the cores of its OpenMP team, and
    threads started later inherit that: s3kv's I/O, codec and copy threads
    would then take turns with the forward on its cores instead of using
    the ones the binding left free (vLLM keeps one for a KV connector)."""
    if _ALLOWED_CPUS is not None:
        with contextlib.suppress(AttributeError, OSError, ValueError):
            os.sched_setaffinity(0, _ALLOWED_CPUS)


class ClockedLoop(asyncio.SelectorEventLoop):
    """An event loop whose time is ``clock``'s: its timers (``asyncio.wait``
    and ``wait_for`` timeouts, ``asyncio.sleep``) run on that clock, so a
    test can drive every timeout of the code on the loop. A clock that
    stands still holds the timers; one moved by a test is seen when the
    loop next wakes (a callback scheduled from another thread wakes it)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.clock = clock

    def time(self) -> float:
        return self.clock()


class BackgroundLoop:
    """An event loop on a daemon thread of its own, timed by ``clock``
    (:class:`ClockedLoop`)."""

    def __init__(self, name: str = "s3kv-io", clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.loop = ClockedLoop(clock)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        unbind_thread()
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; thread-safe."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (not from the loop thread)."""
        return self.submit(coro).result(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel what is still running, stop the loop and join the thread."""
        if not self._thread.is_alive():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            self.run(cancel_all(), timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


STORE_NICE = 10
"""Niceness of the write-through threads (Linux: per thread)."""


def background_thread() -> None:
    """Initializer of threads that do background work (write-through
    encoding, NVMe writes): unbound, at :data:`STORE_NICE`, so that they
    take a core only when the forward and the loads leave it."""
    unbind_thread()
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), STORE_NICE)


def store_threads(threads: int) -> int:
    """Write-through (encoding) threads beside ``threads`` codec threads:
    half as many, and no more than the cores a forward leaves (one fewer
    than the process may use), at least one. This paces a burst of stores:
    where cores are few its chunks are encoded one after another, leaving
    the forward its cores so that decode steps stay even, while their NVMe
    writes and PUTs still overlap."""
    cores = len(_ALLOWED_CPUS) if _ALLOWED_CPUS else (os.cpu_count() or 1)
    return max(1, min(threads // 2, cores - 1))


class JobLoop(BackgroundLoop):
    """A background loop that keeps track of the jobs it runs (:meth:`drain`
    waits for them), with threads for blocking work: ``threads`` for
    decoding and copies, and :func:`store_threads` at a lower CPU priority
    (:data:`STORE_NICE`) for write-through (encoding), so that it never
    slows a forward or a load."""

    def __init__(self, name: str, threads: int, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(name, clock)
        self.threads = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="s3kv-codec", initializer=unbind_thread
        )
        self.background_threads = concurrent.futures.ThreadPoolExecutor(
            store_threads(threads), thread_name_prefix="s3kv-store", initializer=background_thread
        )
        self._lock = threading.Lock()
        self._pending: set[concurrent.futures.Future[Any]] = set()

    def track(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` as a job :meth:`drain` waits for; its failure is logged."""
        fut = self.submit(coro)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._untrack)

    def _untrack(self, fut: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._pending.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            log.error("s3kv: background task failed: %r", fut.exception())

    async def in_threads(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.threads, fn, *args)

    async def in_background(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.background_threads, fn, *args)

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` (on the loop's clock) for the jobs; True if all of them finished."""
        deadline = self.clock() + timeout_s
        while True:
            with self._lock:
                pending = list(self._pending)
            if not pending:
                return True
            if not self._wait(pending, deadline):
                return False

    def _wait(self, futures: list[concurrent.futures.Future[Any]], deadline: float) -> bool:
        """Wait for ``futures`` until ``deadline`` on the loop's clock; True
        if they finished. Each wait lasts what is left on the clock, then
        looks at it again (a test's clock may stand still or jump)."""
        while True:
            left = deadline - self.clock()
            if left <= 0:
                return all(f.done() for f in futures)
            _, pending = concurrent.futures.wait(futures, timeout=left)
            if not pending:
                return True

    def close(
        self,
        timeout_s: float,
        flush: Callable[[], Coroutine[Any, Any, Any]] | None = None,
        last: Callable[[], Coroutine[Any, Any, Any]] | None = None,
    ) -> None:
        """Let the jobs under way finish, then ``flush``, all within
        ``timeout_s``; what is still running then is cancelled (each task's
        handlers run), ``last`` runs, and the loop and threads stop. The
        time is the loop's clock's; the last two steps get at least 0.1 s."""
        deadline = self.clock() + timeout_s
        reserve = min(1.0, timeout_s / 4) if flush is not None else 0.0
        if not self.drain(max(0.0, timeout_s - reserve)):
            log.warning("s3kv: abandoning unfinished transfers at shutdown")
        if flush is not None:
            flushed = self.submit(flush())
            try:
                if not self._wait([flushed], max(deadline, self.clock() + 0.1)):
                    raise TimeoutError("out of time")
                flushed.result()
            except Exception as e:
                log.warning("s3kv: publishing the last stores at shutdown failed: %r", e)

        async def abandon() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # aborts run in their handlers
            if last is not None:
                await last()

        with contextlib.suppress(Exception):
            self.run(abandon(), timeout=max(0.1, deadline - self.clock()))
        self.stop(timeout=max(0.1, deadline - self.clock()))
        self.threads.shutdown(wait=False, cancel_futures=True)
        self.background_threads.shutdown(wait=False, cancel_futures=True)
