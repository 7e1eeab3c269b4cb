"""One layer's KV cache tensor as pages: its bytes, the axis of its blocks
and, where parts are cut by KV head (:mod:`s3kv.shards`), the axis of its
heads (:class:`LayerPages`); :mod:`s3kv.connector.pages` copies pages with it."""

from __future__ import annotations

import math
from functools import cached_property
from typing import Any

import numpy as np
import torch

from s3kv.errors import ConfigError


def along(a: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
    index = [slice(None)] * a.ndim
    index[axis] = slice(start, stop)
    return a[tuple(index)]


class LayerPages:
    """One layer's KV tensor seen as uint8, with its block axis."""

    def __init__(
        self, name: str, tensor: torch.Tensor, num_blocks: int, head_axis: int | None = None
    ) -> None:
        if tensor.stride(-1) != 1:
            raise ConfigError(f"{name}: KV cache tensor's last axis is not contiguous")
        u8 = tensor.view(torch.uint8) if tensor.dtype != torch.uint8 else tensor
        # The block axis: of the axes of num_blocks, the one with the largest
        # stride (another may be as long: a page's bytes, tokens or heads).
        axes = [i for i, n in enumerate(u8.shape) if n == num_blocks]
        strides = sorted((u8.stride(i) for i in axes), reverse=True)
        if not axes or (len(strides) > 1 and strides[0] == strides[1]):
            raise ConfigError(
                f"{name}: cannot find the block axis of KV cache shape {tuple(tensor.shape)} "
                f"(num_blocks={num_blocks})"
            )
        self.name = name
        self.axis = max(axes, key=u8.stride)
        self.page_bytes = u8.numel() // num_blocks
        self.real_bytes: int | None = None
        """Bytes of a page that hold state, where fewer than the page's (a
        Mamba layer's state padded to the attention layers' page)."""
        stride = u8.stride(0) if self.axis == 0 else 0
        if stride > self.page_bytes and u8[0].is_contiguous():
            # vLLM pads a state layer's pages to the page size of the others:
            # the page is the block stride, its tail unused by the layer.
            self.real_bytes = self.page_bytes
            u8 = u8.as_strided((num_blocks, stride), (stride, 1))
            self.page_bytes = stride
        self.u8 = u8
        self.dtype = str(tensor.dtype).removeprefix("torch.")
        self.itemsize = tensor.element_size()
        self.head_axis = head_axis
        """The axis of the layer's KV heads (None: heads are not cut)."""
        if head_axis is not None and not (head_axis != self.axis and 0 <= head_axis < u8.dim() - 1):
            raise ConfigError(f"{name}: KV heads on axis {head_axis} of KV cache shape {tuple(tensor.shape)}")

    @property
    def num_heads(self) -> int | None:
        """The rank's KV heads in a page (None: heads are not cut)."""
        return None if self.head_axis is None else int(self.u8.shape[self.head_axis])

    def heads(self, a: Any, heads: tuple[int, int] | None) -> Any:
        """``a`` (the layer's pages, or a frame of them: numpy or torch) cut
        to the KV heads ``heads`` along the head axis; ``a`` itself for None."""
        if heads is None:
            return a
        assert self.head_axis is not None, "a layer whose heads are not cut"
        first, n = heads
        if isinstance(a, torch.Tensor):
            return a.narrow(self.head_axis, first, n)
        return along(a, self.head_axis, first, first + n)

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

    def frame_bytes(self, n_blocks: int, heads: tuple[int, int] | None = None) -> int:
        """Bytes of ``n_blocks`` of the layer's pages (of ``heads`` only, where given)."""
        return math.prod(self.shape_for(n_blocks, heads))

    def shape_for(self, n_blocks: int, heads: tuple[int, int] | None = None) -> tuple[int, ...]:
        """The shape of ``n_blocks`` of the layer's pages (of ``heads`` only, where given)."""
        shape = list(self.u8.shape)
        shape[self.axis] = n_blocks
        if heads is not None:
            assert self.head_axis is not None, "a layer whose heads are not cut"
            shape[self.head_axis] = heads[1]
        return tuple(shape)
