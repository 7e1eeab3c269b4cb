"""A synchronous load from the CPU tier, copied into the KV cache layer by
layer while the forward runs (:class:`LayerwiseLoad`): the forward waits
for each layer's copies only when it reaches that layer."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from s3kv.connector.pages import PageIO
from s3kv.tiering.loop import unbind_thread


class LayerwiseLoad:
    """A synchronous load from the CPU tier that the forward overlaps: layer
    i+1 is copied while layer i computes. On the CPU platform a thread does
    the copies; on a device, the side stream, with one event per layer."""

    def __init__(
        self, pages: PageIO, chunks: Sequence[tuple[Sequence[np.ndarray], Sequence[int], int, int]]
    ) -> None:
        self.pages = pages
        self.chunks = list(chunks)
        self.error: BaseException | None = None
        n = len(pages.layers)
        self._events: list = []
        self._started = time.perf_counter()
        self._finished: float | None = None
        if pages.on_device:
            # The blocks may have been in use by earlier work on the forward's stream.
            pages._stream.wait_stream(torch.cuda.current_stream(pages.device))
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record(pages._stream)
            for i in range(n):
                self._copy_layer(i)
                ev = torch.cuda.Event(enable_timing=(i == n - 1))
                ev.record(pages._stream)
                self._events.append(ev)
            self._thread = None
        else:
            self._events = [threading.Event() for _ in range(n)]
            self._thread = threading.Thread(target=self._run, name="s3kv-layer-load", daemon=True)
            self._thread.start()

    def _copy_layer(self, i: int) -> None:
        for arrays, block_ids, first, last in self.chunks:
            self.pages.write(i, block_ids, first, last, arrays[i])

    def _run(self) -> None:
        unbind_thread()
        try:
            for i, ev in enumerate(self._events):
                self._copy_layer(i)
                ev.set()
            self._finished = time.perf_counter()
        except BaseException as e:  # reported as load errors by the caller
            self.error = e
            for ev in self._events:
                ev.set()

    def wait_layer(self, i: int) -> None:
        ev = self._events[i]
        if isinstance(ev, threading.Event):
            ev.wait()
        else:
            torch.cuda.current_stream(self.pages.device).wait_event(ev)

    @property
    def nbytes(self) -> int:
        """Bytes the copies read out of the host (every chunk's layers)."""
        return sum(a.nbytes for arrays, *_ in self.chunks for a in arrays)

    def elapsed_s(self) -> float | None:
        """How long the copies took, once :meth:`wait_all` returned (they
        overlap the forward: this is not added to the step's time)."""
        if self._thread is None and self._events:
            return self._start_event.elapsed_time(self._events[-1]) / 1000
        return None if self._finished is None else self._finished - self._started

    def wait_all(self) -> None:
        if self._thread is not None:
            self._thread.join()
        else:
            for i in range(len(self._events)):
                self.wait_layer(i)
