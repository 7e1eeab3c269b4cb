"""Protocol "epochs": a replica's reading of the manifest log through epoch
objects (:mod:`s3kv.manifest.epochs`), the fan-in that keeps a fleet of a
thousand from reading every segment of every replica.

Time is cut into epochs of ``publish_s``; a ``settle_s`` after an epoch
ends, one replica (candidates ranked by a hash of the epoch and the
replica, each next one a ``grace_step_s`` later) lists the segments from a
lookback of twice the skew margin before it, leaves out those earlier
epochs named, and writes them as epoch ``e`` with a create-only PUT; every
other replica GETs that one object. An epoch that does not read is covered
from the segments by each reader alone; a replica whose clock runs far
ahead of every other's stamps writes no epoch. Start-up: the newest
snapshot (meta ``epoch``), then the epochs after it, many GETs in flight;
the segments themselves where epochs are missing long after their end.

An :class:`EpochChain` is one part of a :class:`~s3kv.manifest.sync.ManifestSync`
(built by it when ``SyncSettings.protocol`` is "epochs"): it owns what is
the chain's (the next epoch and when it is due, the names epochs covered,
the candidates, what it knows of the other replicas' clocks, its lister)
and uses the sync's shared parts: its reader, the log applied (``_seen``,
``_tally``, ``_apply``/``_applied``), its snapshots and the lister and
snapshot loading of start-up.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import xxhash

from s3kv.errors import (
    AlreadyExists,
    CorruptManifest,
    NotFound,
    PermissionDenied,
    RangeNotSatisfiable,
    TooLarge,
)
from s3kv.manifest import epochs as me
from s3kv.manifest.listing import SegmentLister
from s3kv.manifest.protocol import (
    Horizon,
    epoch_end,
    epoch_ms,
    epoch_name,
    epoch_of,
    epoch_start,
    name_ts,
    parse_name,
    replica_of,
)
from s3kv.manifest.ranks import PARTIAL_TTL_MS
from s3kv.manifest.replay import replay
from s3kv.stores.base import PutMode

if TYPE_CHECKING:
    from s3kv.auth import FleetKeys
    from s3kv.manifest.keyset import Manifest
    from s3kv.manifest.ranks import RankTally
    from s3kv.manifest.reader import ObjectReader
    from s3kv.manifest.settings import Offload, SyncSettings
    from s3kv.stats import Counters
    from s3kv.stores.base import ObjectStore

log = logging.getLogger("s3kv.manifest")


class SyncParts(Protocol):
    """What an :class:`EpochChain` uses of its
    :class:`~s3kv.manifest.sync.ManifestSync`: the settings and the reader,
    the log applied so far (the names applied, the chunks waiting for other
    ranks, applying more), snapshots (loading the newest, writing one) and
    what start-up and staleness report. Named here, not imported: the sync
    imports the chain."""

    s: SyncSettings
    store: ObjectStore
    base: str
    keys: FleetKeys | None
    writer: str
    reader: ObjectReader
    counters: Counters
    manifest: Manifest
    loaded: bool
    refreshed_at: float | None
    _clock: Callable[[], float]
    _offload: Offload
    _seen: dict[str, int]
    _tally: RankTally
    _lister: SegmentLister
    _snapshot_meta: dict[str, Any]

    @property
    def clock_ms(self) -> int: ...

    async def _apply(self, fetched: list[me.Member]) -> int: ...

    def _applied(self, fetched: list[me.Member]) -> None: ...

    async def _snapshot(self, horizon: Horizon, extra: dict[str, Any] | None = None) -> None: ...

    async def _load_snapshot(self) -> tuple[np.ndarray, str | None]: ...


class EpochChain:
    """The epochs one replica has read, aggregated or covered, and the next one
    (:attr:`next_epoch`), due at :attr:`due`."""

    def __init__(self, sync: SyncParts) -> None:
        self._sync = sync
        self.s = sync.s
        self.store = sync.store
        self.base = sync.base
        self.keys = sync.keys
        self.writer = sync.writer
        self.reader = sync.reader
        self.counters = sync.counters
        self._clock = sync._clock
        self._offload = sync._offload
        self.e_ms = epoch_ms(self.s.publish_s)
        self._lookback_ms = 2 * int(self.s.skew_s * 1000)
        """How far before an epoch its aggregator lists: late segments go to a later epoch."""
        self._late_ms = int((self.s.settle_s + (self.s.max_rank + 4) * self.s.grace_step_s) * 1000)
        """An epoch still missing this long after its end has no aggregator coming."""
        self.next_epoch = 0
        """Every epoch before it is applied (read, aggregated or covered)."""
        self.due = 0.0
        """When (``clock`` seconds) the sync's loop next looks at :attr:`next_epoch`."""
        self._gets = 0
        """GETs of :attr:`next_epoch` so far."""
        self.covered: dict[str, int] = {}
        """Segments that epoch objects named (within the lookback), with the
        epoch: an aggregator leaves them out."""
        self._covered_in: dict[int, list[str]] = {}
        """The names of :attr:`covered`, by epoch (:meth:`forget` drops whole epochs)."""
        self.candidates: dict[str, int] = {}
        """Replicas that were members of epochs (within the lookback), with
        the newest such epoch: who may aggregate."""
        self.lister = SegmentLister(self.store, self.base, skew_s=self.s.skew_s, clock=self._clock)
        """The segments an epoch covers, listed (by aggregators and readers covering one)."""
        self._jitter = (xxhash.xxh3_64_intdigest(self.writer.encode()) % 1000) / 1000
        self._probe_phase = xxhash.xxh3_64_intdigest(self.writer.encode()) // 1000
        """Which epochs (of each ``probe_every``) this replica asks for early: spread by writer."""
        self._warned_ahead = False
        self._others_ms = 0
        """The newest stamp of another replica's seen: its segments listed, the
        epochs it wrote (their clocks when they did). This replica aggregates
        no epoch while its clock is more than the skew margin past it."""
        self._others_new_at = 0
        """When (this replica's clock, ms) :attr:`_others_ms` last moved."""
        self._forgot_at: int | None = None
        """The floor :meth:`forget` last dropped names below."""
        self._refused_at: float | None = None
        """When this replica last refused to aggregate (its clock ahead): for
        a skew margin after, it only asks for epochs."""
        self._lead_ms = 0
        self._probed: tuple[int, me.Epoch] | None = None
        """An epoch asked for before it was due, and there: read next."""
        self._probing = False
        """The last early ask found the epoch: ask early at every epoch."""
        """How far the fleet's stamps have run ahead of this replica's clock
        (the most seen, at most the skew margin): epochs are due by the
        fleet's time, so a replica whose clock is behind reads (and
        aggregates) them when the rest do, not that much later."""

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _fleet_now(self) -> float:
        """The fleet's time as this replica knows it (``clock`` seconds, plus
        how far others' stamps have been ahead of it): what epochs are due by."""
        return self._clock() + self._lead_ms / 1000

    def _observe(self, ts_ms: int) -> None:
        """Another replica stamped ``ts_ms`` (a segment, an epoch it wrote) by
        now: the fleet's time is at least that."""
        ahead = min(ts_ms - self._now_ms(), int(self.s.skew_s * 1000))
        if ahead > self._lead_ms:
            self._lead_ms = ahead

    def _read_at(self, e: int) -> float:
        """When (the fleet's time, :meth:`_fleet_now`) this replica first asks for epoch ``e``:
        after its end and the settle time, and a little after the first
        candidate's try (spread by writer, so the fleet's GETs do not come at once)."""
        end_s = (epoch_end(e, self.e_ms) + 1) / 1000
        return end_s + self.s.settle_s + self.s.grace_step_s * 0.5 * (1 + self._jitter)

    def aggregate_rank(self, e: int) -> int:
        """This replica's place among the candidates to aggregate epoch ``e``:
        the replicas that were members of recent epochs and itself, ordered
        by a hash of (e, replica), so the work rotates."""
        candidates = set(self.candidates) | {self.writer}
        order = sorted(candidates, key=lambda r: (xxhash.xxh3_64_intdigest(f"{e}/{r}".encode()), r))
        return order.index(self.writer)

    def aggregate_at(self, e: int) -> float:
        """When (the fleet's time) this replica aggregates epoch ``e`` if it is still missing."""
        rank = self.aggregate_rank(e)
        delay = min(rank, self.s.max_rank) * self.s.grace_step_s
        if rank > self.s.max_rank:  # the rest spread over three more steps
            spread = xxhash.xxh3_64_intdigest(f"{e}/{self.writer}/spread".encode()) % 1000 / 1000
            delay += self.s.grace_step_s * 3 * spread
        return (epoch_end(e, self.e_ms) + 1) / 1000 + self.s.settle_s + delay

    def last_closed(self, now_ms: int) -> int:
        """The newest epoch whose end and settle time have passed."""
        return epoch_of(now_ms - int(self.s.settle_s * 1000), self.e_ms) - 1

    async def get_epoch(self, e: int) -> tuple[str, me.Epoch | None]:
        """Epoch ``e``'s object: ("ok", it), ("missing", None) when there is
        none yet, ("bad", None) when it does not read (corrupt, unsigned or
        forged with the fleet secret, too large, stamped in the future:
        counted as ``manifest_epochs_skipped``), ("failed", None) when the
        GET failed otherwise (throttled, reset)."""
        name = epoch_name(self.base, e, self.e_ms)
        try:
            data = await self.reader.fetch(name)
            decode = functools.partial(me.decode, keys=self.keys, directory=self.store.directory)
            epoch: me.Epoch = await self._offload(decode, self.base, name, data)
            if epoch.ts > self._now_ms() + int(self.s.skew_s * 1000):
                raise CorruptManifest(f"{name}: written at {epoch.ts}, in the future")
        except NotFound:
            self.counters.add("manifest_epochs_missing")
            return "missing", None
        except PermissionDenied as err:
            if err.credentials:
                raise
            return self._bad_epoch(name, err)
        except (CorruptManifest, RangeNotSatisfiable, TooLarge) as err:
            return self._bad_epoch(name, err)
        except Exception as err:
            self.counters.add("manifest_errors")
            log.warning("s3kv: fetching manifest epoch %s failed (%s); trying again", name, err)
            return "failed", None
        if epoch.writer != self.writer:
            self._saw_others(epoch.ts)
            self._observe(epoch.ts)
        self.counters.add("manifest_epochs_read")
        return "ok", epoch

    def _saw_others(self, ts: int) -> None:
        if ts > self._others_ms:
            self._others_ms, self._others_new_at = ts, self._now_ms()

    def _bad_epoch(self, name: str, err: Exception) -> tuple[str, None]:
        self.counters.add("manifest_epochs_skipped")
        self.counters.add("manifest_errors")
        log.warning("s3kv: skipping manifest epoch %s (%s); reading its segments instead", name, err)
        return "bad", None

    def _took(self, e: int, members: list[me.Member], *, covered: bool) -> list[me.Member]:
        """Epoch ``e``'s members, known: the replicas among them become
        candidates; with ``covered`` (an epoch object named them) later
        epochs leave them out. Returns those not applied yet."""
        for name, _ in members:
            parsed = parse_name(self.base, name)
            if parsed is not None and not parsed.writer.startswith("gc"):  # gc's runs aggregate nothing
                self.candidates[replica_of(parsed.writer)] = e
                if replica_of(parsed.writer) != self.writer:
                    self._observe(parsed.ts)
            if covered:
                self.covered[name] = e
                self._covered_in.setdefault(e, []).append(name)
        return [(n, o) for n, o in members if n not in self._sync._seen]

    async def _segments_of(self, e: int, *, check_clock: bool) -> list[me.Member] | None:
        """The segments epoch ``e`` covers, listed and read: stamped up to
        its end, from ``lookback`` before its start, none an earlier epoch
        covered. With ``check_clock``, None when this replica's clock looks
        far ahead of the fleet's: the newest stamp of other replicas' it has
        seen (segments listed now, epochs they wrote) is more than the skew
        margin behind it. (None seen at all: a fleet of one, or a new one.)"""
        now_ms = self._now_ms()
        skew_ms = int(self.s.skew_s * 1000)
        self.lister.restart()
        listed = await self.lister.after(self.lister.floor(epoch_start(e, self.e_ms), self._lookback_ms))
        others = [
            p.ts
            for m in listed
            if (p := parse_name(self.base, m.key, directory=self.store.directory)) is not None
            and p.kind == "segment"
            and replica_of(p.writer) != self.writer
            and p.ts <= now_ms + skew_ms
        ]
        self._saw_others(max(others, default=0))
        if (
            check_clock
            and self._others_ms < now_ms - skew_ms
            and now_ms - self._others_new_at < skew_ms  # the fleet is still there: not a fleet of one now
        ):
            return None
        end = epoch_end(e, self.e_ms)
        todo = [
            (m.key, m.size)
            for m in self.reader.sift(listed, "segment", now_ms, self.covered)
            if (name_ts(m.key) or 0) <= end
        ]
        return await self._read_once(todo)

    async def cover(self, e: int, members: list[me.Member] | None = None) -> int:
        """Epoch ``e`` covered by this replica alone, from raw segments
        (its object does not read, or this replica may not write it):
        applied, nothing written. Later epochs still name these segments."""
        if members is None:
            members = await self._segments_of(e, check_clock=False) or []
        self.counters.add("manifest_epochs_covered")
        keys = await self._sync._apply(self._took(e, members, covered=False))
        self._next(e)
        return keys

    async def read(self, e: int, epoch: me.Epoch) -> int:
        keys = await self._sync._apply(self._took(e, epoch.members, covered=True))
        self._next(e)
        return keys

    def _next(self, e: int) -> None:
        self.next_epoch, self._gets = e + 1, 0

    async def aggregate(self, e: int) -> int | None:
        """Write epoch ``e`` (create-only: of racing aggregators one wins; a
        loser reads the winner's), apply it, and, every ``snapshot_epochs``,
        snapshot. Returns the fingerprints added; None when this replica's
        clock looks far ahead of the fleet's (it writes nothing: the epoch
        is left to the others, and read when they have written it)."""
        members = await self._segments_of(e, check_clock=True)
        if members is None:
            self.counters.add("manifest_epochs_refused")
            self._refused_at = self._clock()
            if not self._warned_ahead:
                self._warned_ahead = True
                log.warning(
                    "s3kv: this replica's clock looks more than %.0f s ahead of the fleet's (the other "
                    "replicas' newest stamps are older than that); leaving manifest epochs to them",
                    self.s.skew_s,
                )
            return None
        epoch = me.Epoch(e, self.e_ms, self.writer, self._now_ms(), members)
        body: bytes = await self._offload(me.encode, self.base, epoch, self.keys)
        name = epoch_name(self.base, e, self.e_ms)
        if len(body) > self.s.max_object_bytes:
            log.warning(
                "s3kv: manifest epoch %s would be %d bytes, over the limit; not written", name, len(body)
            )
            return await self.cover(e, members)
        try:
            await self.store.put(name, body, mode=PutMode.CREATE)
        except AlreadyExists:
            status, theirs = await self.get_epoch(e)
            if status == "ok" and theirs is not None:
                return await self.read(e, theirs)
            return await self.cover(e, members)
        self.counters.add("manifest_epochs_written")
        keys = await self.read(e, epoch)
        if self.s.snapshot_epochs and e % self.s.snapshot_epochs == 0:
            await self.snapshot(e)
        return keys

    async def step(self) -> int | None:
        """Epoch :attr:`next_epoch`, if it is due: read, or aggregated at
        this replica's rank's time. Returns the fingerprints added, or None
        when it is not due (yet) or not there yet (:meth:`next_due` says when)."""
        e = self.next_epoch
        if self._probed is not None:
            x, early = self._probed
            self._probed = None
            if x == e:
                return await self._read_and_probe(e, early)
        now = self._fleet_now()
        lead = now - self._clock()  # self.due is in this replica's clock
        aggregate_at, read_at = self.aggregate_at(e), self._read_at(e)
        if now < min(aggregate_at, read_at):
            self.due = min(aggregate_at, read_at) - lead
            return None
        refused = self._refused_at is not None and self._clock() - self._refused_at < self.s.skew_s
        if self._gets == 0 or now < aggregate_at or refused:
            self._gets += 1
            status, epoch = await self.get_epoch(e)
            if status == "ok" and epoch is not None:
                return await self._read_and_probe(e, epoch)
            if status == "bad":
                return await self.cover(e)
            if now < aggregate_at or refused:
                due = now + self.s.epoch_retry_s
                if not refused:
                    due = min(aggregate_at, due)
                self.due = due - lead
                return None
        keys = await self.aggregate(e)
        if keys is None:
            self.due, self._gets = now + self.s.epoch_retry_s - lead, 0
        return keys

    async def _read_and_probe(self, e: int, epoch: me.Epoch) -> int:
        """Apply epoch ``e``, read; then, one epoch in ``probe_every`` (at
        every one while early asks find them), ask for the next before it is
        due. There already: the fleet's time is at least its first
        candidate's time to write it (this replica's clock is behind by
        more than it knew), and it is read next."""
        keys = await self.read(e, epoch)
        nxt = e + 1
        every = max(1, self.s.probe_every)
        if (self._probing or (nxt + self._probe_phase) % every == 0) and self._fleet_now() < self._read_at(
            nxt
        ):
            status, early = await self.get_epoch(nxt)
            self._probing = status == "ok" and early is not None
            if self._probing and early is not None:
                written_ms = epoch_end(nxt, self.e_ms) + 1 + int(self.s.settle_s * 1000)
                ahead = min(written_ms - self._now_ms(), int(self.s.skew_s * 1000))
                if ahead > self._lead_ms:
                    self._lead_ms = ahead
                    self.counters.add("manifest_epochs_early")
                self._probed = (nxt, early)
        return keys

    async def advance(self, between: Callable[[], None] | None = None) -> int:
        """Every epoch due by now, in order; ``between`` is called after each
        (a first start catches up the whole lookback, hundreds of epochs at
        a short interval: what else is due must not wait for all of them)."""
        keys = 0
        while (got := await self.step()) is not None:
            keys += got
            if between is not None:
                between()
        # Up to date: every epoch its aggregators have had time to write, read.
        if self.next_epoch > self.last_closed(int(self._fleet_now() * 1000) - self._late_ms):
            self._sync.refreshed_at = self._clock()
        self.forget()
        if self._sync.manifest.fps.needs_merge():
            await self._offload(self._sync.manifest.fps.merge)
        return keys

    def forget(self) -> None:
        """Names older than any later epoch lists: memory stays bounded by the lookback."""
        floor = epoch_start(self.next_epoch, self.e_ms) - self._lookback_ms - self.e_ms
        if floor != self._forgot_at:  # the floor moves once an epoch; advance() runs more often
            self._forgot_at = floor
            self._sync._seen = {n: ts for n, ts in self._sync._seen.items() if ts >= floor}
            # A name an epoch covered is stamped no later than that epoch's
            # end: one before the floor is never listed again. Dropped by
            # epoch, not by a scan of every name held (N an epoch).
            for e in [e for e in self._covered_in if epoch_end(e, self.e_ms) < floor]:
                for name in self._covered_in.pop(e):
                    if self.covered.get(name) == e:
                        del self.covered[name]
            oldest = self.next_epoch - self._lookback_ms // self.e_ms - 2
            self.candidates = {r: e for r, e in self.candidates.items() if e >= oldest}
        if len(self._sync._tally):
            self._sync._tally.expire(self._sync._lister.floor(self._sync.clock_ms, PARTIAL_TTL_MS))

    async def snapshot(self, e: int) -> None:
        """The snapshot of this replica's manifest, which has applied every
        epoch up to ``e``: meta ``epoch`` (where a new replica's epochs
        start) and the legacy horizon (where an older replica's segments do)."""
        oldest = self._sync._tally.oldest()
        # A chunk still waiting for other ranks: a replica starting from this
        # snapshot reads the epoch that named its first segment again.
        since = e if oldest is None or oldest not in self.covered else self.covered[oldest] - 1
        horizon = Horizon.over(
            (n for n in self._sync._seen if oldest is None or n < oldest), int(self.s.skew_s * 1000)
        )
        await self._sync._snapshot(horizon, {"epoch": since, "e_ms": self.e_ms})

    async def load(self) -> int:
        """Start-up, protocol "epochs": the newest snapshot, then the epochs
        after it, fetched many at once and applied in order. A snapshot
        without ``epoch`` (gc's compaction's, an older replica's) starts the
        epochs a lookback before its horizon's, and of their members takes
        those it does not hold: after the floor its readers list from, and
        not named in its horizon's ``recent``. Where an epoch is missing
        long after its end (a hole: the fleet was down, or ran older
        replicas only) the segments from there are listed instead, then
        epochs from a lookback before now; so they are after a snapshot
        with no horizon at all. Returns the fingerprints loaded."""
        snapshot, start_after = await self._sync._load_snapshot()
        meta = self._sync._snapshot_meta
        now_ms = self._now_ms()
        last = self.last_closed(now_ms)
        lookback_epochs = -(-self._lookback_ms // self.e_ms)
        e: int | None = None
        if meta.get("e_ms") == self.e_ms and isinstance(meta.get("epoch"), int) and meta["epoch"] <= last:
            e = int(meta["epoch"]) + 1
        held: str | None = None
        """A snapshot of segments only: every segment named up to this (the
        floor its readers list after) is in it, as are its horizon's
        ``recent`` (in ``taken``)."""
        if e is None and start_after is not None:
            held = start_after
            horizon_ms = name_ts(Horizon.last_of(meta)) or 0
            e = max(epoch_of(horizon_ms, self.e_ms) - lookback_epochs, 0)
        members: list[me.Member] = []
        taken: set[str] = set(self._sync._seen)

        def take(got: list[me.Member]) -> None:
            for name, obj in got:
                if name not in taken and (held is None or name > held):
                    taken.add(name)
                    members.append((name, obj))

        self._sync._lister.restart()
        listed = False
        """Segments listed up to now already (every listing here goes on to the newest)."""
        if e is None:  # no snapshot, or one with no horizon: every segment
            take(await self._raw_segments(start_after, taken))
            listed = True
            e = max(epoch_of(now_ms, self.e_ms) - lookback_epochs, 0)
        while e <= last:
            batch = range(e, min(last, e + self.s.fetch_concurrency - 1) + 1)
            got = await asyncio.gather(*(self.get_epoch(x) for x in batch))
            stop = False
            for x, (status, epoch) in zip(batch, got, strict=True):
                if status == "ok" and epoch is not None:
                    take(self._took(x, epoch.members, covered=True))
                elif status == "bad":
                    self.counters.add("manifest_epochs_covered")
                    take(self._took(x, await self._segments_of(x, check_clock=False) or [], covered=False))
                elif epoch_end(x, self.e_ms) < now_ms - self._lookback_ms:
                    # A hole: whatever segments its aggregators would have taken, listed.
                    floor = self._sync._lister.floor(epoch_start(x, self.e_ms), self._lookback_ms)
                    floor = max(floor, held or floor)  # none the snapshot holds
                    take(await self._raw_segments(floor, taken))
                    listed = True
                    e = max(x + 1, epoch_of(now_ms, self.e_ms) - lookback_epochs)
                    break
                else:  # not written yet: the loop reads or aggregates it
                    if not listed and epoch_end(x, self.e_ms) < now_ms - self._late_ms:
                        # ... but no aggregator wrote it when it should have
                        # (the fleet stopped since, the last replica's last
                        # segment after its last epoch): its segments now,
                        # so that this replica starts with them.
                        floor = self._sync._lister.floor(epoch_start(x, self.e_ms), self._lookback_ms)
                        take(await self._raw_segments(max(floor, held or floor), taken | set(self.covered)))
                    stop = True
                    break
                e = x + 1
            if stop:
                break
        self.next_epoch, self._gets = e, 0
        live = await self._offload(replay, snapshot, members, self._sync._tally)
        await self._offload(self._sync.manifest.fps.replace, live)
        self._sync._applied(members)
        self._sync._lister.done()
        self.forget()
        await self._offload(self._sync.manifest.fps.merge)
        self._sync.loaded = True
        self._sync.refreshed_at = self._clock()
        return len(live)

    async def _raw_segments(self, start_after: str | None, seen: set[str]) -> list[me.Member]:
        """Every segment listed after ``start_after`` not in ``seen``, read (today's load)."""
        listed = await self._sync._lister.after(start_after)
        todo = [(m.key, m.size) for m in self.reader.sift(listed, "segment", self._now_ms(), seen)]
        return await self._read_once(todo)

    async def _read_once(self, todo: Sequence[tuple[str, int | None]]) -> list[me.Member]:
        """The segments ``todo`` (name, listed size) that read. One whose GET
        failed is not kept for the reader's retry: the chain lists it again
        (the next epoch's aggregator, the next start)."""
        fetched = await self.reader.segments(todo)
        for name, _ in todo:
            self.reader.retry.pop(name, None)
        return fetched
