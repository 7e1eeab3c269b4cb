"""The CPU tier's bytes: one buffer of fixed-size slots, one chunk shard each.

A slot holds every layer's pages of one chunk, layer after layer, in the byte
order of the KV cache (copied whole, never reinterpreted). The buffer comes
from the caller: on a CUDA/XPU engine the connector allocates it pinned, so
copies to and from the device run asynchronously; on the CPU platform plain
memory. The scheduler decides which chunk goes into which slot; the CPU
tier's handler (:class:`~s3kv.tiering.tiers.cpu.handler.CpuHandler`) reads and
writes slots for the transfer engine.
"""

from __future__ import annotations

import threading

import numpy as np


def slots_for(capacity_bytes: int, slot_bytes: int) -> int:
    """How many chunk slots fit in ``capacity_bytes`` (both sides compute it)."""
    return capacity_bytes // slot_bytes if slot_bytes > 0 else 0


class HostPool:
    def __init__(
        self, num_slots: int, layer_bytes: int, num_layers: int, buffer: np.ndarray | None = None
    ) -> None:
        self.num_slots = num_slots
        self.layer_bytes = layer_bytes
        self.num_layers = num_layers
        self.slot_bytes = layer_bytes * num_layers
        if buffer is None:
            buffer = np.empty((num_slots, self.slot_bytes), dtype=np.uint8)
        if buffer.dtype != np.uint8 or buffer.size != num_slots * self.slot_bytes:
            raise ValueError(
                f"host pool buffer must be {num_slots} x {self.slot_bytes} bytes of uint8, "
                f"got {buffer.size} of {buffer.dtype}"
            )
        self.buffer = buffer.reshape(num_slots, self.slot_bytes)
        self._keys: list[bytes | None] = [None] * num_slots
        self._lock = threading.Lock()

    def check_slot(self, slot: int | None) -> int:
        if slot is None or not 0 <= slot < self.num_slots:
            raise ValueError(f"host pool: slot {slot} out of range 0..{self.num_slots - 1}")
        return slot

    def layer_view(self, slot: int, layer: int) -> np.ndarray:
        """Layer ``layer``'s pages in slot ``slot`` (a writable view)."""
        start = layer * self.layer_bytes
        return self.buffer[self.check_slot(slot), start : start + self.layer_bytes]

    def layer_views(self, slot: int) -> list[np.ndarray]:
        return [self.layer_view(slot, i) for i in range(self.num_layers)]

    def claim(self, slot: int, key: bytes | None) -> None:
        """Say which chunk slot ``slot`` holds (None: being overwritten)."""
        with self._lock:
            self._keys[self.check_slot(slot)] = key

    def holds(self, slot: int, key: bytes) -> bool:
        with self._lock:
            return self._keys[self.check_slot(slot)] == key

    def release(self, slot: int, key: bytes) -> None:
        """Slot ``slot`` no longer holds ``key`` (if it did)."""
        with self._lock:
            if self._keys[self.check_slot(slot)] == key:
                self._keys[slot] = None
