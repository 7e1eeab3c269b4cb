"""Counters that s3kv keeps, in one flat, mergeable dict of numbers.

The connector ships them to vLLM's stats path; tests and the demo read them
back. Names carry units (``_bytes``, ``_s``) and say what is counted.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Mapping
from typing import TypeVar

COUNTERS: dict[str, str] = {
    "lookup_requests": "Requests whose prefix was looked up in the cache",
    "lookup_tokens": "Prompt tokens looked up",
    "hit_tokens": "Tokens offered to vLLM as loadable from the cache (all tiers)",
    "hit_tokens_cpu": "Tokens offered from the CPU tier",
    "hit_tokens_disk": "Tokens offered from the NVMe tier",
    "hit_tokens_s3": "Tokens offered from S3",
    "load_chunks_cpu": "Chunk shards loaded into the KV cache from the CPU tier",
    "load_chunks_disk": "Chunk shards loaded into the KV cache from the NVMe tier",
    "load_chunks_s3": "Chunk shards loaded into the KV cache from S3",
    "load_bytes_cpu": "Bytes copied from the CPU tier for loads",
    "load_bytes_disk": "Bytes read from the NVMe tier for loads",
    "load_bytes_s3": "Bytes fetched from S3 for loads",
    "load_seconds": "Seconds spent loading chunk shards (sum)",
    "load_errors_missing": "Chunk loads failed: object missing",
    "load_errors_corrupt": "Chunk loads failed: checksum, header or size wrong",
    "load_errors_timeout": "Chunk loads failed: slower than load_timeout_s",
    "load_errors_unavailable": "Chunk loads failed: store unreachable or throttling",
    "load_errors_other": "Chunk loads failed for another reason",
    "promote_chunks_cpu": "Chunk shards loaded from NVMe or S3 and kept in the CPU tier",
    "store_chunks_cpu": "Chunk shards copied into the CPU tier",
    "store_chunks_disk": "Chunk shard files written to the NVMe tier (stores and promotions)",
    "store_chunks_s3": "Chunk shards written to S3",
    "store_chunks_existing": "Chunk shards another writer had already stored in S3",
    "store_raw_bytes": "KV bytes of the chunk shards written through (before compression)",
    "store_bytes_disk": "Bytes written to the NVMe tier",
    "store_bytes_s3": "Bytes written to S3",
    "store_seconds": "Seconds spent encoding and writing chunk shards through (sum)",
    "store_dropped_backpressure": "Write-throughs dropped because max_inflight_bytes was reached",
    "store_dropped_no_slot": "CPU-tier stores dropped: every slot was in use",
    "store_dropped_disk_full": "NVMe writes dropped: the file system was full",
    "store_errors_disk": "NVMe writes that failed otherwise (the chunk is simply not cached there)",
    "store_errors_s3": "S3 writes that failed (the chunk is simply not cached there)",
    "evict_chunks_cpu": "Chunks evicted from the CPU tier (least recently used)",
    "evict_chunks_disk": "Chunks evicted from the NVMe tier (least recently used)",
    "manifest_segments_published": "Manifest segments this replica wrote (the chunks it stored)",
    "manifest_segments_loaded": "Manifest segments of the fleet applied",
    "manifest_snapshots_written": "Manifest snapshots this replica wrote",
    "manifest_errors": "Manifest reads or writes that failed (retried later)",
    "manifest_dropped": "Keys dropped from the manifest: their object was missing or corrupt",
    "s3_requests_get": "HTTP requests sent to S3: GET",
    "s3_requests_put": "HTTP requests sent to S3: PUT and multipart parts",
    "s3_requests_list": "HTTP requests sent to S3: LIST",
    "s3_requests_head": "HTTP requests sent to S3: HEAD",
    "s3_requests_delete": "HTTP requests sent to S3: DELETE",
    "s3_requests_other": "HTTP requests sent to S3: other operations",
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


K = TypeVar("K", bound=Hashable)


def merge(a: Mapping[K, float], b: Mapping[K, float]) -> dict[K, float]:
    """Sum two dicts of numbers key by key."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out
