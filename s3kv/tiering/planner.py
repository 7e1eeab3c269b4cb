"""The scheduler side's decisions, free of vLLM: which tier each chunk of a
request loads from, which chunks each step stores and where, what the local
tiers evict, and what the workers' reports change.

Every decision is made here, once, so that all TP ranks execute the same
plan. Nothing here does I/O: evicted disk files are handed to the caller
(:meth:`Planner.take_disk_evictions`) to delete off the scheduling thread.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from s3kv.keys import Namespace, chain_keys
from s3kv.manifest.keyset import EMPTY, Manifest, fingerprints
from s3kv.stats import Counters
from s3kv.tiering.breaker import Breaker
from s3kv.tiering.placement import Tier, TierIndex
from s3kv.tiering.plan import LoadChunk, LoadPlan, ScheduledRequest, StepPlan, StoreChunk, TierEvent

ExtrasFn = Callable[[int, int], Any]
"""extras(start_token, end_token) -> the extra keys of that chunk, or None."""
PrefixIds = Callable[[int], Hashable | None]
"""prefix_ids(chunk) -> an id, local to this engine, of every token and extra
key up to the end of that chunk (vLLM's block hash of its last block), or
None. Equal ids mean equal chunk keys, so a prefix this engine has keyed
once is not hashed again."""
VERIFIED_SIZE = 1 << 16
"""Keys remembered present in the manifest (~100 bytes each)."""
MEMO_SIZE = 1 << 16
"""Chunk keys remembered by prefix id (~200 bytes each)."""


@dataclass
class _Request:
    token_ids: Sequence[int]
    """The request's tokens so far (vLLM's live list: prompt, then output)."""
    num_prompt_tokens: int
    extras: ExtrasFn | None
    prefix_ids: PrefixIds | None = None
    keys: list[bytes] = field(default_factory=list)
    fps: np.ndarray = field(default_factory=lambda: EMPTY)
    """Fingerprints of ``keys``, for the manifest's vectorised lookup."""
    local_tokens: int = 0
    hit_start: int = 0
    """First chunk of the last lookup's hit (chunks below are local)."""
    hit: list[Tier] = field(default_factory=list)
    """Tier of each chunk of the hit, from ``hit_start``."""
    hit_tokens: dict[Tier, int] = field(default_factory=dict)
    stored_until: int = 0
    """Chunks below this index are stored or planned."""
    loaded: range = range(0)
    """Chunks planned to load from a tier: they are not stored from the KV
    cache again (promotion copies them up from what was loaded and checked)."""
    load_async: bool = False
    """What the last lookup told vLLM: an asynchronous load."""
    load_failed: bool = False
    """A load for this request failed: vLLM recomputes it, and asking again
    (vLLM does when nothing was computed) would only fail again."""


def disk_estimate(shard_bytes: int) -> int:
    """Bytes to reserve for one rank's file of a chunk before its size is
    known: the raw pages plus zstd's worst-case growth and the header."""
    return shard_bytes + shard_bytes // 64 + (16 << 10)


BAD_KEY_RETRY_S = 10.0
"""After a store found an object reported bad in the way, how long before
the key is stored again (the object stays until ``s3kv gc`` deletes it)."""


