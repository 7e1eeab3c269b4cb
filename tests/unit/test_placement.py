"""TierIndex: the scheduler's LRU map of a local tier, in slots or bytes."""

from __future__ import annotations

import pytest

from s3kv.tiering.placement import TierIndex


def ready(index: TierIndex, key, size: int = 1) -> list:
    """reserve + commit; the keys evicted."""
    got = index.reserve(key, size)
    assert got is not None, key
    return [k for k, _ in got[1]] + [k for k, _ in index.commit(key)]


def test_negative_capacity_is_refused():
    with pytest.raises(ValueError):
        TierIndex("x", -1)


def test_slots_are_allocated_in_order_and_reused_after_eviction():
    index = TierIndex("cpu", 3, slots=True)
    entries = []
    for k in "abc":
        entry, evicted = index.reserve(k, 12345)
        assert evicted == [] and entry.size == 1
        entries.append(entry)
        index.commit(k, 999)  # the real size does not matter for slots
    assert [e.slot for e in entries] == [0, 1, 2]
    assert index.used == 3 and index.used == len(index)
    index.touch("a")
    entry, evicted = index.reserve("d")
    assert [k for k, _ in evicted] == ["b"] and evicted[0][1].slot == 1
    assert entry.slot == 1 and index.evictions == 1
    index.commit("d")
    assert sorted(index.get(k).slot for k in "acd") == [0, 1, 2]
    index.remove("c")
    entry, evicted = index.reserve("e")
    assert evicted == [] and entry.slot == 2 and index.evictions == 1


def test_slot_capacity_cannot_shrink():
    with pytest.raises(ValueError):
        TierIndex("cpu", 2, slots=True).shrink(1)


def test_byte_capacity_counts_sizes():
    index = TierIndex("disk", 100)
    assert ready(index, "a", 40) == [] and ready(index, "b", 40) == []
    assert index.used == 80
    assert index.reserve("huge", 101) is None and index.used == 80
    entry, evicted = index.reserve("c", 50)  # 130 > 100: a goes (b alone leaves 90)
    assert [k for k, _ in evicted] == ["a"] and entry.size == 50 and entry.slot is None
    assert index.used == 90 and index.evictions == 1
    index.commit("c")
    entry, evicted = index.reserve("d", 100)  # everything else must go
    assert [k for k, _ in evicted] == ["b", "c"] and index.used == 100 and index.evictions == 3


def test_reserve_evicts_nothing_when_pinned_or_pending_entries_block():
    index = TierIndex("disk", 100)
    ready(index, "a", 30)
    assert index.reserve("pending", 40) is not None  # pending: cannot be evicted
    ready(index, "b", 30)
    assert index.pin("a") and index.pin("b")
    assert index.reserve("c", 31) is None
    assert index.used == 100 and index.evictions == 0 and not index.has("c")
    assert index.has("a") and index.has("b") and index.has("pending")
    index.unpin("a")
    assert index.reserve("c", 31) is None  # a alone is not enough
    entry, evicted = index.reserve("c", 30)
    assert [k for k, _ in evicted] == ["a"] and index.used == 100 and index.evictions == 1
    assert index.has("b") and index.has("pending")


def test_slot_reserve_blocked_by_pins_and_pending():
    index = TierIndex("cpu", 2, slots=True)
    ready(index, "a")
    assert index.reserve("b") is not None
    index.pin("a")
    assert index.reserve("c") is None and index.evictions == 0 and index.used == 2
    index.unpin("a")
    entry, evicted = index.reserve("c")
    assert [k for k, _ in evicted] == ["a"] and entry.slot == 0


def test_pending_entries_are_not_hits_but_are_there():
    index = TierIndex("disk", 100)
    entry, _ = index.reserve("k", 10)
    assert not entry.ready
    assert "k" not in index and index.has("k") and index.get("k") is entry
    assert len(index) == 0 and list(index.keys()) == [] and index.used == 10
    assert index.reserve("k", 10) is None
    index.commit("k")
    assert "k" in index and len(index) == 1 and entry.ready


