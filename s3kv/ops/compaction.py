"""gc's compaction of one namespace's manifest (step 5 of
:func:`s3kv.ops.gc.execute`): a snapshot of the live keys, then the old
segments and snapshots it makes redundant pruned, and each closed hour's
access records merged into one.

The live keys: the listing is the truth (complete chunks: every shard's
object, ``.r0`` to ``.r{shards-1}`` whoever wrote it; those no manifest object named only if they verify, see
:meth:`_Namespace.orphans`), less what was deleted, plus keys in segments
written since the listing began (their objects may have been stored after
it), replayed as replicas replay them (:func:`~s3kv.manifest.replay.replay`).
The snapshot is written and old ones pruned by the replicas' own writer and
rule (:mod:`s3kv.manifest.snapshots`). Epoch objects (:mod:`s3kv.manifest.epochs`)
that no reader needs any more are pruned with them (:meth:`_Namespace.stale_epochs`).

A segment or snapshot it needs that gc cannot read (a 403, a 503) raises
:class:`Unread`: one the new snapshot needs, before it is written; the
snapshot under which segments are pruned, before anything is. One larger
than ``manifest_max_bytes`` is corrupt to it, as to every replica.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import numpy as np

from s3kv.auth import FleetKeys
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
    UnsupportedFormat,
)
from s3kv.keys import fingerprint, parse_object_key
from s3kv.manifest import format as mf
from s3kv.manifest.arrays import as_sorted_unique
from s3kv.manifest.bad import entries
from s3kv.manifest.protocol import (
    SEGMENTS,
    Horizon,
    Stamps,
    access_hour,
    access_name,
    epoch_end,
    is_segment,
    name_ts,
    parse_name,
    record_hour,
)
from s3kv.manifest.ranks import MAX_RANKS, RankTally, rank_fields
from s3kv.manifest.replay import replay
from s3kv.manifest.snapshots import stale_snapshots, write_snapshot
from s3kv.manifest.tombstones import Held, delete_keys
from s3kv.ops.chunks import check_object
from s3kv.ops.inventory import Chunk, NamespaceInfo, epoch_id
from s3kv.ops.reads import read_manifest, read_manifest_head
from s3kv.shards import Slicing
from s3kv.stores.base import ObjectMeta, ObjectStore, PutMode


@dataclass(frozen=True)
class Settings:
    """How gc compacts (from its :class:`~s3kv.ops.gc.Policy` and run)."""

    skew_s: float
    """The replicas' ``manifest_clock_skew_s``."""
    max_bytes: int
    """The replicas' ``manifest_max_bytes``: no manifest object is read past it."""
    segment_min_age_s: float
    """Segments a snapshot covers are deleted once this old."""
    concurrency: int
    keys: FleetKeys | None = None


@dataclass
class Compacted:
    """What compactions did (the fields of :class:`~s3kv.ops.gc.Result` of the same names)."""

    snapshots_written: int = 0
    segments_deleted: int = 0
    snapshots_deleted: int = 0
    epochs_deleted: int = 0
    access_merged: int = 0
    access_skipped: int = 0
    orphans_published: int = 0
    orphans_refused: int = 0
    orphans_skipped: int = 0
    unsigned: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


class Unread(Exception):
    """A segment or snapshot a namespace's compaction needs, unread: the
    compaction stops (:attr:`~s3kv.ops.gc.Result.compactions_skipped`), the run goes on."""


@contextlib.contextmanager
def _needed(name: str) -> Iterator[None]:
    """Reading manifest object ``name``, which the compaction needs: one gc
    may not read (a 403) or that failed to read (a 503) raises
    :class:`Unread` (another role, or a later try, may read it: a snapshot
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
        raise Unread(str(e) if name in str(e) else f"{name}: {e}") from e


def _count(value: Any) -> TypeGuard[int]:
    """Whether a header's value is a whole number >= 0 (JSON's true is not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shards(chunk: Chunk) -> list[int]:
    """The shards whose objects of ``chunk`` the listing holds."""
    return [parsed[2] for o in chunk.objects if (parsed := parse_object_key(o.key)) is not None]


def _complete(chunk: Chunk, shards: int | None) -> bool:
    """Whether every shard's object of ``chunk`` is listed (``.r0`` to
    ``.r{shards-1}``); with the shards unknown, any chunk may be."""
    return shards is None or set(_shards(chunk)).issuperset(range(shards))


