"""What is in a bucket prefix: namespaces, their chunks, manifests, and
anything that is not s3kv's.

Listing is the truth (the manifest is a hint): :func:`scan` lists a
prefix one level at a time with a delimiter, then every namespace's shard
directories (``{ns}/{kk}/``) in parallel, so a bucket of millions of chunks
is listed by many concurrent paginations instead of one. Access records
(``manifest/access/``) are read to give each chunk its last use, and
manifest objects' prefixes to tell whether the namespace's replicas sign
(:func:`manifest_signed`). No manifest object is read past the replicas'
``manifest_max_bytes`` (:func:`~s3kv.ops.reads.read_manifest`), whatever it
holds or claims.

Epoch objects (``manifest/ep/{E_ms}/{e}``: :mod:`s3kv.manifest.epochs`, one
per publish interval, written by the fleet's aggregators) are manifest
objects like segments: listed as :attr:`NamespaceInfo.epochs`, never foreign
(a name under ``ep/`` that is no epoch's is).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from s3kv.auth import FleetKeys
from s3kv.config import DEFAULTS
from s3kv.descriptor import NAME as DESCRIPTOR
from s3kv.descriptor import ChunkPages, Described
from s3kv.errors import (
    CorruptManifest,
    NotFound,
    PermissionDenied,
    RangeNotSatisfiable,
    TooLarge,
    Transient,
)
from s3kv.keys import fingerprint, namespace_prefix, parse_object_key
from s3kv.manifest import format as mf
from s3kv.manifest.protocol import (
    ACCESS,
    EPOCHS,
    SEGMENTS,
    SNAPSHOTS,
    Stamps,
    access_hour_end,
    epoch_end,
    name_ts,
    parse_epoch,
    parse_name,
)
from s3kv.ops.described import sharding, summary
from s3kv.ops.reads import read_descriptor, read_manifest
from s3kv.stores.base import ByteRange, ObjectMeta, ObjectStore

LOCK_NAME = "gc.lock"


@dataclass(frozen=True)
class EpochId:
    """What an epoch object's name says: its chain (``e_ms``, the epoch
    length of the replicas that write it) and its number."""

    e_ms: int
    epoch: int

    @property
    def end_ms(self) -> int:
        """The epoch's last stamp (:func:`~s3kv.manifest.protocol.epoch_end`)."""
        return epoch_end(self.epoch, self.e_ms)


def epoch_id(base: str, key: str) -> EpochId | None:
    """The epoch object ``key`` names under the manifest prefix ``base``
    (:func:`~s3kv.manifest.protocol.parse_epoch`), or None."""
    parsed = parse_epoch(base, key)
    return EpochId(parsed[1], parsed[0]) if parsed is not None else None


def is_namespace_id(name: str) -> bool:
    return len(name) == 32 and all(c in "0123456789abcdef" for c in name)


@dataclass
class Chunk:
    """One chunk key: its shard objects, size, and times."""

    key: bytes
    objects: list[ObjectMeta] = field(default_factory=list)
    accessed: float | None = None
    """Newest access record naming it (seconds since the epoch), if any."""

    @property
    def size(self) -> int:
        return sum(o.size for o in self.objects)

    @property
    def written(self) -> float:
        return max(o.last_modified for o in self.objects)

    @property
    def last_used(self) -> float:
        """Last access the fleet recorded, else the write time."""
        return max(self.written, self.accessed or 0.0)


