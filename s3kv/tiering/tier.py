"""The bytes half of a local tier, as each worker holds it.

A local tier is split across vLLM's processes: its *placement* (which key is
where, what to evict: :class:`~s3kv.tiering.placement.TierIndex`) lives on
the scheduler side, its *bytes* in each worker. This module is the bytes
half's interface; the host pool (:mod:`s3kv.tiering.hostpool`), the NVMe
directory (:mod:`s3kv.tiering.disk`) and the dict-backed reference below
implement it, and one conformance suite checks all three.

Calls are synchronous and thread-safe for distinct keys (workers call them
from executor threads). ``slot`` is the location the scheduler chose, for
tiers that have slots; the others ignore it.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod

import numpy as np

from s3kv.errors import NotFound
from s3kv.tiering.chunks import ChunkData, FrameSink
from s3kv.tiering.placement import Tier


class TierStorage(ABC):
    tier: Tier

    @abstractmethod
    def write(self, key: bytes, chunk: ChunkData, slot: int | None = None) -> int:
        """Store ``chunk`` under ``key``; returns the bytes it takes. Raises
        StorageFull / PermissionDenied when the medium refuses."""

    @abstractmethod
    def read(self, key: bytes, sink: FrameSink, slot: int | None = None) -> int:
        """Hand each layer of ``key`` to ``sink``; returns the bytes read.
        Raises NotFound, or CorruptChunk (and forgets the bad copy)."""

    @abstractmethod
    def delete(self, key: bytes, slot: int | None = None) -> None:
        """Forget ``key``; absent is not an error."""

    @abstractmethod
    def bytes_used(self) -> int:
        """Bytes this tier really holds (measured, not accounted)."""


class MemoryTierStorage(TierStorage):
    """A dict of private copies: the reference the other tiers are tested against."""

    tier = Tier.CPU

    def __init__(self) -> None:
        self._chunks: dict[bytes, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def write(self, key: bytes, chunk: ChunkData, slot: int | None = None) -> int:
        copies = [np.array(a, dtype=np.uint8, copy=True).reshape(-1) for a in chunk.layers]
        with self._lock:
            self._chunks[key] = copies
        return sum(a.nbytes for a in copies)

    def read(self, key: bytes, sink: FrameSink, slot: int | None = None) -> int:
        with self._lock:
            layers = self._chunks.get(key)
        if layers is None:
            raise NotFound(key.hex())
        for i, a in enumerate(layers):
            sink(i, a)
        return sum(a.nbytes for a in layers)

    def delete(self, key: bytes, slot: int | None = None) -> None:
        with self._lock:
            self._chunks.pop(key, None)

    def bytes_used(self) -> int:
        with self._lock:
            return sum(a.nbytes for layers in self._chunks.values() for a in layers)
