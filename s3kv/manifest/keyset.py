"""The hot manifest in memory: which chunks S3 holds, as 64-bit fingerprints.

``get_num_new_matched_tokens`` asks it for a request's whole chain of chunk
keys at once, so it must answer from memory, fast, for millions of keys. A
:class:`FingerprintSet` keeps a sorted ``uint64`` array (8 bytes a key) plus
two small Python sets of recent additions and removals; :meth:`merge` folds
the sets into a new array off the hot path and swaps it in.

A fingerprint is the first 8 bytes of a 16-byte chunk key. Two keys sharing
one (odds ~n/2^64 a lookup) only cost a failed load: objects are named by the
full key, so a wrong fingerprint can never load wrong KV.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

from s3kv.keys import fingerprint

EMPTY = np.empty(0, dtype=np.uint64)


def fingerprints(keys: Sequence[bytes]) -> np.ndarray:
    """The fingerprints of ``keys`` as a uint64 array (one pass, no Python loop per key)."""
    if not keys:
        return EMPTY
    return np.frombuffer(b"".join(k[:8] for k in keys), dtype=">u8").astype(np.uint64)


def as_sorted_unique(values: Iterable[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=np.uint64)
    if len(arr) < 2 or (arr[1:] > arr[:-1]).all():  # already so (a snapshot): O(n), no sort
        return arr
    return np.unique(arr)


def _positions(base: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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
    pos, found = _positions(base, values)
    return np.insert(base, pos[~found], values[~found])


def delete_sorted(base: np.ndarray, values: np.ndarray) -> np.ndarray:
    values = np.unique(values)
    pos, found = _positions(base, values)
    return np.delete(base, pos[found]) if found.any() else base


class FingerprintSet:
    """A set of uint64 fingerprints: many writers (under a lock), lock-free
    readers. An fp is present if it was added since the last merge, or is in
    the array and was not removed since."""

    def __init__(self, merge_at: int = 1 << 16) -> None:
        self.merge_at = merge_at
        self._base = EMPTY
        self._added: set[int] = set()
        self._removed: set[int] = set()
        self._n = 0
        """Members, kept exact by the writers (a merge changes none)."""
        self.epoch = 0
        """Bumped by every change that may remove members: a reader that saw
        a fingerprint present at an epoch knows it still is while that lasts."""
        self._lock = threading.Lock()
        self._merge_lock = threading.Lock()

    # -- reads ---------------------------------------------------------------------
    def __contains__(self, fp: int) -> bool:
        if fp in self._added:
            return True
        if fp in self._removed:
            return False
        base = self._base
        i = int(np.searchsorted(base, np.uint64(fp)))
        return i < len(base) and int(base[i]) == fp

    def present(self, fps: np.ndarray) -> np.ndarray:
        """A bool array: which of ``fps`` are present (one vectorised pass)."""
        # The sets before the array: a merge swapping both in between then
        # only makes the sets repeat what the new array already says.
        added, removed = self._added, self._removed
        base = self._base
        if len(base):
            idx = np.searchsorted(base, fps)
            np.minimum(idx, len(base) - 1, out=idx)
            hit = base[idx] == fps
        else:
            hit = np.zeros(len(fps), dtype=bool)
        if added or removed:
            for i, fp in enumerate(fps.tolist()):
                if fp in added:
                    hit[i] = True
                elif fp in removed:
                    hit[i] = False
        return hit

    def __len__(self) -> int:
        return self._n

    def _count_present(self, fps: list[int]) -> int:
        return int(self.present(np.array(fps, dtype=np.uint64)).sum()) if fps else 0

    @property
    def nbytes(self) -> int:
        """Memory held, roughly: the array plus ~40 bytes per set entry."""
        return int(self._base.nbytes) + 40 * (len(self._added) + len(self._removed))

    def array(self) -> np.ndarray:
        """Every present fingerprint, sorted (a merge)."""
        self.merge()
        return self._base

    # -- writes --------------------------------------------------------------------
    def add(self, fp: int) -> None:
        with self._lock:
            if fp not in self:
                self._n += 1
            self._removed.discard(fp)
            self._added.add(fp)

    def discard(self, fp: int) -> None:
        with self._lock:
            was = fp in self
            if was:
                self._n -= 1
            self._added.discard(fp)
            self._removed.add(fp)
            if was:  # last: a reader that sees the new epoch sees the removal
                self.epoch += 1

    def update(self, fps: np.ndarray | Iterable[int], removed: np.ndarray | Iterable[int] = ()) -> None:
        """Add ``fps``, then remove ``removed`` (a manifest segment)."""
        add_list = list(set(fps.tolist() if isinstance(fps, np.ndarray) else fps))
        del_list = list(set(removed.tolist() if isinstance(removed, np.ndarray) else removed))
        with self._lock:
            self._n += len(add_list) - self._count_present(add_list)
            self._removed.difference_update(add_list)
            self._added.update(add_list)
            self._n -= self._count_present(del_list)
            self._added.difference_update(del_list)
            self._removed.update(del_list)
            if del_list:
                self.epoch += 1

    def replace(self, fps: np.ndarray) -> None:
        """Start over from a snapshot (sorted, unique); later changes survive."""
        with self._merge_lock, self._lock:
            self._base = fps.astype(np.uint64, copy=False)
            in_base = self._base
            added = np.fromiter(self._added, dtype=np.uint64, count=len(self._added))
            removed = np.fromiter(self._removed, dtype=np.uint64, count=len(self._removed))
            self._n = (
                len(in_base)
                + int((~_positions(in_base, added)[1]).sum() if len(added) else 0)
                - int(_positions(in_base, removed)[1].sum() if len(removed) else 0)
            )
            self.epoch += 1

    def needs_merge(self) -> bool:
        return len(self._added) + len(self._removed) >= self.merge_at

    def merge(self) -> None:
        """Fold the recent sets into the array. Runs off the scheduling
        thread; writers are blocked only to copy and trim the sets."""
        with self._merge_lock:
            with self._lock:
                added, removed = set(self._added), set(self._removed)
            base = self._base
            if added:
                base = insert_sorted(base, np.fromiter(added, dtype=np.uint64, count=len(added)))
            if removed:
                base = delete_sorted(base, np.fromiter(removed, dtype=np.uint64, count=len(removed)))
            with self._lock:
                self._base = base
                # What changed while merging stays in the sets: identities
                # tell the merged members from the newer ones.
                self._added = self._added - added
                self._removed = self._removed - removed


class Manifest:
    """The bytes-key face of a :class:`FingerprintSet`: what the planner asks
    (``key in manifest``, ``present(keys)``) and tells (``add``, ``discard``)."""

    def __init__(self, merge_at: int = 1 << 16) -> None:
        self.fps = FingerprintSet(merge_at)
        self.journal: Journal | None = None
        """Told of this replica's own additions and uses, to publish them."""

    def __contains__(self, key: bytes) -> bool:
        return fingerprint(key) in self.fps

    def __len__(self) -> int:
        return len(self.fps)

    @property
    def epoch(self) -> int:
        """See :attr:`FingerprintSet.epoch`."""
        return self.fps.epoch

    def present_fps(self, fps: np.ndarray) -> np.ndarray:
        return self.fps.present(fps)

    def present(self, keys: Sequence[bytes]) -> np.ndarray:
        return self.fps.present(fingerprints(keys))

    def add(self, key: bytes) -> None:
        """This replica stored ``key`` (or found it stored): the fleet learns of it."""
        fp = fingerprint(key)
        self.fps.add(fp)
        if self.journal is not None:
            self.journal.stored(fp)

    def update(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self.add(key)

    def discard(self, key: bytes) -> None:
        """Forget ``key`` here only (its object turned out missing or corrupt)."""
        self.fps.discard(fingerprint(key))

    def touch(self, keys: Sequence[bytes]) -> None:
        """These chunks were used: recorded for gc's least-recently-used policy."""
        if self.journal is not None and keys:
            self.journal.used(fingerprints(keys))


class Journal(Protocol):
    def stored(self, fp: int) -> None: ...

    def used(self, fps: np.ndarray) -> None: ...
