"""The scheduler side's bookkeeping, free of vLLM: which chunks a request can
load, which chunks each step should store, and what the workers reported.

The connector adapts vLLM's objects to these calls; every placement decision
is made here, once, so that all TP ranks execute the same plan.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from s3kv.index import ChunkIndex
from s3kv.keys import Namespace, chain_keys

ExtrasFn = Callable[[int, int], Any]
"""extras(start_token, end_token) -> the extra keys of that chunk, or None."""


@dataclass(frozen=True)
class LoadChunk:
    key: bytes
    block_ids: tuple[int, ...]
    """Block ids of the whole chunk, in order."""
    first_block: int
    """Pages before this index are already valid locally and are not written."""


@dataclass(frozen=True)
class LoadPlan:
    req_id: str
    chunks: tuple[LoadChunk, ...]


@dataclass(frozen=True)
class StoreChunk:
    key: bytes
    block_ids: tuple[int, ...]


@dataclass
class StepPlan:
    loads: list[LoadPlan] = field(default_factory=list)
    stores: list[StoreChunk] = field(default_factory=list)


@dataclass
class _Request:
    token_ids: Sequence[int]
    num_prompt_tokens: int
    extras: ExtrasFn | None
    keys: list[bytes] = field(default_factory=list)
    hit_chunks: int = 0
    local_tokens: int = 0
    stored_until: int = 0
    """Chunks below this index are stored, planned, or known to the index."""
    load_failed: bool = False
    """A load for this request failed: vLLM recomputes it, and asking again
    (vLLM does when nothing was computed) would only fail again."""


@dataclass(frozen=True)
class ScheduledRequest:
    req_id: str
    num_computed_tokens: int
    """Tokens computed before this step."""
    num_scheduled_tokens: int
    block_ids: Callable[[], Sequence[int]]
    """The request's block ids (called only when a store is planned)."""


