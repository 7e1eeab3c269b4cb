"""Rank segments: with TP > 1 every rank publishes its own shards, and a
chunk counts only once every rank's segment has named it.

A rank segment says so in its header (``meta["rank"]``, ``meta["ranks"]``,
:func:`rank_fields`); readers (replicas and gc's compaction, through
:func:`~s3kv.manifest.replay.replay`) keep the chunks some ranks named in a
:class:`RankTally` until the others do."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from s3kv.errors import CorruptManifest
from s3kv.manifest.arrays import as_sorted_unique

MAX_RANKS = 64
"""A rank segment naming more ranks than this is garbage."""
PARTIAL_TTL_MS = 15 * 60 * 1000
"""A chunk some ranks published but the others never did after this long
is forgotten (a rank's PUT failed: the chunk is not whole)."""


def rank_fields(meta: dict[str, object]) -> tuple[int, int] | None:
    """A rank segment's (rank, ranks) when it has more than one rank; None
    for an ordinary segment. Raises CorruptManifest for nonsense."""
    if "ranks" not in meta and "rank" not in meta:
        return None
    rank, ranks = meta.get("rank"), meta.get("ranks")
    if (
        not isinstance(rank, int)
        or not isinstance(ranks, int)
        or isinstance(rank, bool)
        or isinstance(ranks, bool)
        or not 0 <= rank < ranks <= MAX_RANKS
    ):
        raise CorruptManifest(f"rank segment with rank {rank!r} of {ranks!r}")
    return (rank, ranks) if ranks > 1 else None


class RankTally:
    """Chunks named by some ranks' segments but not yet by all: a chunk
    becomes live once every rank has named it. Remembers, per chunk, the
    first segment that named it, so a snapshot's horizon stays before it
    (a reader starting from that snapshot reads that segment again)."""

    def __init__(self, held: Callable[[int], Iterable[int]] | None = None) -> None:
        self._partial: dict[int, tuple[int, int, str]] = {}
        """fingerprint -> (ranks' bit mask, ranks, first segment's name)."""
        self._held = held
        """The ranks known to hold a chunk's shard besides what segments say
        (gc: the rank objects its listing holds), counted as named."""

    def __len__(self) -> int:
        return len(self._partial)

    def add(self, name: str, rank: int, ranks: int, fps: Iterable[int]) -> np.ndarray:
        """Segment ``name`` of ``rank`` (of ``ranks``) named ``fps``: the
        fingerprints that are now whole."""
        full = (1 << ranks) - 1
        whole: list[int] = []
        for fp in fps:
            mask, _, first = self._partial.get(fp, (0, ranks, name))
            mask |= 1 << rank
            for held in self._held(fp) if self._held is not None else ():
                if held < ranks:
                    mask |= 1 << held
            if mask == full:
                self._partial.pop(fp, None)
                whole.append(fp)
            else:
                self._partial[fp] = (mask, ranks, min(first, name))
        return as_sorted_unique(whole)

    def discard(self, fps: Iterable[int]) -> None:
        for fp in fps:
            self._partial.pop(fp, None)

    def oldest(self) -> str | None:
        """The name of the oldest segment a partial chunk depends on."""
        return min((first for _, _, first in self._partial.values()), default=None)

    def expire(self, before: str) -> int:
        """Forget chunks whose first segment sorts before ``before``."""
        old = [fp for fp, (_, _, first) in self._partial.items() if first < before]
        for fp in old:
            del self._partial[fp]
        return len(old)
