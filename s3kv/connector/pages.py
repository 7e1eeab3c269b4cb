"""Copying whole KV block pages between vLLM's KV cache tensors and host
memory, for any layout: a layer's tensor has one axis of ``num_blocks``; a
chunk's pages of a layer are ``index_select`` along it, kept as opaque
bytes, and written back with ``index_copy_``. Nothing inside a page is ever
reinterpreted (on the CPU backend its byte order depends on the ISA).

One small interface, two implementations:
- host tensors (vLLM's CPU backend): plain copies, from any thread;
- device tensors (CUDA/XPU): every copy runs on one side stream, in order.
  Copies out of the cache first wait for the forward's writes; the forward's
  next work waits for the copies (:meth:`PageIO.fence`), so a block freed and
  reused by vLLM is never overwritten before it was copied out, and a
  layer-by-layer load makes the forward wait only for its own layer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from s3kv.errors import ConfigError
from s3kv.frame_sinks import PageTarget

if TYPE_CHECKING:
    from s3kv.tiering.plan import LoadChunk


def _runs(block_ids: Sequence[int], first: int, last: int) -> list[tuple[int, int]]:
    """Index ranges [i, j) of ``block_ids[first:last]`` whose ids are consecutive."""
    runs, i = [], first
    while i < last:
        j = i + 1
        while j < last and block_ids[j] == block_ids[j - 1] + 1:
            j += 1
        runs.append((i, j))
        i = j
    return runs


def _nothing() -> None:
    pass


def _along(a: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
    index = [slice(None)] * a.ndim
    index[axis] = slice(start, stop)
    return a[tuple(index)]


class LayerPages:
    """One layer's KV tensor seen as uint8, with its block axis."""

    def __init__(self, name: str, tensor: torch.Tensor, num_blocks: int) -> None:
        if tensor.stride(-1) != 1:
            raise ConfigError(f"{name}: KV cache tensor's last axis is not contiguous")
        u8 = tensor.view(torch.uint8) if tensor.dtype != torch.uint8 else tensor
        axes = [i for i, n in enumerate(u8.shape) if n == num_blocks]
        if len(axes) != 1:
            raise ConfigError(
                f"{name}: cannot find the block axis of KV cache shape {tuple(tensor.shape)} "
                f"(num_blocks={num_blocks})"
            )
        self.name = name
        self.u8 = u8
        self.axis = axes[0]
        self.page_bytes = u8.numel() // num_blocks
        self.dtype = str(tensor.dtype).removeprefix("torch.")
        self.itemsize = tensor.element_size()

    @cached_property
    def outer(self) -> list[tuple[int, ...]]:
        """The indexes of the axes before the block axis (K and V, where they come first)."""
        return list(np.ndindex(*self.u8.shape[: self.axis]))

    @cached_property
    def planes(self) -> list[np.ndarray] | None:
        """Host tensors: the layer as [num_blocks, page bytes] arrays, one per
        index of the axes before the block axis, each a view of the cache;
        None where a run of blocks would not be contiguous in them."""
        if self.u8.device.type != "cpu":
            return None
        a = self.u8.numpy()
        planes = []
        for outer in self.outer:
            plane = a[outer]
            if not plane.flags.c_contiguous:
                return None
            planes.append(plane.reshape(plane.shape[0], -1))
        return planes

    def shape_for(self, n_blocks: int) -> tuple[int, ...]:
        shape = list(self.u8.shape)
        shape[self.axis] = n_blocks
        return tuple(shape)