def _held(chunk: Chunk | None, slicing: Slicing | None) -> Iterable[int]:
    """The ranks a rank segment's ``chunk`` counts as named by, from the
    listing: where each rank stores its own shard, those whose objects are
    listed; in a namespace cut into shards, a shard is no rank's (whichever
    rank or replica wrote it): every rank once every shard is listed, else
    none."""
    if chunk is None:
        return ()
    if slicing is None or slicing.per_rank:
        return _shards(chunk)
    return range(MAX_RANKS) if _complete(chunk, slicing.shards) else ()


async def compact(
    store: ObjectStore,
    info: NamespaceInfo,
    stamps: Stamps,
    settings: Settings,
    done: Compacted,
    *,
    since_s: float,
    changed: bool,
    clock: Callable[[], float],
    lease: Held | None = None,
    bad: Mapping[str, str | None] | None = None,
) -> None:
    """Compact namespace ``info``'s manifest, counting in ``done``:
    ``since_s``, when the listing began (segments from then on are
    replayed); ``changed``, whether this run deleted chunks of it; ``bad``,
    the bad records (object name: ETag) its snapshot carries on
    (:attr:`~s3kv.ops.reported.BadFound.carried`), with those of the segments
    it replays that the listing did not hold (written since: not judged)."""
    ns = _Namespace(store, info, stamps, settings, done)
    ns.bad.update(bad or {})
    await ns.compact(since_s, changed, clock, lease)


