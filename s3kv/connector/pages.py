"""Copying whole KV block pages between vLLM's KV cache tensors and host
memory, for any layout: a layer's tensor has one axis of ``num_blocks``; a
chunk's pages of a layer are ``index_select`` along it, stored as opaque
bytes, and written back with ``index_copy_``. Nothing inside a page is
ever reinterpreted (on the CPU backend its byte order depends on the ISA).

One small interface, two implementations:
- host tensors (vLLM's CPU backend): plain copies from any thread;
- device tensors (CUDA/XPU): writes go through a side stream, and
  :meth:`PageIO.synchronize` waits for them before a load is reported done.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from s3kv.errors import ConfigError


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
        first = kv_caches[layer_names[0]]
        self.device = first.device
        self._stream = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.device)

    def read(self, block_ids: Sequence[int]) -> list[np.ndarray]:
        """Private host copies of the pages of ``block_ids``, one array per layer.
        Called on the forward's thread after the forward, so it sees its writes."""
        idx = self._index(block_ids)
        out = []
        for layer in self.layers:
            pages = layer.u8.index_select(layer.axis, idx)
            if pages.device.type != "cpu":
                pages = pages.to("cpu")
            out.append(pages.numpy().reshape(-1))
        return out

    def write(self, layer_index: int, block_ids: Sequence[int], first: int, data: np.ndarray) -> None:
        """Write pages ``first..`` of a chunk's layer (``data`` holds all of the
        chunk's pages) into ``block_ids[first:]``. Thread-safe for distinct blocks."""
        layer = self.layers[layer_index]
        n = len(block_ids)
        src = torch.from_numpy(data).view(layer.shape_for(n))
        if first:
            src = src.narrow(layer.axis, first, n - first)
        ids = block_ids[first:]
        if self._stream is None:
            layer.u8.index_copy_(layer.axis, self._index(ids), src)
            return
        with torch.cuda.stream(self._stream):
            layer.u8.index_copy_(layer.axis, self._index(ids), src.to(self.device, non_blocking=True))

    def synchronize(self) -> None:
        """Return once every :meth:`write` so far is visible to the forward."""
        if self._stream is not None:
            self._stream.synchronize()

    @property
    def page_shape(self) -> tuple[int, ...]:
        """Shape of one block's page in the first layer (for chunk headers)."""
        return self.layers[0].shape_for(1)
