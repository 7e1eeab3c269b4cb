"""A hit over a model's KV cache groups: which part of which chunk a hit
needs, and where each is (free of vLLM).

A chunk of a model with several KV cache groups is one object per group
(:mod:`s3kv.kvgroups`). A hit ending at chunk ``k`` needs every
full-attention group's parts of chunks ``[start, k)`` and each windowed
group's parts of the chunks its window reaches from the hit's end; a hit is
offered only where every part it needs is in some tier (a hit is whole).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from s3kv.kvgroups import FULL, NULL_BLOCK, GroupLayout, part_key
from s3kv.manifest.keyset import fingerprints
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import LoadChunk, StoreChunk
from s3kv.tiering.scheduler.stack import TierStack
from s3kv.tiering.tiers.manager import TierManager


@dataclass(slots=True)
class PartKeys:
    """One request's part keys (and fingerprints) of the groups after the
    first (group 0's are its chain keys), grown with its chain."""

    keys: dict[int, list[bytes]] = field(default_factory=dict)
    fps: dict[int, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class GroupHit:
    """Where each part of a hit from chunk ``start`` is, and which hit ends are whole."""

    start: int
    where: tuple[tuple[TierManager | None, ...], ...]
    """``where[g][c - start]``: the nearest tier holding group g's part of chunk c."""
    ends: tuple[int, ...]
    """The chunk ends ``k`` (exclusive, ascending) of hits whose every part is held."""
    needed: Mapping[int, tuple[tuple[int, int], ...]]
    """Hit end -> the (chunk, group) parts it needs."""

    @property
    def longest(self) -> int:
        return self.ends[-1] if self.ends else self.start

    def tier(self, chunk: int, group: int) -> TierManager | None:
        return self.where[group][chunk - self.start]

    def managers(self, end: int) -> set[TierManager]:
        """The tiers the hit ending at ``end`` loads from."""
        return {m for c, g in self.needed.get(end, ()) if (m := self.tier(c, g)) is not None}


BlockIds = Sequence[int] | Sequence[Sequence[int]]
"""A request's block ids: one list, or one per KV cache group."""


def by_group(block_ids: BlockIds) -> tuple[Sequence[int], ...]:
    """``block_ids`` as one list per KV cache group."""
    if block_ids and not isinstance(block_ids[0], int):
        return tuple(block_ids)  # type: ignore[arg-type]
    return (block_ids,)  # type: ignore[return-value]


class PartsKeyed(Protocol):
    """A request's chain keys and part keys."""

    keys: list[bytes]
    fps: np.ndarray
    parts: PartKeys


class PartsRequest(PartsKeyed, Protocol):
    """What :class:`GroupParts` reads of a request: its keys, its last hit."""

    group_hit: GroupHit | None
    hit_start: int
    hit: list[TierManager]


@dataclass
class PartsLoad:
    """A load of a hit's parts, as planned."""

    end: int
    """The tokens the load reaches."""
    chunks: list[LoadChunk]
    failed: list[int]
    """Blocks of parts vLLM wants that no tier holds."""
    pins: list[tuple[TierManager, bytes]]
    """The entries the load reads, held until it is over."""
    chunk_tiers: dict[int, TierManager]
    """Each chunk's farthest source (for the counts by tier)."""


class GroupParts:
    """The part keys of requests' chunks, and the hits they make."""

    def __init__(self, layout: GroupLayout, chunk_tokens: int) -> None:
        self.layout = layout
        self.chunk_tokens = chunk_tokens
        self.full = tuple(i for i, g in enumerate(layout.groups) if g.kind == FULL)
        self.windowed = layout.windowed

    def keys(
        self, chain: Sequence[bytes], chain_fps: np.ndarray, parts: PartKeys, g: int, n: int
    ) -> tuple[list[bytes], np.ndarray]:
        """Group ``g``'s part keys (and fingerprints) of at least chunks [0, n)."""
        if g == 0:
            return list(chain) if not isinstance(chain, list) else chain, chain_fps
        keys = parts.keys.setdefault(g, [])
        if len(keys) < n:
            new = [part_key(k, g) for k in chain[len(keys) : n]]
            keys += new
            parts.fps[g] = np.concatenate([parts.fps.get(g, np.empty(0, np.uint64)), fingerprints(new)])
        return keys, parts.fps[g]

    def needed(self, start: int, end: int, end_tokens: int) -> tuple[tuple[int, int], ...]:
        """The (chunk, group) parts a hit of chunks [start, end) reaching
        ``end_tokens`` tokens needs."""
        ct = self.chunk_tokens
        out = [(c, g) for c in range(start, end) for g in self.full]
        for g in self.windowed:
            out += [(c, g) for c in range(start, end) if self.layout.needs(g, c, ct, end_tokens)]
        return tuple(out)

    def hit(
        self,
        stack: TierStack,
        owner: Hashable,
        chain: Sequence[bytes],
        chain_fps: np.ndarray,
        parts: PartKeys,
        start: int,
        n_chunks: int,
        num_tokens: int,
    ) -> GroupHit:
        """The whole hits of chunks from ``start`` (no I/O). A hit that ends
        where vLLM must compute the last token ends a block earlier: its
        windowed parts are judged from there (a superset of the parts)."""
        where = []
        for g in range(len(self.layout.groups)):
            keys, fps = self.keys(chain, chain_fps, parts, g, n_chunks)
            where.append(tuple(stack.where(owner, keys, fps, start, n_chunks)))
        longest = n_chunks
        for g in self.full:
            row = where[g]
            longest = min(longest, start + (row.index(None) if None in row else len(row)))
        bs, ct = self.layout.block_size, self.chunk_tokens
        last_full_block = (num_tokens - 1) // bs * bs
        ends: list[int] = []
        needed: dict[int, tuple[tuple[int, int], ...]] = {}
        for k in range(start + 1, longest + 1):
            parts_k = self.needed(start, k, min(k * ct, last_full_block))
            if all(where[g][c - start] is not None for c, g in parts_k):
                ends.append(k)
                needed[k] = parts_k
        hit = GroupHit(start, tuple(where), tuple(ends), needed)
        stack.settle_probes(owner, hit.managers(hit.longest))
        return hit

    def chunk_tiers(self, hit: GroupHit, end: int, stack: TierStack) -> list[TierManager]:
        """One tier per chunk of the hit ending at ``end``, for what counts
        chunks: the farthest its needed parts load from."""
        order = {m: i for i, m in enumerate(stack.tiers)}
        farthest: dict[int, TierManager] = {}
        for c, g in hit.needed.get(end, ()):
            m = hit.tier(c, g)
            if m is not None and (c not in farthest or order[m] > order[farthest[c]]):
                farthest[c] = m
        if not farthest:
            return []
        fill = farthest[max(farthest)]  # a chunk whose parts none of the hit needs loads nothing
        return [farthest.get(c, fill) for c in range(hit.start, end)]

    def windowed_counts(self, hit: GroupHit, end: int) -> Mapping[Tier, int] | None:
        """Windowed parts a hit ending at ``end`` loads, by tier (None: no whole hit ends there)."""
        if end not in hit.needed:
            return None
        counts: dict[Tier, int] = {}
        for c, g in hit.needed[end]:
            if g in self.windowed:
                m = hit.tier(c, g)
                assert m is not None
                counts[m.tier] = counts.get(m.tier, 0) + 1
        return counts

    def part(self, req: PartsKeyed, chunk: int, g: int) -> bytes:
        """The key of group ``g``'s part of the request's chunk ``chunk``."""
        return self.keys(req.keys, req.fps, req.parts, g, chunk + 1)[0][chunk]

    def plan_load(
        self,
        stack: TierStack,
        owner: Hashable,
        req: PartsRequest,
        group_ids: Sequence[Sequence[int]],
        start: int,
        end: int,
        promote: bool,
    ) -> PartsLoad:
        """The load of tokens [start, end) that vLLM allocated blocks for:
        each group's part of each chunk where vLLM wants pages (a windowed
        group's blocks below its window are vLLM's null block: not loaded).
        A part the lookup did not judge (vLLM shortened the hit, so a window
        starts earlier) loads from the nearest tier holding it now; where
        none does, its blocks fail, and vLLM recomputes from the first."""
        ct, bs = self.chunk_tokens, self.layout.block_size
        bpc = ct // bs
        first_chunk, end_chunk = start // ct, -(-end // ct)
        ghit = req.group_hit
        if ghit is None or ghit.start > first_chunk or end_chunk > ghit.longest:
            raise ValueError(f"{end - start} tokens exceed the planned hit")
        wanted: list[tuple[int, int, tuple[int, ...], int, int]] = []
        for c in range(first_chunk, end_chunk):
            for g, ids_all in enumerate(group_ids):
                ids = tuple(ids_all[c * bpc : (c + 1) * bpc])
                first = max(0, start // bs - c * bpc)
                last = min(bpc, -(-(end - c * ct) // bs))
                if len(ids) < last:
                    raise ValueError(f"group {g}'s blocks cannot hold chunk {c}")
                ids += (NULL_BLOCK,) * (bpc - len(ids))  # pages vLLM computes itself: never written
                while first < last and ids[first] == NULL_BLOCK:  # below the group's window
                    first += 1
                if first < last:
                    wanted.append((c, g, ids, first, last))
        found: dict[tuple[int, int], TierManager | None] = {}
        for c, g, *_ in wanted:
            m = ghit.tier(c, g)
            if m is None:
                keys, fps = self.keys(req.keys, req.fps, req.parts, g, c + 1)
                m = stack.where(owner, keys, fps, c, c + 1)[0]
            found[(c, g)] = m
        stack.release(owner, keep={m for m in found.values() if m is not None})
        # Hold every source first, so that promotions cannot evict a later part of this very hit.
        pins = [(m, self.part(req, c, g)) for (c, g), m in found.items() if m is not None]
        places = {pin: pin[0].prepare_load(pin[1]) for pin in pins}
        for m in stack.tiers:
            m.record_use([key for _, key in pins])
        load = PartsLoad(end, [], [], pins, {})
        order = {m: i for i, m in enumerate(stack.tiers)}
        for c, g, ids, first, last in wanted:
            m = found[(c, g)]
            if m is None:
                load.failed += ids[first:last]
                continue
            key = self.part(req, c, g)
            sources, promoted = stack.load(key, m, places[(m, key)], promote)
            load.chunks.append(LoadChunk(key, ids, first, last, sources, promoted, group=g))
            if c not in load.chunk_tiers or order[m] > order[load.chunk_tiers[c]]:
                load.chunk_tiers[c] = m
        return load

    def plan_stores(
        self, stack: TierStack, req: PartsRequest, group_ids: Sequence[Sequence[int]], chunk: int
    ) -> list[StoreChunk]:
        """Stores of every group's part of ``chunk`` whose pages a later hit
        can read are all still held by vLLM (a windowed group's far behind
        are freed: those parts are not promised); pages before those are
        stored as zeros."""
        bpc = self.chunk_tokens // self.layout.block_size
        out = []
        for g, ids_all in enumerate(group_ids):
            ids = tuple(ids_all[chunk * bpc : (chunk + 1) * bpc])
            first = self.layout.reach_start(g, chunk, self.chunk_tokens)
            if first == bpc or NULL_BLOCK in ids[first:]:
                continue
            key = self.part(req, chunk, g)
            targets, pinned = stack.store(key)
            if targets:
                out.append(StoreChunk(key, ids, targets, pinned, group=g, first_block=first))
        return out

    def prefetching(self, prefetcher: Prefetching, req: PartsKeyed, start: int, end: int) -> bool:
        """Is a part of chunks [start, end) of another group than the first
        being prefetched (the request's lookup waits for it)?"""
        return any(
            prefetcher.awaits(self.keys(req.keys, req.fps, req.parts, g, end)[0], start, end)
            for g in range(1, len(self.layout.groups))
        )

    def costs(self, hit: GroupHit, start: int) -> dict[str, Any]:
        """The cost model's view of a hit's parts (:meth:`CostModel.choose`'s ``full_parts``, ``windowed``)."""
        return {"full_parts": len(self.full), "windowed": lambda k: self.windowed_counts(hit, start + k)}


class Prefetching(Protocol):
    def awaits(self, keys: Sequence[bytes], start: int, end: int) -> bool: ...


def chunk_load(
    stack: TierStack,
    owner: Hashable,
    req: PartsRequest,
    block_ids: Sequence[int],
    start: int,
    end: int,
    chunk_tokens: int,
    block_size: int,
    promote: bool,
) -> PartsLoad:
    """The load of tokens [start, end) of a one-group model: each chunk of
    the lookup's hit (``req.hit``) from the tier it chose."""
    ct, bs = chunk_tokens, block_size
    bpc = ct // bs
    first_chunk, end_chunk = start // ct, -(-end // ct)
    tiers = req.hit[first_chunk - req.hit_start : end_chunk - req.hit_start]
    if len(tiers) != end_chunk - first_chunk:
        raise ValueError(f"{end - start} tokens exceed the planned hit")
    stack.release(owner, keep=tiers)  # vLLM may have trimmed the hit
    # Hold every source first, so that promotions cannot evict a later chunk of this very hit.
    pins = [(m, req.keys[c]) for c, m in zip(range(first_chunk, end_chunk), tiers, strict=True)]
    places = [m.prepare_load(key) for m, key in pins]
    for m in stack.tiers:
        m.record_use(req.keys[first_chunk:end_chunk])
    load = PartsLoad(end, [], [], pins, {})
    for c, m, place in zip(range(first_chunk, end_chunk), tiers, places, strict=True):
        ids = tuple(block_ids[c * bpc : (c + 1) * bpc])
        if len(ids) != bpc:
            raise ValueError(f"{len(block_ids)} blocks cannot hold chunk {c}")
        first = max(0, start // bs - c * bpc)
        last = min(bpc, -(-(end - c * ct) // bs))
        sources, promoted = stack.load(req.keys[c], m, place, promote)
        load.chunks.append(LoadChunk(req.keys[c], ids, first, last, sources, promoted))
        load.chunk_tiers[c] = m
    return load