class Planner:
    def __init__(
        self,
        *,
        namespace: Namespace,
        chunk_tokens: int,
        block_size: int,
        index: ChunkIndex,
        world_size: int = 1,
        store_retry_s: float = 120.0,
        backoff_s: tuple[float, float] = (5.0, 60.0),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if chunk_tokens % block_size:
            raise ValueError("chunk_tokens must be a multiple of block_size")
        self.namespace = namespace
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.blocks_per_chunk = chunk_tokens // block_size
        self.index = index
        self.world_size = world_size
        self.store_retry_s = store_retry_s
        self._clock = clock
        self._requests: dict[str, _Request] = {}
        self._pending_loads: list[LoadPlan] = []
        self._storing: dict[bytes, float] = {}
        """Keys planned for store and not yet reported, with when."""
        self._stored_ranks: dict[bytes, int] = {}
        self._backoff_s = backoff_s
        self._next_backoff_s = backoff_s[0]
        self._paused_until = 0.0
        """While the store does not answer, offer no hits (a circuit breaker)."""

    # -- lookups -------------------------------------------------------------
    def knows(self, req_id: str) -> bool:
        return req_id in self._requests

    def _keys(self, req_id: str, req: _Request) -> list[bytes]:
        n_chunks = req.num_prompt_tokens // self.chunk_tokens
        have = len(req.keys)
        if have < n_chunks:
            ct = self.chunk_tokens
            extras = None
            if req.extras is not None:
                extras = [req.extras(i * ct, (i + 1) * ct) for i in range(have, n_chunks)]
            req.keys += chain_keys(
                self.namespace,
                req.token_ids[have * ct : n_chunks * ct],
                ct,
                extras,
                parent=req.keys[-1] if req.keys else None,
                start_chunk=have,
            )
        return req.keys

    def lookup(
        self,
        req_id: str,
        token_ids: Sequence[int],
        num_prompt_tokens: int,
        num_computed_tokens: int,
        extras: ExtrasFn | None = None,
    ) -> int:
        """Tokens beyond ``num_computed_tokens`` (the local, block-aligned hit)
        that the store can supply. No I/O; repeated calls are cheap."""
        req = self._requests.get(req_id)
        if req is None:
            req = self._requests[req_id] = _Request(token_ids, num_prompt_tokens, extras)
        req.local_tokens = num_computed_tokens
        if req.load_failed or self._clock() < self._paused_until:
            req.hit_chunks = 0
            return 0
        keys = self._keys(req_id, req)
        req.hit_chunks = self.index.prefix_hits(keys)
        return max(0, req.hit_chunks * self.chunk_tokens - num_computed_tokens)

    def on_alloc(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM allocated blocks for a hit of ``num_external_tokens``: plan the load."""
        req = self._requests.get(req_id)
        if req is None or num_external_tokens <= 0:
            return
        start = req.local_tokens
        end = start + num_external_tokens
        bpc = self.blocks_per_chunk
        chunks = []
        for c in range(start // self.chunk_tokens, end // self.chunk_tokens):
            ids = tuple(block_ids[c * bpc : (c + 1) * bpc])
            if len(ids) != bpc:
                raise ValueError(f"request {req_id}: {len(block_ids)} blocks cannot hold chunk {c}")
            first = max(0, start // self.block_size - c * bpc)
            chunks.append(LoadChunk(req.keys[c], ids, first))
        if chunks:
            self._pending_loads.append(LoadPlan(req_id, tuple(chunks)))

    # -- per step ------------------------------------------------------------
    def plan_step(self, scheduled: Sequence[ScheduledRequest]) -> StepPlan:
        plan = StepPlan(loads=self._pending_loads)
        self._pending_loads = []
        now = self._clock()
        for s in scheduled:
            req = self._requests.get(s.req_id)
            if req is None:
                continue
            done_tokens = min(s.num_computed_tokens + s.num_scheduled_tokens, req.num_prompt_tokens)
            done_chunks = done_tokens // self.chunk_tokens
            if done_chunks <= req.stored_until:
                continue
            keys = self._keys(s.req_id, req)
            block_ids: Sequence[int] | None = None
            bpc = self.blocks_per_chunk
            for c in range(req.stored_until, done_chunks):
                key = keys[c]
                if key in self.index:
                    continue
                started = self._storing.get(key)
                if started is not None and now - started < self.store_retry_s:
                    continue
                if block_ids is None:
                    block_ids = s.block_ids()
                ids = tuple(block_ids[c * bpc : (c + 1) * bpc])
                if len(ids) != bpc:
                    break
                self._storing[key] = now
                plan.stores.append(StoreChunk(key, ids))
            req.stored_until = done_chunks
        return plan

    def on_finished(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    # -- worker reports ----------------------------------------------------
    def on_stored(self, counts: dict[bytes, int]) -> None:
        """``counts[key]`` more ranks hold their shard of ``key``."""
        for key, n in counts.items():
            total = self._stored_ranks.get(key, 0) + n
            if total >= self.world_size:
                self._stored_ranks.pop(key, None)
                self._storing.pop(key, None)
                self.index.add(key)
            else:
                self._stored_ranks[key] = total

    def on_store_failed(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._storing.pop(key, None)
            self._stored_ranks.pop(key, None)

    def on_load_results(self, failed_req_ids: Iterable[str], *, loaded: int, unavailable: int) -> None:
        """What loads did: requests with failed chunks get no more hits; loads
        the store did not answer pause all hits, for a time that doubles while
        nothing loads (up to ``backoff_s[1]``) and resets on success."""
        for req_id in failed_req_ids:
            req = self._requests.get(req_id)
            if req is not None:
                req.load_failed = True
        if unavailable:
            self._paused_until = self._clock() + self._next_backoff_s
            self._next_backoff_s = min(self._next_backoff_s * 2, self._backoff_s[1])
        elif loaded:
            self._next_backoff_s = self._backoff_s[0]

    @property
    def paused(self) -> bool:
        return self._clock() < self._paused_until

    def on_missing(self, keys: Sequence[bytes]) -> None:
        """Workers found these keys absent or corrupt in the store."""
        for key in keys:
            self.index.discard(key)
