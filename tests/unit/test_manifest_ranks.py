"""The rank tally (s3kv.manifest.ranks): a chunk of several ranks counts
once every rank's segment has named it."""

from s3kv.manifest.ranks import RankTally


def test_tally_forgets_chunks_a_rank_never_completed_and_tombstones():
    t = RankTally()
    assert t.add("seg/1", 0, 2, [1, 2, 3]).tolist() == []
    t.discard([3])  # gc deleted it meanwhile
    assert t.add("seg/2", 1, 2, [1, 3]).tolist() == [1]
    assert t.oldest() == "seg/1" and len(t) == 2  # 2 waits for rank 1; 3 waits for rank 0 again
    assert t.expire("seg/2") == 1 and len(t) == 1 and t.oldest() == "seg/2"
