"""Checking stored objects: chunk objects (header and every frame decoded),
manifest objects, descriptors; and telling apart objects s3kv did not write.

A chunk object is *corrupt* when it does not parse, names another
namespace, key or shard than its object name says, has another length than
its header says, holds other pages than its namespace's descriptor names
(another layer count, a frame that is not one layer's pages), or a frame
fails its checksum or does not decode to its raw length (bad zstd bytes,
another content size, a frame claiming more than
:data:`~s3kv.codec.MAX_FRAME_RAW`, refused undecoded). With the fleet
secret, a sound object without a valid MAC (unsigned, signed with an
unknown key, or whose MAC fails) is *unsigned*: replicas refuse it as they
refuse corrupt ones. An object of a newer format than this s3kv reads, or
one it does not decode (:class:`~s3kv.errors.Unchecked`: a chunk of another
size than the descriptor's, or, without one, of more pages than a chunk
holds), is *unsupported*: reported, never deleted. A *foreign* object is one
under the prefix that is no chunk, manifest object, descriptor or the gc
lease: verify reports it and never deletes it. An object verify may not
read (a 403: another KMS key, a bucket policy) or that failed to read (a
503), the namespace's descriptor included, is *unreadable*: reported with
why, not deleted, and checked again the next run; the rest are checked all
the same. A manifest object larger than ``manifest_max_bytes`` (replicas
refuse it unread) is *oversized*: reported, never deleted. An epoch object
is checked whole as replicas read it (:mod:`s3kv.manifest.epochs`: its header
names its own epoch, its members are segments of the bucket's layout, their
arrays add up); one that does not decode is corrupt, one without the fleet's
MAC unsigned, like every manifest object.

Chunk objects are read a range at a time (:func:`s3kv.ops.chunks.check_object`),
never whole; a descriptor larger than any replica writes is corrupt unread,
a manifest object larger than replicas read is oversized unread, and
neither is read past that bound whatever it became since it was listed:
what an object claims or holds bounds neither memory nor time.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from s3kv import codec
from s3kv.auth import FleetKeys
from s3kv.chunk_reader import ChunkReader, ranged_get
from s3kv.config import DEFAULTS
from s3kv.descriptor import MAX_BYTES as DESCRIPTOR_MAX_BYTES
from s3kv.descriptor import NAME as DESCRIPTOR
from s3kv.descriptor import ChunkPages
from s3kv.errors import (
    CorruptChunk,
    CorruptManifest,
    NotFound,
    PermissionDenied,
    Precondition,
    S3KVError,
    TooLarge,
    Transient,
    Unsigned,
    UnsignedManifest,
    UnsignedWrite,
    UnsupportedFormat,
    UnsupportedManifestVersion,
)
from s3kv.keys import parse_object_key
from s3kv.manifest import epochs
from s3kv.manifest import format as mf
from s3kv.manifest.protocol import epoch_end, epoch_start, gc_writer_id, parse_name
from s3kv.manifest.tombstones import delete_keys, publish_tombstones
from s3kv.ops.chunks import check_object
from s3kv.ops.described import inspect_descriptor
from s3kv.ops.inventory import Inventory, manifest_signed
from s3kv.ops.reads import check_manifest, epoch_base, read_at_most, read_descriptor
from s3kv.stores.base import HEAD_BYTES, ObjectMeta, ObjectStore


@dataclass
class Problem:
    key: str
    kind: str
    """corrupt, unsigned, unsupported, oversized, unreadable or foreign"""
    reason: str
    namespace: str | None = None


@dataclass
class VerifyReport:
    checked: int = 0
    checked_bytes: int = 0
    population: int = 0
    problems: list[Problem] = field(default_factory=list)
    vanished: int = 0
    """Objects listed that were gone when read (a gc or replica deleted them),
    or rewritten between two reads of one check."""
    deleted: list[str] = field(default_factory=list)
    signed_namespaces: set[str] = field(default_factory=set)
    """Namespaces where a sound object read was signed: their replicas sign."""

    @property
    def corrupt(self) -> list[Problem]:
        """What replicas refuse to read: corrupt and (with a secret) unsigned objects."""
        return [p for p in self.problems if p.kind in ("corrupt", "unsigned")]

    @property
    def unsigned(self) -> list[Problem]:
        return [p for p in self.problems if p.kind == "unsigned"]

    @property
    def unsupported(self) -> list[Problem]:
        """Objects of a newer format than this s3kv reads: never deleted."""
        return [p for p in self.problems if p.kind == "unsupported"]

    @property
    def oversized(self) -> list[Problem]:
        """Manifest objects larger than replicas read: never deleted."""
        return [p for p in self.problems if p.kind == "oversized"]

    @property
    def unreadable(self) -> list[Problem]:
        """Objects verify may not read or that failed to read: not checked this run."""
        return [p for p in self.problems if p.kind == "unreadable"]

    @property
    def foreign(self) -> list[Problem]:
        return [p for p in self.problems if p.kind == "foreign"]

    def as_dict(self) -> dict[str, Any]:
        return {
            "checked": self.checked,
            "checked_bytes": self.checked_bytes,
            "population": self.population,
            "vanished": self.vanished,
            "corrupt": [p.__dict__ for p in self.corrupt if p.kind == "corrupt"],
            "unsigned": [p.__dict__ for p in self.unsigned],
            "unsupported": [p.__dict__ for p in self.unsupported],
            "oversized": [p.__dict__ for p in self.oversized],
            "unreadable": [p.__dict__ for p in self.unreadable],
            "foreign": [p.__dict__ for p in self.foreign],
            "deleted": self.deleted,
        }


def check_descriptor(ns: str, data: bytes) -> None:
    try:
        d = json.loads(data)
    except ValueError as e:
        raise CorruptChunk(f"descriptor is not JSON: {e}") from e
    if not isinstance(d, dict) or d.get("namespace") != ns:
        raise CorruptChunk("descriptor names another namespace")


async def verify(
    store: ObjectStore,
    inv: Inventory,
    *,
    sample: int | None,
    seed: int | None = None,
    concurrency: int = 16,
    progress: Callable[[int], None] | None = None,
    keys: FleetKeys | None = None,
    manifest_max_bytes: int = DEFAULTS.manifest_max_bytes,
) -> VerifyReport:
    """Check every object of the inventory's namespaces (``sample=None``)
    or ``sample`` chunk objects chosen at random. Foreign objects and
    descriptors the scan could not read are reported either way; with
    ``keys``, objects without a valid MAC too. A manifest object is read
    only up to ``manifest_max_bytes`` (the replicas' ``manifest_max_bytes``)."""
    report = VerifyReport()
    jobs: list[tuple[str, ObjectMeta, str]] = []  # (what, meta, namespace)
    for ns, info in inv.namespaces.items():
        for chunk in info.chunks.values():
            jobs += [("chunk", o, ns) for o in chunk.objects]
        for p in info.foreign:
            report.problems.append(Problem(p.key, "foreign", "not an object s3kv writes", ns))
        if info.descriptor_meta is not None and info.descriptor_error is not None:
            report.problems.append(Problem(info.descriptor_meta.key, "unreadable", info.descriptor_error, ns))
        if sample is None:
            jobs += [("manifest", o, ns) for o in info.manifest_objects]
            if info.descriptor_meta is not None and info.descriptor_error is None:
                jobs.append(("descriptor", info.descriptor_meta, ns))
    for p in inv.foreign:
        report.problems.append(Problem(p.key, "foreign", "not an object s3kv writes"))
    report.population = len(jobs)
    if sample is not None and sample < len(jobs):
        jobs = random.Random(seed).sample(jobs, sample)
    sem = asyncio.Semaphore(concurrency)

    async def one(what: str, meta: ObjectMeta, ns: str) -> None:
        try:
            async with sem:
                if what == "chunk":  # read a range at a time, bounded by the descriptor's pages
                    described = inv.namespaces[ns].described
                    pages = described.pages if described is not None else None
                    got: codec.ChunkHeader | bytes = await check_object(store, meta.key, pages, keys)
                elif what == "descriptor":
                    got = await read_at_most(store, meta, DESCRIPTOR_MAX_BYTES, CorruptChunk, what)
                else:
                    got = await read_at_most(store, meta, manifest_max_bytes)
            if isinstance(got, codec.ChunkHeader):
                if got.signed:
                    report.signed_namespaces.add(ns)
            elif what == "manifest":
                try:
                    check_manifest(meta.key, got, keys, directory=store.directory)
                except UnsignedManifest as e:
                    # sound otherwise? then it is "unsigned"
                    check_manifest(meta.key, got, directory=store.directory)
                    raise Unsigned(str(e)) from None
                if mf.is_signed(got):
                    report.signed_namespaces.add(ns)
            else:
                check_descriptor(ns, got)
        except (NotFound, Precondition):  # gone, or rewritten, while read
            report.vanished += 1
            return
        except (PermissionDenied, Transient) as e:  # this object only: the others are checked
            if isinstance(e, PermissionDenied) and e.credentials:
                raise  # S3 refuses verify itself: every read would
            report.problems.append(Problem(meta.key, "unreadable", str(e), ns))
            return
        except TooLarge as e:
            report.problems.append(Problem(meta.key, "oversized", str(e), ns))
        except (UnsupportedFormat, UnsupportedManifestVersion) as e:
            report.problems.append(Problem(meta.key, "unsupported", str(e), ns))
        except (CorruptChunk, CorruptManifest) as e:
            kind = "unsigned" if isinstance(e, Unsigned) else "corrupt"
            report.problems.append(Problem(meta.key, kind, str(e), ns))
        report.checked += 1
        report.checked_bytes += meta.size
        if progress is not None:
            progress(1)

    await asyncio.gather(*(one(*j) for j in jobs))
    report.problems.sort(key=lambda p: (p.kind, p.key))
    return report


async def delete_corrupt(
    store: ObjectStore,
    inv: Inventory,
    report: VerifyReport,
    *,
    lease: Any,
    skew_s: float,
    concurrency: int = 8,
    keys: FleetKeys | None = None,
) -> list[str]:
    """Delete what verify found corrupt: every shard's object of a damaged chunk (after
    a tombstone, as gc does), or the damaged manifest object or descriptor.
    Returns the keys deleted.

    Without ``keys``, nothing in a namespace whose replicas sign (a sound
    signed object read, or a signed manifest) is deleted: UnsignedWrite.
    Without the secret, verify cannot tell a forgery from the fleet's own
    objects, and the tombstones it would publish are unsigned, which those
    replicas ignore."""
    if keys is None:
        for ns in sorted({p.namespace for p in report.corrupt if p.namespace is not None}):
            info = inv.namespaces.get(ns)
            if ns in report.signed_namespaces or (info is not None and await manifest_signed(store, info)):
                raise UnsignedWrite(
                    f"namespace {ns}: its replicas sign their objects, so verify deletes nothing there "
                    "without the fleet secret (S3KV_AUTH_KEY or --auth-key-file); nothing was deleted"
                )

    names: dict[str, str | None] = {}
    """Object -> its ETag as listed: deleted only if still that version."""
    dead: dict[str, list[bytes]] = {}
    for p in report.corrupt:
        parsed = parse_object_key(p.key)
        info = inv.namespaces.get(p.namespace or "")
        if parsed is not None and info is not None and parsed[1] in info.chunks:
            names.update((o.key, o.etag) for o in info.chunks[parsed[1]].objects)
            dead.setdefault(info.id, []).append(parsed[1])
        else:
            listed = [m for m in (info.manifest_objects if info else []) if m.key == p.key]
            if info is not None and info.descriptor_meta is not None and info.descriptor_meta.key == p.key:
                listed.append(info.descriptor_meta)
            names[p.key] = listed[0].etag if listed else None
    writer = gc_writer_id()
    for ns, chunk_keys in dead.items():
        info = inv.namespaces[ns]
        await publish_tombstones(
            store, info.manifest_base, chunk_keys, info.stamps(writer), skew_s, keys=keys
        )
    conditional = sorted(k for k, etag in names.items() if etag is not None)
    plain = sorted(k for k, etag in names.items() if etag is None)
    failed = set(await delete_keys(store, plain, concurrency=concurrency, lease=lease))
    sem = asyncio.Semaphore(concurrency)

    async def one(name: str) -> None:
        async with sem:
            if lease is not None:
                lease.check()
            try:
                await store.delete_if(name, names[name])  # type: ignore[arg-type]
            except NotFound:
                pass
            except (Precondition, S3KVError, NotImplementedError):
                failed.add(name)  # rewritten since it was listed (or not deletable): kept

    await asyncio.gather(*(one(n) for n in conditional))
    return [k for k in sorted(names) if k not in failed]


async def inspect_object(
    store: ObjectStore, name: str, *, check_frames: bool = False, keys: FleetKeys | None = None
) -> dict[str, Any]:
    """What one object is: a chunk's header (and, with ``check_frames``, its
    frames checked), a manifest object's kind, counts and header (an epoch
    object's members: :func:`_inspect_epoch`), or what a
    namespace's descriptor says (:func:`~s3kv.ops.described.inspect_descriptor`)."""
    if name.rsplit("/", 1)[-1] == DESCRIPTOR:
        return await inspect_descriptor(store, name)
    if (base := epoch_base(name)) is not None:
        return await _inspect_epoch(store, name, base, keys)
    if "/manifest/" in name:
        data = await store.get(name)
        obj = mf.decode(data, name=name)
        return {
            "object": name,
            "type": f"manifest {obj.kind}",
            "bytes": len(data),
            "added": int(obj.added.size),
            "removed": int(obj.removed.size),
            "header": obj.meta,
        }
    head = await ChunkReader().read_header(ranged_get(store, name), HEAD_BYTES)
    h = head.header
    out: dict[str, Any] = {
        "object": name,
        "type": "chunk",
        "namespace": h.namespace,
        "key": h.key,
        "shard": h.rank,
        "tokens": h.tokens,
        "codec": h.codec,
        "shuffle": h.shuffle,
        "dtype": h.dtype,
        "page_shape": list(h.page_shape),
        "frames": len(h.frames),
        "format_version": h.version,
        "signed_by_key_id": h.kid.hex() if h.kid is not None else None,
        "header_bytes": h.header_length,
        "object_bytes": h.object_length,
        "raw_bytes": h.raw_bytes,
        "stored_bytes": h.stored_bytes,
        "compression_ratio": round(h.raw_bytes / h.stored_bytes, 3) if h.stored_bytes else None,
        "frame_table": [[f.offset, f.length, f.raw_length, f"{f.checksum:016x}"] for f in h.frames],
    }
    parsed = parse_object_key(name)
    problems = []
    if parsed is not None:
        try:
            h.check_identity(parsed[0], parsed[1].hex(), parsed[2])
        except CorruptChunk as e:
            problems.append(str(e))
    if keys is not None and not check_frames:
        try:
            ChunkReader(keys).parse_header(head.data)
        except CorruptChunk as e:
            problems.append(f"unsigned: {e}")
    if check_frames:
        pages, note = await _pages_of(store, name)
        if note is not None:
            out["notes"] = [note]
        try:
            await check_object(store, name, pages, keys)
        except (CorruptChunk, S3KVError) as e:
            problems.append(str(e))
        out["frames_checked"] = True
    out["problems"] = problems
    return out


async def _inspect_epoch(store: ObjectStore, name: str, base: str, keys: FleetKeys | None) -> dict[str, Any]:
    """An epoch object decoded (:func:`s3kv.manifest.epochs.decode`): which
    epoch, who aggregated it and when, and its members (each segment it
    covers: name, writer, keys added and removed); with ``keys``, one
    without the fleet's MAC is a problem, as for a chunk."""
    data = await store.get(name)
    epoch = epochs.decode(base, name, data)
    problems = []
    if keys is not None:
        try:
            epochs.decode(base, name, data, keys=keys)
        except UnsignedManifest as e:
            problems.append(f"unsigned: {e}")
    members = []
    for member, obj in epoch.members:
        parsed = parse_name(base, member)
        members.append(
            {
                "segment": member[len(base) :],
                "writer": parsed.writer if parsed is not None else "?",
                "added": int(obj.added.size),
                "removed": int(obj.removed.size),
            }
        )
    return {
        "object": name,
        "type": "manifest epoch",
        "bytes": len(data),
        "epoch": epoch.e,
        "epoch_ms": epoch.e_ms,
        "stamps": f"{epoch_start(epoch.e, epoch.e_ms)}..{epoch_end(epoch.e, epoch.e_ms)}",
        "aggregated_by": epoch.writer,
        "aggregated_at_ms": epoch.ts,
        "signed": mf.is_signed(data),
        "members": len(members),
        "writers": len({m["writer"] for m in members}),
        "added": sum(m["added"] for m in members),
        "removed": sum(m["removed"] for m in members),
        "member_table": members,
        "problems": problems,
    }


async def _pages_of(store: ObjectStore, name: str) -> tuple[ChunkPages | None, str | None]:
    """The pages the descriptor of chunk object ``name``'s namespace names;
    one it may not read (a 403) or that fails to read (a 503) is taken for
    none, as verify takes it, with a note saying why."""
    parsed = parse_object_key(name)
    if parsed is None:
        return None, None
    base = name.rsplit("/", 2)[0] + "/"  # {prefix}/{namespace}/
    try:
        described = (await read_descriptor(store, base + DESCRIPTOR, parsed[0]))[1]
    except (PermissionDenied, Transient) as e:
        if isinstance(e, PermissionDenied) and e.credentials:
            raise  # S3 refuses the caller itself: every read would
        return None, f"the namespace's descriptor could not be read ({e}): frames checked without its pages"
    return (described.pages if described is not None else None), None
