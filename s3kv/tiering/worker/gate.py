"""One load attempt's way into the KV cache: a :class:`Gate` that closes
when the attempt is over, so that no late write reaches blocks that are no
longer the attempt's."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from s3kv.chunk_reader import FrameRead, FrameSink, PageTarget, scatter, scratch_buffer


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
