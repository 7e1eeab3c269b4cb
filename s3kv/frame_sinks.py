"""Where a chunk's checked frames go: a function that takes each layer's
decoded bytes (:data:`FrameSink`), or, for the worker's loads, a
:class:`FrameInto` that has each frame read straight into its destination
(:class:`PageTarget`), one frame at a time or a chunk's stored frames at
once (:class:`ChunkFrames`), and the buffers both use. The
:class:`~s3kv.chunk_reader.ChunkReader` hands frames to them only once
checked."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

FrameSink = Callable[[int, np.ndarray], None]
"""Called once per layer with that layer's decoded page bytes (uint8). With
``scratch`` decoding (the worker's loads), the array is a buffer the thread
reuses for the next frame: the sink copies what it keeps before it returns."""


@dataclass(frozen=True)
class PageTarget:
    """Where one layer's frame of a loaded chunk goes, when the sink can say:
    ``buffers`` (writable uint8, in the frame's byte order, their sizes
    summing to the frame's raw length) are the KV pages themselves, or a
    pinned staging buffer on a device; ``commit`` makes the bytes written
    there the pages (on a device: the copy to it), once they passed their
    check."""

    buffers: list[np.ndarray]
    commit: Callable[[], None]
    private: bool = False
    """``buffers`` are this target's own (a staging buffer made for it), not
    the pages: a read that may never return fills them outside the load's
    gate, and what it writes there after the load went on reaches nothing
    anyone reads."""


FrameRead = Callable[[list[np.ndarray]], None]
"""Reads one frame's bytes into the buffers given, in order, and checks
them there: raises CorruptChunk if they fail."""


class ChunkFrames(Protocol):
    """A chunk's frames as they are stored, uncompressed, one after another
    in a file (the NVMe tier's of codec ``none``): read into their
    destinations with as few reads as the destinations allow
    (:meth:`FrameInto.read_chunk_into`)."""

    @property
    def nbytes(self) -> Sequence[int]:
        """Each frame's bytes, in order (its layer's pages: the engine's
        sizes, checked against the header before anything is read)."""

    def cached(self, buffers: Sequence[np.ndarray]) -> int:
        """Read the frames' bytes, from the first frame's start, into
        ``buffers`` (in order) as far as they can be read without waiting
        for a device: the bytes read, 0 where none could be (not in the
        page cache, or no such read here). Never waits on a disk nor starts
        I/O (it reads nothing rather than risk either: a disk that is not
        answering in time, a file the page cache does not hold whole), so
        it may run under a lock a load's other paths need."""

    def read(self, frame: int, out: list[np.ndarray], start: int = 0) -> None:
        """Read frame ``frame``'s bytes from byte ``start`` of it on into
        ``out`` (their sizes summing to what is left), unchecked;
        CorruptChunk where the file ends first. May wait on a device that
        never answers."""

    def check(self, frame: int, parts: Sequence[np.ndarray]) -> None:
        """Raise CorruptChunk unless ``parts`` (in order) hold frame
        ``frame``'s stored bytes."""


class FrameInto(Protocol):
    """Where the worker's loads put checked frames: a load attempt's
    :class:`~s3kv.tiering.worker.gate.Gate` into the KV cache (and the
    slots it promotes into)."""

    def write(self, layer: int, data: np.ndarray) -> None:
        """Take one layer's checked page bytes (a buffer the caller reuses)."""

    def read_into(self, layer: int, nbytes: int, read: FrameRead, *, may_stall: bool = False) -> None:
        """Have ``read`` put the layer's ``nbytes`` straight where they go
        and check them there; ``may_stall``: ``read`` waits on a device
        that may never answer (a disk)."""

    def read_chunk_into(self, frames: ChunkFrames) -> None:
        """Have every frame of ``frames`` read where it goes and checked
        there, in order: what the page cache holds in one pass, the rest
        as reads that may stall (a disk)."""


class SinkFailed(Exception):
    """Putting checked frames where they go failed (the cause): the
    engine's failure, not the object's (see :meth:`ChunkReader.read_frames`)."""


def scatter(data: np.ndarray, buffers: Sequence[np.ndarray]) -> None:
    """Copy ``data`` (uint8) into ``buffers``, one after the other."""
    at = 0
    for b in buffers:
        np.copyto(b, data[at : at + b.nbytes])
        at += b.nbytes


_scratch = threading.local()


def scratch_buffer(nbytes: int) -> np.ndarray:
    """This thread's reused decode buffer of exactly ``nbytes`` bytes: each
    frame decodes into it in one pass, and the sink copies it into the pages."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.nbytes != nbytes:
        buf = _scratch.buf = np.empty(nbytes, dtype=np.uint8)
    return buf


_chunk_scratch = threading.local()


def chunk_scratch(nbytes: int) -> np.ndarray:
    """``nbytes`` of this thread's second reused buffer (one that only
    grows), for what a chunk's one-pass read puts nowhere else: apart from
    :func:`scratch_buffer`, which each frame's own copies reuse meanwhile."""
    buf = getattr(_chunk_scratch, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _chunk_scratch.buf = np.empty(nbytes, dtype=np.uint8)
    return buf[:nbytes]
