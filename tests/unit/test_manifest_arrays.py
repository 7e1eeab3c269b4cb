"""The sorted fingerprint arrays (s3kv.manifest.arrays): inserting and
deleting, resolving bulk changes in order, laying them over a delta and
applying them to a base."""

import numpy as np

from s3kv.manifest.arrays import apply_to, delete_sorted, insert_sorted, overlay, resolve


def arr(values) -> np.ndarray:
    return np.array(sorted(values), dtype=np.uint64)


def fps(*values):
    return np.array(values, dtype=np.uint64)


def test_sorted_insert_and_delete_keep_arrays_sorted_and_unique():
    base = fps(2, 4, 6)
    assert insert_sorted(base, fps(5, 4, 1, 7, 5)).tolist() == [1, 2, 4, 5, 6, 7]
    assert delete_sorted(base, fps(4, 9, 2)).tolist() == [6]
    assert delete_sorted(base, fps(9)) is base


def test_array_helpers():
    fps, present = resolve([(np.array([3, 1, 3], dtype=np.uint64), [1, 9]), ([9, 4], [])])
    assert fps.tolist() == [1, 3, 4, 9] and present.tolist() == [False, True, True, True]
    delta, state = overlay(
        arr([2, 4, 6]), np.array([True, False, True]), arr([1, 4, 7]), np.array([False] * 3)
    )
    assert delta.tolist() == [1, 2, 4, 6, 7] and state.tolist() == [False, True, False, True, False]
    out = apply_to(arr([2, 4, 6, 8]), arr([1, 4, 5, 8, 9]), np.array([True, False, True, True, True]))
    assert out.tolist() == [1, 2, 5, 6, 8, 9]
