"""Garbage collection of a shared bucket: which chunks to delete, and
deleting them without harming replicas that serve from it.

:func:`plan` is pure: from an :class:`~s3kv.ops.inventory.Inventory`, a
:class:`Policy` and one instant ``now`` it decides what goes. The policies
combine: retiring namespaces, ``max_age`` (no use for that long: the
fleet's access records, else the write time) and ``max_bytes`` (least
recently used first until the rest fits) each select chunks; the
``min_age`` guard then keeps any chunk written or used more recently than
that, whatever selected it. A chunk is deleted whole (every rank's object).

:func:`execute` carries a plan out, holding the gc lease
(:mod:`s3kv.ops.lock`):

1. a tombstone segment per namespace names the deleted keys, *before* the
   objects go, so replicas polling the manifest stop offering them as hits;
2. DeleteObjects in batches of 1000, a bounded number at once;
3. a retired namespace with no chunk left loses its manifest and descriptor;
4. incomplete multipart uploads older than a bound are aborted;
5. compaction: a snapshot of the namespace's live keys (the listing is the
   truth, plus keys in segments written since the listing began), then the
   segments it covers that are older than ``segment_min_age_s`` are deleted,
   snapshots beyond the newest few pruned, and each closed hour's access
   records merged into one object (keeping only live keys). A segment or
   snapshot it needs that gc cannot read (a 403, a 503, or larger than the
   replicas' ``manifest_max_bytes``, past which gc reads no manifest object)
   skips that namespace's compaction this run; the others go on.

A replica that loads a chunk between the listing and the tombstone reaching
it gets a load error and recomputes: the cache is a hint, never a source of
wrong tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from s3kv.auth import FleetKeys
from s3kv.config import DEFAULTS
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
    UnsignedManifest,
    UnsignedWrite,
    UnsupportedFormat,
)
from s3kv.keys import fingerprint, parse_object_key
from s3kv.manifest import format as mf
from s3kv.manifest.arrays import as_sorted_unique
from s3kv.manifest.protocol import (
    SEGMENTS,
    Horizon,
    Stamps,
    access_hour,
    access_name,
    gc_writer_id,
    is_segment,
    name_ts,
    record_hour,
    snapshot_name,
)
from s3kv.manifest.ranks import RankTally, rank_fields
from s3kv.manifest.tombstones import delete_keys, publish_tombstones
from s3kv.ops.chunks import check_object
from s3kv.ops.inventory import (
    Chunk,
    Inventory,
    NamespaceInfo,
    manifest_signed,
    read_manifest,
    read_manifest_head,
)
from s3kv.ops.lock import Lease
from s3kv.stores.base import ObjectMeta, ObjectStore, PutMode, Upload

DEFAULT_PRICE_PER_GIB_MONTH = 0.023
"""S3 Standard, us-east-1, first 50 TB (USD per GiB-month)."""
SNAPSHOTS_KEPT = 3


@dataclass(frozen=True)
class Policy:
    max_age_s: float | None = None
    """Delete chunks not used (or, never used, not written) for this long."""
    max_bytes: int | None = None
    """Then delete least recently used chunks until the rest is at most this."""
    namespaces: tuple[str, ...] = ()
    """Act only on these namespaces (ids); empty: all."""
    keep_namespaces: tuple[str, ...] = ()
    """Retire every namespace in scope but these."""
    retire: bool = False
    """Retire every namespace in scope."""
    min_age_s: float = 3600.0
    """Never delete a chunk written or used more recently than this."""
    abort_uploads_after_s: float | None = 86400.0
    """Abort incomplete multipart uploads older than this; None: leave them."""
    compact: bool = True
    segment_min_age_s: float = 600.0
    """Segments a snapshot covers are deleted once this old (replicas poll
    every few seconds: by then every live one has read them)."""
    skew_s: float = DEFAULTS.manifest_clock_skew_s
    """The replicas' ``manifest_clock_skew_s``."""
    manifest_max_bytes: int = DEFAULTS.manifest_max_bytes
    """The replicas' ``manifest_max_bytes``: no manifest object is read past it."""

    def retires(self, ns: str) -> bool:
        return self.retire or bool(self.keep_namespaces and ns not in self.keep_namespaces)


