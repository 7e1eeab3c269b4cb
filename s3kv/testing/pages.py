"""Pages as functions, for tests and benchmarks that load chunks without a
KV cache: :class:`Pages` is a :class:`~s3kv.tiering.worker.gate.PageSink`
and :class:`Frames` a :class:`~s3kv.frame_sinks.FrameInto` made of them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from s3kv.frame_sinks import ChunkFrames, FrameRead, FrameSink, PageTarget, scratch_buffer
from s3kv.tiering.plan import LoadChunk


@dataclass(frozen=True)
class Pages:
    """``write(chunk, layer, data)`` takes each loaded layer, unless
    ``target(chunk, layer)`` names where its frame is read straight into."""

    write: Callable[[LoadChunk, int, np.ndarray], None]
    target: Callable[[LoadChunk, int], PageTarget | None] = lambda chunk, layer: None


@dataclass(frozen=True)
class Frames:
    """Each checked layer to ``sink``, read into this thread's scratch buffer."""

    sink: FrameSink

    def write(self, layer: int, data: np.ndarray) -> None:
        self.sink(layer, data)

    def read_into(self, layer: int, nbytes: int, read: FrameRead, *, may_stall: bool = False) -> None:
        buf = scratch_buffer(nbytes)
        read([buf])
        self.sink(layer, buf)

    def read_chunk_into(self, frames: ChunkFrames) -> None:
        for layer, nbytes in enumerate(frames.nbytes):
            buf = scratch_buffer(nbytes)
            frames.read(layer, [buf])
            frames.check(layer, [buf])
            self.sink(layer, buf)