@dataclass
class NamespaceInfo:
    id: str
    base: str
    """Listing prefix of the namespace (ends with '/')."""
    descriptor: dict[str, Any] | None = None
    """The descriptor as it reads (for listings: untrusted, never acted on)."""
    descriptor_meta: ObjectMeta | None = None
    described: Described | None = None
    """What the descriptor says of the namespace's chunks, where it is this
    namespace's (:func:`~s3kv.descriptor.parse_descriptor`): gc and verify act on that."""
    descriptor_error: str | None = None
    """Why the descriptor listed could not be read (a 403: another KMS key, a
    bucket policy; a 503), if so: the namespace is then taken to have none
    this scan (gc publishes no orphan of it, checks are bounded without its
    pages), and verify and gc report it."""
    access_unread: int = 0
    """Access records the scan left out (corrupt, larger than
    ``manifest_max_bytes``, with the fleet secret unsigned): the uses they
    record are not counted; gc reports them."""
    chunks: dict[bytes, Chunk] = field(default_factory=dict)
    segments: list[ObjectMeta] = field(default_factory=list)
    snapshots: list[ObjectMeta] = field(default_factory=list)
    access: list[ObjectMeta] = field(default_factory=list)
    epochs: list[ObjectMeta] = field(default_factory=list)
    """Epoch objects (:func:`epoch_id` reads their names)."""
    foreign: list[ObjectMeta] = field(default_factory=list)
    """Objects under the namespace that s3kv did not write."""

    @property
    def manifest_base(self) -> str:
        return self.base + "manifest/"

    @property
    def chunk_bytes(self) -> int:
        return sum(c.size for c in self.chunks.values())

    @property
    def object_count(self) -> int:
        return sum(len(c.objects) for c in self.chunks.values())

    @property
    def manifest_objects(self) -> list[ObjectMeta]:
        return [*self.segments, *self.snapshots, *self.access, *self.epochs]

    @property
    def model(self) -> str:
        """What the descriptor says the model is (a name, or a content hash)."""
        d = self.descriptor or {}
        fields = d.get("fields") or {}
        return str(d.get("model") or fields.get("model") or fields.get("model_content") or "?")

    @property
    def pages(self) -> ChunkPages | None:
        """The pages the descriptor says a chunk holds, if it says."""
        return self.described.pages if self.described is not None else None

    @property
    def tp_size(self) -> int | None:
        """The TP size of the replicas that store here, by the descriptor;
        None: unknown, or shared by replicas of every TP size (:attr:`shards`)."""
        return self.described.tp_size if self.described is not None else None

    @property
    def shards(self) -> int | None:
        """Shard objects of every chunk key (``.r0`` to ``.r{shards-1}``), by
        the descriptor: its ``kv_shards``, else one a rank; None: unknown."""
        return self.described.shards if self.described is not None else None

    @property
    def groups(self) -> int | None:
        """KV cache groups, by the descriptor: the part objects (keys) of
        each chunk (:mod:`s3kv.kvgroups`), 1 for one group; None: unknown."""
        d = self.described
        if d is None or d.groups_unread:
            return None
        return len(d.groups) if d.groups is not None else 1

    def layout(self) -> str:
        f = (self.descriptor or {}).get("fields") or {}
        if not f:
            return "?"
        dtype = (
            f.get("kv_cache_dtype") if f.get("kv_cache_dtype") not in (None, "auto") else f.get("model_dtype")
        )
        d = self.described
        layers = f"{f.get('num_layers', '?')}L"
        if d is not None and d.groups is not None:
            layers = summary(d.groups)
        elif d is not None and d.groups_unread:
            layers += ", KV cache groups unread"
        parts = [
            str(dtype or "?"),
            layers,
            f"{f.get('num_kv_heads', '?')}x{f.get('head_size', '?')}",
            f"block {f.get('block_size', '?')}",
            f"chunk {(self.descriptor or {}).get('chunk_tokens', '?')}",
            sharding(self.described, f.get("tp_size", "?")),
        ]
        return ", ".join(p.replace("torch.", "") for p in parts)

    def fp_index(self) -> dict[int, bytes]:
        return {fingerprint(k): k for k in self.chunks}

    def stamps(
        self,
        writer: str,
        *,
        skew_s: float = DEFAULTS.manifest_clock_skew_s,
        clock: Callable[[], float] = time.time,
    ) -> Stamps:
        """Stamps for ``writer``'s manifest objects here: after every segment
        and snapshot listed (those in the future excepted)."""
        names = (o.key for o in (*self.segments, *self.snapshots))
        return Stamps(writer, names, skew_s=skew_s, clock=clock)


@dataclass
class Inventory:
    prefix: str
    namespaces: dict[str, NamespaceInfo]
    foreign: list[ObjectMeta]
    """Objects under the prefix outside any namespace (the gc lock excepted)."""
    started_at: float
    """Wall time the listing began."""

    def resolve(self, names: Iterable[str]) -> list[str]:
        """Namespace ids from ids or unique prefixes of at least 4 characters;
        an unknown or ambiguous one raises a ValueError that names it."""
        out: list[str] = []
        for name in names:
            hits = [ns for ns in self.namespaces if ns.startswith(name.lower())] if len(name) >= 4 else []
            if name.lower() in self.namespaces:
                hits = [name.lower()]
            if len(hits) != 1:
                what = "ambiguous" if hits else "unknown"
                raise ValueError(
                    f"{what} namespace {name!r}: the prefix holds {len(self.namespaces)} "
                    f"namespace(s){' (' + ', '.join(sorted(self.namespaces)[:5]) + ')' if self.namespaces else ''}; "
                    "`s3kv ls` lists them"
                )
            out.append(hits[0])
        return out


