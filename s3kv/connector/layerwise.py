"""A synchronous load from the CPU tier, copied into the KV cache layer by
layer while the forward runs (:class:`LayerwiseLoad`): the forward waits
for each layer's copies only when it reaches that layer."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from s3kv.connector.pages import PageIO
from s3kv.tiering.loop import unbind_thread

if TYPE_CHECKING:
    from s3kv.tiering.plan import LoadChunk


class LayerwiseLoad:
    """A synchronous load from the CPU tier that the forward overlaps: the
    layers are copied in the model's order (:attr:`PageIO.order`), layer
    i+1 while layer i computes. A layer's copies are every chunk's frame of
    it: each chunk is one group's part, its frames held in a slot
    (``chunks``: (the chunk, the slot's frames); ``heads``: each one's
    shard of the KV heads, where cut), and a layer takes the
    frame its group gives it, pages ``first_block..last_block``; padding
    frames are not copied. On the CPU platform a thread does the copies; on
    a device, the side stream, with one event per layer."""

    def __init__(
        self,
        pages: PageIO,
        chunks: Sequence[tuple[LoadChunk, Sequence[np.ndarray]]],
        heads: Sequence[tuple[int, int] | None] | None = None,
    ) -> None:
        self.pages = pages
        self.error: BaseException | None = None
        self._copies: list[list[tuple[LoadChunk, np.ndarray, tuple[int, int] | None]]] = [
            [] for _ in pages.layers
        ]
        """Layer -> (chunk, its frame of the layer, the shard's KV heads in it)."""
        for i, (chunk, frames) in enumerate(chunks):
            shard = heads[i] if heads is not None else None
            for f, layer in enumerate(pages.layers_of(chunk.group)):
                self._copies[layer].append((chunk, frames[f], shard))
        self._events: list = [None] * len(pages.layers)
        self._started = time.perf_counter()
        self._finished: float | None = None
        if pages.on_device:
            # The blocks may have been in use by earlier work on the forward's stream.
            pages._stream.wait_stream(torch.cuda.current_stream(pages.device))
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record(pages._stream)
            for i in pages.order:
                self._copy_layer(i)
                ev = torch.cuda.Event(enable_timing=(i == pages.order[-1]))
                ev.record(pages._stream)
                self._events[i] = ev
            self._thread = None
        else:
            self._events = [threading.Event() for _ in pages.layers]
            self._thread = threading.Thread(target=self._run, name="s3kv-layer-load", daemon=True)
            self._thread.start()

    def _copy_layer(self, i: int) -> None:
        for chunk, frame, heads in self._copies[i]:
            self.pages.write(i, chunk.block_ids, chunk.first_block, chunk.last_block, frame, heads=heads)

    def _run(self) -> None:
        unbind_thread()
        try:
            for i in self.pages.order:
                self._copy_layer(i)
                self._events[i].set()
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
        """Bytes the copies read out of the host (every chunk's frames of layers)."""
        return sum(frame.nbytes for copies in self._copies for _, frame, _ in copies)

    def elapsed_s(self) -> float | None:
        """How long the copies took, once :meth:`wait_all` returned (they
        overlap the forward: this is not added to the step's time)."""
        if self._thread is None:
            return self._start_event.elapsed_time(self._events[self.pages.order[-1]]) / 1000
        return None if self._finished is None else self._finished - self._started

    def wait_all(self) -> None:
        if self._thread is not None:
            self._thread.join()
        else:
            for i in range(len(self._events)):
                self.wait_layer(i)
