"""Counters that s3kv keeps, in one flat, mergeable dict of numbers.

The connector ships them to vLLM's stats path; tests and the demo read them
back. Names carry units (``_bytes``, ``_s``) and say what is counted.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

COUNTERS: dict[str, str] = {
    "lookup_requests": "Requests whose prefix was looked up in the cache",
    "lookup_tokens": "Prompt tokens looked up",
    "hit_tokens": "Tokens offered to vLLM as loadable from the cache",
    "load_chunks": "Chunk shards loaded into the KV cache",
    "load_bytes": "Bytes fetched from the store for loads",
    "load_seconds": "Seconds spent loading chunk shards (sum)",
    "load_errors_missing": "Chunk loads failed: object missing",
    "load_errors_corrupt": "Chunk loads failed: checksum, header or size wrong",
    "load_errors_timeout": "Chunk loads failed: slower than load_timeout_s",
    "load_errors_unavailable": "Chunk loads failed: store unreachable or throttling",
    "load_errors_other": "Chunk loads failed for another reason",
    "store_chunks": "Chunk shards written to the store",
    "store_chunks_existing": "Chunk shards another writer had already stored",
    "store_raw_bytes": "KV bytes of the chunk shards stored (before compression)",
    "store_bytes": "Bytes written to the store",
    "store_seconds": "Seconds spent encoding and writing chunk shards (sum)",
    "store_dropped_backpressure": "Stores dropped because max_inflight_bytes was reached",
    "store_errors": "Stores that failed (the chunk is simply not cached)",
}


class Counters:
    """Thread-safe counters. ``take()`` returns and resets what accumulated
    since the last take (for vLLM's per-step stats); ``totals()`` is
    everything since start."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}
        self._totals: dict[str, float] = {}

    def add(self, name: str, value: float = 1) -> None:
        if name not in COUNTERS:
            raise KeyError(f"unknown counter {name!r}")
        with self._lock:
            self._values[name] = self._values.get(name, 0) + value
            self._totals[name] = self._totals.get(name, 0) + value

    def totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self._totals)

    def take(self) -> dict[str, float]:
        with self._lock:
            values, self._values = self._values, {}
        return values


def merge(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out
