"""The in-memory fingerprint set against a plain Python set: random
operations of every kind (single changes, bulk segments, snapshots,
merges), exact counts, the epoch, and readers racing writers; and the
bytes-key Manifest over it."""

from __future__ import annotations

import random
import sys
import threading

import numpy as np

from s3kv.manifest.keyset import FingerprintSet, Manifest, fingerprints

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
    # Every fp the arrays hold (all found there: the sets decide alone, a
    # removal among them included) and every member (the same, or an
    # addition the arrays lack).
    for fps in (s._view.base, arr(m.members)):
        assert s.present(fps).tolist() == [f in m.members for f in fps.tolist()]


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


def test_bulk_writers_do_not_alias_the_callers_arrays():
    s = FingerprintSet()
    mine = arr([1, 2, 3])
    s.update(mine)
    mine[:] = 0
    assert s.present(arr([1, 2, 3])).tolist() == [True, True, True]


def test_readers_never_see_a_torn_state():
    """Readers without a lock, while merges, segments and single changes run:
    every key added before a read began (by this replica, by a segment, by
    this replica and then re-announced by a segment) is present in it, and
    no key never added is. The sets are made large and thread switches
    frequent, so that readers land between the steps of a writer."""
    rng = np.random.default_rng(3)
    batch, rounds = 40, 80
    pool = np.unique(rng.integers(0, 2**64, 4 * batch * rounds + 500, dtype=np.uint64))
    rng.shuffle(pool)
    n = batch * rounds
    single, bulk, both, never = pool[:n], pool[n : 2 * n], pool[2 * n : 3 * n], pool[3 * n : 3 * n + 500]
    base = np.sort(pool[3 * n + 500 :])
    s = FingerprintSet(merge_at=1 << 20)
    s.replace(base)
    done = {"single": 0, "bulk": 0, "both": 0}
    stop, merge_wanted, merged = threading.Event(), threading.Event(), threading.Event()
    failures: list[str] = []
    reads = [0]

    def reader() -> None:
        while not stop.is_set():
            upto = dict(done)  # added before this read began
            for name, arr in (("single", single), ("bulk", bulk), ("both", both)):
                if not s.present(arr[max(0, upto[name] - 2 * batch) : upto[name]]).all():
                    failures.append(name)
            if s.present(never).any():
                failures.append("never")
            reads[0] += 1

    def prober() -> None:  # the newest keys, which only the sets hold: a read of a few bytecodes
        singles, boths = single.tolist(), both.tolist()
        while not stop.is_set():
            i, j = done["single"], done["both"]
            if (i and singles[i - 1] not in s) or (j and boths[j - 1] not in s):
                failures.append("contains")

    def merger() -> None:
        while not stop.is_set():
            if merge_wanted.wait(0.05):
                merge_wanted.clear()
                s.merge()
                merged.set()

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    threads = [threading.Thread(target=f) for f in (reader, prober, merger)]
    for t in threads:
        t.start()
    try:
        for r in range(rounds):
            lo, hi = r * batch, (r + 1) * batch
            for i in range(lo, hi):
                s.add(int(single[i]))
                done["single"] = i + 1
                s.add(int(both[i]))
                done["both"] = i + 1
            s.update(both[lo:hi], removed=never[:50])  # the sets' entries give way to the delta's
            s.update_many([(bulk[lo:hi], ()), ((), never[50:60])])
            done["bulk"] = hi
            merged.clear()
            merge_wanted.set()
            assert merged.wait(10)
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(switch)
    assert reads[0] > rounds and not failures, failures[:5]
    assert s.present(pool[: 3 * n]).all() and not s.present(never).any() and len(s) == 3 * n + len(base)


class Observed(FingerprintSet):
    """Calls ``on_sets`` each time a writer replaces one of the small sets,
    in the middle of its change: a reader's look at that very moment."""

    on_sets = None

    @property
    def _added(self) -> set[int]:
        return self.__dict__["_a"]

    @_added.setter
    def _added(self, value: set[int]) -> None:
        self.__dict__["_a"] = value
        if self.on_sets is not None:
            self.on_sets()

    @property
    def _removed(self) -> set[int]:
        return self.__dict__["_r"]

    @_removed.setter
    def _removed(self, value: set[int]) -> None:
        self.__dict__["_r"] = value
        if self.on_sets is not None:
            self.on_sets()


