"""The bucket index over the manifest's base array against numpy's binary
search: many sizes, crafted buckets longer than its window, and a
FingerprintSet whose base is replaced and merged while deltas and single
changes sit on top."""

from __future__ import annotations

import numpy as np
import pytest

from s3kv.manifest.arrays import MAX_WINDOW, BucketIndex
from s3kv.manifest.keyset import FingerprintSet

U64_MAX = 2**64 - 1


def searched(arr: np.ndarray, fps: np.ndarray) -> np.ndarray:
    """The plain answer: a binary search."""
    if not len(arr):
        return np.zeros(len(fps), dtype=bool)
    return arr.take(arr.searchsorted(fps), mode="clip") == fps


def probes(arr: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Members, their neighbours (the same bucket, mostly), random values and the extremes."""
    members = arr[rng.integers(0, len(arr), 2000)] if len(arr) else arr
    near = np.concatenate([members - np.uint64(1), members + np.uint64(1)]) if len(arr) else arr
    rand = rng.integers(0, U64_MAX, 2000, dtype=np.uint64, endpoint=True)
    return np.concatenate([members, near, rand, np.array([0, 1, U64_MAX - 1, U64_MAX], dtype=np.uint64)])


def check(arr: np.ndarray, rng: np.random.Generator) -> BucketIndex:
    index = BucketIndex(arr)
    fps = probes(arr, rng)
    want = searched(arr, fps)
    assert index.present(fps).tolist() == want.tolist()
    hit, every = index.find(fps)
    assert hit.tolist() == want.tolist() and every == bool(want.all())
    assert index.present(fps[:0]).tolist() == []
    assert [int(f) in index for f in fps[:300].tolist() + fps[-300:].tolist()] == (
        want[:300].tolist() + want[-300:].tolist()
    )
    return index


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 8, 17, 100, 1000, 65_537, 1_000_000])
def test_index_agrees_with_a_binary_search(n):
    rng = np.random.default_rng(n)
    arr = np.unique(rng.integers(0, U64_MAX, n, dtype=np.uint64, endpoint=True))
    index = check(arr, rng)
    if n:
        # Two to four keys a bucket on average, a window no longer than needed.
        buckets = 1 << (64 - int(index._shift))
        assert buckets >= n / 4 and (buckets < n / 2 or buckets == 2)
        assert index._rows.shape[1] <= MAX_WINDOW and not len(index._long)
        assert index.nbytes == len(index._starts) * index._starts.itemsize


def test_extreme_values_are_found():
    arr = np.array([0, 1, 2**63, U64_MAX - 1, U64_MAX], dtype=np.uint64)
    assert BucketIndex(arr).present(arr).all()
    check(arr, np.random.default_rng(0))


@pytest.mark.parametrize("crowd", [MAX_WINDOW + 1, 200])
def test_buckets_longer_than_the_window_are_searched(crowd):
    """Crafted fingerprints sharing their top bits (a hostile segment could
    publish them): a bucket longer than any window is searched instead."""
    rng = np.random.default_rng(crowd)
    background = rng.integers(0, U64_MAX, 100_000, dtype=np.uint64, endpoint=True)
    top = np.uint64(0xABCDE) << np.uint64(44)
    crafted = top + rng.integers(0, 1 << 44, crowd, dtype=np.uint64)
    arr = np.unique(np.concatenate([background, crafted]))
    index = check(arr, rng)
    assert len(index._long) >= 1 and index._rows.shape[1] == MAX_WINDOW
    both = np.concatenate([crafted, crafted + np.uint64(1), arr[:50]])
    assert index.present(both).tolist() == searched(arr, both).tolist()
    assert all(int(f) in index for f in crafted.tolist())
    # the last of the crowd is past any window that starts at its bucket
    assert index.present(crafted[-1:]).tolist() == [True]


def test_batches_of_members_agree_with_a_binary_search():
    """A lookup whose every fingerprint is found skips the per-row reduce (a
    stored prefix's lookup, the common case): batches of members alone (with
    repeats), the same with one stranger, and members of a bucket longer
    than the window (found by the search, not in their windows)."""
    rng = np.random.default_rng(11)
    background = rng.integers(0, U64_MAX, 100_000, dtype=np.uint64, endpoint=True)
    crafted = (np.uint64(0xABCDE) << np.uint64(44)) + rng.integers(0, 1 << 44, 100, dtype=np.uint64)
    arr = np.unique(np.concatenate([background, crafted]))
    index = BucketIndex(arr)
    assert len(index._long) == 1
    for size in (1, 2, 31, 32, 33, 200):
        for _ in range(30):
            members = arr[rng.integers(0, len(arr), size)]
            assert index.present(members).tolist() == [True] * size
            assert index.find(members)[1] is True
            one_off = members.copy()
            one_off[rng.integers(size)] ^= np.uint64(1)  # a neighbour: the same bucket, mostly not a member
            want = searched(arr, one_off)
            hit, every = index.find(one_off)
            assert hit.tolist() == want.tolist() and every == bool(want.all())
    assert index.present(crafted).tolist() == [True] * len(crafted)
    assert index.find(crafted)[1] is True  # some found by the search, past their windows
    crowd = np.concatenate([crafted, crafted + np.uint64(1)])
    assert index.present(crowd).tolist() == searched(arr, crowd).tolist()


def test_the_set_indexes_every_new_base():
    """replace and merge put a new base in the view with its own index; the
    set's answers with a delta and single changes on top are a search's."""
    rng = np.random.default_rng(7)
    s = FingerprintSet(merge_at=1 << 30)
    model: set[int] = set()

    def agree():
        view = s._view
        assert view.buckets.arr is view.base
        fps = np.concatenate([probes(view.base, rng), np.array(sorted(model)[:500], dtype=np.uint64)])
        assert s.present(fps).tolist() == [f in model for f in fps.tolist()]
        assert [f in s for f in fps[:200].tolist()] == [f in model for f in fps[:200].tolist()]

    snap = np.unique(rng.integers(0, U64_MAX, 200_000, dtype=np.uint64, endpoint=True))
    s.replace(snap)
    model |= set(snap.tolist())
    agree()
    assert s.nbytes > snap.nbytes  # the index counts
    for _ in range(3):
        added = rng.integers(0, U64_MAX, 5000, dtype=np.uint64, endpoint=True)
        gone = s._view.base[rng.integers(0, len(s._view.base), 3000)]
        s.update(added, gone)
        model |= set(added.tolist())
        model -= set(gone.tolist())
        for f in rng.integers(0, U64_MAX, 50, dtype=np.uint64).tolist():
            s.add(f)
            model.add(f)
        for f in list(model)[:50]:
            s.discard(f)
            model.discard(f)
        agree()
        s.merge()
        agree()
        assert len(s) == len(model)
