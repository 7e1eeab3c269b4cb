"""BadRecords: what a replica knows of the chunk objects reported bad, bounded."""

from __future__ import annotations

from s3kv.keys import Namespace, chain_keys, fingerprint, object_key
from s3kv.manifest.bad import BadRecords, entries


def test_only_well_formed_entries_are_read_from_a_header():
    listed = [["a", '"e"'], ["b", None], ["c"], ["d", 5], [7, "e"], "x", ["e", "f", "g"], None]
    assert entries(listed) == [("a", '"e"'), ("b", None)]
    assert entries({"a": 1}) == [] and entries(None) == []


def test_the_newest_records_and_fingerprints_are_kept():
    bad = BadRecords(kept=3)
    for fp in (1, 2, 3, 1, 4):  # 1 again: it is the newest now
        bad.add(fp)
    assert 2 not in bad and all(fp in bad for fp in (3, 1, 4)) and len(bad) == 3
    for i in range(5):
        bad.record(f"n{i}", None)
    bad.record("n2", '"e2"')  # reported again, with another ETag
    assert bad.header() == [["n3", None], ["n4", None], ["n2", '"e2"']]


def test_a_snapshots_records_give_their_chunks_fingerprints():
    ns = Namespace.from_fields({"m": "bad-records"})
    keys = chain_keys(ns, list(range(128)), 64)
    names = [object_key("p", ns.id, k, 1) for k in keys]
    bad = BadRecords()
    meta = {"bad": [[names[0], '"e0"'], ["p/manifest/seg/x", '"e"'], [names[1], None]]}
    assert bad.from_snapshot(meta) == 2
    assert fingerprint(keys[0]) in bad and fingerprint(keys[1]) in bad and len(bad) == 2
    assert bad.header() == [[names[0], '"e0"'], [names[1], None]]


def test_a_segments_removals_are_bad_and_its_records_carried():
    bad = BadRecords()
    bad.from_segment([5, 6], {"bad": [["a", '"e1"'], ["b", None]], "writer": "w"})
    assert 5 in bad and 6 in bad and 7 not in bad
    assert bad.header() == [["a", '"e1"'], ["b", None]]