class Planner:
    def __init__(
        self,
        *,
        namespace: Namespace,
        chunk_tokens: int,
        block_size: int,
        s3: Manifest | None,
        cpu: TierIndex | None = None,
        disk: TierIndex | None = None,
        world_size: int = 1,
        shard_bytes: int = 0,
        promote: bool = True,
        save_generated: bool = True,
        emit_events: bool = False,
        counters: Counters | None = None,
        store_retry_s: float = 120.0,
        backoff_s: tuple[float, float] = (5.0, 60.0),
        probe_timeout_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if chunk_tokens % block_size:
            raise ValueError("chunk_tokens must be a multiple of block_size")
        if cpu is not None and not cpu.slots:
            raise ValueError("the CPU tier's index must count slots")
        self.namespace = namespace
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.blocks_per_chunk = chunk_tokens // block_size
        self.s3 = s3
        self.cpu = cpu
        self.disk = disk
        self.world_size = world_size
        self.disk_reserve = world_size * disk_estimate(shard_bytes)
        self.promote = promote
        self.save_generated = save_generated
        self.emit_events = emit_events
        self._events: list[TierEvent] = []
        self._event_info: OrderedDict[bytes, tuple[bytes | None, tuple[int, ...]]] = OrderedDict()
        """Parent key and tokens of chunks being written, for their events."""
        self.counters = counters or Counters()
        self.store_retry_s = store_retry_s
        self._clock = clock
        self._requests: dict[str, _Request] = {}
        self._verified: dict[bytes, None] = {}
        """Keys seen in the manifest at ``_verified_epoch``."""
        self._verified_epoch = -1
        self._memo: dict[Hashable, tuple[list[bytes], np.ndarray]] = {}
        """Prefix id of chunk c -> a chain whose first c + 1 keys (and
        fingerprints) are that prefix's."""
        self._pending_loads: list[LoadPlan] = []
        self._pending_stores: list[StoreChunk] = []
        self._pending_held: list[str] = []
        self._held: set[str] = set()
        self._load_pins: dict[str, list[tuple[Tier, bytes]]] = {}
        """Entries a load reads, unpinned when it is over on every rank."""
        self._async_loading: set[str] = set()
        self._storing: dict[bytes, float] = {}
        """Keys planned for an S3 store and not yet reported, or whose store
        found an object reported bad in the way (a 412): with when, so that
        they are not stored again before ``store_retry_s``."""
        self._tally: dict[tuple[Tier | str, bytes], int] = {}
        """Ranks that reported a slot release (or a synchronous load) so far."""
        self._outcomes: dict[tuple[Tier, bytes], tuple[int, int]] = {}
        """(ranks that wrote, ranks that failed) of each pending write."""
        self._disk_sizes: dict[bytes, int] = {}
        self._existing: set[bytes] = set()
        """S3 stores that found the object there already (a 412), until decided."""
        self._deleting: set[Hashable] = set()
        self._disk_evictions: list[Hashable] = []
        self.breakers = {
            tier: Breaker(
                backoff_s,
                probe_timeout_s=probe_timeout_s,
                clock=clock,
                on_trip=lambda t=tier: self.counters.add(f"breaker_trips_{t.value}"),
            )
            for tier in (Tier.DISK, Tier.S3)
        }
        """While a tier is in trouble (S3 not answering; the disk failing or
        too slow), offer none of its hits and plan no writes to it; the other
        tiers go on. One probe at a time finds out when it is back."""
        self.s3_down = False
        """S3 did not answer at start-up: paused until it does (set and
        cleared by the caller, which keeps trying in the background)."""

    # -- keys and tiers --------------------------------------------------------
    def knows(self, req_id: str) -> bool:
        return req_id in self._requests

    def _keys(self, req: _Request, n_chunks: int) -> list[bytes]:
        have = len(req.keys)
        if have < n_chunks and req.prefix_ids is not None:
            # A prefix keyed before (a shared system prompt): no hashing. The
            # memo points into the chains of earlier requests (lists that only
            # grow); the longest known prefix is found by bisection.
            memo, ids = self._memo, req.prefix_ids
            lo, hi, found = have - 1, n_chunks, None
            while hi - lo > 1:
                mid = (lo + hi) // 2
                pid = ids(mid)
                entry = memo.get(pid) if pid is not None else None
                if entry is None:
                    hi = mid
                else:
                    lo, found = mid, entry
            if found is not None:
                chain, fps = found
                req.keys += chain[have : lo + 1]
                req.fps = fps[: lo + 1]
                have = lo + 1
        if have < n_chunks:
            ct = self.chunk_tokens
            extras = None
            if req.extras is not None:
                extras = [req.extras(i * ct, (i + 1) * ct) for i in range(have, n_chunks)]
            new = chain_keys(
                self.namespace,
                req.token_ids[have * ct : n_chunks * ct],
                ct,
                extras,
                parent=req.keys[-1] if req.keys else None,
                start_chunk=have,
            )
            req.keys += new
            req.fps = np.concatenate([req.fps, fingerprints(new)])
            if req.prefix_ids is not None:
                for c in range(have, n_chunks):
                    pid = req.prefix_ids(c)
                    if pid is not None:
                        self._memo[pid] = (req.keys, req.fps)
                if len(self._memo) > MEMO_SIZE:  # start over rather than keep an LRU order per chunk
                    self._memo.clear()
        return req.keys

    def _in_s3(self, req: _Request, keys: list[bytes], start: int, end: int, usable: bool) -> list[bool]:
        """Which of chunks [start, end) the manifest has: keys seen present
        since its last removal are known; the rest are looked up in one
        vectorised pass (each a binary search through the whole manifest,
        cache misses in a large one)."""
        if self.s3 is None or not usable:
            return [False] * (end - start)
        epoch = self.s3.epoch
        if epoch != self._verified_epoch:
            self._verified.clear()
            self._verified_epoch = epoch
        verified = self._verified
        todo = [i for i in range(start, end) if keys[i] not in verified]
        if not todo:
            return [True] * (end - start)
        found = self.s3.present_fps(req.fps[todo]).tolist()
        out = [True] * (end - start)
        for i, has in zip(todo, found):
            if has:
                verified[keys[i]] = None
            else:
                out[i - start] = False
        if len(verified) > VERIFIED_SIZE:
            verified.clear()
        return out

    @property
    def paused(self) -> bool:
        """S3 is not to be used by a new request now (down, or its breaker open)."""
        return self.s3_down or not self.breakers[Tier.S3].usable()

    def _allows(self, tier: Tier, owner: Hashable, *, take: bool = True) -> bool:
        """May ``owner`` use ``tier`` now (see :class:`Breaker`)?"""
        if tier is Tier.S3 and self.s3_down:
            return False
        return self.breakers[tier].allow(owner, take=take)

    def _release_probes(self, owner: Hashable, keep: Iterable[Tier] = ()) -> None:
        """``owner`` uses no tier but those in ``keep``: a half-open breaker's
        probe slot it holds on another goes to the next that asks."""
        keep = set(keep)
        for tier, breaker in self.breakers.items():
            if tier not in keep and not breaker.closed:
                breaker.release(owner)

    def _index(self, tier: Tier) -> TierIndex | None:
        return self.cpu if tier is Tier.CPU else self.disk if tier is Tier.DISK else None

    # -- lookups -----------------------------------------------------------------
    def lookup(
        self,
        req_id: str,
        token_ids: Sequence[int],
        num_tokens: int,
        num_computed_tokens: int,
        extras: ExtrasFn | None = None,
        *,
        num_prompt_tokens: int | None = None,
        prefix_ids: PrefixIds | None = None,
    ) -> tuple[int, bool]:
        """(tokens beyond ``num_computed_tokens`` that the tiers can supply,
        load asynchronously?). No I/O; repeated calls are cheap.

        A load only from the CPU tier is synchronous and leaves the last
        block with a token to compute to vLLM; any other is asynchronous."""
        req = self._requests.get(req_id)
        if req is None:
            prompt = num_tokens if num_prompt_tokens is None else num_prompt_tokens
            req = self._requests[req_id] = _Request(token_ids, prompt, extras, prefix_ids)
        req.token_ids = token_ids
        req.local_tokens = num_computed_tokens
        req.hit = []
        if req.load_failed:
            return 0, False
        ct = self.chunk_tokens
        n_chunks = num_tokens // ct
        start = num_computed_tokens // ct
        if start >= n_chunks:
            return 0, False
        keys = self._keys(req, n_chunks)
        in_s3 = self._in_s3(req, keys, start, n_chunks, self._allows(Tier.S3, req_id, take=False))
        disk_ok = self._allows(Tier.DISK, req_id, take=False)
        cpu, disk = self.cpu, self.disk
        hit: list[Tier] = []
        for key, s3_has in zip(keys[start:n_chunks], in_s3):
            if cpu is not None and key in cpu:
                hit.append(Tier.CPU)
            elif disk is not None and disk_ok and key in disk:
                hit.append(Tier.DISK)
            elif s3_has:
                hit.append(Tier.S3)
            else:
                break
        req.hit_start, req.hit = start, hit
        for tier in (Tier.DISK, Tier.S3):
            if not self.breakers[tier].closed:  # half-open: a request that hits the tier probes it
                if tier in hit:
                    self._allows(tier, req_id)
                else:
                    self.breakers[tier].release(req_id)
        end = (start + len(hit)) * ct
        sync = bool(hit) and all(t is Tier.CPU for t in hit)
        if sync:
            # vLLM must compute at least one prompt token; leave it the whole
            # last block so our copies and its writes never share a block.
            end = min(end, (num_tokens - 1) // self.block_size * self.block_size)
        n = end - num_computed_tokens
        req.load_async = n > 0 and not sync
        return (n, not sync) if n > 0 else (0, False)

    def on_alloc(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM allocated blocks for a hit of ``num_external_tokens``: plan the load."""
        req = self._requests.get(req_id)
        if req is None:
            return
        if num_external_tokens <= 0:
            self._release_probes(req_id)  # vLLM loads nothing: a probe it took is not one
            return
        ct, bs, bpc = self.chunk_tokens, self.block_size, self.blocks_per_chunk
        start = req.local_tokens
        end = start + num_external_tokens
        first_chunk, end_chunk = start // ct, -(-end // ct)
        tiers = req.hit[first_chunk - req.hit_start : end_chunk - req.hit_start]
        if len(tiers) != end_chunk - first_chunk:
            raise ValueError(f"request {req_id}: {num_external_tokens} tokens exceed the planned hit")
        self._release_probes(req_id, keep=tiers)  # vLLM may have trimmed the hit
        # Pin every source first, so that promotions cannot evict a later
        # chunk of this very hit.
        pins: list[tuple[Tier, bytes]] = []
        for c, tier in zip(range(first_chunk, end_chunk), tiers):
            index = self._index(tier)
            if index is not None:
                index.touch(req.keys[c])
                index.pin(req.keys[c])
                pins.append((tier, req.keys[c]))
        if self.s3 is not None:
            self.s3.touch(req.keys[first_chunk:end_chunk])  # access records, for gc
        chunks = []
        req.hit_tokens = {}
        for c, tier in zip(range(first_chunk, end_chunk), tiers):
            ids = tuple(block_ids[c * bpc : (c + 1) * bpc])
            if len(ids) != bpc:
                raise ValueError(f"request {req_id}: {len(block_ids)} blocks cannot hold chunk {c}")
            first = max(0, start // bs - c * bpc)
            last = min(bpc, -(-(end - c * ct) // bs))
            self._remember(req, c)
            chunks.append(self._plan_load(req.keys[c], tier, ids, first, last))
            n_tokens = min(end, (c + 1) * ct) - max(start, c * ct)
            req.hit_tokens[tier] = req.hit_tokens.get(tier, 0) + n_tokens
        for tier, n in req.hit_tokens.items():
            self.counters.add(f"hit_tokens_{tier.value}", n)
        req.loaded = range(first_chunk, end_chunk)
        # vLLM acts on what the lookup said (it may have trimmed the hit since).
        plan = LoadPlan(req_id, tuple(chunks), not req.load_async)
        self._pending_loads.append(plan)
        self._load_pins[req_id] = pins
        if req.load_async:
            self._async_loading.add(req_id)

    def _plan_load(
        self,
        key: bytes,
        tier: Tier,
        ids: tuple[int, ...],
        first: int,
        last: int,
    ) -> LoadChunk:
        cpu_slot = promote_slot = None
        promote_disk = False
        if tier is Tier.CPU:
            entry = self.cpu.get(key)  # type: ignore[union-attr]
            cpu_slot = entry.slot if entry is not None else None
            sources: tuple[Tier, ...] = (Tier.CPU,)
        elif tier is Tier.DISK:
            s3_too = (
                self.s3 is not None and key in self.s3 and not self.s3_down and self.breakers[Tier.S3].closed
            )
            sources = (Tier.DISK, Tier.S3) if s3_too else (Tier.DISK,)
        else:
            sources = (Tier.S3,)
        if self.promote and tier is not Tier.CPU:
            promote_slot = self._reserve_cpu(key)
            if tier is Tier.S3 and self.breakers[Tier.DISK].closed and self._reserve_disk(key):
                promote_disk = True
        return LoadChunk(key, ids, first, last, sources, cpu_slot, promote_slot, promote_disk)

    def _reserve_cpu(self, key: bytes) -> int | None:
        """A pending CPU slot for ``key``, evicting the least recently used."""
        if self.cpu is None:
            return None
        got = self.cpu.reserve(key)
        if got is None:
            return None
        for old, _ in got[1]:
            self.counters.add("evict_chunks_cpu")
            self._event(False, Tier.CPU, old)
        return got[0].slot

    def _reserve_disk(self, key: bytes) -> bool:
        if self.disk is None or key in self._deleting:
            return False
        got = self.disk.reserve(key, self.disk_reserve)
        if got is None:
            return False
        self._evict_disk(got[1])
        return True

    def _evict_disk(self, evicted: Iterable[tuple[Hashable, Any]]) -> None:
        for key, _ in evicted:
            self.counters.add("evict_chunks_disk")
            self._forget_disk_files(key)
            if isinstance(key, bytes):
                self._event(False, Tier.DISK, key)

    def hit_sources(self, req_id: str) -> dict[Tier, int]:
        """Tokens of the request's planned load, by tier."""
        req = self._requests.get(req_id)
        return dict(req.hit_tokens) if req is not None else {}

    # -- per step ------------------------------------------------------------------
    def plan_step(self, scheduled: Sequence[ScheduledRequest]) -> StepPlan:
        plan = StepPlan(loads=self._pending_loads, stores=self._pending_stores, held=self._pending_held)
        self._pending_loads, self._pending_stores, self._pending_held = [], [], []
        for s in scheduled:
            req = self._requests.get(s.req_id)
            if req is None:
                continue
            done = s.num_computed_tokens + s.num_scheduled_tokens
            plan.stores += self._plan_stores(req, done, s.block_ids)
        return plan

    def _plan_stores(
        self, req: _Request, done_tokens: int, block_ids: Callable[[], Sequence[int]]
    ) -> list[StoreChunk]:
        """Stores of the request's full chunks computed by ``done_tokens``
        whose token ids are known, and not yet in every tier."""
        limit = len(req.token_ids) if self.save_generated else req.num_prompt_tokens
        done_chunks = min(done_tokens, limit) // self.chunk_tokens
        if done_chunks <= req.stored_until:
            return []
        keys = self._keys(req, done_chunks)
        bpc = self.blocks_per_chunk
        ids_all: Sequence[int] | None = None
        out = []
        for c in range(req.stored_until, done_chunks):
            if ids_all is None:
                ids_all = block_ids()
            ids = tuple(ids_all[c * bpc : (c + 1) * bpc])
            if len(ids) != bpc:
                break
            if c in req.loaded and not req.load_failed:
                continue
            store = self._plan_store(keys[c], ids)
            if store is not None:
                self._remember(req, c)
                out.append(store)
        req.stored_until = done_chunks
        return out

    def _plan_store(self, key: bytes, ids: tuple[int, ...]) -> StoreChunk | None:
        now = self._clock()
        owner = ("store", key)
        to_s3 = (
            self.s3 is not None
            and key not in self.s3  # type: ignore[operator]
            and now - self._storing.get(key, -self.store_retry_s) >= self.store_retry_s
            and self._allows(Tier.S3, owner)  # last: half-open, this store is the probe
        )
        to_disk = (
            self.disk is not None
            and not self.disk.has(key)
            and key not in self._deleting
            and self._allows(Tier.DISK, owner, take=False)
        )
        slot = None
        if self.cpu is not None and not self.cpu.has(key):
            slot = self._reserve_cpu(key)
            if slot is None:
                self.counters.add("store_dropped_no_slot")
        if to_disk:
            to_disk = self._reserve_disk(key) and self._allows(Tier.DISK, owner)
        if slot is None and not to_disk and not to_s3:
            return None
        if to_s3:
            self._storing[key] = now
        if slot is not None and (to_disk or to_s3):
            self.cpu.pin(key)  # type: ignore[union-attr]  # the write-through reads the slot
        return StoreChunk(key, ids, slot, to_disk, to_s3)

    def request_finished(self, req_id: str, block_ids: Sequence[int], num_computed_tokens: int) -> bool:
        """The request is done. Plan stores of its last full chunks (those
        holding generated tokens) for the next step; True if vLLM must keep
        its blocks until that step's copies are done."""
        req = self._requests.get(req_id)
        if req is None:
            return False
        if req_id in self._async_loading:
            # Aborted while loading: vLLM holds the blocks until the load is
            # over, and they do not hold valid KV yet. Nothing to store. (A
            # probe slot it holds goes back when the load is over.)
            del self._requests[req_id]
            return False
        self._release_probes(req_id)
        stores = self._plan_stores(req, num_computed_tokens, lambda: block_ids)
        if not stores:
            del self._requests[req_id]
            return False
        self._pending_stores += stores
        self._pending_held.append(req_id)
        self._held.add(req_id)
        return True

    def on_sent(self, req_ids: Iterable[str]) -> None:
        """vLLM freed these held requests' blocks (the copies were done)."""
        for req_id in req_ids:
            if req_id in self._held:
                self._held.discard(req_id)
                self._requests.pop(req_id, None)

    def on_recved(self, req_ids: Iterable[str]) -> None:
        """Loads of these requests are over on every rank (vLLM's
        ``finished_recving`` for async loads, the workers' report for
        synchronous ones): what they read may be evicted again."""
        for req_id in req_ids:
            self._async_loading.discard(req_id)
            self._unpin(self._load_pins.pop(req_id, []))
            # Its tiers' breakers heard how it went (a success closes one, a
            # tier's failure reopens it); a load that failed for another
            # reason leaves the probe slot to the next request.
            self._release_probes(req_id)

    def on_sync_loaded(self, counts: dict[str, int]) -> None:
        for req_id, n in counts.items():
            if self._count("sync", req_id, n):  # type: ignore[arg-type]
                self.on_recved([req_id])

    def _unpin(self, pins: Iterable[tuple[Tier, bytes]]) -> None:
        for tier, key in pins:
            index = self._index(tier)
            if index is not None:
                index.unpin(key)

    # -- worker reports ----------------------------------------------------------
    def _count(self, what: Tier | str, key: bytes, n: int) -> bool:
        """Add ``n`` ranks' reports; True once every rank reported."""
        total = self._tally.get((what, key), 0) + n
        if total >= self.world_size:
            self._tally.pop((what, key), None)
            return True
        self._tally[(what, key)] = total
        return False

    def _outcome(self, tier: Tier, key: bytes, ok: int, failed: int) -> bool | None:
        """Add ranks' write outcomes for (tier, key): None while some rank has
        not reported, then whether every rank succeeded."""
        good, bad = self._outcomes.get((tier, key), (0, 0))
        good, bad = good + ok, bad + failed
        if good + bad < self.world_size:
            self._outcomes[(tier, key)] = (good, bad)
            return None
        self._outcomes.pop((tier, key), None)
        return bad == 0

    def on_written(self, tier: Tier, counts: dict[bytes, int], sizes: dict[bytes, int] | None = None) -> None:
        """``counts[key]`` more ranks hold their shard of ``key`` in ``tier``
        (``sizes``: their bytes, for the disk)."""
        for key, n in counts.items():
            if tier is Tier.DISK and sizes:
                self._disk_sizes[key] = self._disk_sizes.get(key, 0) + sizes.get(key, 0)
            self._decide(tier, key, self._outcome(tier, key, n, 0))

    def on_existing(self, keys: Iterable[bytes]) -> None:
        """Ranks' S3 stores of these keys found the object already there."""
        self._existing.update(keys)

    def on_write_failed(self, tier: Tier, counts: dict[bytes, int]) -> None:
        """``counts[key]`` more ranks dropped or failed their write of ``key``."""
        for key, n in counts.items():
            self._decide(tier, key, self._outcome(tier, key, 0, n))

    def _decide(self, tier: Tier, key: bytes, ok: bool | None) -> None:
        """Commit a write every rank made; undo one that any rank failed,
        once none is still writing (a slot or file is not reused under a
        rank that still writes it)."""
        if ok is None:
            return
        if ok:
            self._event(True, tier, key)
        elif tier in self.breakers:
            self.breakers[tier].release(("store", key))  # if the store was the probe, it is over
        if tier is Tier.S3:
            existing = key in self._existing
            self._existing.discard(key)
            # An object some replica reported bad is never published from a
            # 412 (it may be that very object); one this replica wrote is,
            # by the ranks that wrote it (manifest.publish), the moment
            # their PUTs returned: here it only joins this replica's index.
            bad = self.s3 is not None and self.s3.is_bad(key)
            if bad and (existing or not ok):
                # The bad object is in the way (a 412, or a store that found
                # one it could not verify) until gc removes it: the next
                # store waits BAD_KEY_RETRY_S instead of trying every step
                # (one PUT per key that often is cheap; gc may run any time).
                self._storing[key] = self._clock() - self.store_retry_s + BAD_KEY_RETRY_S
            else:
                self._storing.pop(key, None)
            if ok and self.s3 is not None and not (existing and bad):
                self.s3.add(key, publish=existing)
        elif tier is Tier.CPU and self.cpu is not None:
            if ok:
                self.cpu.commit(key)
            else:
                self.cpu.abort(key)
        elif tier is Tier.DISK and self.disk is not None:
            size = self._disk_sizes.pop(key, None)
            if ok:
                self._evict_disk(self.disk.commit(key, size))
            elif self.disk.abort(key) is not None:
                self._forget_disk_files(key)  # ranks that did write leave files

    def _forget_disk_files(self, key: Hashable) -> None:
        self._deleting.add(key)
        self._disk_evictions.append(key)

    def on_released(self, counts: dict[bytes, int]) -> None:
        """Ranks no longer read the CPU slot of these stores."""
        for key, n in counts.items():
            if self._count("release", key, n) and self.cpu is not None:
                self.cpu.unpin(key)

    def on_missing(self, tier: Tier, keys: Iterable[bytes]) -> None:
        """Workers found these keys absent or corrupt in ``tier``."""
        for key in keys:
            if tier is Tier.S3:
                if self.s3 is not None and key in self.s3:
                    self.s3.discard(key)
                    self.counters.add("manifest_dropped")
            elif tier is Tier.CPU and self.cpu is not None:
                self.cpu.remove(key)
            elif tier is Tier.DISK and self.disk is not None and self.disk.has(key):
                self.disk.remove(key)
                self._forget_disk_files(key)  # the other ranks' files of it
            self._event(False, tier, key)

    def on_disk_full(self) -> None:
        """The disk filled up below ``disk_bytes`` (other files grew): take
        what s3kv holds now as the capacity, so later stores evict instead."""
        if self.disk is not None:
            self._evict_disk(self.disk.shrink(max(self.disk.used, self.disk_reserve)))

    def on_load_results(
        self,
        failed_req_ids: Iterable[str],
        *,
        ok: Mapping[Tier, int] | None = None,
        failed: Mapping[Tier, int] | None = None,
    ) -> None:
        """What transfers did: requests with failed chunks get no more hits;
        each tier's breaker hears that tier's successes and failures (not
        answering, throttled, too slow) and no other's: see :class:`Breaker`."""
        for req_id in failed_req_ids:
            req = self._requests.get(req_id)
            if req is not None:
                req.load_failed = True
        ok, failed = ok or {}, failed or {}
        for tier, breaker in self.breakers.items():
            breaker.report(ok.get(tier, 0), failed.get(tier, 0))

    # -- disk deletions ------------------------------------------------------------
    def take_disk_evictions(self) -> list[Hashable]:
        """Disk entries to delete (chunk keys, or paths of other files)."""
        out, self._disk_evictions = self._disk_evictions, []
        return out

    def on_deleted(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            self._deleting.discard(key)

    # -- KV events -------------------------------------------------------------
    def _remember(self, req: _Request, c: int) -> None:
        """Keep what a chunk's BlockStored event needs until it is written."""
        if not self.emit_events:
            return
        ct = self.chunk_tokens
        key = req.keys[c]
        self._event_info[key] = (req.keys[c - 1] if c else None, tuple(req.token_ids[c * ct : (c + 1) * ct]))
        self._event_info.move_to_end(key)
        while len(self._event_info) > 1 << 14:
            self._event_info.popitem(last=False)

    def _event(self, stored: bool, tier: Tier, key: bytes) -> None:
        if not self.emit_events:
            return
        if stored:
            parent, tokens = self._event_info.get(key, (None, ()))
            self._events.append(TierEvent(True, tier, key, parent, tokens))
        else:
            self._events.append(TierEvent(False, tier, key))

    def take_events(self) -> list[TierEvent]:
        out, self._events = self._events, []
        return out
