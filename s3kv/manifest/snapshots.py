"""Writing snapshots and pruning old ones: the one writer and the one rule
that replicas (:meth:`~s3kv.manifest.sync.ManifestSync.maybe_snapshot`)
and gc's compaction (:mod:`s3kv.ops.compaction`) both follow.

A snapshot holds every live fingerprint and, in its header, the
:class:`~s3kv.manifest.protocol.Horizon` of the segments it covers and its
writer. The newest :data:`SNAPSHOTS_KEPT` stay when older ones are pruned,
so a reader that listed a snapshot a moment ago still finds it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from s3kv.manifest import format as mf
from s3kv.manifest.protocol import Horizon, parse_name, snapshot_name
from s3kv.stores.base import ObjectMeta, ObjectStore, PutMode

if TYPE_CHECKING:
    from s3kv.auth import FleetKeys

SNAPSHOTS_KEPT = 3
"""Snapshots that survive a prune: the newest few."""


async def write_snapshot(
    store: ObjectStore,
    base: str,
    live: np.ndarray,
    horizon: Horizon,
    *,
    writer: str,
    next_ts: Callable[[], int],
    keys: FleetKeys | None = None,
    by: str | None = None,
    offload: Callable[..., Awaitable[Any]] = asyncio.to_thread,
    extra: dict[str, Any] | None = None,
) -> ObjectMeta:
    """Write a snapshot of ``live`` (sorted, unique) covering ``horizon``
    under the manifest prefix ``base``, create-only, stamped by ``next_ts``
    once it is encoded (by ``offload``, off the event loop: it may hold millions of keys);
    with ``keys``, signed. ``by`` marks who wrote it (gc's are "gc");
    ``extra`` goes into its header too (protocol "epochs": the ``epoch``
    every one up to which it covers, and ``e_ms``)."""
    meta = {**(extra or {}), **horizon.meta(), "writer": writer}
    if by is not None:
        meta["by"] = by
    body = await offload(mf.encode, mf.ManifestObject("snapshot", live, meta=meta), keys)
    ts = next_ts()
    name = snapshot_name(base, ts, writer)
    await store.put(name, body, mode=PutMode.CREATE)
    return ObjectMeta(name, len(body), ts / 1000)


def stale_snapshots(
    base: str,
    names: Iterable[str],
    *,
    limit_ms: int,
    kept: int = SNAPSHOTS_KEPT,
    cover: str | None = None,
) -> list[str]:
    """The snapshots to delete of those listed (``names``), oldest first.

    Only snapshots by name, none stamped after ``limit_ms`` (now plus the
    skew margin): junk is neither counted among the newest nor deleted.
    The newest ``kept`` stay; with ``cover`` (the snapshot gc prunes
    segments under), so do it and every snapshot after it, so that the
    segments' removal never leaves a reader without one that covers them."""
    ours = sorted(
        n
        for n in names
        if (parsed := parse_name(base, n)) is not None and parsed.kind == "snapshot" and parsed.ts <= limit_ms
    )
    old = ours[: max(len(ours) - kept, 0)]
    return [n for n in old if cover is None or n < cover]