@dataclass
class Deletion:
    ns: str
    chunk: Chunk
    reason: str
    """retired, max-age or max-bytes"""


@dataclass
class Plan:
    now: float
    policy: Policy
    deletions: list[Deletion] = field(default_factory=list)
    guarded: dict[str, int] = field(default_factory=dict)
    """Chunks a policy selected that the min-age guard kept, by namespace."""
    _guarded: set[tuple[str, bytes]] = field(default_factory=set, repr=False)
    retired: list[str] = field(default_factory=list)
    """Namespaces emptied whole: their manifest and descriptor go too."""
    namespace_objects: list[ObjectMeta] = field(default_factory=list)
    """Those namespaces' manifest objects and descriptors."""
    uploads: list[Upload] = field(default_factory=list)
    scope: list[str] = field(default_factory=list)
    bytes_in_scope: int = 0
    unread_descriptors: dict[str, str] = field(default_factory=dict)
    """Namespaces in scope whose descriptor could not be read (a 403, a 503),
    and why: taken to have none this run (no orphan of theirs published)."""
    unread_access: dict[str, int] = field(default_factory=dict)
    """Access records the scan left out, by namespace (corrupt, larger than
    ``manifest_max_bytes``, with the fleet secret unsigned): the uses they
    record do not count."""

    @property
    def objects(self) -> list[ObjectMeta]:
        return [o for d in self.deletions for o in d.chunk.objects]

    @property
    def bytes(self) -> int:
        return sum(d.chunk.size for d in self.deletions)

    def by_namespace(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for d in self.deletions:
            row = out.setdefault(d.ns, {"chunks": 0, "objects": 0, "bytes": 0})
            row["chunks"] += 1
            row["objects"] += len(d.chunk.objects)
            row["bytes"] += d.chunk.size
        return out


def plan(inv: Inventory, policy: Policy, now: float, uploads: Iterable[Upload] = ()) -> Plan:
    """Decide what a gc run deletes, as of ``now`` (seconds since the epoch)."""
    scope = list(policy.namespaces) or sorted(inv.namespaces)
    p = Plan(now=now, policy=policy, scope=scope)
    chosen: set[tuple[str, bytes]] = set()

    def guarded(chunk: Chunk) -> bool:
        return now - chunk.last_used < policy.min_age_s

    def keep(ns: str, chunk: Chunk) -> None:
        if (ns, chunk.key) not in p._guarded:
            p._guarded.add((ns, chunk.key))
            p.guarded[ns] = p.guarded.get(ns, 0) + 1

    def select(ns: str, chunk: Chunk, reason: str) -> None:
        if (ns, chunk.key) in chosen:
            return
        if guarded(chunk):
            keep(ns, chunk)
            return
        chosen.add((ns, chunk.key))
        p.deletions.append(Deletion(ns, chunk, reason))

    p.unread_descriptors = {
        ns: err for ns in scope if (err := inv.namespaces[ns].descriptor_error) is not None
    }
    p.unread_access = {ns: n for ns in scope if (n := inv.namespaces[ns].access_unread)}
    items = [(ns, c) for ns in scope for c in inv.namespaces[ns].chunks.values()]
    p.bytes_in_scope = sum(c.size for _, c in items)
    for ns in scope:
        if policy.retires(ns):
            for chunk in inv.namespaces[ns].chunks.values():
                select(ns, chunk, "retired")
    if policy.max_age_s is not None:
        for ns, chunk in items:
            if now - chunk.last_used > policy.max_age_s:
                select(ns, chunk, "max-age")
    if policy.max_bytes is not None:
        remaining = p.bytes_in_scope - p.bytes
        for ns, chunk in sorted(items, key=lambda it: (it[1].last_used, it[0], it[1].key)):
            if remaining <= policy.max_bytes:
                break
            if (ns, chunk.key) in chosen:
                continue
            if guarded(chunk):
                keep(ns, chunk)
                continue
            select(ns, chunk, "max-bytes")
            remaining -= chunk.size
    for ns in scope:
        info = inv.namespaces[ns]
        if policy.retires(ns) and not p.guarded.get(ns) and not _recent_manifest(info, now, policy):
            p.retired.append(ns)
            p.namespace_objects += info.manifest_objects
            if info.descriptor_meta is not None:
                p.namespace_objects.append(info.descriptor_meta)
    if policy.abort_uploads_after_s is not None:
        bases = tuple(inv.namespaces[ns].base for ns in scope)
        p.uploads = [
            u for u in uploads if u.key.startswith(bases) and now - u.initiated > policy.abort_uploads_after_s
        ]
    return p


def _recent_manifest(info: NamespaceInfo, now: float, policy: Policy) -> bool:
    """A segment or access record newer than the guard: a replica is writing."""
    return any(now - o.last_modified < policy.min_age_s for o in (*info.segments, *info.access))


def monthly_cost(n_bytes: int, price_per_gib_month: float = DEFAULT_PRICE_PER_GIB_MONTH) -> float:
    return n_bytes / 2**30 * price_per_gib_month


# -- carrying it out ---------------------------------------------------------------


@dataclass
class Result:
    deleted: dict[str, dict[str, int]] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    """Keys whose delete failed (the run should be repeated)."""
    aborted_uploads: int = 0
    tombstones: int = 0
    snapshots_written: int = 0
    segments_deleted: int = 0
    snapshots_deleted: int = 0
    access_merged: int = 0
    namespaces_removed: list[str] = field(default_factory=list)
    bad_deleted: int = 0
    """Objects replicas reported bad, deleted."""
    unsigned: list[str] = field(default_factory=list)
    """Manifest objects gc read and ignored: with the fleet secret, not validly signed."""
    orphans_published: int = 0
    """Complete chunk objects no manifest object named (their writer died
    before publishing them), checked and added to the new snapshot."""
    orphans_refused: int = 0
    """Objects under chunk names that no manifest object named and that do
    not verify: left out of the snapshot."""
    orphans_skipped: int = 0
    """Chunks no manifest object named that gc did not judge this run (an
    object it may not read or that failed to read, changed while read, of a
    newer format or not decoded; every one of a namespace whose descriptor
    does not say its TP size): left out of the snapshot, judged again the
    next run."""
    compactions_skipped: dict[str, str] = field(default_factory=dict)
    """Namespaces whose compaction gc stopped this run, and why: a segment or
    snapshot it needs that gc may not read (a 403), that failed to read (a
    503) or larger than ``manifest_max_bytes``. A snapshot written without
    one of them would lose its keys or tombstones: none is written from what
    was read, nothing is pruned, and it is compacted again the next run."""
    access_skipped: int = 0
    """Access records not merged this run, left as they are: gc may not read
    one, reading it failed, or it is larger than ``manifest_max_bytes``."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "deleted": self.deleted,
            "failed": self.failed,
            "aborted_uploads": self.aborted_uploads,
            "tombstone_segments": self.tombstones,
            "snapshots_written": self.snapshots_written,
            "segments_deleted": self.segments_deleted,
            "snapshots_deleted": self.snapshots_deleted,
            "access_records_merged": self.access_merged,
            "namespaces_removed": self.namespaces_removed,
            "bad_objects_deleted": self.bad_deleted,
            "unsigned_manifest_objects_ignored": self.unsigned,
            "orphan_chunks_published": self.orphans_published,
            "orphan_chunks_refused": self.orphans_refused,
            "orphan_chunks_skipped": self.orphans_skipped,
            "compactions_skipped": self.compactions_skipped,
            "access_records_skipped": self.access_skipped,
        }


Progress = Callable[[int], None]


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
    """Segments whose reports gc did not read this run, so (a 403, a 503), or
    larger than ``manifest_max_bytes``."""


async def find_bad(
    store: ObjectStore,
    inv: Inventory,
    *,
    keys: FleetKeys | None = None,
    concurrency: int = 8,
    manifest_max_bytes: int = DEFAULTS.manifest_max_bytes,
) -> BadFound:
    """The chunk objects replicas reported bad (in their segments' ``bad``
    lists) that are still there and still fail to verify; an object that
    reads well now (stored again since, or named by a bogus record) is not
    bad. One gc may not read, or that fails to read, is skipped and counted:
    it does not stop the run. Reads only."""
    named: dict[str, str] = {}
    out = BadFound()
    for ns, info in inv.namespaces.items():
        for m in info.segments:
            try:
                meta = (await read_manifest_head(store, m, keys, manifest_max_bytes))[3]
            except (NotFound, CorruptManifest):
                continue
            except (PermissionDenied, Transient, TooLarge) as e:
                if isinstance(e, PermissionDenied) and e.credentials:
                    raise  # S3 refuses gc itself, not this object
                out.segments_skipped += 1
                continue
            for entry in meta.get("bad") or ():
                if isinstance(entry, list) and entry and isinstance(entry[0], str):
                    name = entry[0]
                    parsed = parse_object_key(name)
                    if name.startswith(info.base) and parsed is not None and parsed[0] == ns:
                        named[name] = ns
    sem = asyncio.Semaphore(concurrency)

    async def one(name: str, ns: str) -> BadObject | None:
        key = parse_object_key(name)[1]  # type: ignore[index]
        async with sem:
            try:
                # The head first (most bad objects fail there: forged,
                # unsigned, torn, misnamed), then the frames a range at a
                # time, no more than the descriptor's pages.
                await check_object(store, name, _pages(inv.namespaces[ns]), keys, sound_first=False)
            except (NotFound, Precondition):
                return None  # gone, or stored again while read
            except UnsupportedFormat:
                return None  # a newer s3kv's object, or one not decoded: never deleted
            except CorruptChunk as e:
                return BadObject(ns, key, name, e.etag, str(e))
            except (PermissionDenied, Transient) as e:
                if isinstance(e, PermissionDenied) and e.credentials:
                    raise  # S3 refuses gc itself, not this object
                out.skipped += 1
        return None

    found = await asyncio.gather(*(one(n, ns) for n, ns in sorted(named.items())))
    out.objects = [b for b in found if b is not None]
    return out


async def delete_bad(store: ObjectStore, inv: Inventory, bad: Iterable[BadObject], result: Result) -> None:
    """Delete bad objects, each only if it is still the version gc read
    (If-Match); then a replica may store the chunk again."""
    for b in bad:
        try:
            if b.etag is None:
                raise NotImplementedError("no ETag")
            await store.delete_if(b.name, b.etag)
        except (NotFound, Precondition):
            continue  # gone, or rewritten since gc read it
        except (S3KVError, NotImplementedError):
            result.failed.append(b.name)
            continue
        result.bad_deleted += 1
        chunk = inv.namespaces[b.ns].chunks.get(b.key)
        if chunk is not None:
            chunk.objects = [o for o in chunk.objects if o.key != b.name]
            if not chunk.objects:
                del inv.namespaces[b.ns].chunks[b.key]


async def execute(
    store: ObjectStore,
    inv: Inventory,
    p: Plan,
    *,
    lease: Lease | None,
    concurrency: int = 8,
    progress: Progress | None = None,
    writer: str | None = None,
    clock: Callable[[], float] = time.time,
    keys: FleetKeys | None = None,
    bad: Iterable[BadObject] = (),
) -> Result:
    """Carry the plan out (and delete ``bad`` objects); with ``keys``, every
    manifest object gc writes is signed and only signed ones are read."""
    writer = writer or gc_writer_id()
    result = Result()
    if keys is None:
        for ns in p.scope:
            if await manifest_signed(store, inv.namespaces[ns]):
                raise UnsignedWrite(
                    f"namespace {ns}: its replicas sign their manifest, so gc's tombstones and snapshots "
                    "must be signed too: give gc the fleet secret (S3KV_AUTH_KEY or --auth-key-file)"
                )
    # 0. Bad objects replicas could not delete (their keys are tombstoned already).
    await delete_bad(store, inv, bad, result)
    stamps = {ns: inv.namespaces[ns].stamps(writer, skew_s=p.policy.skew_s, clock=clock) for ns in p.scope}
    by_ns: dict[str, list[Deletion]] = {}
    for d in p.deletions:
        by_ns.setdefault(d.ns, []).append(d)
    # 1. Tombstones first: replicas drop the keys before the objects go.
    for ns, dels in by_ns.items():
        if ns in p.retired:
            continue
        dead = [d.chunk.key for d in dels]
        base = inv.namespaces[ns].manifest_base
        await publish_tombstones(store, base, dead, stamps[ns], p.policy.skew_s, clock, keys)
        result.tombstones += 1
    # 2. The chunks.
    names = [o.key for o in p.objects]
    failed = set(await delete_keys(store, names, concurrency=concurrency, lease=lease, progress=progress))
    result.failed = sorted(failed)
    for d in p.deletions:
        if any(o.key in failed for o in d.chunk.objects):
            continue
        row = result.deleted.setdefault(d.ns, {"chunks": 0, "objects": 0, "bytes": 0})
        row["chunks"] += 1
        row["objects"] += len(d.chunk.objects)
        row["bytes"] += d.chunk.size
        inv.namespaces[d.ns].chunks.pop(d.chunk.key, None)
    # 3. Retired namespaces, once empty.
    for ns in p.retired:
        if inv.namespaces[ns].chunks:
            continue
        objs = [o.key for o in p.namespace_objects if o.key.startswith(inv.namespaces[ns].base)]
        bad = await delete_keys(store, objs, concurrency=concurrency, lease=lease)
        result.failed += bad
        if not bad:
            result.namespaces_removed.append(ns)
    # 4. Abandoned multipart uploads.
    for upload in p.uploads:
        if lease is not None:
            lease.check()
        try:
            await store.abort_upload(upload)
            result.aborted_uploads += 1
        except S3KVError:
            result.failed.append(upload.key)
    # 5. Compaction.
    if p.policy.compact:
        for ns in p.scope:
            if ns in p.retired:
                continue
            if lease is not None:
                lease.check()
            try:
                await compact(
                    store, inv, inv.namespaces[ns], p, stamps[ns], result, concurrency, clock, lease, keys
                )
            except _Unread as e:
                result.compactions_skipped[ns] = str(e)
    return result


def _whole(
    tally: RankTally, name: str, ranks: tuple[int, int], fps: list[int], by_fp: dict[int, Chunk]
) -> list[int]:
    """The fingerprints of a rank segment that are whole, counting the
    ranks whose objects the listing holds as named too."""
    for fp in fps:
        chunk = by_fp.get(fp)
        for o in chunk.objects if chunk is not None else ():
            parsed = parse_object_key(o.key)
            if parsed is not None and parsed[2] < ranks[1]:
                tally.add("", parsed[2], ranks[1], [fp])
    return tally.add(name, *ranks, fps).tolist()


def _pages(info: NamespaceInfo) -> ChunkPages | None:
    """The pages the namespace's descriptor names, if it does."""
    return info.described.pages if info.described is not None else None


def _complete(chunk: Chunk, tp: int | None) -> bool:
    """Whether every rank's object of ``chunk`` is listed (``.r0`` to
    ``.r{tp-1}``); with the TP size unknown, any chunk may be."""
    if tp is None:
        return True
    ranks = {parsed[2] for o in chunk.objects if (parsed := parse_object_key(o.key)) is not None}
    return ranks.issuperset(range(tp))


class _Unread(Exception):
    """A segment or snapshot a namespace's compaction needs, unread: the
    compaction stops (:attr:`Result.compactions_skipped`), the run goes on."""


@contextlib.contextmanager
def _needed(name: str) -> Iterator[None]:
    """Reading manifest object ``name``, which the compaction needs: one gc
    may not read (a 403) or that failed to read (a 503) raises
    :class:`_Unread` (another role, or a later try, may read it: a snapshot
    without it could lose its keys); a 403 that refuses gc's own credentials
    stops the run. One larger than ``manifest_max_bytes`` is corrupt to the
    compaction, as to every replica (they skip it unread): a junk object
    under a segment's name cannot stop a namespace's compaction."""
    try:
        yield
    except TooLarge as e:
        raise CorruptManifest(str(e) if name in str(e) else f"{name}: {e}") from e
    except (PermissionDenied, Transient) as e:
        if isinstance(e, PermissionDenied) and e.credentials:
            raise  # S3 refuses gc itself, not this object
        raise _Unread(str(e) if name in str(e) else f"{name}: {e}") from e


async def _orphans(
    store: ObjectStore,
    info: NamespaceInfo,
    listed: dict[int, Chunk],
    snapshot: ObjectMeta | None,
    new: list[ObjectMeta],
    segment: Callable[[ObjectMeta], Awaitable[mf.ManifestObject]],
    keys: FleetKeys | None,
    concurrency: int,
    max_bytes: int,
) -> dict[int, bool | None]:
    """Complete chunks in the listing that neither the newest snapshot nor a
    segment after it names (a replica killed before it published them), and
    whether every rank's object verifies (header, frames and, with the fleet
    secret, MAC): gc's compaction adds those that do, so a bucket filled by
    replicas that died never stays invisible. None for a chunk not judged
    this run: one of its objects gc may not read (a 403: another KMS key, a
    bucket policy), that failed to read (a 503), changed while read, or that
    it does not decode (:class:`~s3kv.errors.Unchecked`); or every chunk of
    a namespace whose descriptor does not say its TP size, so that no chunk
    is taken for whole without every rank's object."""
    named: set[int] = set()
    if snapshot is not None:
        # None that reads: every chunk is checked; one unread: no compaction.
        with _needed(snapshot.key), contextlib.suppress(NotFound, CorruptManifest):
            named.update((await read_manifest(store, snapshot, keys, max_bytes)).added.tolist())
    for m in new:
        try:
            named.update((await segment(m)).added.tolist())
        except (NotFound, CorruptManifest):
            continue
    todo = {fp: c for fp, c in listed.items() if fp not in named}
    tp, pages = info.tp_size, _pages(info)
    sem = asyncio.Semaphore(concurrency)

    async def sound(chunk: Chunk) -> bool | None:
        if tp is None:
            return None
        by_rank = {p[2]: o for o in chunk.objects if (p := parse_object_key(o.key)) is not None}
        for rank in range(tp):
            async with sem:
                try:
                    await check_object(store, by_rank[rank].key, pages, keys, sound_first=False)
                except NotFound:
                    return False
                except (UnsupportedFormat, PermissionDenied, Transient, Precondition) as e:
                    if isinstance(e, PermissionDenied) and e.credentials:
                        raise  # S3 refuses gc itself, not this object
                    return None
                except CorruptChunk:
                    return False
        return True

    oks = await asyncio.gather(*(sound(c) for c in todo.values()))
    return dict(zip(todo, oks))


async def compact(
    store: ObjectStore,
    inv: Inventory,
    info: NamespaceInfo,
    p: Plan,
    stamps: Stamps,
    result: Result,
    concurrency: int,
    clock: Callable[[], float],
    lease: Lease | None = None,
    keys: FleetKeys | None = None,
) -> None:
    """Compact one namespace's manifest (step 5 of :func:`execute`). A
    segment or snapshot it needs that it cannot read raises :class:`_Unread`:
    one the new snapshot needs, before it is written; the snapshot under
    which segments are pruned, before anything is."""
    now_ms = int(clock() * 1000)
    skew_ms = int(p.policy.skew_s * 1000)
    max_bytes = p.policy.manifest_max_bytes
    # Segments by name, none stamped in the future: the newest becomes the
    # new snapshot's horizon, and replicas refuse a horizon in the future
    # (and read every segment after one that names no segment).
    segments = sorted(
        [
            m
            async for m in store.list(info.manifest_base + SEGMENTS)
            if is_segment(info.manifest_base, m.key, directory=store.directory)
            and not stamps.in_future(m.key)
        ],
        key=lambda m: m.key,
    )
    stamps.seen(m.key for m in segments)
    snapshots = sorted(info.snapshots, key=lambda m: m.key)

    async def head(m: ObjectMeta) -> dict[str, Any] | None:
        try:
            with _needed(m.key):
                return (await read_manifest_head(store, m, keys, max_bytes))[3]
        except PermissionDenied:
            raise  # refused for gc's own credentials (_needed let it through)
        except S3KVError:  # gone, corrupt or oversized, of a newer format: no horizon
            return None

    newest = await head(snapshots[-1]) if snapshots else None
    covered = Horizon.of(newest or {})
    new = [m for m in segments if not covered.covers(m.key)]
    listed = {fingerprint(k): c for k, c in info.chunks.items() if _complete(c, info.tp_size)}
    reads: dict[str, mf.ManifestObject | S3KVError] = {}

    async def segment(m: ObjectMeta) -> mf.ManifestObject:
        """A segment, read once a compaction (the orphan check and the live
        set both need the recent ones); raises as decoding it did."""
        if m.key not in reads:
            try:
                with _needed(m.key):
                    reads[m.key] = await read_manifest(store, m, keys, max_bytes)
            except (NotFound, CorruptManifest) as e:
                reads[m.key] = e
        got = reads[m.key]
        if isinstance(got, S3KVError):
            raise got
        return got

    orphans = await _orphans(
        store, info, listed, snapshots[-1] if snapshots else None, new, segment, keys, concurrency, max_bytes
    )
    live: set[int] | None = None
    if new or info.id in result.deleted or any(orphans.values()):
        # The live keys: the listing (chunks with every rank; those no
        # manifest object named only if they verify), less what was deleted,
        # plus keys in segments written since the listing began (their
        # objects may have been stored after it), in name order.
        live = set(listed) - {fp for fp, ok in orphans.items() if ok is not True}
        since = min(int(inv.started_at * 1000), stamps.max_listed) - skew_ms
        tally, by_fp = RankTally(), {fingerprint(k): c for k, c in info.chunks.items()}
        for m in [m for m in segments if (name_ts(m.key) or 0) >= since]:
            try:
                obj = await segment(m)
                ranks = rank_fields(obj.meta)
            except UnsignedManifest:
                result.unsigned.append(m.key)
                continue
            except (NotFound, CorruptManifest):
                continue
            added = obj.added.tolist()
            if ranks is not None:  # whole once every rank is named here or listed
                added = _whole(tally, m.key, ranks, added, by_fp)
            live.update(added)
            live.difference_update(obj.removed.tolist())
    # Every segment and snapshot it needs read: counted, then written.
    result.orphans_refused += sum(ok is False for ok in orphans.values())
    result.orphans_skipped += sum(ok is None for ok in orphans.values())
    if live is not None:
        result.orphans_published += sum(ok is True for ok in orphans.values())
        horizon = Horizon.over((m.key for m in segments), skew_ms)  # up to the newest segment
        meta = {**horizon.meta(), "writer": stamps.writer, "by": "gc"}
        body = mf.encode(mf.ManifestObject("snapshot", as_sorted_unique(list(live)), meta=meta), keys)
        name = snapshot_name(info.manifest_base, stamps.next(now_ms), stamps.writer)
        await store.put(name, body, mode=PutMode.CREATE)
        result.snapshots_written += 1
        snapshots.append(ObjectMeta(name, len(body), now_ms / 1000))
    # Segments are dropped only under a snapshot that is itself older than
    # segment_min_age (and that reads whole): a replica that started loading
    # from an older snapshot, or one that fell behind, has had that long to
    # read the segments after it.
    min_age_ms = p.policy.segment_min_age_s * 1000
    cover: ObjectMeta | None = None
    for m in reversed(snapshots):
        if now_ms - (name_ts(m.key) or now_ms) >= min_age_ms:
            cover = m
            break
    old: list[str] = []
    if cover is not None:
        try:
            with _needed(cover.key):
                snap = await read_manifest(store, cover, keys, max_bytes)
            cover_horizon = Horizon.last_of(snap.meta)
        except (NotFound, CorruptManifest):
            cover_horizon = ""
        old = [
            m.key
            for m in segments
            if cover_horizon and m.key <= cover_horizon and now_ms - (name_ts(m.key) or now_ms) > min_age_ms
        ]
    keep = {m.key for m in snapshots[-SNAPSHOTS_KEPT:]} | ({cover.key} if cover is not None else set())
    stale_snaps = [m.key for m in snapshots if m.key not in keep and (cover is None or m.key < cover.key)]
    if lease is not None:
        lease.check()
    bad = await delete_keys(store, old + stale_snaps, concurrency=concurrency, lease=lease)
    result.failed += bad
    result.segments_deleted += len(set(old) - set(bad))
    result.snapshots_deleted += len(set(stale_snaps) - set(bad))
    await _merge_access(store, info, stamps, result, now_ms, concurrency, keys, max_bytes)


async def _merge_access(
    store: ObjectStore,
    info: NamespaceInfo,
    stamps: Stamps,
    result: Result,
    now_ms: int,
    concurrency: int,
    keys: FleetKeys | None = None,
    max_bytes: int = DEFAULTS.manifest_max_bytes,
) -> None:
    """One object per closed hour, holding the live keys used in it; a
    record gc may not read, that failed to read, or larger than ``max_bytes``
    is left as it is (counted) and merged the next run."""
    hours: dict[str, list[ObjectMeta]] = {}
    for m in info.access:
        hours.setdefault(record_hour(info.manifest_base, m.key), []).append(m)
    current = access_hour(now_ms)
    live = {fingerprint(k) for k in info.chunks}
    for hour, records in sorted(hours.items()):
        if hour >= current or len(records) < 2:
            continue
        fps: set[int] = set()
        unread: set[str] = set()
        for m in records:
            try:
                fps.update((await read_manifest(store, m, keys, max_bytes)).added.tolist())
            except UnsignedManifest:
                result.unsigned.append(m.key)
            except (NotFound, CorruptManifest):
                pass
            except (PermissionDenied, Transient, TooLarge) as e:
                if isinstance(e, PermissionDenied) and e.credentials:
                    raise  # S3 refuses gc itself, not this object
                unread.add(m.key)
        result.access_skipped += len(unread)
        records = [m for m in records if m.key not in unread]
        if not records:
            continue
        newest = max(name_ts(m.key) or 0 for m in records)
        name = access_name(info.manifest_base, newest, stamps.writer, stamps.next_seq())
        body = mf.encode(
            mf.ManifestObject("access", as_sorted_unique(list(fps & live)), meta={"merged": len(records)}),
            keys,
        )
        await store.put(name, body, mode=PutMode.CREATE)
        bad = await delete_keys(store, [m.key for m in records], concurrency=concurrency, lease=None)
        result.failed += bad
        result.access_merged += len(records) - len(bad)
