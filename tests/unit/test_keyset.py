"""The in-memory fingerprint set against a plain Python set: random
operations of every kind (single changes, bulk segments, snapshots,
merges), exact counts, the epoch, and readers racing writers."""

from __future__ import annotations

import random
import threading

import numpy as np

from s3kv.manifest.keyset import FingerprintSet, apply_to, overlay, resolve

U64_MAX = 2**64 - 1


def arr(values) -> np.ndarray:
    return np.array(sorted(values), dtype=np.uint64)


class Model:
    """What a FingerprintSet must say: a set, plus the changes since the
    last merge (which a snapshot's ``replace`` keeps)."""

    def __init__(self) -> None:
        self.members: set[int] = set()
        self.pending: dict[int, bool] = {}

    def op(self, fp: int, present: bool) -> None:
        self.pending[fp] = present
        (self.members.add if present else self.members.discard)(fp)

    def update(self, added, removed) -> None:
        for fp in added:
            self.op(fp, True)
        for fp in removed:
            self.op(fp, False)

    def replace(self, snapshot) -> None:
        self.members = set(snapshot)
        for fp, present in self.pending.items():
            (self.members.add if present else self.members.discard)(fp)

    def merge(self) -> None:
        self.pending = {}


def random_ops(seed: int, rounds: int, universe: list[int]):
    rng = random.Random(seed)

    def some(k: int) -> list[int]:
        return [rng.choice(universe) for _ in range(rng.randrange(k))]

    for _ in range(rounds):
        r = rng.random()
        if r < 0.3:
            yield "add", rng.choice(universe)
        elif r < 0.5:
            yield "discard", rng.choice(universe)
        elif r < 0.72:  # adds and removals may overlap, and repeat
            yield "update", (some(12), some(6))
        elif r < 0.84:
            yield "update_many", [(some(10), some(5)) for _ in range(rng.randrange(1, 5))]
        elif r < 0.92:
            yield "merge", None
        else:
            yield "replace", sorted(set(some(40)))


def check(s: FingerprintSet, m: Model, probe: np.ndarray) -> None:
    assert len(s) == len(m.members)
    got = set(probe[s.present(probe)].tolist())
    assert got == m.members


def test_random_operations_agree_with_a_plain_set():
    rng = random.Random(0)
    # Small enough for frequent collisions; the uint64 extremes included.
    universe = [0, 1, 2**63 - 1, 2**63, U64_MAX - 1, U64_MAX] + [rng.randrange(2**64) for _ in range(90)]
    probe = arr(set(universe))
    for seed in range(40):
        s, m = FingerprintSet(merge_at=rng.choice([1, 8, 1 << 16])), Model()
        for step, (kind, arg) in enumerate(random_ops(seed, 300, universe)):
            members_before, epoch_before = set(m.members), s.epoch
            if kind == "add":
                s.add(arg)
                m.op(arg, True)
            elif kind == "discard":
                s.discard(arg)
                m.op(arg, False)
            elif kind == "update":
                added, removed = arg
                # Lists of ints, and unsorted arrays with repeats: both are accepted.
                if step % 2:
                    s.update(added, removed)
                else:
                    s.update(np.array(added, dtype=np.uint64), np.array(removed, dtype=np.uint64))
                m.update(added, removed)
            elif kind == "update_many":
                s.update_many(arg)
                for added, removed in arg:
                    m.update(added, removed)
            elif kind == "merge":
                s.merge()
                m.merge()
            else:
                s.replace(arr(arg))
                m.replace(arg)
            assert len(s) == len(m.members), (seed, step, kind)
            if members_before - m.members:
                assert s.epoch > epoch_before, (seed, step, kind)  # a removal is announced
            elif kind in ("add", "merge"):
                assert s.epoch == epoch_before, (seed, step, kind)
            if s.needs_merge():
                s.merge()
                m.merge()
            if step % 7 == 0:
                check(s, m, probe)
                fp = universe[step % len(universe)]
                assert (fp in s) == (fp in m.members)
        check(s, m, probe)
        assert set(s.array().tolist()) == m.members  # a merge, then the array alone
        assert s.array().tolist() == sorted(m.members) and len(s) == len(m.members)


