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
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from s3kv.connector.layer_pages import LayerPages, along
from s3kv.errors import ConfigError
from s3kv.frame_sinks import PageTarget
from s3kv.kvgroups import GroupLayout

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


def _layer_numbers(name: str) -> tuple[int, ...]:
    """The numbers in a layer's name ("model.layers.7.self_attn.attn": (7,))."""
    return tuple(int(part) for part in name.split(".") if part.isdigit())


class PageIO:
    """Every layer's pages (``layer_names``, indexed in that order), and
    where each frame of a KV cache group's part of a chunk goes: frame i of
    group g's part is layer ``groups.groups[g].layers[i]``, with group g's
    block ids; a group with fewer layers than :attr:`frames` has padding
    frames, zeros in the object, that map to no layer.

    Under vLLM's hybrid KV cache manager the groups' layers overlay one
    another (one backing buffer, each group's layers from its start, a
    block id owned by one group at a time): every layer's pages are its own
    tensor view, and they are only ever copied with its own group's block
    ids."""

    def __init__(
        self,
        kv_caches: dict[str, torch.Tensor],
        layer_names: Sequence[str],
        num_blocks: int,
        groups: GroupLayout | None = None,
        head_axis: int | None = None,
        frames: int = 0,
    ) -> None:
        missing = [n for n in layer_names if n not in kv_caches]
        if missing:
            raise ConfigError(f"KV caches of layers {missing[:3]} were not registered")
        self.layers = [LayerPages(n, kv_caches[n], num_blocks, head_axis) for n in layer_names]
        self.index_of = {n: i for i, n in enumerate(layer_names)}
        self.group_layers: list[tuple[int, ...]] = (
            [g.layers for g in groups.groups] if groups is not None else [tuple(range(len(self.layers)))]
        )
        self.frame_of: dict[int, tuple[int, int]] = {}
        """Layer index -> (its group, its frame in the group's parts)."""
        for g, layers in enumerate(self.group_layers):
            for f, layer in enumerate(layers):
                if not 0 <= layer < len(self.layers) or layer in self.frame_of:
                    raise ConfigError(f"KV cache group {g}: layer index {layer} is not a layer of its own")
                self.frame_of[layer] = (g, f)
        if len(self.frame_of) != len(self.layers):
            raise ConfigError("KV cache groups leave layers out: every layer must be in one group")
        self.frames = max(frames, *(len(layers) for layers in self.group_layers))
        """Frames of every part: the most layers a group has (or ``frames``,
        where a pipeline stage's parts are padded to the largest stage's)."""
        self.order = sorted(range(len(self.layers)), key=lambda i: _layer_numbers(layer_names[i]))
        """The layers in the model's order (the forward's, by the numbers in
        their names): the groups' layers interleave there."""
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

    def layers_of(self, group: int) -> tuple[int, ...]:
        """Group ``group``'s layers, in the order of its parts' frames."""
        if not 0 <= group < len(self.group_layers):
            raise ValueError(f"KV cache group {group}: this engine has {len(self.group_layers)}")
        return self.group_layers[group]

    def layer_of(self, group: int, frame: int) -> int | None:
        """The layer that frame ``frame`` of group ``group``'s parts is
        (None: a padding frame)."""
        layers = self.layers_of(group)
        return layers[frame] if frame < len(layers) else None

    def read_into(
        self,
        layer_index: int,
        block_ids: Sequence[int],
        out: np.ndarray,
        first: int = 0,
        heads: tuple[int, int] | None = None,
    ) -> None:
        """Copy the pages of ``block_ids[first:]`` of one layer into ``out``
        (host, uint8, the size of all of ``block_ids``' pages), and zeros in
        place of the pages before ``first`` (blocks vLLM may have freed: never
        read). Call after the forward wrote them. ``heads``: only those KV
        heads (first local head, heads) of each page, a shard's."""
        layer = self.layers[layer_index]
        n = len(block_ids)
        if self._stream is None:
            src = layer.heads(layer.u8.numpy(), heads)
            frame = out.reshape(layer.shape_for(n, heads))
            along(frame, layer.axis, 0, first).fill(0)
            for i, j in _runs(block_ids, first, n):
                np.copyto(
                    along(frame, layer.axis, i, j),
                    along(src, layer.axis, block_ids[i], block_ids[i] + j - i),
                )
            if layer.real_bytes is not None:  # a padded page's tail is not the layer's: zeros
                frame[:, layer.real_bytes :] = 0
            return
        dst = torch.from_numpy(out).view(layer.shape_for(n, heads))
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            if first:  # the frame is made on the device, to cross in one copy
                pages = torch.zeros(layer.shape_for(n, heads), dtype=torch.uint8, device=self.device)
                if first < n:
                    got = layer.heads(
                        layer.u8.index_select(layer.axis, self._index(block_ids[first:])), heads
                    )
                    pages.narrow(layer.axis, first, n - first).copy_(got)
            else:
                pages = layer.heads(layer.u8.index_select(layer.axis, self._index(block_ids)), heads)
                if heads is not None:
                    pages = pages.contiguous()
            if layer.real_bytes is not None:
                pages[:, layer.real_bytes :] = 0
            dst.copy_(pages, non_blocking=True)

    def target(
        self,
        layer_index: int,
        block_ids: Sequence[int],
        first: int,
        last: int,
        *,
        after: object | None = None,
        heads: tuple[int, int] | None = None,
    ) -> PageTarget | None:
        """Where a chunk's layer frame (all of the chunk's pages, as
        :meth:`write` takes them; of ``heads`` only, where given) can be read
        or decoded straight into, for pages ``first..last`` going to
        ``block_ids[first:last]``.

        On the host: the pages themselves, one buffer per run of consecutive
        blocks and index of the axes before the block axis (K and V), the
        frame's other pages into throwaway buffers; None where those runs
        are not contiguous (then :meth:`write` copies). On a device: a pinned
        staging buffer of the frame's size, made for this target alone
        (:attr:`PageTarget.private`), whose commit copies its runs into the
        pages on the side stream (after ``after``). A shard's heads of a
        page are not one run of bytes on the host: then None too."""
        layer = self.layers[layer_index]
        n = len(block_ids)
        if self._stream is not None:
            staging = torch.empty(layer.frame_bytes(n, heads), dtype=torch.uint8, pin_memory=True)
            return PageTarget(
                [staging.numpy()],  # keeps ``staging`` alive while a reader holds it
                lambda: self._to_device(layer, block_ids, first, last, staging, after, heads),
                private=True,
            )
        planes = layer.planes
        if planes is None or (heads is not None and heads[1] != layer.num_heads):
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
        heads: tuple[int, int] | None = None,
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
            frame = staging.to(self.device, non_blocking=True).view(layer.shape_for(len(block_ids), heads))
            pages = frame.narrow(layer.axis, first, last - first)
            dst = layer.heads(layer.u8, heads)
            if len(runs) == 1:
                dst.narrow(layer.axis, block_ids[first], last - first).copy_(pages)
            else:
                dst.index_copy_(layer.axis, self._index(block_ids[first:last]), pages)

    def load_pages(self, after: object | None, heads: tuple[int, int] | None = None) -> LoadPages:
        """The pages this step's background loads write (the transfer
        engine's :class:`~s3kv.tiering.worker.gate.PageSink`), after the
        forward work marked by ``after`` (:meth:`forward_mark`); of one
        shard's ``heads`` only, where given."""
        return LoadPages(self, after, heads)

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
        heads: tuple[int, int] | None = None,
    ) -> None:
        """Write pages ``first..last`` of a chunk's layer (``data`` holds all of
        the chunk's pages; of ``heads`` only, where given) into
        ``block_ids[first:last]``, after the forward work marked by ``after``
        (:meth:`forward_mark`). Thread-safe for distinct blocks."""
        layer = self.layers[layer_index]
        n = len(block_ids)
        if self._stream is None:
            # numpy, one copy per run of consecutive blocks: torch's uint8
            # index_copy_ is slow on the CPU and starts OpenMP work from
            # every codec thread, which collapses on a busy CPU.
            dst = layer.heads(layer.u8.numpy(), heads)
            pages = np.asarray(data).reshape(layer.shape_for(n, heads))
            for i, j in _runs(block_ids, first, last):
                np.copyto(
                    along(dst, layer.axis, block_ids[i], block_ids[i] + j - i),
                    along(pages, layer.axis, i, j),
                )
            return
        # From pinned memory (the CPU tier's slots are; a decoded frame is
        # staged), so that the H2D copies are truly asynchronous.
        src = torch.from_numpy(np.ascontiguousarray(data).reshape(-1))
        if not src.is_pinned():
            src = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True).copy_(src)
        self._to_device(layer, block_ids, first, last, src, after, heads)

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
    """A step's background loads into the KV cache: each frame of a chunk's
    part goes to its group's layer (:meth:`PageIO.layer_of`), pages
    ``first_block..last_block`` to their blocks, by :meth:`PageIO.write` or
    :meth:`PageIO.target`, after ``after``; padding frames to none."""

    def __init__(self, io: PageIO, after: object | None, heads: tuple[int, int] | None = None) -> None:
        self.io = io
        self.after = after
        self.heads = heads
        """The KV heads of the shard these loads bring (None: whole pages)."""

    def write(self, chunk: LoadChunk, frame: int, data: np.ndarray) -> None:
        layer = self.io.layer_of(chunk.group, frame)
        if layer is not None:  # a padding frame goes nowhere
            self.io.write(
                layer,
                chunk.block_ids,
                chunk.first_block,
                chunk.last_block,
                data,
                after=self.after,
                heads=self.heads,
            )

    def target(self, chunk: LoadChunk, frame: int) -> PageTarget | None:
        layer = self.io.layer_of(chunk.group, frame)
        if layer is None:  # read into scratch, then write() drops it
            return None
        return self.io.target(
            layer, chunk.block_ids, chunk.first_block, chunk.last_block, after=self.after, heads=self.heads
        )


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
