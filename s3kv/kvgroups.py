"""A model's KV cache groups, as s3kv shares them (free of vLLM).

vLLM's hybrid KV cache manager splits a model's attention layers into
groups of equally many layers, one attention kind per group (full,
sliding-window, chunked-local), each with its own block table: a sliding
window group of a request holds blocks only for the tokens its window can
still reach, the others are vLLM's null block (id 0).

s3kv stores a chunk as one object per group (each rank's shard of it): the
*part* of the chunk that group holds, keyed by :func:`part_key`. All parts
have the same shape, :attr:`GroupLayout.frames` frames of one chunk's pages
each: a group with fewer layers than that (vLLM pads the last group of a
kind) stores zero pages in its extra frames, so that every object, CPU slot
and NVMe file of a namespace is one size, as with a single group.

A hit of a prefix needs every full-attention group's parts of every chunk,
but a windowed group's parts only of the chunks its window reaches from the
hit's end (:meth:`GroupLayout.needs`); the other chunks' parts are never
loaded, so bytes loaded for a hit of a sliding-window model scale with its
full-attention layers plus the window. A Mamba group's part of a chunk holds
its state at the chunk's end (its last page; the others are zeros), stored
where vLLM kept that state, and a hit of k chunks loads only chunk k-1's.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

FULL = "full"
SLIDING = "sliding_window"
CHUNKED = "chunked_local"
MAMBA = "mamba"
"""Mamba / linear-attention state: a group whose block at a position holds
the state after exactly the tokens up to that block's end (vLLM's
``mamba_cache_mode="align"``); a hit needs only the state at its end."""
KINDS = (FULL, SLIDING, CHUNKED, MAMBA)

NULL_BLOCK = 0
"""vLLM's null block id: a block a windowed group does not hold."""


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: its attention kind and its layers."""

    kind: str
    layers: tuple[int, ...]
    """The group's layers, as indexes into the engine's layer order, in frame order."""
    window: int = 0
    """Sliding window: the tokens a query attends back over, including itself
    (and any tokens vLLM retains beyond it); chunked-local: the attention
    chunk size. 0 for full attention."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown KV cache group kind {self.kind!r}")
        if (self.kind in (FULL, MAMBA)) != (self.window == 0) or self.window < 0:
            raise ValueError(f"a {self.kind} group with window {self.window}")

    def skipped_tokens(self, computed: int) -> int:
        """Tokens before the first one that the next token's attention still
        reads, after ``computed`` tokens (vLLM's ``get_num_skipped_tokens``)."""
        if self.kind == SLIDING:
            return max(0, computed - self.window + 1)
        if self.kind == CHUNKED:
            return computed // self.window * self.window
        if self.kind == MAMBA:
            return max(0, computed - 1)
        return 0


@dataclass(frozen=True)
class GroupLayout:
    """The engine's KV cache groups, with one block size for all."""

    groups: tuple[KVGroup, ...]
    block_size: int

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a model with no KV cache group")

    @property
    def frames(self) -> int:
        """Frames of every part object: the most layers a group has."""
        return max(len(g.layers) for g in self.groups)

    @property
    def single(self) -> bool:
        """One full-attention group: parts are chunks, as before groups."""
        return len(self.groups) == 1 and self.groups[0].kind == FULL

    @property
    def has_state(self) -> bool:
        """Has a Mamba group: a hit must leave vLLM a token to compute (its
        state after the whole prompt cannot take the last token again)."""
        return any(g.kind == MAMBA for g in self.groups)

    @property
    def windowed(self) -> tuple[int, ...]:
        """The groups whose attention does not reach back to the first token."""
        return tuple(i for i, g in enumerate(self.groups) if g.kind != FULL)

    def first_block(self, g: int, end_tokens: int) -> int:
        """The first block of group ``g`` that a hit of ``end_tokens``
        tokens needs (vLLM allocates none below it)."""
        return self.groups[g].skipped_tokens(end_tokens) // self.block_size

    def needs(self, g: int, chunk: int, chunk_tokens: int, end_tokens: int) -> bool:
        """Does a hit of ``end_tokens`` tokens need group ``g``'s part of ``chunk``?"""
        bpc = chunk_tokens // self.block_size
        return (chunk + 1) * bpc > self.first_block(g, end_tokens)

    def reach_start(self, g: int, chunk: int, chunk_tokens: int) -> int:
        """The first page of ``chunk`` in group ``g`` that any hit ending at
        or after the chunk's end can need: the pages a store of the part
        must copy (a later hit's window starts later still)."""
        bpc = chunk_tokens // self.block_size
        return min(bpc, max(0, self.first_block(g, (chunk + 1) * chunk_tokens) - chunk * bpc))


def part_key(key: bytes, group: int) -> bytes:
    """The key of group ``group``'s part of the chunk keyed ``key``: the
    chunk's own key for group 0 (a one-group model's objects are its chunks,
    as before groups), a hash of it and the group's index for the others."""
    if group == 0:
        return key
    h = xxhash.xxh3_128()
    h.update(key)
    h.update(b"s3kv-group")
    h.update(group.to_bytes(4, "little"))
    return h.digest()
