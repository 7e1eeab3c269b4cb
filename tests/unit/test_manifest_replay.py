"""Replaying the manifest log (s3kv.manifest.replay), directly: what a
snapshot and the segments after it say is live, as replicas and gc's
compaction both read it."""

import random

import numpy as np

from s3kv.manifest import format as mf
from s3kv.manifest.keyset import FingerprintSet
from s3kv.manifest.ranks import RankTally
from s3kv.manifest.replay import bad_removals, changes, replay


def arr(*values):
    return np.array(values, dtype=np.uint64)


def seg(added=(), removed=(), **meta):
    return mf.ManifestObject("segment", arr(*sorted(added)), arr(*sorted(removed)), meta)


def test_segments_apply_in_order_over_the_snapshot():
    snapshot = arr(1, 2, 3)
    segments = [
        ("seg/1", seg(added=[4, 5], removed=[1])),
        ("seg/2", seg(removed=[4, 2])),
        ("seg/3", seg(added=[1, 9])),  # a later add beats an earlier removal
    ]
    assert replay(snapshot, segments).tolist() == [1, 3, 5, 9]
    assert replay(snapshot, []).tolist() == [1, 2, 3]
    assert replay([], segments).tolist() == [1, 5, 9]


def test_within_a_segment_its_removals_come_after_its_adds():
    assert replay(arr(), [("seg/1", seg(added=[7, 8], removed=[7]))]).tolist() == [8]


def test_replay_writes_to_none_of_its_inputs():
    snapshot = arr(1, 2, 3)
    obj = seg(added=[4], removed=[2])
    before = (snapshot.copy(), obj.added.copy(), obj.removed.copy())
    out = replay(snapshot, [("seg/1", obj)])
    assert out.tolist() == [1, 3, 4]
    assert [a.tolist() for a in (snapshot, obj.added, obj.removed)] == [b.tolist() for b in before]


def test_a_rank_segments_chunk_counts_once_every_rank_named_it():
    tally = RankTally()
    first = [("seg/1", seg(added=[1, 2], rank=0, ranks=2))]
    assert replay(arr(), first, tally).tolist() == []
    assert len(tally) == 2  # both wait for rank 1, across calls
    second = [("seg/2", seg(added=[2], rank=1, ranks=2))]
    assert replay(arr(), second, tally).tolist() == [2]
    assert len(tally) == 1 and tally.oldest() == "seg/1"


def test_a_removal_forgets_a_chunk_still_waiting_for_ranks():
    segments = [
        ("seg/1", seg(added=[1], rank=0, ranks=2)),
        ("seg/2", seg(removed=[1])),  # gc deleted its objects meanwhile
        ("seg/3", seg(added=[1], rank=1, ranks=2)),
    ]
    assert replay(arr(), segments).tolist() == []


def test_ranks_held_elsewhere_count_as_named():
    """gc counts the rank objects its listing holds as named."""
    listed = {1: [0], 2: []}
    tally = RankTally(held=lambda fp: listed.get(fp, ()))
    assert replay(arr(), [("seg/1", seg(added=[1, 2], rank=1, ranks=2))], tally).tolist() == [1]


def test_changes_are_what_the_replicas_apply_to_their_live_set():
    """A replica applies segments to its live set one batch at a time
    (refresh): the same as replaying them over a snapshot of it (load)."""
    rng = random.Random(7)
    for _ in range(50):
        snapshot = np.unique(np.array([rng.randrange(64) for _ in range(20)], dtype=np.uint64))
        segments = [
            (f"seg/{i:03d}", seg(added=set(rng.sample(range(64), 6)), removed=set(rng.sample(range(64), 4))))
            for i in range(rng.randrange(1, 8))
        ]
        live = FingerprintSet()
        live.replace(snapshot)
        tally = RankTally()
        for i in range(0, len(segments), 3):
            live.update_many(changes(segments[i : i + 3], tally))
        assert live.array().tolist() == replay(snapshot, segments).tolist()


def test_a_segment_reporting_bad_objects_names_them_in_its_removals():
    bad = seg(removed=[5, 6], bad=[["a", "e1"], ["b", None]])
    assert bad_removals(bad).tolist() == [5, 6]
    assert bad_removals(seg(removed=[5, 6])).tolist() == []  # a tombstone
    assert bad_removals(seg(removed=[5, 6, 7], bad=[["a", "e1"]])).tolist() == []  # more than it lists
    assert bad_removals(seg(removed=[5], bad="a")).tolist() == []
