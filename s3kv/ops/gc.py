"""Garbage collection of a shared bucket: which chunks to delete, and
deleting them without harming replicas that serve from it.

:func:`plan` is pure: from an :class:`~s3kv.ops.inventory.Inventory`, a
:class:`Policy` and one instant ``now`` it decides what goes. The policies
combine: retiring namespaces, ``max_age`` (no use for that long: the
fleet's access records, else the write time) and ``max_bytes`` (least
recently used first until the rest fits) each select chunks; the
``min_age`` guard then keeps any chunk written or used more recently than
that, whatever selected it. A chunk is deleted whole (every shard's object).

:func:`execute` carries a plan out, holding the gc lease
(:mod:`s3kv.ops.lock`):

1. a tombstone segment per namespace names the deleted keys, *before* the
   objects go, so replicas polling the manifest stop offering them as hits;
2. DeleteObjects in batches of 1000, a bounded number at once;
3. a retired namespace with no chunk left loses its manifest and descriptor;
4. incomplete multipart uploads older than a bound are aborted;
5. compaction (:mod:`s3kv.ops.compaction`): a snapshot of the namespace's
   live keys (the listing is the truth, plus keys in segments written since
   the listing began), then the segments it covers that are older than
   ``segment_min_age_s`` are deleted, snapshots beyond the newest few
   pruned, epoch objects that no reader needs any more (older than the
   oldest kept snapshot's epoch less the lookback, never the newest)
   pruned, and each closed hour's access records merged into one object
   (keeping only live keys). A segment or snapshot it needs that gc cannot
   read (a 403, a 503, or larger than the replicas' ``manifest_max_bytes``,
   past which gc reads no manifest object) skips that namespace's
   compaction this run; the others go on.

Before all that, the chunk objects replicas reported bad and that are still
bad (:mod:`s3kv.ops.reported`) are deleted.

A replica that loads a chunk between the listing and the tombstone reaching
it gets a load error and recomputes: the cache is a hint, never a source of
wrong tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from s3kv.auth import FleetKeys
from s3kv.config import DEFAULTS
from s3kv.errors import S3KVError, UnsignedWrite
from s3kv.manifest.protocol import gc_writer_id
from s3kv.manifest.tombstones import delete_keys, publish_tombstones
from s3kv.ops import compaction
from s3kv.ops.inventory import Chunk, Inventory, NamespaceInfo, manifest_signed
from s3kv.ops.lock import Lease
from s3kv.ops.reported import BadFound, BadObject, delete_bad, find_bad
from s3kv.stores.base import ObjectMeta, ObjectStore, Upload

__all__ = ["BadFound", "BadObject", "Plan", "Policy", "Result", "execute", "find_bad", "monthly_cost", "plan"]

DEFAULT_PRICE_PER_GIB_MONTH = 0.023
"""S3 Standard, us-east-1, first 50 TB (USD per GiB-month)."""


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
    """A segment, epoch or access record newer than the guard: a replica is writing."""
    return any(now - o.last_modified < policy.min_age_s for o in (*info.segments, *info.epochs, *info.access))


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
    epochs_deleted: int = 0
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

    def add(self, done: compaction.Compacted) -> None:
        """Count what a namespace's compaction did."""
        self.snapshots_written += done.snapshots_written
        self.segments_deleted += done.segments_deleted
        self.snapshots_deleted += done.snapshots_deleted
        self.epochs_deleted += done.epochs_deleted
        self.access_merged += done.access_merged
        self.access_skipped += done.access_skipped
        self.orphans_published += done.orphans_published
        self.orphans_refused += done.orphans_refused
        self.orphans_skipped += done.orphans_skipped
        self.unsigned += done.unsigned
        self.failed += done.failed

    def as_dict(self) -> dict[str, Any]:
        return {
            "deleted": self.deleted,
            "failed": self.failed,
            "aborted_uploads": self.aborted_uploads,
            "tombstone_segments": self.tombstones,
            "snapshots_written": self.snapshots_written,
            "segments_deleted": self.segments_deleted,
            "snapshots_deleted": self.snapshots_deleted,
            "epochs_deleted": self.epochs_deleted,
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
    carried: Mapping[str, Mapping[str, str | None]] | None = None,
) -> Result:
    """Carry the plan out (and delete ``bad`` objects); with ``keys``, every
    manifest object gc writes is signed and only signed ones are read.
    ``carried``: by namespace, the bad records its snapshots carry on
    (:attr:`BadFound.carried`), but for the objects deleted here."""
    bad = list(bad)
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
    result.bad_deleted, result.failed = await delete_bad(store, inv, bad)
    gone = {b.name for b in bad} - set(result.failed)  # deleted, or gone or rewritten since read
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
    result.failed += sorted(failed)  # after the bad objects that could not be deleted
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
        undeleted = await delete_keys(store, objs, concurrency=concurrency, lease=lease)
        result.failed += undeleted
        if not undeleted:
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
        settings = compaction.Settings(
            p.policy.skew_s, p.policy.manifest_max_bytes, p.policy.segment_min_age_s, concurrency, keys
        )
        for ns in p.scope:
            if ns in p.retired:
                continue
            if lease is not None:
                lease.check()
            done = compaction.Compacted()
            try:
                await compaction.compact(
                    store,
                    inv.namespaces[ns],
                    stamps[ns],
                    settings,
                    done,
                    since_s=inv.started_at,
                    changed=ns in result.deleted,
                    clock=clock,
                    lease=lease,
                    bad={n: e for n, e in (carried or {}).get(ns, {}).items() if n not in gone},
                )
            except compaction.Unread as e:
                result.compactions_skipped[ns] = str(e)
            finally:
                result.add(done)
    return result
