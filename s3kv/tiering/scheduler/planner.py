"""The scheduler side's decisions, free of vLLM: which tier each chunk of a
request loads from, which chunks each step stores and where, and what the
workers' reports change.

Every decision is made here, once, so that all TP ranks execute the same
plan. The planner composes three pieces: the requests' chain keys
(:class:`ChainKeys`), the count of ranks' reports (:class:`RankCount`) and
the tiers (:class:`TierStack`: one :class:`TierManager` per tier, nearest
first), naming none of them. Nothing here does I/O: what a tier evicts,
its manager hands to a thread of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from s3kv.config import DEFAULTS, S3KVConfig
from s3kv.keys import Namespace
from s3kv.kvgroups import GroupLayout
from s3kv.stats import Counters
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import (
    LoadPlan,
    ScheduledRequest,
    StepPlan,
    StepTokens,
    StoreChunk,
    TierEvent,
    TierReport,
)
from s3kv.tiering.scheduler.cost import CostModel
from s3kv.tiering.scheduler.keychain import BlockHashes, ChainKeys, ExtrasFn, HashScheme, Keyed, PrefixIds
from s3kv.tiering.scheduler.loads import LoadsInFlight, PrefillBacklog
from s3kv.tiering.scheduler.parts import BlockIds, GroupHit, GroupParts, by_group, chunk_load
from s3kv.tiering.scheduler.prefetch import Prefetcher
from s3kv.tiering.scheduler.ranks import RankCount
from s3kv.tiering.scheduler.requests import RequestState
from s3kv.tiering.scheduler.stack import TierStack
from s3kv.tiering.tiers.manager import TierEvents, TierManager


class Planner:
    def __init__(
        self,
        *,
        namespace: Namespace,
        chunk_tokens: int,
        block_size: int,
        tiers: Sequence[TierManager] = (),
        world_size: int = 1,
        promote: bool = DEFAULTS.promote,
        save_generated: bool = DEFAULTS.save_generated,
        emit_events: bool = False,
        counters: Counters | None = None,
        cost: CostModel | None = None,
        chunk_bytes: int = 0,
        prefetch_bytes: int = 0,
        prefetch_wait_s: float = DEFAULTS.load_timeout_s + 5.0,
        clock: Callable[[], float] = time.monotonic,
        groups: GroupLayout | None = None,
        hash_scheme: HashScheme | None = None,
    ) -> None:
        if chunk_tokens % block_size:
            raise ValueError("chunk_tokens must be a multiple of block_size")
        self.namespace = namespace
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.blocks_per_chunk = chunk_tokens // block_size
        self.chain = ChainKeys(namespace, chunk_tokens, hash_scheme)
        """The requests' chunk keys, by the engine's scheme (``hash_scheme``: from vLLM's block hashes)."""
        self.ranks = RankCount(world_size)
        self.events = TierEvents(emit_events)
        self.counters = counters or Counters()
        self.stack = TierStack(tiers, self.counters, self.events)
        self.promote = promote
        self.save_generated = save_generated
        self._requests: dict[str, RequestState] = {}
        self._pending_loads: list[LoadPlan] = []
        self._pending_stores: list[StoreChunk] = []
        self._pending_held: list[str] = []
        self._held: set[str] = set()
        self._load_pins: dict[str, list[tuple[TierManager, bytes]]] = {}
        """Entries a load reads, let go when it is over on every rank."""
        self._async_loading: set[str] = set()
        self.cost = cost
        """The load policy and its estimates (None: every hit is offered, nothing is timed)."""
        self._loads = LoadsInFlight(cost)
        self._backlog = PrefillBacklog()
        self.prefetcher = Prefetcher(
            self.stack,
            self.chain,
            self._requests,
            self._remember,
            chunk_bytes=chunk_bytes,
            budget_bytes=prefetch_bytes,
            wait_s=prefetch_wait_s,
            counters=self.counters,
            clock=clock,
        )
        """Fetches what only S3 holds of arriving requests' hits into the nearer tiers."""
        self.parts = GroupParts(groups, chunk_tokens) if groups is not None and not groups.single else None
        """A model's KV cache groups, each chunk one object per group (None: one group)."""
        self.prefetcher.parts = self.parts

    @classmethod
    def from_config(
        cls,
        config: S3KVConfig,
        *,
        namespace: Namespace,
        block_size: int,
        tiers: Sequence[TierManager] = (),
        world_size: int = 1,
        emit_events: bool = False,
        counters: Counters | None = None,
        chunk_bytes: int = 0,
        groups: GroupLayout | None = None,
        hash_scheme: HashScheme | None = None,
    ) -> Planner:
        """The planner ``config`` asks for, over ``tiers`` (nearest first);
        ``chunk_bytes``: the raw KV bytes of one object (a chunk's shard, or
        its part of one KV cache group), for the cost model; ``hash_scheme``:
        chunk keys from vLLM's block hashes (None: from the tokens)."""
        return cls(
            namespace=namespace,
            chunk_tokens=config.chunk_tokens,
            block_size=block_size,
            tiers=tiers,
            world_size=world_size,
            promote=config.promote,
            save_generated=config.save_generated,
            emit_events=emit_events,
            counters=counters,
            cost=CostModel(
                chunk_bytes=chunk_bytes, policy=config.load_policy, min_step_tokens=config.chunk_tokens
            ),
            chunk_bytes=chunk_bytes,
            prefetch_bytes=config.prefetch_bytes,
            prefetch_wait_s=config.load_timeout_s + 5.0,
            groups=groups,
            hash_scheme=hash_scheme,
        )

    def tier(self, tier: Tier) -> TierManager | None:
        """The manager of ``tier``, or None when it is off."""
        return self.stack.get(tier)

    def knows(self, req_id: str) -> bool:
        """Was the request looked up before?"""
        req = self._requests.get(req_id)
        return req is not None and req.looked_up

    def _request(
        self,
        req_id: str,
        token_ids: Sequence[int],
        num_tokens: int,
        num_prompt_tokens: int | None,
        extras: ExtrasFn | None,
        prefix_ids: PrefixIds | None,
        block_hashes: BlockHashes | None,
    ) -> RequestState:
        req = self._requests.get(req_id)
        if req is None:
            prompt = num_tokens if num_prompt_tokens is None else num_prompt_tokens
            req = self._requests[req_id] = RequestState(token_ids, prompt, extras, prefix_ids, block_hashes)
        req.token_ids = token_ids
        return req

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
        policy: str | None = None,
        block_hashes: BlockHashes | None = None,
    ) -> tuple[int | None, bool]:
        """(tokens beyond ``num_computed_tokens`` that the tiers can supply,
        load asynchronously?). No I/O; repeated calls are cheap. None while
        the request's prefetch is under way: vLLM asks again next step.
        ``policy`` (``cost``, ``always``) overrides the load policy for it.
        Under the block scheme ``block_hashes`` key it (not its tokens).

        A load only from synchronous tiers (the CPU pool) leaves the last
        block with a token to compute to vLLM; any other is asynchronous."""
        req = self._request(
            req_id, token_ids, num_tokens, num_prompt_tokens, extras, prefix_ids, block_hashes
        )
        req.looked_up = True
        req.local_tokens = num_computed_tokens
        req.hit = []
        self._backlog.set(req_id, num_tokens - num_computed_tokens)  # until a load is offered
        if req.load_failed:
            return 0, False
        ct = self.chunk_tokens
        n_chunks = num_tokens // ct
        if self.parts is not None and self.parts.layout.has_state:
            # A state after the whole prompt cannot take its last token again,
            # which vLLM recomputes after a hit of all of it: leave it a token.
            n_chunks = (num_tokens - 1) // ct
        start = num_computed_tokens // ct
        if start >= n_chunks:
            self.prefetcher.leave(req_id)  # vLLM holds all of it: nothing to fetch
            return 0, False
        keys = self.chain.extend(req, n_chunks)
        # Block hashes may cover fewer (none under the block scheme without them).
        n_chunks = min(n_chunks, len(keys))
        if start >= n_chunks:
            self.prefetcher.leave(req_id)
            return 0, False
        waiting = self.prefetcher.awaits(keys, start, n_chunks)
        if not waiting and self.parts is not None:
            waiting = self.parts.prefetching(self.prefetcher, req, start, n_chunks)
        if waiting:
            if not req.waited:
                req.waited = True
                self.counters.add("prefetch_waits")
            return None, False
        self.prefetcher.leave(req_id)  # scheduled now: it loads the rest itself
        ghit: GroupHit | None = None
        if self.parts is None:
            hit = self.stack.hits(req_id, keys, req.fps, start, n_chunks)
        else:
            ghit = self.parts.hit(self.stack, req_id, keys, req.fps, req.parts, start, n_chunks, num_tokens)
            hit = self.parts.chunk_tiers(ghit, ghit.longest, self.stack)
        req.group_hit = ghit
        whole, sync = self._offer(hit, start, num_tokens, num_computed_tokens)
        n = whole
        if self.cost is not None and hit:
            inflight = self._loads.by_tier
            if self.prefetcher.in_flight:  # prefetches share their source tier with the loads
                inflight = dict(inflight)
                for tier, count in self.prefetcher.in_flight_by_tier().items():
                    inflight[tier] = inflight.get(tier, 0) + count
            decision = self.cost.choose(
                [m.tier for m in hit],
                [m.sync_load and self.parts is None for m in hit],
                first_token=start * ct,
                chunk_tokens=ct,
                local_tokens=num_computed_tokens,
                context_tokens=num_tokens,
                end_tokens=num_tokens - 1,
                policy=policy,
                ahead_tokens=self._backlog.ahead_of(req_id),
                inflight=inflight,
                **(self.parts.costs(ghit, start) if self.parts is not None and ghit is not None else {}),
            )
            if decision.chunks < len(hit):
                hit = hit[: decision.chunks]
                if ghit is not None and self.parts is not None:  # the parts the shorter hit needs
                    end = start + decision.chunks
                    hit = self.parts.chunk_tiers(ghit, end, self.stack) if decision.chunks else []
                    self.stack.release(req_id, keep=ghit.managers(end))
                else:
                    self.stack.release(req_id, keep=hit)  # a probe of a tier it no longer loads from
                n, sync = self._offer(hit, start, num_tokens, num_computed_tokens)
            if not req.decided and decision.explored:
                self.counters.add("load_policy_explored")
        req.hit_start, req.hit = start, hit
        if not req.decided:  # vLLM asks again while the request waits: count it once
            req.decided = True
            self.counters.add("load_policy_tokens_offered", n)
            self.counters.add("load_policy_tokens_declined", whole - n)
        req.load_async = n > 0 and not sync
        self._backlog.set(req_id, num_tokens - num_computed_tokens - n)
        return (n, not sync) if n > 0 else (0, False)

    def _offer(
        self, hit: Sequence[TierManager], start: int, num_tokens: int, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """(tokens a load of ``hit`` from chunk ``start`` supplies, synchronously?)."""
        end = (start + len(hit)) * self.chunk_tokens
        # With several KV cache groups every load is asynchronous: vLLM takes
        # a failed one only as a whole request, which a synchronous load is not.
        sync = bool(hit) and self.parts is None and hit[0].sync_load and all(m.sync_load for m in hit)
        if sync:
            # vLLM must compute at least one prompt token; leave it the whole
            # last block so our copies and its writes never share a block.
            end = min(end, (num_tokens - 1) // self.block_size * self.block_size)
        return max(0, end - num_computed_tokens), sync

    # -- prefetch ----------------------------------------------------------------
    def prefetch(
        self,
        req_id: str,
        token_ids: Sequence[int],
        num_tokens: int,
        extras: ExtrasFn | None = None,
        *,
        num_prompt_tokens: int | None = None,
        prefix_ids: PrefixIds | None = None,
        block_hashes: BlockHashes | None = None,
    ) -> None:
        """A request arrived: fetch the chunks of its hit that only a remote
        tier (S3) holds into the nearer tiers, planned with the next step
        (:class:`Prefetcher`); its lookups wait for chunks in flight."""
        if not self.prefetcher.enabled:
            return
        req = self._request(
            req_id, token_ids, num_tokens, num_prompt_tokens, extras, prefix_ids, block_hashes
        )
        if num_tokens // self.chunk_tokens == 0 or req.load_failed:
            return
        self.prefetcher.arrive(req_id)

    # -- allocation ---------------------------------------------------------------
    def on_alloc(self, req_id: str, block_ids: BlockIds, num_external_tokens: int) -> None:
        """vLLM allocated blocks for a hit of ``num_external_tokens``: plan the
        load. ``block_ids``: the request's, or each KV cache group's."""
        req = self._requests.get(req_id)
        if req is None:
            return
        if num_external_tokens <= 0:
            self.stack.release(req_id)  # vLLM loads nothing: a probe it took is not one
            return
        start = req.local_tokens
        end = start + num_external_tokens
        ct = self.chunk_tokens
        try:
            if self.parts is not None:
                load = self.parts.plan_load(
                    self.stack, req_id, req, by_group(block_ids), start, end, self.promote
                )
            else:
                ids = by_group(block_ids)[0]
                load = chunk_load(self.stack, req_id, req, ids, start, end, ct, self.block_size, self.promote)
        except ValueError as e:
            raise ValueError(f"request {req_id}: {e}") from None
        req.hit_tokens = {}
        for c, m in load.chunk_tiers.items():
            self._remember(req, c)
            n_tokens = min(end, (c + 1) * ct) - max(start, c * ct)
            req.hit_tokens[m.tier] = req.hit_tokens.get(m.tier, 0) + n_tokens
        for tier, n in req.hit_tokens.items():
            self.counters.add(f"hit_tokens_{tier.value}", n)
        req.loaded = range(start // ct, -(-end // ct))
        # vLLM acts on what the lookup said (it may have trimmed the hit since).
        self.events.hide(c.key for c in load.chunks if c.group)
        plan = LoadPlan(req_id, tuple(load.chunks), not req.load_async, failed=tuple(load.failed))
        self._pending_loads.append(plan)
        self._load_pins[req_id] = load.pins
        self._loads.planned(req_id, [m.tier for m, _ in load.pins], req.load_async)
        if req.load_async:
            self._async_loading.add(req_id)

    def hit_sources(self, req_id: str) -> dict[Tier, int]:
        """Tokens of the request's planned load, by tier."""
        req = self._requests.get(req_id)
        return dict(req.hit_tokens) if req is not None else {}

    # -- per step ------------------------------------------------------------------
    def plan_step(self, scheduled: Sequence[ScheduledRequest]) -> StepPlan:
        self.prefetcher.start_arrived()
        plan = StepPlan(
            loads=self._pending_loads,
            stores=self._pending_stores,
            held=self._pending_held,
            prefetch=self.prefetcher.take(),
        )
        self.events.hide(c.key for p in plan.prefetch for c in p.chunks if c.group)
        self._pending_loads, self._pending_stores, self._pending_held = [], [], []
        tokens, context = 0, 0
        for s in scheduled:
            tokens += s.num_scheduled_tokens
            req = self._requests.get(s.req_id)
            if req is None:
                continue
            done = s.num_computed_tokens + s.num_scheduled_tokens
            if s.num_computed_tokens < req.num_prompt_tokens and s.num_scheduled_tokens:
                context = max(context, done)  # a prefill
            self._backlog.set(s.req_id, req.num_prompt_tokens - done)
            plan.stores += self._plan_stores(req, done, s.block_ids)
        if self.cost is not None and tokens:
            plan.step = StepTokens(tokens, context)
        return plan

    def _plan_stores(
        self, req: RequestState, done_tokens: int, block_ids: Callable[[], BlockIds]
    ) -> list[StoreChunk]:
        """Stores of the request's full chunks computed by ``done_tokens``
        whose token ids are known, and not yet in every tier: each KV cache
        group's part of each, where vLLM still holds the pages a later hit
        can read (a windowed group's far behind are freed: not promised)."""
        limit = len(req.token_ids) if self.save_generated else req.num_prompt_tokens
        done_chunks = min(done_tokens, limit) // self.chunk_tokens
        if done_chunks <= req.stored_until:
            return []
        keys = self.chain.extend(req, done_chunks)
        done_chunks = min(done_chunks, len(keys))  # block hashes cover fewer: the rest later
        bpc = self.blocks_per_chunk
        group_ids: tuple[Sequence[int], ...] | None = None
        out = []
        for c in range(req.stored_until, done_chunks):
            if group_ids is None:
                group_ids = by_group(block_ids())
            if any(len(ids) < (c + 1) * bpc for ids in group_ids):
                break
            if c in req.loaded and not req.load_failed:
                continue
            if self.parts is not None:
                stores = self.parts.plan_stores(self.stack, req, group_ids, c)
                self.events.hide(st.key for st in stores if st.group)
                out += stores
                self._remember(req, c)
                continue
            ids = tuple(group_ids[0][c * bpc : (c + 1) * bpc])
            targets, pinned = self.stack.store(keys[c])
            if targets:
                self._remember(req, c)
                out.append(StoreChunk(keys[c], ids, targets, pinned))
        req.stored_until = done_chunks
        return out

    def request_finished(self, req_id: str, block_ids: BlockIds, num_computed_tokens: int) -> bool:
        """The request is done. Plan stores of its last full chunks (those
        holding generated tokens) for the next step; True if vLLM must keep
        its blocks until that step's copies are done."""
        self._backlog.set(req_id, 0)
        req = self._requests.get(req_id)
        if req is None:
            return False
        self.prefetcher.leave(req_id)
        if req_id in self._async_loading:
            # Aborted while loading: vLLM holds the blocks until the load is
            # over, and they do not hold valid KV yet. Nothing to store. (A
            # probe slot it holds goes back when the load is over.)
            del self._requests[req_id]
            return False
        self.stack.release(req_id)
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
            self._loads.over(req_id)
            for m, key in self._load_pins.pop(req_id, []):
                m.complete_load(key)
            # Its tiers' breakers heard how it went (a success closes one, a
            # tier's failure reopens it); a load that failed for another
            # reason leaves the probe slot to the next request.
            self.stack.release(req_id)

    # -- worker reports ----------------------------------------------------------
    def on_report(self, report: TierReport) -> None:
        """What the workers did since their last report, summed over ranks: a
        write counts once every rank reported it (and fails if any failed);
        each tier hears its own outcomes, and its breaker its own transfers
        (not answering, throttled, too slow) and no other tier's."""
        decided = self.ranks.writes(report)
        self.stack.on_report(report, decided)
        self.prefetcher.reported(decided)  # the budget some of them took is free again
        self._loads.observe(report)
        for key, n in report.released.items():  # ranks no longer read the store's staging place
            if self.ranks.count(("release", key), n):
                self.stack.released(key)
        for req_id, n in report.sync_loaded.items():
            if self.ranks.count(("sync", req_id), n):
                self.on_recved([req_id])
        for req_id in report.load_failed:  # no more hits for a request with failed chunks
            req = self._requests.get(req_id)
            if req is not None:
                req.load_failed = True
        self.stack.end_report(report)

    # -- KV events -------------------------------------------------------------
    def _remember(self, req: Keyed, c: int) -> None:
        """Keep what a chunk's BlockStored event needs until it is written."""
        if self.events.enabled:
            ct = self.chunk_tokens
            parent = req.keys[c - 1] if c else None
            self.events.remember(req.keys[c], parent, tuple(req.token_ids[c * ct : (c + 1) * ct]))

    def take_events(self) -> list[TierEvent]:
        return self.events.take()