class _Namespace:
    """One namespace's compaction; each segment is read at most once."""

    def __init__(
        self, store: ObjectStore, info: NamespaceInfo, stamps: Stamps, s: Settings, done: Compacted
    ) -> None:
        self.store, self.info, self.stamps, self.s, self.done = store, info, stamps, s, done
        self._reads: dict[str, mf.ManifestObject | S3KVError] = {}
        self._heads: dict[str, dict[str, Any]] = {}
        """Snapshots' headers read this compaction (with the fleet secret a
        snapshot is read whole to check its MAC: once, not once a use)."""
        self.bad: dict[str, str | None] = {}
        """Bad records the snapshot carries (:mod:`s3kv.manifest.bad`): a
        replica that starts from it must know those of the segments it covers."""

    async def segment(self, m: ObjectMeta) -> mf.ManifestObject:
        """A segment, read once a compaction (the orphan check and the live
        set both need the recent ones); raises as decoding it did."""
        if m.key not in self._reads:
            try:
                with _needed(m.key):
                    self._reads[m.key] = await read_manifest(self.store, m, self.s.keys, self.s.max_bytes)
            except (NotFound, CorruptManifest) as e:
                self._reads[m.key] = e
        got = self._reads[m.key]
        if isinstance(got, S3KVError):
            raise got
        return got

    async def head(self, m: ObjectMeta) -> dict[str, Any] | None:
        """A snapshot's header; None when it has none to give (gone,
        corrupt or oversized, of a newer format)."""
        if m.key in self._heads:
            return self._heads[m.key]
        try:
            with _needed(m.key):
                meta = (await read_manifest_head(self.store, m, self.s.keys, self.s.max_bytes))[3]
                self._heads[m.key] = meta
                return meta
        except PermissionDenied:
            raise  # refused for gc's own credentials (_needed let it through)
        except S3KVError:
            return None

    async def compact(
        self, since_s: float, changed: bool, clock: Callable[[], float], lease: Held | None
    ) -> None:
        store, info, stamps, done = self.store, self.info, self.stamps, self.done
        now_ms = int(clock() * 1000)
        skew_ms = int(self.s.skew_s * 1000)
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
        newest = await self.head(snapshots[-1]) if snapshots else None
        covered = Horizon.of(newest or {})
        new = [m for m in segments if not covered.covers(m.key)]
        listed = {fingerprint(k): c for k, c in info.chunks.items() if _complete(c, info.shards)}
        orphans = await self.orphans(listed, snapshots[-1] if snapshots else None, new)
        live: np.ndarray | None = None
        if new or changed or any(orphans.values()):
            since = min(int(since_s * 1000), stamps.max_listed) - skew_ms
            start = [fp for fp in listed if orphans.get(fp, True) is True]
            live = await self.live(start, [m for m in segments if (name_ts(m.key) or 0) >= since])
        # Every segment and snapshot it needs read: counted, then written.
        done.orphans_refused += sum(ok is False for ok in orphans.values())
        done.orphans_skipped += sum(ok is None for ok in orphans.values())
        if live is not None:
            done.orphans_published += sum(ok is True for ok in orphans.values())
            horizon = Horizon.over((m.key for m in segments), skew_ms)  # up to the newest segment
            snapshots.append(
                await write_snapshot(
                    store,
                    info.manifest_base,
                    live,
                    horizon,
                    writer=stamps.writer,
                    next_ts=lambda: stamps.next(now_ms),
                    keys=self.s.keys,
                    by="gc",
                    extra={"bad": [[n, e] for n, e in self.bad.items()]} if self.bad else None,
                )
            )
            done.snapshots_written += 1
        await self.prune(segments, snapshots, now_ms, lease)
        await self.merge_access(now_ms)

    async def live(self, start: list[int], recent: list[ObjectMeta]) -> np.ndarray:
        """``start`` (the listing's live keys) with the segments ``recent``
        replayed over it; a rank segment's chunk counts once every rank
        named it or the listing holds its objects (:func:`_held`)."""
        read: list[tuple[str, mf.ManifestObject]] = []
        scanned = {m.key for m in self.info.segments}
        for m in recent:
            try:
                obj = await self.segment(m)
                rank_fields(obj.meta)  # nonsense there is garbage
            except UnsignedManifest:
                self.done.unsigned.append(m.key)
                continue
            except (NotFound, CorruptManifest):
                continue
            read.append((m.key, obj))
            if m.key not in scanned:  # reported since gc's scan: not judged, carried
                self.bad.update(entries(obj.meta.get("bad")))
        chunks = {fingerprint(k): c for k, c in self.info.chunks.items()}
        slicing = self.info.described.slicing if self.info.described is not None else None
        tally = RankTally(held=lambda fp: _held(chunks.get(fp), slicing))
        return replay(as_sorted_unique(start), read, tally)

    async def prune(
        self, segments: list[ObjectMeta], snapshots: list[ObjectMeta], now_ms: int, lease: Held | None
    ) -> None:
        """Segments are dropped only under a snapshot that is itself older
        than ``segment_min_age_s`` (and that reads whole): a replica that
        started loading from an older snapshot, or one that fell behind, has
        had that long to read the segments after it. Snapshots go by the
        replicas' rule, which keeps that one and every one after it."""
        min_age_ms = self.s.segment_min_age_s * 1000
        cover: ObjectMeta | None = None
        for m in reversed(snapshots):
            if now_ms - (name_ts(m.key) or now_ms) >= min_age_ms:
                cover = m
                break
        old: list[str] = []
        if cover is not None:
            try:
                with _needed(cover.key):
                    snap = await read_manifest(self.store, cover, self.s.keys, self.s.max_bytes)
                self._heads[cover.key] = snap.meta
                cover_horizon = Horizon.last_of(snap.meta)
            except (NotFound, CorruptManifest):
                cover_horizon = ""
            old = [
                m.key
                for m in segments
                if cover_horizon
                and m.key <= cover_horizon
                and now_ms - (name_ts(m.key) or now_ms) > min_age_ms
            ]
        limit_ms = now_ms + int(self.s.skew_s * 1000)
        stale = stale_snapshots(
            self.info.manifest_base,
            (m.key for m in snapshots),
            limit_ms=limit_ms,
            cover=cover.key if cover is not None else None,
        )
        kept = [
            m
            for m in snapshots
            if m.key not in stale
            and (name := parse_name(self.info.manifest_base, m.key)) is not None
            and name.kind == "snapshot"
            and name.ts <= limit_ms
        ]
        epochs = await self.stale_epochs(kept, now_ms)
        if lease is not None:
            lease.check()
        bad = await delete_keys(self.store, old + stale + epochs, concurrency=self.s.concurrency, lease=lease)
        self.done.failed += bad
        self.done.segments_deleted += len(set(old) - set(bad))
        self.done.snapshots_deleted += len(set(stale) - set(bad))
        self.done.epochs_deleted += len(set(epochs) - set(bad))

    async def stale_epochs(self, kept: list[ObjectMeta], now_ms: int) -> list[str]:
        """The epoch objects no reader needs any more: those that end more
        than the lookback (twice the skew margin, the window an epoch's
        aggregator lists segments over) before the end of the oldest kept
        snapshot's epoch (a replica that starts from a snapshot reads the
        epochs after it, and skips by name members a recent epoch covered),
        and more than ``segment_min_age_s`` (and the lookback) before now (a
        replica that fell behind reads them in order). A kept snapshot of
        before epochs (no ``epoch`` in its header; gc's own) is taken to need
        the epochs from its horizon less the lookback. Never the newest epoch
        of a chain; none with no snapshot kept, and none while a kept
        snapshot's header does not read or says nonsense: pruned the next run."""
        lookback_ms = int(2 * self.s.skew_s * 1000)
        needs: list[int] = []
        for m in kept:
            try:
                meta = await self.head(m)
            except Unread:
                return []
            if meta is None:
                return []
            epoch, e_ms = meta.get("epoch"), meta.get("e_ms")
            if epoch is None and e_ms is None:
                needs.append((name_ts(Horizon.last_of(meta)) or 0) - lookback_ms)
            elif _count(epoch) and _count(e_ms) and e_ms > 0:
                needs.append(epoch_end(epoch, e_ms) - lookback_ms)
            else:
                return []
        if not needs:
            return []
        floor_ms = min(*needs, now_ms - max(int(self.s.segment_min_age_s * 1000), lookback_ms))
        named = [(e, m.key) for m in self.info.epochs if (e := epoch_id(self.info.manifest_base, m.key))]
        newest: dict[int, int] = {}
        for e, _ in named:
            newest[e.e_ms] = max(newest.get(e.e_ms, e.epoch), e.epoch)
        return sorted(key for e, key in named if e.end_ms < floor_ms and e.epoch < newest[e.e_ms])

    async def orphans(
        self, listed: dict[int, Chunk], snapshot: ObjectMeta | None, new: list[ObjectMeta]
    ) -> dict[int, bool | None]:
        """Complete chunks in the listing that neither the newest snapshot nor
        a segment after it names (a replica killed before it published them),
        and whether every shard's object verifies (header, frames and, with the
        fleet secret, MAC): the compaction adds those that do, so a bucket
        filled by replicas that died never stays invisible. None for a chunk
        not judged this run: one of its objects gc may not read (a 403:
        another KMS key, a bucket policy), that failed to read (a 503),
        changed while read, or that it does not decode
        (:class:`~s3kv.errors.Unchecked`); or every chunk of a namespace whose
        descriptor does not say its shards, so that no chunk is taken for
        whole without every shard's object."""
        named: set[int] = set()
        if snapshot is not None:
            # None that reads: every chunk is checked; one unread: no compaction.
            with _needed(snapshot.key), contextlib.suppress(NotFound, CorruptManifest):
                snap = await read_manifest(self.store, snapshot, self.s.keys, self.s.max_bytes)
                self._heads[snapshot.key] = snap.meta
                named.update(snap.added.tolist())
        for m in new:
            try:
                named.update((await self.segment(m)).added.tolist())
            except (NotFound, CorruptManifest):
                continue
        todo = {fp: c for fp, c in listed.items() if fp not in named}
        shards, pages = self.info.shards, self.info.pages
        sem = asyncio.Semaphore(self.s.concurrency)

        async def sound(chunk: Chunk) -> bool | None:
            if shards is None:
                return None
            by_shard = {p[2]: o for o in chunk.objects if (p := parse_object_key(o.key)) is not None}
            for shard in range(shards):
                async with sem:
                    try:
                        await check_object(
                            self.store, by_shard[shard].key, pages, self.s.keys, sound_first=False
                        )
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

    async def merge_access(self, now_ms: int) -> None:
        """One object per closed hour, holding the live keys used in it; a
        record gc may not read, that failed to read, or larger than
        ``max_bytes`` is left as it is (counted) and merged the next run."""
        store, info, stamps, keys, done = self.store, self.info, self.stamps, self.s.keys, self.done
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
                    fps.update((await read_manifest(store, m, keys, self.s.max_bytes)).added.tolist())
                except UnsignedManifest:
                    done.unsigned.append(m.key)
                except (NotFound, CorruptManifest):
                    pass
                except (PermissionDenied, Transient, TooLarge) as e:
                    if isinstance(e, PermissionDenied) and e.credentials:
                        raise  # S3 refuses gc itself, not this object
                    unread.add(m.key)
            done.access_skipped += len(unread)
            records = [m for m in records if m.key not in unread]
            if not records:
                continue
            newest = max(name_ts(m.key) or 0 for m in records)
            name = access_name(info.manifest_base, newest, stamps.writer, stamps.next_seq())
            body = mf.encode(
                mf.ManifestObject(
                    "access", as_sorted_unique(list(fps & live)), meta={"merged": len(records)}
                ),
                keys,
            )
            await store.put(name, body, mode=PutMode.CREATE)
            bad = await delete_keys(
                store, [m.key for m in records], concurrency=self.s.concurrency, lease=None
            )
            done.failed += bad
            done.access_merged += len(records) - len(bad)
