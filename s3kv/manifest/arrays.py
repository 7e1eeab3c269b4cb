"""Sorted, unique ``uint64`` arrays of fingerprints, worked on with numpy:
the manifest's sets (:mod:`s3kv.manifest.keyset`), its objects' arrays
(:mod:`s3kv.manifest.format`) and replaying its log
(:mod:`s3kv.manifest.replay`) share them. No function writes to its
inputs: readers may hold them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

EMPTY = np.empty(0, dtype=np.uint64)
NO_STATE = np.empty(0, dtype=bool)


def as_array(values: Iterable[int] | np.ndarray) -> np.ndarray:
    if isinstance(values, np.ndarray):
        return values.astype(np.uint64, copy=False)
    return np.array(values if isinstance(values, (list, tuple)) else list(values), dtype=np.uint64)


def as_sorted_unique(values: Iterable[int] | np.ndarray) -> np.ndarray:
    arr = as_array(values)
    if len(arr) < 2 or (arr[1:] > arr[:-1]).all():  # already so (a snapshot): O(n), no sort
        return arr
    return np.unique(arr)


def positions(base: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where ``values`` (sorted, unique) go in ``base``, and which are there."""
    pos = np.searchsorted(base, values)
    found = np.zeros(len(values), dtype=bool)
    inside = pos < len(base)
    found[inside] = base[pos[inside]] == values[inside]
    return pos, found