Progress = Callable[[int], None]
"""Called with how many more objects were listed."""


async def manifest_signed(store: ObjectStore, info: NamespaceInfo, sample: int = 8) -> bool:
    """Whether the namespace's replicas sign their manifest: its newest
    snapshot, one of its newest segments or its newest epoch is signed (a forger's unsigned
    ones beside them do not make it look unsigned; one that is not read, a
    403 or a 503, does not stop the run)."""
    newest = []
    for objs, n in ((info.snapshots, 1), (info.segments, sample), (info.epochs, 1)):
        named = sorted(
            (m for m in objs if parse_name(info.manifest_base, m.key) is not None), key=lambda m: m.key
        )
        newest += named[-n:]
    for m in newest:
        try:  # its prefix only: one GET of 32 bytes, whatever the object holds
            prefix = await store.get(m.key, ByteRange(0, mf.PREFIX.size))
            mf.head_length(prefix)  # a manifest object's prefix, or CorruptManifest
        except (NotFound, RangeNotSatisfiable, CorruptManifest, PermissionDenied, Transient) as e:
            if isinstance(e, PermissionDenied) and e.credentials:
                raise  # S3 refuses the caller itself: every read would
            continue  # gone, junk, or not read (a 403, a 503): the others tell
        if mf.is_signed(prefix):
            return True
    return False


async def _list_all(store: ObjectStore, prefix: str, progress: Progress | None) -> list[ObjectMeta]:
    out: list[ObjectMeta] = []
    async for meta in store.list(prefix):
        out.append(meta)
        if progress is not None and len(out) % 1000 == 0:
            progress(1000)
    if progress is not None:
        progress(len(out) % 1000)
    return out


async def scan_namespace(
    store: ObjectStore,
    prefix: str,
    ns: str,
    *,
    concurrency: int = 16,
    progress: Progress | None = None,
    read_access: bool = True,
    keys: FleetKeys | None = None,
    manifest_max_bytes: int = DEFAULTS.manifest_max_bytes,
) -> NamespaceInfo:
    info = NamespaceInfo(ns, namespace_prefix(prefix, ns))
    objects, dirs = await store.list_dirs(info.base)
    # Shard directories ({kk}/) are listed 16 at a time, by their first hex
    # digit: 16 paginations in parallel, not 256 (or one). A directory
    # bucket lists only prefixes that end with '/': each on its own there.
    groups: dict[str, set[str]] = {}
    for d in dirs:
        name = d[len(info.base) :]
        shard = len(name) == 3 and name[0] in "0123456789abcdef" and not store.directory
        groups.setdefault(info.base + name[0] if shard else d, set()).add(d)
    sem = asyncio.Semaphore(concurrency)

    async def one(listing_prefix: str, members: set[str]) -> list[ObjectMeta]:
        async with sem:
            metas = await _list_all(store, listing_prefix, progress)
        # A group's prefix ("{ns}/a") also matches other names: keep its own.
        starts = tuple(members)
        return [m for m in metas if m.key.startswith(starts)]

    listed = await asyncio.gather(*(one(g, members) for g, members in groups.items()))
    for meta in objects:
        if meta.key == info.base + DESCRIPTOR:
            info.descriptor_meta = meta
        else:
            info.foreign.append(meta)
    for metas in listed:
        for meta in metas:
            _classify(info, meta)
    if info.descriptor_meta is not None:
        try:
            info.descriptor, info.described = await read_descriptor(store, info.descriptor_meta.key, ns)
        except (PermissionDenied, Transient) as e:  # this object only: the scan goes on
            if isinstance(e, PermissionDenied) and e.credentials:
                raise  # S3 refuses the caller itself: every read would
            info.descriptor_error = str(e)
    if read_access and info.access:
        info.access_unread = await read_access_records(
            store, info, concurrency=concurrency, keys=keys, max_bytes=manifest_max_bytes
        )
    return info