def test_later_operations_win_in_every_order():
    for bulk_first in (True, False):
        s = FingerprintSet()
        s.replace(arr([5]))
        if bulk_first:
            s.update([], [7])
            s.add(7)  # single after bulk: present
            s.update([5], [])
            s.discard(5)  # absent
        else:
            s.add(7)
            s.update([], [7])  # bulk after single: absent
            s.discard(5)
            s.update([5], [])  # present
        assert (7 in s, 5 in s) == ((True, False) if bulk_first else (False, True))
        assert s.present(arr([5, 7])).tolist() == [5 in s, 7 in s]
        assert len(s) == 1
        s.merge()
        assert (7 in s, 5 in s) == ((True, False) if bulk_first else (False, True))
    s = FingerprintSet()
    s.update([1, 2], [2])  # within one segment: adds first, then removals
    s.update_many([([3], []), ([], [3]), ([4], [4]), ([], [6]), ([6], [])])
    assert s.present(arr([1, 2, 3, 4, 6])).tolist() == [True, False, False, False, True]
    assert len(s) == 2


def test_array_helpers():
    fps, present = resolve([(np.array([3, 1, 3], dtype=np.uint64), [1, 9]), ([9, 4], [])])
    assert fps.tolist() == [1, 3, 4, 9] and present.tolist() == [False, True, True, True]
    delta, state = overlay(
        arr([2, 4, 6]), np.array([True, False, True]), arr([1, 4, 7]), np.array([False] * 3)
    )
    assert delta.tolist() == [1, 2, 4, 6, 7] and state.tolist() == [False, True, False, True, False]
    out = apply_to(arr([2, 4, 6, 8]), arr([1, 4, 5, 8, 9]), np.array([True, False, True, True, True]))
    assert out.tolist() == [1, 2, 5, 6, 8, 9]


def test_bulk_writers_do_not_alias_the_callers_arrays():
    s = FingerprintSet()
    mine = arr([1, 2, 3])
    s.update(mine)
    mine[:] = 0
    assert s.present(arr([1, 2, 3])).tolist() == [True, True, True]


def test_readers_never_see_a_torn_state():
    """Keys that stay present (some from the base, some from segments, some
    from this replica's own adds re-announced by segments) and keys never
    added, read without a lock while segments, single changes and merges
    run: every read must find the first all present, the second all absent."""
    rng = np.random.default_rng(3)
    stable_base = np.unique(rng.integers(0, 2**64, 200, dtype=np.uint64))
    stable_seg = np.unique(rng.integers(0, 2**64, 200, dtype=np.uint64))
    stable_own = np.unique(rng.integers(0, 2**64, 50, dtype=np.uint64))
    never = np.unique(rng.integers(0, 2**64, 200, dtype=np.uint64))
    churn = np.unique(rng.integers(0, 2**64, 2000, dtype=np.uint64))
    s = FingerprintSet(merge_at=64)
    s.replace(stable_base)
    s.update(stable_seg)
    for fp in stable_own.tolist():
        s.add(fp)
    stable = np.concatenate([stable_base, stable_seg, stable_own])
    probe = np.concatenate([stable, never])
    expect = np.concatenate([np.ones(len(stable), dtype=bool), np.zeros(len(never), dtype=bool)])
    stop = threading.Event()
    failures: list[str] = []
    reads = [0]

    def reader() -> None:
        while not stop.is_set():
            if not (s.present(probe) == expect).all():
                failures.append("present")
            fp = int(stable[reads[0] % len(stable)])
            if fp not in s:
                failures.append(f"contains {fp}")
            reads[0] += 1

    def merger() -> None:
        while not stop.is_set():
            s.merge()

    threads = [threading.Thread(target=reader), threading.Thread(target=merger)]
    for t in threads:
        t.start()
    try:
        r = random.Random(4)
        for i in range(400):
            pick = churn[r.randrange(len(churn) - 50) :][:50]
            if i % 3 == 0:
                s.update(pick, removed=churn[: r.randrange(20)])
            elif i % 3 == 1:  # segments naming the stable keys again
                s.update_many([(stable_seg[i % 100 :][:30], ()), (stable_own[: i % 50], pick[:5])])
            else:
                for fp in pick[:10].tolist():
                    s.add(fp) if r.random() < 0.5 else s.discard(fp)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert reads[0] > 0 and not failures, failures[:5]
    assert (s.present(probe) == expect).all()