def insert_sorted(base: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``base`` with ``values`` added, still sorted and unique: one O(n) copy,
    not a sort of millions of keys."""
    values = np.unique(values)
    pos, found = positions(base, values)
    return np.insert(base, pos[~found], values[~found])


def delete_sorted(base: np.ndarray, values: np.ndarray) -> np.ndarray:
    values = np.unique(values)
    pos, found = positions(base, values)
    return np.delete(base, pos[found]) if found.any() else base


def resolve(
    changes: Sequence[tuple[np.ndarray | Iterable[int], np.ndarray | Iterable[int]]],
) -> tuple[np.ndarray, np.ndarray]:
    """Bulk changes as one ``(fingerprints, present)`` pair, the fingerprints
    sorted and unique: what applying ``changes`` in order leaves, each
    ``(added, removed)`` adding, then removing; a later operation on a
    fingerprint beats an earlier one. New arrays, never the inputs."""
    if len(changes) == 1:
        added, removed = as_sorted_unique(changes[0][0]), as_sorted_unique(changes[0][1])
        if not len(removed):
            return (added.copy() if added is changes[0][0] else added), np.ones(len(added), dtype=bool)
        if not len(added):
            return (removed.copy() if removed is changes[0][1] else removed), np.zeros(
                len(removed), dtype=bool
            )
        added = added[~positions(removed, added)[1]]  # the removal comes second: it wins
        pos = np.searchsorted(added, removed)
        return np.insert(added, pos, removed), np.insert(np.ones(len(added), dtype=bool), pos, False)
    parts: list[np.ndarray] = []
    states: list[np.ndarray] = []
    for adds, removes in changes:
        a, r = as_array(adds), as_array(removes)
        parts += [a, r]
        states += [np.ones(len(a), dtype=bool), np.zeros(len(r), dtype=bool)]
    if not parts:
        return EMPTY, NO_STATE
    # Reversed, the first occurrence of a fingerprint is its last operation.
    fps, first = np.unique(np.concatenate(parts)[::-1], return_index=True)
    return fps, np.concatenate(states)[::-1][first]


def overlay(
    delta: np.ndarray, state: np.ndarray, fps: np.ndarray, present: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``(delta, state)`` with ``(fps, present)`` (sorted, unique) laid over
    it: where both name a fingerprint, ``present`` wins. New arrays; the
    inputs are never written to (readers may hold them)."""
    if not len(delta):
        return fps, present
    if not len(fps):
        return delta, state
    pos, found = positions(delta, fps)
    state = state.copy()
    state[pos[found]] = present[found]
    new = ~found
    if not np.count_nonzero(new):
        return delta, state
    return np.insert(delta, pos[new], fps[new]), np.insert(state, pos[new], present[new])


def apply_to(base: np.ndarray, fps: np.ndarray, present: np.ndarray) -> np.ndarray:
    """``base`` (sorted, unique) with ``fps[present]`` in it and ``fps[~present]``
    not: one search of ``fps`` through ``base``, at most two O(n) copies."""
    if not len(fps):
        return base
    pos, found = positions(base, fps)
    drop, add = found & ~present, ~found & present
    out = np.delete(base, pos[drop]) if drop.any() else base
    if add.any():
        at = pos[add]
        # Each deletion before an insertion point moves it one place down.
        out = np.insert(out, at - np.searchsorted(pos[drop], at), fps[add])
    return out


def lookup(arr: np.ndarray, fps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each of ``fps`` (any order) would be in ``arr`` (sorted, not
    empty), and which are there. Method calls and ``take(mode="clip")``, not
    ``np.searchsorted`` and ``np.minimum``: the hot path pays numpy's call
    overhead per call, which at 32 keys is most of the cost."""
    idx = arr.searchsorted(fps)
    return idx, arr.take(idx, mode="clip") == fps


MAX_WINDOW = 32
"""The longest bucket :class:`BucketIndex` scans whole (32 keys, 256 bytes);
fingerprints in longer buckets (only crafted ones make them) are searched."""


class BucketIndex:
    """Membership in a sorted, unique ``uint64`` array of random 64-bit
    fingerprints in ~3 cache misses a key instead of a binary search's ~24.

    The top ``k`` bits of a fingerprint name its bucket; ``2**k`` is about
    ``len(arr) / 4`` (2 to 4 keys a bucket), so the directory of where each
    bucket starts (uint32 below 2**32 keys: 1 to 2 bytes a key) is ~1/4 to
    1/2 the array's 8 bytes a key. A lookup of ``m`` fingerprints is a
    handful of numpy calls: the bucket starts, one gather of a fixed window
    of ``W`` keys from each (``W`` the longest bucket, no more than
    :data:`MAX_WINDOW`), one compare. A binary search would do the same work
    but its loads depend on each other; these go out together.

    Built once per array, never changed: readers share it lock-free with
    the array it indexes (a new array, a new index)."""

    __slots__ = ("arr", "nbytes", "_shift", "_starts", "_rows", "_long")

    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr
        n = len(arr)
        self.nbytes = 0
        if not n:
            return
        k = max(1, ((n + 3) // 4 - 1).bit_length())  # ceil(log2(n / 4)), at least one bit
        self._shift = np.uint64(64 - k)
        # Each bucket's start: where ``arr`` reaches ``bucket << shift``; one
        # counting pass (a search of every bucket's bound takes 6x longer).
        lens = np.bincount((arr >> self._shift).astype(np.intp), minlength=1 << k)
        bounds = np.cumsum(lens) - lens
        width = min(int(lens.max()), MAX_WINDOW)
        self._long = np.flatnonzero(lens > width).astype(np.uint64)
        """Buckets longer than the window, sorted: searched instead."""
        # Each window starts no later than len - width, so every gather is in
        # bounds and still covers its bucket (which ends by len).
        self._starts = np.minimum(bounds, n - width).astype(np.uint32 if n < 1 << 32 else np.int64)
        self._rows = np.lib.stride_tricks.sliding_window_view(arr, width)
        """Row i is arr[i : i + width], a view: no copy."""
        self.nbytes = int(self._starts.nbytes + self._long.nbytes)

    def present(self, fps: np.ndarray) -> np.ndarray:
        """Which of ``fps`` (uint64, any order) are in the array."""
        return self.find(fps)[0]

    def find(self, fps: np.ndarray) -> tuple[np.ndarray, bool]:
        """(which of ``fps`` are in the array, whether all of them are)."""
        if not self.nbytes:
            return np.zeros(len(fps), dtype=bool), not len(fps)
        buckets = fps >> self._shift
        eq = self._rows[self._starts.take(buckets)] == fps[:, None]
        # A row holds a fingerprint at most once (the array is unique): as
        # many matches as rows is every one found, without the per-row reduce
        # (a stored prefix's lookup, the common case).
        if np.count_nonzero(eq) == len(fps):
            return np.ones(len(fps), dtype=bool), True
        # The ufunc's reduce, not ``any(1)``: that is a Python wrapper around it.
        hit = np.logical_or.reduce(eq, 1)
        long = self._long
        if len(long):
            at = long.take(long.searchsorted(buckets), mode="clip") == buckets
            if np.count_nonzero(at):
                hit[at] = lookup(self.arr, fps[at])[1]
                return hit, bool(np.count_nonzero(hit) == len(hit))
        return hit, False

    def __contains__(self, fp: int) -> bool:
        if not self.nbytes:
            return False
        bucket = fp >> int(self._shift)
        if len(self._long) and bucket in self._long:
            i = int(self.arr.searchsorted(np.uint64(fp)))
            return i < len(self.arr) and int(self.arr[i]) == fp
        return fp in self._rows[int(self._starts[bucket])].tolist()


NO_INDEX = BucketIndex(EMPTY)
