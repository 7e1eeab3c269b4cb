"""Figures for ``s3kv ls`` and ``s3kv stats``, from an inventory."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from typing import Any

from s3kv.chunk_reader import ChunkReader, ranged_get
from s3kv.errors import CorruptChunk, CorruptManifest, NotFound, S3KVError
from s3kv.manifest.protocol import Horizon, name_ts, record_hour
from s3kv.ops.described import group_rows
from s3kv.ops.inventory import EpochId, Inventory, NamespaceInfo, epoch_id
from s3kv.ops.reads import read_manifest_head
from s3kv.stores.base import HEAD_BYTES, ObjectStore

SIZE_EDGES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
AGE_EDGES = [(3600, "1h"), (86400, "1d"), (7 * 86400, "7d"), (30 * 86400, "30d"), (90 * 86400, "90d")]


def parts_row(info: NamespaceInfo) -> dict[str, Any]:
    """A namespace's chunk keys, objects and bytes, the shard objects of
    each chunk key (None: not said), and its KV cache groups:
    with several, each chunk key is one group's part of a chunk, and chunk
    keys over groups estimates the chunks (more where a windowed group's part
    of a chunk no hit reaches was not stored)."""
    d = info.described
    groups = info.groups
    return {
        "chunks": len(info.chunks),
        "objects": info.object_count,
        "bytes": info.chunk_bytes,
        "groups": groups,
        "shards": info.shards,
        "kv_groups": group_rows(d.groups) if d is not None and d.groups is not None else None,
        "chunks_estimate": round(len(info.chunks) / groups) if groups else None,
    }


def epoch_state(info: NamespaceInfo, now: float) -> dict[str, Any]:
    """A namespace's epoch objects (:mod:`s3kv.manifest.epochs`): how many,
    their bytes, and the newest: its number, epoch length and how far its
    end is behind ``now`` (seconds; a fleet whose aggregators keep up stays
    a publish interval or two behind). Replicas configured with another
    publish interval write another chain of their own: each is one row of
    ``chains``, the newest of all is the namespace's."""
    chains: dict[int, dict[str, Any]] = {}
    newest: EpochId | None = None
    for m in info.epochs:
        e = epoch_id(info.manifest_base, m.key)
        if e is None:
            continue
        row = chains.setdefault(e.e_ms, {"e_ms": e.e_ms, "epochs": 0, "bytes": 0, "newest_epoch": e.epoch})
        row["epochs"] += 1
        row["bytes"] += m.size
        row["newest_epoch"] = max(row["newest_epoch"], e.epoch)
        if newest is None or (e.end_ms, e.e_ms) > (newest.end_ms, newest.e_ms):
            newest = e
    for row in chains.values():
        row["behind_s"] = round(now - EpochId(row["e_ms"], row["newest_epoch"]).end_ms / 1000, 3)
    return {
        "epochs": sum(r["epochs"] for r in chains.values()),
        "epoch_bytes": sum(r["bytes"] for r in chains.values()),
        "newest_epoch": newest.epoch if newest is not None else None,
        "epoch_ms": newest.e_ms if newest is not None else None,
        "newest_epoch_behind_s": round(now - newest.end_ms / 1000, 3) if newest is not None else None,
        "epoch_chains": [chains[k] for k in sorted(chains)],
    }


def namespace_row(info: NamespaceInfo, now: float | None = None) -> dict[str, Any]:
    """A namespace's line of ``s3kv ls``; ``now`` (default: the clock's)
    says how far behind its newest epoch is."""
    chunks = list(info.chunks.values())
    accessed = [c.accessed for c in chunks if c.accessed is not None]
    return {
        "namespace": info.id,
        "model": info.model,
        "layout": info.layout(),
        **parts_row(info),
        "manifest_objects": len(info.manifest_objects),
        "manifest_bytes": sum(o.size for o in info.manifest_objects),
        "oldest_write": min((c.written for c in chunks), default=None),
        "newest_write": max((c.written for c in chunks), default=None),
        "last_access": max(accessed, default=None),
        "foreign_objects": len(info.foreign),
        **epoch_state(info, time.time() if now is None else now),
    }


def _size_label(lo: int, hi: int | None) -> str:
    from s3kv.units import format_size

    return (
        f"< {format_size(hi)}"
        if lo == 0
        else (f">= {format_size(lo)}" if hi is None else f"{format_size(lo)} - {format_size(hi)}")
    )


