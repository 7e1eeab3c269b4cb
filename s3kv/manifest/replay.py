"""Replaying the manifest log: what a snapshot and the segments after it
say is live. Replicas (:class:`~s3kv.manifest.sync.ManifestSync`) and gc's
compaction (:mod:`s3kv.ops.compaction`) both read the log through here, so
they agree on what it says.

The rules: segments apply in name order (the order given), each adding its
fingerprints, then removing its removals, so a later segment beats an
earlier one; a rank segment's chunks count once every rank has named them
(:class:`~s3kv.manifest.ranks.RankTally`), and a removal forgets a chunk
still waiting for ranks (its objects were deleted: the chunk is not whole
until they are stored again).

Pure: no I/O. The caller reads and checks the objects (a segment whose
rank fields are nonsense is garbage, skipped before it gets here)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from s3kv.manifest import format as mf
from s3kv.manifest.arrays import EMPTY, apply_to, as_sorted_unique, resolve
from s3kv.manifest.ranks import RankTally, rank_fields

Change = tuple[np.ndarray, np.ndarray]
"""One segment's effect: (fingerprints it adds, fingerprints it removes)."""


def changes(segments: Iterable[tuple[str, mf.ManifestObject]], tally: RankTally) -> list[Change]:
    """What each of ``segments`` (name, object) does, in the order given:
    a rank segment adds only the chunks every rank has now named, counted
    in ``tally`` (which keeps those still waiting, across calls)."""
    out: list[Change] = []
    for name, obj in segments:
        ranks = rank_fields(obj.meta)
        added = obj.added if ranks is None else tally.add(name, *ranks, obj.added.tolist())
        if len(obj.removed):
            tally.discard(obj.removed.tolist())
        out.append((added, obj.removed))
    return out


def replay(
    snapshot: np.ndarray | Iterable[int],
    segments: Iterable[tuple[str, mf.ManifestObject]],
    tally: RankTally | None = None,
) -> np.ndarray:
    """The live fingerprints, sorted and unique: ``snapshot``'s, with the
    :func:`changes` of ``segments`` applied in order. ``tally``: chunks
    already waiting for ranks (a fresh one by default); it is updated."""
    fps, present = resolve(changes(segments, RankTally() if tally is None else tally))
    return apply_to(as_sorted_unique(snapshot), fps, present)


def bad_removals(obj: mf.ManifestObject) -> np.ndarray:
    """The fingerprints a segment reports bad (their objects are corrupt and
    its writer could not delete them): its removals, when its header lists
    the bad objects (``meta["bad"]``); none otherwise. Replicas never
    publish those from a 412."""
    bad = obj.meta.get("bad")
    if bad and isinstance(bad, list) and len(obj.removed) <= len(bad):
        return obj.removed
    return EMPTY
