"""How a chunk part is cut into objects (*shards*), and which of them each
tensor-parallel rank holds and writes (free of vLLM).

Three ways, decided once per namespace (:func:`choose`):

- ``heads``: a part is cut by KV head into :attr:`Slicing.shards` slices of
  :attr:`Slicing.heads_per_shard` heads each, whatever the TP size: shard
  ``s`` holds heads ``[s*q, (s+1)*q)`` of every frame. A rank holds the
  slices of the heads it owns and stores and loads exactly those, so TP 1,
  2, 4 and 8 replicas of one model read what any of them wrote (where the
  namespace leaves the TP size out: the config's ``share_across_tp``). A
  head that several ranks hold (fewer KV heads than ranks) is written by
  the first of them only and read by all.
- ``replicated``: every rank holds the same page (MLA's latent KV): one
  shard, written by rank 0, read by every rank.
- ``ranks``: the page's heads cannot be cut (a layout s3kv does not know,
  Mamba state sharded across ranks): one shard per rank, as before, and the
  namespace keeps the TP size.

Slices are at most :data:`MAX_SHARDS` per part (several heads a slice for
models with more KV heads): each shard is an object, a PUT and a GET, and
a TP 1 replica would otherwise pay one per head for a model with 32 or 64
KV heads. Eight slices let TP 1 to 8 share, the sizes fleets deploy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

HEADS = "heads"
REPLICATED = "replicated"
RANKS = "ranks"

MAX_SHARDS = 8
"""The most slices a part is cut into (a power of two: TP sizes are)."""


@dataclass(frozen=True)
class Slicing:
    """How a namespace's parts are cut into shards."""

    mode: str
    shards: int
    """Objects per part (per chunk with one KV cache group)."""
    heads_per_shard: int = 0
    """``heads``: KV heads in each shard; 0 otherwise."""

    @property
    def per_rank(self) -> bool:
        """One shard per rank (heads not cut, nothing stored once): the namespace must keep its TP size."""
        return self.mode == RANKS

    def field(self) -> dict[str, Any] | None:
        """The namespace field ``kv_shards`` (None in ``ranks`` mode: those
        namespaces keep ``tp_size`` and are what they were before slicing)."""
        if self.mode == RANKS:
            return None
        return {"mode": self.mode, "shards": self.shards, "heads_per_shard": self.heads_per_shard}


@dataclass(frozen=True)
class ShardRole:
    """One shard a rank holds: which object, where in the rank's pages, and
    whether this rank writes it to the tiers replicas share."""

    index: int
    """The shard's index: the ``r{index}`` of its object's name, and its header's rank."""
    head_offset: int = 0
    """First of the rank's local KV heads in the shard (``heads`` mode)."""
    heads: int = 0
    """Local KV heads in the shard; 0: the whole page."""
    writer: bool = True
    """This rank writes the shard to NVMe and S3; False: another rank holds
    the same bytes and writes them (the rank still loads it, and keeps it in
    its own CPU tier)."""


def ranks(tp_size: int) -> Slicing:
    """One shard per rank (heads not cut: the namespace keeps the TP size)."""
    return Slicing(RANKS, tp_size)


def choose(*, total_heads: int | None, tp_size: int, replicated: bool, sliceable: bool) -> Slicing:
    """How to cut the parts of a model with ``total_heads`` KV heads (None:
    no heads, e.g. a Mamba state) at TP ``tp_size``: ``replicated`` when
    every rank holds the same page, ``heads`` when ``sliceable`` (every
    group's page is KV heads whose bytes do not depend on the TP size) and
    each rank's heads are whole slices, else ``ranks``."""
    if tp_size < 1:
        raise ValueError(f"tp_size {tp_size}")
    if replicated:
        return Slicing(REPLICATED, 1)
    if not sliceable or not total_heads or total_heads < 1:
        return ranks(tp_size)
    shards = math.gcd(total_heads, MAX_SHARDS)
    per_shard = total_heads // shards
    local = max(1, total_heads // tp_size)
    if total_heads % tp_size and tp_size % total_heads:
        return ranks(tp_size)  # heads not spread evenly over the ranks (vLLM refuses it anyway)
    if local % per_shard:
        return ranks(tp_size)  # a rank holds part of a slice: it could not write it whole
    return Slicing(HEADS, shards, per_shard)


def roles(
    slicing: Slicing, *, tp_size: int, rank: int, total_heads: int | None = None
) -> tuple[ShardRole, ...]:
    """The shards rank ``rank`` of ``tp_size`` holds under ``slicing``, in
    the order of its local heads."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} of {tp_size}")
    if slicing.mode == RANKS:
        return (ShardRole(rank),)
    if slicing.mode == REPLICATED:
        return (ShardRole(0, writer=rank == 0),)
    if total_heads is None or total_heads % slicing.shards:
        raise ValueError(f"{total_heads} KV heads cannot be cut into {slicing.shards} slices")
    q = slicing.heads_per_shard
    if total_heads >= tp_size:  # each rank its own heads
        local = total_heads // tp_size
        first = rank * local
        return tuple(ShardRole((first + h) // q, h, q) for h in range(0, local, q))
    # Fewer heads than ranks: vLLM gives each rank one head, held by tp_size/total_heads ranks.
    holders = tp_size // total_heads
    head = rank // holders
    return (ShardRole(head // q, 0, 1, writer=rank % holders == 0),)


def writers(slicing: Slicing, tp_size: int, total_heads: int | None = None) -> list[int]:
    """The ranks that write some shard: each publishes the chunks it stored,
    and a chunk is in the shared tiers once every one of them did."""
    return [
        r
        for r in range(tp_size)
        if any(role.writer for role in roles(slicing, tp_size=tp_size, rank=r, total_heads=total_heads))
    ]
