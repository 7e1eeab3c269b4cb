"""An asyncio event loop in a daemon thread, for code that is not async itself
(vLLM calls connectors synchronously)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

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


class BackgroundLoop:
    def __init__(self, name: str = "s3kv-io") -> None:
        self.loop = asyncio.new_event_loop()
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
