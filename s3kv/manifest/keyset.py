"""The hot manifest in memory: which chunks S3 holds, as 64-bit fingerprints.

``get_num_new_matched_tokens`` asks it for a request's whole chain of chunk
keys at once, so it must answer from memory, fast, for millions of keys. A
:class:`FingerprintSet` answers from three layers, newest first:

- two small Python sets of this replica's own single changes (a key it
  stored, a key it dropped), newer than everything below;
- a *delta*: a sorted ``uint64`` array of the fingerprints that bulk updates
  (the fleet's manifest segments) changed, with a parallel bool array saying
  whether each is now present;
- the *base*: a sorted ``uint64`` array of the members as of the last merge
  (8 bytes a key), with a :class:`~s3kv.manifest.arrays.BucketIndex` over it
  (1 to 2 bytes a key) that answers a lookup in ~3 cache misses a key
  instead of a binary search's ~24: the first lookup of a prefix at 10M
  keys waits on these.

Segments are applied with numpy (sorting, ``searchsorted``), never through
Python sets of ints; :meth:`merge` folds the delta and the sets into a new
base off the hot path and swaps it in.

A fingerprint is the first 8 bytes of a 16-byte chunk key. Two keys sharing
one (odds ~n/2^64 a lookup) only cost a failed load: objects are named by the
full key, so a wrong fingerprint can never load wrong KV.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from s3kv.keys import fingerprint
from s3kv.manifest.arrays import (
    EMPTY,
    NO_INDEX,
    NO_STATE,
    BucketIndex,
    apply_to,
    lookup,
    overlay,
    positions,
    resolve,
)
from s3kv.manifest.bad import BadRecords


def fingerprints(keys: Sequence[bytes]) -> np.ndarray:
    """The fingerprints of ``keys`` as a uint64 array (one pass, no Python loop per key)."""
    if not keys:
        return EMPTY
    return np.frombuffer(b"".join(k[:8] for k in keys), dtype=">u8").astype(np.uint64)


def _set_array(s: set[int]) -> np.ndarray:
    return np.sort(np.fromiter(s, dtype=np.uint64, count=len(s)))


class _View(NamedTuple):
    """What readers see of the arrays, swapped in whole: never torn, never written to."""

    base: np.ndarray
    """Sorted, unique: the members as of the last merge (or snapshot)."""
    delta: np.ndarray
    """Sorted, unique: fingerprints bulk updates changed since."""
    state: np.ndarray
    """Parallel to ``delta``: whether each is present now."""
    buckets: BucketIndex
    """Over ``base``: made with it, replaced with it."""

    def present(self, fps: np.ndarray) -> np.ndarray:
        _, delta, state, index = self
        hit = index.present(fps)
        if len(delta):
            idx, found = lookup(delta, fps)
            if np.count_nonzero(found):
                hit[found] = state[idx[found]]
        return hit


class FingerprintSet:
    """A set of uint64 fingerprints: many writers (under a lock), lock-free
    readers. An fp is present if the sets say so (added or removed since the
    last merge, by :meth:`add` and :meth:`discard`); else if the delta says
    so (a bulk update since the last merge); else if it is in the base.

    Bulk writers (:meth:`update`, :meth:`update_many`, :meth:`replace`) and
    :meth:`merge` exclude each other and hold the writers' lock only for
    the work on the small sets, not while searching millions of keys:
    :meth:`add` and :meth:`discard`, called from vLLM's scheduling loop,
    never wait for numpy work on a large array."""

    def __init__(self, merge_at: int = 1 << 16) -> None:
        self.merge_at = merge_at
        self._view = _View(EMPTY, EMPTY, NO_STATE, NO_INDEX)
        self._added: set[int] = set()
        self._removed: set[int] = set()
        """Single changes, each newer than the delta's and the base's word on
        that fp; an fp is in at most one of the two."""
        self._n = 0
        """Members, kept exact by the writers (a merge changes none)."""
        self.epoch = 0
        """Bumped by every change that may remove members: a reader that saw
        a fingerprint present at an epoch knows it still is while that lasts."""
        self._lock = threading.Lock()
        self._merge_lock = threading.Lock()
        """Held by merges and bulk writers: the view changes only under it."""

    # -- reads ---------------------------------------------------------------------
    # Readers take the sets before the view, and writers swap the view before
    # the sets: a reader that sees new sets sees the new view, and old sets
    # over a new view only repeat what the sets said before the change.
    def __contains__(self, fp: int) -> bool:
        if fp in self._added:
            return True
        if fp in self._removed:
            return False
        _, delta, state, index = self._view
        if len(delta):
            i = int(delta.searchsorted(np.uint64(fp)))
            if i < len(delta) and int(delta[i]) == fp:
                return bool(state[i])
        return fp in index

    def present(self, fps: np.ndarray) -> np.ndarray:
        """A bool array: which of ``fps`` are present (one vectorised pass)."""
        added, removed = self._added, self._removed
        _, delta, state, index = self._view
        # _View.present, inlined: a Python call costs as much as a numpy one here.
        hit, every = index.find(fps)
        if len(delta):
            idx = delta.searchsorted(fps)
            found = delta.take(idx, mode="clip") == fps
            if np.count_nonzero(found):
                hit[found] = state[idx[found]]
                every = np.count_nonzero(hit) == len(hit)
        # An fp in ``added`` is present and one in ``removed`` absent, whatever
        # the arrays say: with nothing removed and every fp found (a stored
        # prefix's lookup, the common case) ``added`` could change nothing,
        # and asking it costs a cache miss a fp while it is large.
        if removed or (added and not every):
            values = fps.tolist()
            if not (added.isdisjoint(values) and removed.isdisjoint(values)):
                for i, fp in enumerate(values):
                    if fp in added:
                        hit[i] = True
                    elif fp in removed:
                        hit[i] = False
        return hit

    def __len__(self) -> int:
        return self._n

    @property
    def nbytes(self) -> int:
        """Memory held, roughly: the arrays and the base's index plus ~40 bytes per set entry."""
        base, delta, state, index = self._view
        return int(base.nbytes + delta.nbytes + state.nbytes + index.nbytes) + 40 * (
            len(self._added) + len(self._removed)
        )

    def array(self) -> np.ndarray:
        """Every present fingerprint, sorted (a merge)."""
        self.merge()
        return self._view.base

    # -- single changes (this replica's own) -----------------------------------------
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

    # -- bulk changes (the fleet's segments, snapshots) ------------------------------
    def update(self, fps: np.ndarray | Iterable[int], removed: np.ndarray | Iterable[int] = ()) -> None:
        """Add ``fps``, then remove ``removed`` (a manifest segment)."""
        self.update_many([(fps, removed)])

    def update_many(
        self, changes: Sequence[tuple[np.ndarray | Iterable[int], np.ndarray | Iterable[int]]]
    ) -> None:
        """Apply ``(added, removed)`` pairs in order, as :meth:`update` one at
        a time would (manifest segments, in name order), in one pass."""
        fps, present = resolve(changes)
        if not len(fps):
            return
        with self._merge_lock:
            view = self._view  # only this lock's holders replace it
            # All that is O(len(fps)) happens here, before the writers' lock.
            before = view.present(fps)  # the arrays' word; the sets' is added below
            gained = int(np.count_nonzero(present & ~before))
            lost = int(np.count_nonzero(before & ~present))
            # Every change is kept until a merge, even one the base already
            # agrees with: a snapshot replacing the base keeps it (replace).
            delta, state = overlay(view.delta, view.state, fps, present)
            with self._lock:
                # The fps the sets hold: their word was the newest, and is
                # older than this change now. O(len(sets)), the sets are small.
                added, removed = self._added, self._removed
                touched: list[set[int]] = []
                for members, was in ((added, True), (removed, False)):
                    pos, values = self._held(fps, members)
                    if len(pos):
                        b, p = before[pos], present[pos]
                        gained -= int(np.count_nonzero(p & ~b))
                        lost -= int(np.count_nonzero(b & ~p))
                        if was:
                            lost += int(np.count_nonzero(~p))
                        else:
                            gained += int(np.count_nonzero(p))
                    touched.append(values)
                self._n += gained - lost
                self._view = _View(view.base, delta, state, view.buckets)
                if touched[0]:
                    self._added = added - touched[0]
                if touched[1]:
                    self._removed = removed - touched[1]
                if lost:
                    self.epoch += 1

    @staticmethod
    def _held(fps: np.ndarray, members: set[int]) -> tuple[np.ndarray, set[int]]:
        """Where in ``fps`` the ``members`` of one set are, and which they are."""
        if not members:
            return np.empty(0, dtype=np.intp), set()
        arr = _set_array(members)
        pos, found = positions(fps, arr)
        if not np.count_nonzero(found):
            return np.empty(0, dtype=np.intp), set()
        return pos[found], set(arr[found].tolist())

    def replace(self, fps: np.ndarray) -> None:
        """Start over from a snapshot (sorted, unique); later changes survive."""
        base = fps.astype(np.uint64, copy=False)  # the set keeps it: never written to
        with self._merge_lock:
            view = self._view
            n = len(base)
            index = BucketIndex(base)
            if len(view.delta):
                in_base = index.present(view.delta)
                n += int(np.count_nonzero(view.state & ~in_base)) - int(
                    np.count_nonzero(~view.state & in_base)
                )
            new = _View(base, view.delta, view.state, index)
            with self._lock:
                for members, value in ((self._added, True), (self._removed, False)):
                    if members:
                        below = new.present(_set_array(members))
                        n += int(np.count_nonzero(~below)) if value else -int(np.count_nonzero(below))
                self._view = new
                self._n = n
                self.epoch += 1

    # -- merging ---------------------------------------------------------------------
    def needs_merge(self) -> bool:
        return len(self._added) + len(self._removed) + len(self._view.delta) >= self.merge_at

    def merge(self) -> None:
        """Fold the delta and the sets into a new base. Runs off the
        scheduling thread; single writers are blocked only to copy and trim
        the sets."""
        with self._merge_lock:
            view = self._view
            with self._lock:
                added, removed = set(self._added), set(self._removed)
            if not (added or removed or len(view.delta)):
                return
            ops = (
                resolve([(_set_array(added), _set_array(removed))]) if added or removed else (EMPTY, NO_STATE)
            )
            base = apply_to(view.base, *overlay(view.delta, view.state, *ops))
            index = BucketIndex(base)  # before the lock: O(len(base))
            with self._lock:
                self._view = _View(base, EMPTY, NO_STATE, index)
                # What changed while merging stays in the sets: values tell
                # the merged members from the newer ones (only single
                # writers ran meanwhile, and each leaves an fp in one set).
                self._added = self._added - added
                self._removed = self._removed - removed