def size_histogram(sizes: list[int]) -> list[dict[str, Any]]:
    edges = [0, *SIZE_EDGES]
    rows = []
    for i, lo in enumerate(edges):
        hi = edges[i + 1] if i + 1 < len(edges) else None
        n = [s for s in sizes if s >= lo and (hi is None or s < hi)]
        rows.append({"range": _size_label(lo, hi), "objects": len(n), "bytes": sum(n)})
    return rows


def age_histogram(ages: list[tuple[float, int]]) -> list[dict[str, Any]]:
    """``ages``: (seconds, bytes) per chunk."""
    rows, lo, lo_label = [], 0.0, "0"
    for hi, label in [*AGE_EDGES, (float("inf"), "")]:
        n = [b for a, b in ages if lo <= a < hi]
        rows.append(
            {
                "range": f"{lo_label} - {label}" if label else f">= {lo_label}",
                "chunks": len(n),
                "bytes": sum(n),
            }
        )
        lo, lo_label = hi, label
    return rows


async def compression(
    store: ObjectStore, inv: Inventory, sample: int, seed: int | None = None
) -> dict[str, Any]:
    """Raw over stored bytes, from the headers of ``sample`` chunk objects."""
    objects = [o for info in inv.namespaces.values() for c in info.chunks.values() for o in c.objects]
    picked = random.Random(seed).sample(objects, min(sample, len(objects)))
    sem = asyncio.Semaphore(16)
    codecs: dict[str, int] = {}

    async def one(key: str) -> tuple[int, int] | None:
        async with sem:
            try:
                h = (await ChunkReader().read_header(ranged_get(store, key), HEAD_BYTES)).header
            except (CorruptChunk, NotFound, S3KVError):
                return None
        codecs[h.codec] = codecs.get(h.codec, 0) + 1
        return h.raw_bytes, h.stored_bytes

    got = [g for g in await asyncio.gather(*(one(o.key) for o in picked)) if g is not None]
    raw, stored = sum(g[0] for g in got), sum(g[1] for g in got)
    return {
        "sampled": len(got),
        "raw_bytes": raw,
        "stored_bytes": stored,
        "ratio": round(raw / stored, 3) if stored else None,
        "codecs": codecs,
    }


async def manifest_state(store: ObjectStore, info: NamespaceInfo, now: float) -> dict[str, Any]:
    snaps = sorted(info.snapshots, key=lambda m: m.key)
    snap_rows = []
    covered = Horizon()
    for m in snaps:
        row: dict[str, Any] = {
            "name": m.key.rsplit("/", 1)[-1],
            "bytes": m.size,
            "age_s": now - (name_ts(m.key) or 0) / 1000,
        }
        with contextlib.suppress(NotFound, CorruptManifest, S3KVError):
            _kind, n_add, _n_del, meta = await read_manifest_head(store, m)
            row["keys"] = n_add
            row["by"] = meta.get("by", "replica")
            covered = Horizon.of(meta)
        snap_rows.append(row)
    pending = [m for m in info.segments if not covered.covers(m.key)]
    hours = {record_hour(info.manifest_base, m.key) for m in info.access}
    return {
        "segments": len(info.segments),
        "segment_bytes": sum(m.size for m in info.segments),
        "segments_after_snapshot": len(pending),
        "snapshots": snap_rows,
        "access_records": len(info.access),
        "access_hours": len(hours),
        "access_bytes": sum(m.size for m in info.access),
        **epoch_state(info, now),
    }


async def stats(store: ObjectStore, inv: Inventory, now: float, *, sample: int = 64) -> dict[str, Any]:
    chunks = [c for info in inv.namespaces.values() for c in info.chunks.values()]
    sizes = [o.size for c in chunks for o in c.objects]
    return {
        "namespaces": len(inv.namespaces),
        "chunks": len(chunks),
        "objects": len(sizes),
        "bytes": sum(sizes),
        "size_histogram": size_histogram(sizes),
        "age_histogram": age_histogram([(now - c.written, c.size) for c in chunks]),
        "idle_histogram": age_histogram([(now - c.last_used, c.size) for c in chunks]),
        "compression": await compression(store, inv, sample),
        "manifest": {ns: await manifest_state(store, info, now) for ns, info in inv.namespaces.items()},
        "by_namespace": {ns: parts_row(info) for ns, info in inv.namespaces.items()},
    }