def test_commit_with_a_larger_size_evicts_others_never_itself():
    index = TierIndex("disk", 100)
    for k in "abc":
        ready(index, k, 30)
    index.reserve("d", 10)
    assert index.used == 100
    evicted = index.commit("d", 45)  # 135: a and b must go, c can stay
    assert [k for k, _ in evicted] == ["a", "b"] and evicted[0][1].size == 30
    assert index.used == 75 and list(index.keys()) == ["c", "d"] and index.evictions == 2
    assert index.get("d").size == 45 and index.get("d").pins == 0
    index.reserve("e", 5)
    evicted = index.commit("e", 200)  # larger than the tier: everything else goes, e stays
    assert [k for k, _ in evicted] == ["c", "d"]
    assert list(index.keys()) == ["e"] and index.used == 200 and index.get("e").pins == 0


def test_commit_with_a_smaller_size_frees_room():
    index = TierIndex("disk", 100)
    index.reserve("a", 80)
    assert index.commit("a", 20) == [] and index.used == 20
    assert index.reserve("b", 80) is not None and index.evictions == 0


def test_commit_of_unknown_or_removed_key_does_nothing():
    index = TierIndex("disk", 100)
    assert index.commit("nope", 5) == [] and index.used == 0
    index.reserve("doomed", 10)
    index.pin("doomed")
    index.remove("doomed")
    assert index.commit("doomed", 500) == [] and "doomed" not in index and index.used == 10
    index.unpin("doomed")
    assert index.used == 0


def test_abort_frees_a_pending_entry_only():
    index = TierIndex("cpu", 2, slots=True)
    entry, _ = index.reserve("p")
    ready(index, "r")
    assert index.abort("r") is None and "r" in index
    assert index.abort("p") is entry and not index.has("p") and index.used == 1
    assert index.abort("p") is None
    assert index.reserve("q")[0].slot == entry.slot


def test_remove_of_a_pinned_entry_waits_for_the_last_unpin():
    index = TierIndex("disk", 100)
    ready(index, "a", 40)
    assert index.pin("a") and index.pin("a")
    assert index.remove("a") is None
    assert "a" not in index and not index.has("a") and index.get("a") is None
    assert index.used == 40  # its bytes are still being read
    assert not index.pin("a")
    assert index.reserve("a", 40) is None  # its old entry is still there
    index.unpin("a")
    assert index.used == 40
    index.unpin("a")
    assert index.used == 0
    assert index.reserve("a", 40) is not None


def test_remove_returns_the_entry():
    index = TierIndex("disk", 100)
    ready(index, "a", 40)
    removed = index.remove("a")
    assert removed is not None and removed.size == 40 and index.used == 0
    assert index.remove("a") is None


def test_shrink_evicts_down_to_the_new_capacity():
    index = TierIndex("disk", 100)
    for k in "abcd":
        ready(index, k, 25)
    index.pin("a")
    evicted = index.shrink(50)
    assert [k for k, _ in evicted] == ["b", "c"]
    assert index.capacity == 50 and index.used == 50 and list(index.keys()) == ["a", "d"]
    assert index.evictions == 2
    evicted = index.shrink(0)  # a is pinned: as far as that allows
    assert [k for k, _ in evicted] == ["d"] and index.used == 25
    assert index.shrink(-5) == [] and index.capacity == 0


def test_insert_ready():
    index = TierIndex("disk", 100)
    assert index.insert_ready("old", 60) == []
    assert "old" in index and index.get("old").ready
    assert [k for k, _ in index.insert_ready("new", 60)] == ["old"]
    assert list(index.keys()) == ["new"] and index.evictions == 1 and index.used == 60
    assert index.insert_ready("new", 10) is None
    assert index.insert_ready("too big", 101) is None and index.used == 60


def test_keys_are_in_lru_order():
    index = TierIndex("disk", 1000)
    for k in "abcde":
        ready(index, k, 10)
    index.touch("b")
    index.touch("a")
    index.touch("missing")
    index.reserve("pending", 10)
    assert list(index.keys()) == ["c", "d", "e", "b", "a"]
    index.commit("pending")
    assert list(index.keys()) == ["c", "d", "e", "b", "a", "pending"]
    entry, evicted = index.reserve("x", 1000 - 60 + 25)
    assert [k for k, _ in evicted] == ["c", "d", "e"] and index.evictions == 3
