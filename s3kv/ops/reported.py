"""The chunk objects replicas reported bad (:func:`find_bad`): corrupt
ones they could not delete, named in their segments' ``bad`` lists, which
gc judges again and deletes if they are still bad (:func:`delete_bad`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from s3kv.auth import FleetKeys
from s3kv.config import DEFAULTS
from s3kv.errors import (
    CorruptChunk,
    CorruptManifest,
    NotFound,
    PermissionDenied,
    Precondition,
    S3KVError,
    TooLarge,
    Transient,
    UnsupportedFormat,
)
from s3kv.keys import parse_object_key
from s3kv.manifest.bad import entries
from s3kv.ops.chunks import check_object
from s3kv.ops.inventory import Inventory
from s3kv.ops.reads import read_manifest_head
from s3kv.stores.base import ObjectMeta, ObjectStore


@dataclass(frozen=True)
class BadObject:
    """A chunk object a replica reported bad, that gc found corrupt too."""

    ns: str
    key: bytes
    name: str
    etag: str | None
    """The ETag gc read: it deletes only that version."""
    reason: str


@dataclass
class BadFound:
    """What gc made of the chunk objects replicas reported bad."""

    objects: list[BadObject] = field(default_factory=list)
    """Those still there that still fail to verify."""
    skipped: int = 0
    """Those gc did not judge this run: it may not read one (a 403: another
    KMS key, a bucket policy) or reading it failed (a 503). Judged again the
    next run."""
    segments_skipped: int = 0
    """Segments (or snapshots) whose reports gc did not read this run, so (a
    403, a 503), or larger than ``manifest_max_bytes``."""
    carried: dict[str, dict[str, str | None]] = field(default_factory=dict)
    """By namespace, the records (object name: ETag) a snapshot gc writes
    carries on, as replicas' snapshots do (:mod:`s3kv.manifest.bad`): those
    still bad (with the ETag gc read) and those not judged this run; not those
    gone or good again. gc leaves out those it deletes."""


async def find_bad(
    store: ObjectStore,
    inv: Inventory,
    *,
    keys: FleetKeys | None = None,
    concurrency: int = 8,
    manifest_max_bytes: int = DEFAULTS.manifest_max_bytes,
) -> BadFound:
    """The chunk objects replicas reported bad (in their segments' ``bad``
    lists, and the newest snapshot's that reads) that are still there and
    still fail to verify; an object that
    reads well now (stored again since, or named by a bogus record) is not
    bad. One gc may not read, or that fails to read, is skipped and counted:
    it does not stop the run. Reads only."""
    named: dict[str, tuple[str, str | None]] = {}  # object name: (namespace, ETag reported)
    out = BadFound()

    async def head(m: ObjectMeta) -> dict[str, Any] | None:
        try:
            return (await read_manifest_head(store, m, keys, manifest_max_bytes))[3]
        except (NotFound, CorruptManifest):
            return None
        except (PermissionDenied, Transient, TooLarge) as e:
            if isinstance(e, PermissionDenied) and e.credentials:
                raise  # S3 refuses gc itself, not this object
            out.segments_skipped += 1
            return None

    for ns, info in inv.namespaces.items():
        out.carried[ns] = {}
        # The newest snapshot that reads carries the reports of the segments
        # it covers (they may be pruned since); then each segment its own.
        heads = []
        for m in sorted(info.snapshots, key=lambda m: m.key, reverse=True):
            if (meta := await head(m)) is not None:
                heads.append(meta)
                break
        heads += [meta for m in info.segments if (meta := await head(m)) is not None]
        for meta in heads:
            for name, etag in entries(meta.get("bad")):
                parsed = parse_object_key(name)
                if name.startswith(info.base) and parsed is not None and parsed[0] == ns:
                    named[name] = (ns, etag)
    sem = asyncio.Semaphore(concurrency)

    async def one(name: str, ns: str, etag: str | None) -> BadObject | None:
        key = parse_object_key(name)[1]  # type: ignore[index]
        async with sem:
            try:
                # The head first (most bad objects fail there: forged,
                # unsigned, torn, misnamed), then the frames a range at a
                # time, no more than the descriptor's pages.
                await check_object(store, name, inv.namespaces[ns].pages, keys, sound_first=False)
            except (NotFound, Precondition):
                return None  # gone, or stored again while read
            except UnsupportedFormat:
                # A newer s3kv's object, or one not decoded: never deleted, not judged.
                out.carried[ns][name] = etag
            except CorruptChunk as e:
                out.carried[ns][name] = e.etag
                return BadObject(ns, key, name, e.etag, str(e))
            except (PermissionDenied, Transient) as e:
                if isinstance(e, PermissionDenied) and e.credentials:
                    raise  # S3 refuses gc itself, not this object
                out.skipped += 1
                out.carried[ns][name] = etag
        return None

    found = await asyncio.gather(*(one(n, ns, etag) for n, (ns, etag) in sorted(named.items())))
    out.objects = [b for b in found if b is not None]
    return out


async def delete_bad(store: ObjectStore, inv: Inventory, bad: Iterable[BadObject]) -> tuple[int, list[str]]:
    """Delete bad objects, each only if it is still the version gc read
    (If-Match); then a replica may store the chunk again. Returns how many
    were deleted, and the names of those whose delete failed."""
    deleted, failed = 0, []
    for b in bad:
        try:
            if b.etag is None:
                raise NotImplementedError("no ETag")
            await store.delete_if(b.name, b.etag)
        except (NotFound, Precondition):
            continue  # gone, or rewritten since gc read it
        except (S3KVError, NotImplementedError):
            failed.append(b.name)
            continue
        deleted += 1
        chunk = inv.namespaces[b.ns].chunks.get(b.key)
        if chunk is not None:
            chunk.objects = [o for o in chunk.objects if o.key != b.name]
            if not chunk.objects:
                del inv.namespaces[b.ns].chunks[b.key]
    return deleted, failed