class PageIO:
    def __init__(
        self, kv_caches: dict[str, torch.Tensor], layer_names: Sequence[str], num_blocks: int
    ) -> None:
        missing = [n for n in layer_names if n not in kv_caches]
        if missing:
            raise ConfigError(f"KV caches of layers {missing[:3]} were not registered")
        self.layers = [LayerPages(n, kv_caches[n], num_blocks) for n in layer_names]
        self.index_of = {n: i for i, n in enumerate(layer_names)}
        self.device = kv_caches[layer_names[0]].device
        self._stream = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)

    @property
    def on_device(self) -> bool:
        return self._stream is not None

    def host_buffer(self, nbytes: int, *, pinned: bool, resident: bool = False) -> torch.Tensor:
        """Host memory for pages (pinned when the cache is on a device).

        ``resident``: every page mapped now, for a buffer that lives as long
        as the worker (the CPU tier). Pinned memory is; plain memory would
        otherwise be mapped by the loads that first write each slot, a page
        fault at a time, and a busy worker's faults are slow enough to
        dominate a load that fills a CPU slot."""
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned and self.on_device)
        if resident and not buf.is_pinned():
            buf.zero_()
        return buf

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        """``block_ids`` on the device, copied from pinned memory on the
        current stream without waiting (call on the side stream):
        ``torch.tensor(..., device=)`` would copy from pageable memory and so
        make the host wait for the stream, i.e. for the forward."""
        ids = torch.tensor(list(block_ids), dtype=torch.long).pin_memory()
        return ids.to(self.device, non_blocking=True)

    def read_into(self, layer_index: int, block_ids: Sequence[int], out: np.ndarray) -> None:
        """Copy the pages of ``block_ids`` of one layer into ``out`` (host,
        uint8, exactly their size). Call after the forward wrote them."""
        layer = self.layers[layer_index]
        if self._stream is None:
            src = layer.u8.numpy()
            dst = out.reshape(layer.shape_for(len(block_ids)))
            for i, j in _runs(block_ids, 0, len(block_ids)):
                np.copyto(
                    _along(dst, layer.axis, i, j), _along(src, layer.axis, block_ids[i], block_ids[i] + j - i)
                )
            return
        dst = torch.from_numpy(out).view(layer.shape_for(len(block_ids)))
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            pages = layer.u8.index_select(layer.axis, self._index(block_ids))
            dst.copy_(pages, non_blocking=True)

    def target(
        self,
        layer_index: int,
        block_ids: Sequence[int],
        first: int,
        last: int,
        *,
        after: object | None = None,
    ) -> PageTarget | None:
        """Where a chunk's layer frame (all of the chunk's pages, as
        :meth:`write` takes them) can be read or decoded straight into, for
        pages ``first..last`` going to ``block_ids[first:last]``.

        On the host: the pages themselves, one buffer per run of consecutive
        blocks and index of the axes before the block axis (K and V), the
        frame's other pages into throwaway buffers; None where those runs
        are not contiguous (then :meth:`write` copies). On a device: a pinned
        staging buffer of the frame's size, made for this target alone
        (:attr:`PageTarget.private`), whose commit copies its runs into the
        pages on the side stream (after ``after``)."""
        layer = self.layers[layer_index]
        n = len(block_ids)
        if self._stream is not None:
            staging = torch.empty(layer.page_bytes * n, dtype=torch.uint8, pin_memory=True)
            return PageTarget(
                [staging.numpy()],  # keeps ``staging`` alive while a reader holds it
                lambda: self._to_device(layer, block_ids, first, last, staging, after),
                private=True,
            )
        planes = layer.planes
        if planes is None:
            return None
        block_bytes = planes[0].shape[1]
        runs = _runs(block_ids, first, last)
        buffers: list[np.ndarray] = []
        for plane in planes:
            if first:
                buffers.append(np.empty(first * block_bytes, np.uint8))
            for i, j in runs:
                buffers.append(plane[block_ids[i] : block_ids[i] + j - i].reshape(-1))
            if last < n:
                buffers.append(np.empty((n - last) * block_bytes, np.uint8))
        return PageTarget(buffers, _nothing)

    def _to_device(
        self,
        layer: LayerPages,
        block_ids: Sequence[int],
        first: int,
        last: int,
        staging: torch.Tensor,
        after: object | None,
    ) -> None:
        """Copy pages ``first..last`` of a chunk's layer from pinned
        ``staging`` into ``block_ids[first:last]`` on the side stream, after
        ``after``: the frame crosses in one H2D copy into device scratch, then
        one kernel puts its pages in place (a copy for one run of consecutive
        blocks, ``index_copy_`` otherwise): one H2D copy per run of blocks
        would be bound by the copies' launches, scattered blocks most. torch's
        allocators keep ``staging`` and the scratch until the copies ran."""
        if first >= last:
            return
        runs = _runs(block_ids, first, last)
        with torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)
            frame = staging.to(self.device, non_blocking=True).view(layer.shape_for(len(block_ids)))
            pages = frame.narrow(layer.axis, first, last - first)
            if len(runs) == 1:
                layer.u8.narrow(layer.axis, block_ids[first], last - first).copy_(pages)
            else:
                layer.u8.index_copy_(layer.axis, self._index(block_ids[first:last]), pages)

    def load_pages(self, after: object | None) -> LoadPages:
        """The pages this step's background loads write (the transfer
        engine's :class:`~s3kv.tiering.worker.gate.PageSink`), after the
        forward work marked by ``after`` (:meth:`forward_mark`)."""
        return LoadPages(self, after)

    def forward_mark(self) -> object | None:
        """A point on the forward's stream that later :meth:`write` calls
        wait for (on the host platform, None: nothing to wait for)."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def write(
        self,
        layer_index: int,
        block_ids: Sequence[int],
        first: int,
        last: int,
        data: np.ndarray,
        *,
        after: object | None = None,
    ) -> None:
        """Write pages ``first..last`` of a chunk's layer (``data`` holds all of
        the chunk's pages) into ``block_ids[first:last]``, after the forward
        work marked by ``after`` (:meth:`forward_mark`). Thread-safe for
        distinct blocks."""
        layer = self.layers[layer_index]
        n = len(block_ids)
        if self._stream is None:
            # numpy, one copy per run of consecutive blocks: torch's uint8
            # index_copy_ is slow on the CPU and starts OpenMP work from
            # every codec thread, which collapses on a busy CPU.
            dst = layer.u8.numpy()
            pages = np.asarray(data).reshape(layer.shape_for(n))
            for i, j in _runs(block_ids, first, last):
                np.copyto(
                    _along(dst, layer.axis, block_ids[i], block_ids[i] + j - i),
                    _along(pages, layer.axis, i, j),
                )
            return
        # From pinned memory (the CPU tier's slots are; a decoded frame is
        # staged), so that the H2D copies are truly asynchronous.
        src = torch.from_numpy(np.ascontiguousarray(data).reshape(-1))
        if not src.is_pinned():
            src = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True).copy_(src)
        self._to_device(layer, block_ids, first, last, src, after)

    def fence(self) -> Callable[[], None]:
        """Order the forward's later work after every copy issued so far, and
        return a function that waits on the host until they are done."""
        if self._stream is None:
            return lambda: None
        event = torch.cuda.Event()
        event.record(self._stream)
        torch.cuda.current_stream(self.device).wait_event(event)
        return event.synchronize

    def synchronize(self) -> None:
        """Return once every copy so far is complete."""
        if self._stream is not None:
            self._stream.synchronize()

    def step_clock(self) -> StepClock:
        """Start timing the forward about to run (see :class:`StepClock`)."""
        return StepClock(self.device if self.on_device else None)


class LoadPages:
    """A step's background loads into the KV cache: each chunk's layer goes
    to its blocks by :meth:`PageIO.write` or :meth:`PageIO.target`, after
    ``after``."""

    def __init__(self, io: PageIO, after: object | None) -> None:
        self.io = io
        self.after = after

    def write(self, chunk: LoadChunk, layer: int, data: np.ndarray) -> None:
        self.io.write(layer, chunk.block_ids, chunk.first_block, chunk.last_block, data, after=self.after)

    def target(self, chunk: LoadChunk, layer: int) -> PageTarget | None:
        return self.io.target(layer, chunk.block_ids, chunk.first_block, chunk.last_block, after=self.after)


class StepClock:
    """Times one forward: on the host platform the host's time from start to
    :meth:`stop`; on a device the forward stream's, between two events
    (read once the device got past the second: :meth:`seconds` is None
    until then, and never blocks)."""

    def __init__(self, device: torch.device | None) -> None:
        self._device = device
        self._stopped: float | None = None
        if device is None:
            self._start: Any = time.perf_counter()
            self._end: Any = None
        else:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record(torch.cuda.current_stream(device))
            self._end = torch.cuda.Event(enable_timing=True)

    def stop(self) -> None:
        if self._device is None:
            self._stopped = time.perf_counter()
        else:
            self._end.record(torch.cuda.current_stream(self._device))
            self._stopped = 0.0

    def seconds(self) -> float | None:
        if self._stopped is None:
            return None
        if self._device is None:
            return self._stopped - self._start
        if not self._end.query():
            return None
        return self._start.elapsed_time(self._end) / 1000
