"""An asyncio event loop whose time is virtual: when nothing is ready to run
it jumps to its next timer instead of waiting for it.

The fleet model (``benchmarks/fleet.py``) runs the real loops of hundreds
of replicas (:meth:`~s3kv.manifest.sync.ManifestSync.run`, the rank
publishers' ``run``) on one such loop: they are timed only by their clock
and :func:`asyncio.sleep`, so with ``clock=lambda: T0 + loop.time()`` an
hour of the fleet takes as long as its work does, not an hour, and a
request's latency modelled as ``await asyncio.sleep(latency)`` delays the
coroutine that made it, and only that one.

How: CPython's ``BaseEventLoop._run_once`` (3.10 to 3.12) computes how long
to wait for I/O from ``self.time()`` and the earliest timer, waits in
``self._selector.select(timeout)``, then runs the timers due at
``self.time()``. Here ``time()`` returns a counter, and the selector is
wrapped: it polls for I/O without blocking, and when none is ready it adds
the timeout to the counter, so the earliest timer is due at once. Ready
callbacks (timeout 0) never move time. A loop with no timer at all waits on
the real selector (a thread's result, a signal), as any loop does.

Work done outside the loop's thread does not move virtual time: pass the
classes an inline ``offload`` (:func:`inline`), not
:func:`asyncio.to_thread`, or time jumps ahead while the thread works.
Real sockets work (their readiness is polled at every step) but their
latency is not the model's: the model's stores live in memory.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _VirtualSelector:
    """The loop's selector, polled without blocking; a wait with a finite
    timeout and nothing ready moves the loop's virtual time instead."""

    def __init__(self, inner: selectors.BaseSelector, loop: VirtualTimeLoop) -> None:
        self._inner = inner
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:  # nothing scheduled: only the outside world can wake the loop
            return self._inner.select(None)
        events = self._inner.select(0)
        if not events and timeout > 0:
            self._loop.advance(timeout)
        return events

    def __getattr__(self, name: str) -> Any:  # register, unregister, modify, get_map, close, ...
        return getattr(self._inner, name)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose :meth:`time` starts at ``start`` and
    moves only when the loop would otherwise wait: to its next timer."""

    def __init__(self, start: float = 0.0) -> None:
        super().__init__()
        self._now = float(start)
        inner: selectors.BaseSelector = self._selector  # type: ignore[has-type]
        self._selector = _VirtualSelector(inner, self)  # type: ignore[assignment]

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move virtual time on by ``seconds`` (never back)."""
        if seconds > 0:
            self._now += seconds


def run(main: Coroutine[Any, Any, T], *, start: float = 0.0) -> T:
    """``asyncio.run(main)`` on a :class:`VirtualTimeLoop`."""
    loop = VirtualTimeLoop(start)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


async def inline(f: Callable[..., T], *args: Any) -> T:
    """An ``offload`` that runs ``f(*args)`` on the loop itself: work that
    takes no virtual time (and blocks the loop for its real time)."""
    return f(*args)
