"""Removing chunks from a shared bucket while replicas serve from it (``s3kv
gc`` and ``s3kv verify --delete``): a tombstone segment first, so replicas
stop offering the chunks as hits, then the objects, in DeleteObjects
batches."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from s3kv.errors import AlreadyExists, S3KVError
from s3kv.keys import fingerprint
from s3kv.manifest import format as mf
from s3kv.manifest.arrays import as_sorted_unique
from s3kv.manifest.listing import SegmentLister
from s3kv.manifest.protocol import Stamps, segment_name
from s3kv.stores.base import ObjectStore, PutMode

if TYPE_CHECKING:
    from s3kv.auth import FleetKeys

DELETE_BATCH = 1000
"""Keys per DeleteObjects request (S3's limit)."""


class Held(Protocol):
    """A lease the deleter holds (:class:`s3kv.ops.lock.Lease`)."""

    def check(self) -> None:
        """Raise unless it is still held."""


async def publish_tombstones(
    store: ObjectStore,
    base: str,
    chunk_keys: Iterable[bytes],
    stamps: Stamps,
    skew_s: float,
    clock: Callable[[], float] = time.time,
    keys: FleetKeys | None = None,
) -> str:
    """A segment under the manifest prefix ``base`` that removes
    ``chunk_keys`` from every replica's manifest, stamped after the newest
    segment in the bucket (listed afresh from a skew margin below the newest
    seen), so no replica's listing floor hides it. Returns its name."""
    lister = SegmentLister(store, base, skew_s=skew_s, clock=clock)
    floor = lister.floor(stamps.seen_ms, int(skew_s * 1000))
    stamps.seen([m.key for m in await lister.after(floor)])
    removed = as_sorted_unique([fingerprint(k) for k in chunk_keys])
    body = mf.encode(
        mf.ManifestObject("segment", removed=removed, meta={"writer": stamps.writer, "by": "gc"}), keys
    )
    ts = stamps.next(int(clock() * 1000))
    name = segment_name(base, ts, stamps.writer, stamps.seq, directory=store.directory)
    with contextlib.suppress(AlreadyExists):
        await store.put(name, body, mode=PutMode.CREATE)
    return name


async def delete_keys(
    store: ObjectStore,
    keys: list[str],
    *,
    concurrency: int,
    lease: Held | None,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Delete in DeleteObjects batches, ``concurrency`` at a time, each
    only while ``lease`` is held; returns the keys of batches that failed."""
    sem = asyncio.Semaphore(concurrency)
    failed: list[str] = []

    async def one(batch: list[str]) -> None:
        async with sem:
            if lease is not None:
                lease.check()
            try:
                await store.delete_many(batch)
            except S3KVError:
                failed.extend(batch)
                return
            if progress is not None:
                progress(len(batch))

    await asyncio.gather(*(one(keys[i : i + DELETE_BATCH]) for i in range(0, len(keys), DELETE_BATCH)))
    return failed