def _classify(info: NamespaceInfo, meta: ObjectMeta) -> None:
    if meta.key.startswith(info.manifest_base):
        rest = meta.key[len(info.manifest_base) :]
        directory = rest.split("/", 1)[0] + "/"
        if directory == EPOCHS:
            (info.epochs if epoch_id(info.manifest_base, meta.key) else info.foreign).append(meta)
            return
        target = {SEGMENTS: info.segments, SNAPSHOTS: info.snapshots, ACCESS: info.access}.get(directory)
        if target is not None and name_ts(meta.key) is not None:
            target.append(meta)
        else:
            info.foreign.append(meta)
        return
    parsed = parse_object_key(meta.key)
    if parsed is None or parsed[0] != info.id or meta.key.count("/") != info.base.count("/") + 1:
        info.foreign.append(meta)
        return
    _, key, _shard = parsed
    chunk = info.chunks.get(key)
    if chunk is None:
        chunk = info.chunks[key] = Chunk(key)
    chunk.objects.append(meta)


async def read_access_records(
    store: ObjectStore,
    info: NamespaceInfo,
    *,
    concurrency: int = 16,
    keys: FleetKeys | None = None,
    max_bytes: int = DEFAULTS.manifest_max_bytes,
) -> int:
    """Set each chunk's ``accessed`` from the access records; returns the
    corrupt (with ``keys``: or unsigned) records skipped, and those larger
    than ``max_bytes`` (no replica writes one: refused unread, as replicas
    refuse manifest objects). A record that cannot be read for another reason
    (throttling, access denied) raises: deciding what is idle without it
    could delete chunks in use."""
    index = info.fp_index()
    sem = asyncio.Semaphore(concurrency)
    bad = 0
    now = time.time()

    async def one(meta: ObjectMeta) -> tuple[float, np.ndarray] | None:
        nonlocal bad
        async with sem:
            try:
                obj = await read_manifest(store, meta, keys, max_bytes)
            except NotFound:
                return None
            except (CorruptManifest, TooLarge):
                bad += 1
                return None
        return access_hour_end(meta.key, now), obj.added

    for got in await asyncio.gather(*(one(m) for m in info.access)):
        if got is None:
            continue
        ts, fps = got
        for fp in fps.tolist():
            key = index.get(fp)
            if key is not None:
                chunk = info.chunks[key]
                if chunk.accessed is None or ts > chunk.accessed:
                    chunk.accessed = ts
    return bad


async def list_namespaces(store: ObjectStore, prefix: str) -> tuple[list[str], list[ObjectMeta]]:
    """Namespace ids under ``prefix``, and objects there that are not s3kv's."""
    base = f"{prefix}/" if prefix else ""
    objects, dirs = await store.list_dirs(base)
    namespaces, foreign = [], [m for m in objects if m.key != base + LOCK_NAME]
    for d in dirs:
        name = d[len(base) :].rstrip("/")
        if is_namespace_id(name):
            namespaces.append(name)
        else:
            foreign.extend(await _list_all(store, d, None))
    return namespaces, foreign


async def scan(
    store: ObjectStore,
    prefix: str,
    *,
    namespaces: Iterable[str] | None = None,
    concurrency: int = 16,
    progress: Progress | None = None,
    read_access: bool = True,
    keys: FleetKeys | None = None,
    manifest_max_bytes: int = DEFAULTS.manifest_max_bytes,
) -> Inventory:
    """List ``prefix`` (all namespaces, or the given ids/prefixes of ids);
    no manifest object is read past ``manifest_max_bytes``."""
    started = time.time()
    found, foreign = await list_namespaces(store, prefix)
    inv = Inventory(
        prefix, {ns: NamespaceInfo(ns, namespace_prefix(prefix, ns)) for ns in found}, foreign, started
    )
    wanted = inv.resolve(namespaces) if namespaces else sorted(found)
    for ns in wanted:  # one namespace at a time, its directories in parallel
        inv.namespaces[ns] = await scan_namespace(
            store,
            prefix,
            ns,
            concurrency=concurrency,
            progress=progress,
            read_access=read_access,
            keys=keys,
            manifest_max_bytes=manifest_max_bytes,
        )
    inv.namespaces = {ns: inv.namespaces[ns] for ns in wanted}
    return inv
