"""One load attempt's way into the KV cache: a :class:`Gate` over the
worker's :class:`PageSink` that closes when the attempt is over, so that no
late write reaches blocks that are no longer the attempt's."""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from s3kv.frame_sinks import (
    ChunkFrames,
    FrameRead,
    FrameSink,
    PageTarget,
    chunk_scratch,
    scatter,
    scratch_buffer,
)
from s3kv.tiering.plan import LoadChunk


class PageSink(Protocol):
    """Where the worker's loaded chunks go: the KV cache's pages (the
    connector's, for one step's loads). Called from the engine's threads,
    for distinct blocks at once, only through a :class:`Gate`."""

    def write(self, chunk: LoadChunk, layer: int, data: np.ndarray) -> None:
        """Write one layer of ``chunk`` (all of its pages, a buffer the caller reuses)."""

    def target(self, chunk: LoadChunk, layer: int) -> PageTarget | None:
        """Where that layer's frame may be read or decoded straight into
        (None: hand it to :meth:`write`)."""


class Gate:
    """One load attempt's way into the KV cache, for one chunk (and the
    slots it promotes into, ``fills``): each layer goes to ``pages`` and
    every fill while it is open; :meth:`close` waits for a write in
    progress, never for a disk (see :meth:`read_into`). It is the
    :class:`~s3kv.frame_sinks.FrameInto` the tiers' reads hand frames to."""

    def __init__(self, pages: PageSink, chunk: LoadChunk, fills: list[FrameSink] | None = None) -> None:
        self._pages = pages
        self._chunk = chunk
        self._fills = fills or []
        self._lock = threading.Lock()
        self._open = True

    def write(self, layer: int, data: np.ndarray) -> None:
        with self._lock:
            if self._open:
                self._write(layer, data)

    def _write(self, layer: int, data: np.ndarray) -> None:
        self._pages.write(self._chunk, layer, data)
        for fill in self._fills:
            fill(layer, data)

    def _target(self, layer: int) -> PageTarget | None:
        return self._pages.target(self._chunk, layer)

    def read_into(self, layer: int, nbytes: int, read: FrameRead, *, may_stall: bool = False) -> None:
        """Have ``read`` put one layer's frame straight into its pages (or
        their pinned staging buffer), then commit it and hand it to the
        fills; without a target, into a scratch buffer written to the pages
        and the fills. Nothing happens once the gate is closed.

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
            if self._open:
                self._read_aside(layer, nbytes, read, self._target(layer))
            return
        with self._lock:
            if not self._open:
                return
            target = self._target(layer)
            if target is None:
                buf = scratch_buffer(nbytes)
                read([buf])
                self._write(layer, buf)
                return
            read(target.buffers)
            self._commit(layer, nbytes, target, target.buffers)

    def read_chunk_into(self, frames: ChunkFrames) -> None:
        """Have every layer's frame of ``frames`` (a chunk's frames as
        stored, one after another) read where it goes, checked there, then
        committed and handed to the fills, in order, in two phases:

        - What the page cache holds, in one pass (:meth:`ChunkFrames.cached`,
          one read for the whole chunk, which never waits for a device nor
          starts I/O: where it could, it reads nothing)
          under the lock, straight into each frame's target: the pages
          themselves on the host, one copy in all. This is :meth:`read_into`'s
          contract for a read that cannot stall: each frame is checked
          after it was written there, so one that fails has written blocks
          of this load alone, and fails it. :meth:`close` may wait for this
          pass: a copy of a chunk, never a disk.
        - The rest, from where that pass stopped (EAGAIN, a short read), as
          :meth:`read_into` reads a frame that may stall: outside the lock,
          into a buffer of this read's own (the target's private buffer, or
          this thread's scratch buffer) and checked there, then, under the
          lock and if the gate is still open, copied into the pages and
          committed. The frame the first pass got in part is read on from
          where it stopped (so the file is read in order: the kernel's
          readahead sees one sequential stream), and checked whole under
          the lock once its rest is in place.

        Nothing happens once the gate is closed."""
        if not self._open:
            return
        nbytes = frames.nbytes
        targets = [self._target(i) for i in range(len(nbytes))]
        done = 0
        with self._lock:
            if not self._open:
                return
            parts = _destinations(targets, nbytes)
            got = frames.cached([b for p in parts for b in p])
            for i, n in enumerate(nbytes):
                if got < n:
                    break
                got -= n
                frames.check(i, parts[i])
                self._done(i, n, targets[i], parts[i])
                done = i + 1
        if done < len(nbytes) and got:
            if not self._read_rest(done, nbytes[done], got, frames, targets[done], parts[done]):
                return
            done += 1
        for i in range(done, len(nbytes)):
            if not self._open:
                return
            self._read_aside(i, nbytes[i], functools.partial(_read_checked, frames, i), targets[i])

    def _read_rest(
        self,
        layer: int,
        nbytes: int,
        start: int,
        frames: ChunkFrames,
        target: PageTarget | None,
        parts: list[np.ndarray],
    ) -> bool:
        """Read frame ``layer`` on from byte ``start`` (its bytes before are
        in ``parts``, its destination) as a read that may stall, then check
        it whole and commit it; False if the gate closed meanwhile. Where
        ``parts`` are this read's own (a private target; no target: the
        chunk scratch) the rest goes straight there, else into this
        thread's scratch buffer, copied into the pages under the lock."""
        own = target is None or target.private
        rest = _after(parts, start) if own else [scratch_buffer(nbytes - start)]
        frames.read(layer, rest, start)
        with self._lock:
            if not self._open:  # the attempt is over: the bytes stay where they are
                return False
            if not own:
                scatter(rest[0], _after(parts, start))
            frames.check(layer, parts)
            self._done(layer, nbytes, target, parts)
        return True

    def _done(self, layer: int, nbytes: int, target: PageTarget | None, parts: list[np.ndarray]) -> None:
        """Frame ``layer`` is checked in ``parts`` (its target's buffers, or
        a buffer of its own without one): commit it, or write it."""
        if target is None:
            self._write(layer, parts[0])
        else:
            self._commit(layer, nbytes, target, parts)

    def _read_aside(self, layer: int, nbytes: int, read: FrameRead, target: PageTarget | None) -> None:
        """:meth:`read_into` for a read that may stall (into ``target``, the
        layer's): read, then take the lock."""
        parts = target.buffers if target is not None and target.private else [scratch_buffer(nbytes)]
        read(parts)
        with self._lock:
            if not self._open:  # the attempt is over: the bytes stay where they are
                return
            if target is not None and not target.private:
                scatter(parts[0], target.buffers)
            self._done(layer, nbytes, target, parts)

    def _commit(self, layer: int, nbytes: int, target: PageTarget, parts: list[np.ndarray]) -> None:
        """``target`` holds the checked frame (also in ``parts``): commit it,
        and the fills copy it."""
        target.commit()
        if self._fills:
            frame = parts[0] if len(parts) == 1 else np.concatenate(parts, out=scratch_buffer(nbytes))
            for fill in self._fills:
                fill(layer, frame)

    def close(self) -> None:
        with self._lock:
            self._open = False


def _destinations(targets: list[PageTarget | None], nbytes: Sequence[int]) -> list[list[np.ndarray]]:
    """Where each frame of a chunk is read in one pass: its target's
    buffers, or (a frame with no target: written, not read into place) a
    part of this thread's chunk scratch buffer."""
    spare = chunk_scratch(sum(n for t, n in zip(targets, nbytes) if t is None))
    parts: list[list[np.ndarray]] = []
    at = 0
    for target, n in zip(targets, nbytes):
        if target is None:
            parts.append([spare[at : at + n]])
            at += n
        else:
            parts.append(target.buffers)
    return parts


def _after(parts: list[np.ndarray], start: int) -> list[np.ndarray]:
    """Views of ``parts`` (in order) from byte ``start`` of them on."""
    out: list[np.ndarray] = []
    for p in parts:
        if start >= p.nbytes:
            start -= p.nbytes
            continue
        out.append(p[start:])
        start = 0
    return out


def _read_checked(frames: ChunkFrames, frame: int, out: list[np.ndarray]) -> None:
    """Frame ``frame`` of ``frames`` read into ``out``, then checked there (a :data:`FrameRead`)."""
    frames.read(frame, out)
    frames.check(frame, out)