def test_writers_swap_the_sets_only_after_the_view():
    """Keys this replica added (held by the sets alone) stay present at every
    step of a merge folding them into the base and of a segment naming them
    again: the sets may shrink only once the arrays that replace them are
    visible."""
    s = Observed()
    s.replace(arr([1, 2, 3]))
    mine = [10, 11, 12]
    looks: list[list[bool]] = []

    def look() -> None:
        looks.append([fp in s for fp in mine] + s.present(arr(mine)).tolist())

    for fp in mine:
        s.add(fp)
    s.discard(2)
    s.on_sets = look
    s.update(arr(mine[:2]))  # re-announced: the sets give them up to the delta
    s.merge()  # all folded into the base
    s.on_sets = None
    assert len(looks) >= 3 and all(all(seen) for seen in looks), looks
    assert s.array().tolist() == [1, 3, 10, 11, 12] and len(s) == 5


def fps(*values):
    return np.array(values, dtype=np.uint64)


def test_fingerprint_set_adds_removes_and_merges():
    s = FingerprintSet(merge_at=4)
    s.replace(fps(10, 20, 30))
    s.add(25)
    s.discard(20)
    assert [x in s for x in (10, 20, 25, 30, 40)] == [True, False, True, True, False]
    assert s.present(fps(40, 30, 25, 20, 10)).tolist() == [False, True, True, False, True]
    s.merge()
    assert s.array().tolist() == [10, 25, 30] and not s._added and not s._removed
    s.discard(10)
    s.add(10)  # the later change wins
    s.add(99)
    s.discard(99)
    assert 10 in s and 99 not in s
    assert FingerprintSet().present(fps(1, 2)).tolist() == [False, False]


def test_fingerprint_set_counts_members_exactly():
    """``len`` is the manifest_keys gauge: re-adds, removals of absent keys,
    segments and snapshots must not skew it."""
    s = FingerprintSet(merge_at=1000)
    s.update(fps(1, 2, 3, 3))
    s.add(2)  # already there
    s.discard(7)  # never there
    assert len(s) == 3
    s.merge()
    s.discard(1)
    s.add(1)
    s.add(4)
    assert len(s) == 4
    s.update(fps(4, 5), removed=fps(2, 9))
    assert len(s) == 4  # {1, 3, 4, 5}
    s.replace(fps(3, 5, 6, 8))  # a snapshot; the changes since (1 and 4 added, 2 and 9 removed) stay
    assert len(s) == 6 == int(s.present(np.arange(10, dtype=np.uint64)).sum())
    s.merge()
    assert len(s) == len(s.array()) == 6


def test_changes_during_a_merge_are_not_lost():
    """A writer racing merges must end where a plain set would."""
    s = FingerprintSet(merge_at=1)
    ref: set[int] = set()
    rng = random.Random(5)
    stop = threading.Event()

    def merger():
        while not stop.is_set():
            s.merge()

    t = threading.Thread(target=merger)
    t.start()
    try:
        for _ in range(20000):
            fp = rng.randrange(200)
            if rng.random() < 0.6:
                s.add(fp)
                ref.add(fp)
            else:
                s.discard(fp)
                ref.discard(fp)
    finally:
        stop.set()
        t.join()
    probe = np.arange(200, dtype=np.uint64)
    assert set(probe[s.present(probe)].tolist()) == ref
    assert len(s) == len(ref)
    s.merge()
    assert set(s.array().tolist()) == ref


def test_manifest_keys_and_sync():
    m = Manifest()
    told = []

    class J:
        def stored(self, fp):
            told.append(("stored", fp))

        def used(self, arr):
            told.append(("used", arr.tolist()))

    k1, k2 = b"\x01" * 16, b"\x02" * 16
    m.sync = J()
    m.add(k1)
    assert k1 in m and k2 not in m and m.present([k2, k1]).tolist() == [False, True]
    m.touch([k1, k2])
    m.discard(k1)  # local only: nothing published
    assert k1 not in m
    assert told == [("stored", int.from_bytes(k1[:8], "big")), ("used", fingerprints([k1, k2]).tolist())]