class Manifest:
    """The bytes-key face of a :class:`FingerprintSet`: what the planner asks
    (``key in manifest``, ``present(keys)``) and tells (``add``, ``discard``)."""

    def __init__(self, merge_at: int = 1 << 16) -> None:
        self.fps = FingerprintSet(merge_at)
        self.sync: Sync | None = None
        """Told of this replica's own additions, uses and bad objects, to
        publish them to the fleet (a :class:`~s3kv.manifest.sync.ManifestSync`)."""
        self.bad = BadRecords()
        """Chunks some replica found corrupt in S3 and could not delete: a
        store that finds such an object there (a 412) must not publish it
        (``s3kv gc`` deletes them; a new object is published as usual).
        Snapshots carry them."""

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

    def add(self, key: bytes, *, publish: bool = True) -> None:
        """This replica stored ``key`` (or found it stored): the fleet learns
        of it, from here unless ``publish`` is False (its workers published it)."""
        fp = fingerprint(key)
        self.fps.add(fp)
        if publish and self.sync is not None:
            self.sync.stored(fp)

    def update(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self.add(key)

    def discard(self, key: bytes) -> None:
        """Forget ``key`` here only (its object turned out missing or corrupt)."""
        self.fps.discard(fingerprint(key))

    def is_bad(self, key: bytes) -> bool:
        return fingerprint(key) in self.bad

    def quarantine(self, key: bytes, name: str, etag: str | None) -> None:
        """This replica found ``key``'s object ``name`` corrupt and could not
        delete it: forget it, and tell the fleet (a bad record)."""
        fp = fingerprint(key)
        self.bad.add(fp)
        self.bad.record(name, etag)
        self.fps.discard(fp)
        if self.sync is not None:
            self.sync.bad(fp, name, etag)

    def touch(self, keys: Sequence[bytes]) -> None:
        """These chunks were used: recorded for gc's least-recently-used policy."""
        if self.sync is not None and keys:
            self.sync.used(fingerprints(keys))


class Sync(Protocol):
    """What :class:`Manifest` tells of this replica's own changes (:attr:`Manifest.sync`)."""

    def stored(self, fp: int) -> None: ...

    def used(self, fps: np.ndarray) -> None: ...

    def bad(self, fp: int, name: str, etag: str | None) -> None: ...
