"""The manifest protocol: names (built and parsed), writer ids, the hybrid
clock, listing floors, snapshot horizons and access hours."""

import threading

from s3kv.manifest import protocol as mp

BASE = "pfx/" + "ab" * 16 + "/manifest/"
T_MS = 1_700_000_000_000  # 2023-11-14 22:13:20 UTC


def test_names_sort_by_time():
    a = mp.segment_name(BASE, T_MS, "w1", 2)
    b = mp.segment_name(BASE, T_MS + 1, "w0", 1)
    assert a < b and mp.name_ts(a) == T_MS
    assert mp.access_name(BASE, T_MS, "w", 1).startswith(BASE + "access/2023111422/")


def test_names_parse_back_to_what_built_them():
    assert mp.parse_name(BASE, mp.segment_name(BASE, T_MS, "w1", 7)) == mp.ManifestName(
        "segment", T_MS, "w1", 7
    )
    assert mp.parse_name(BASE, mp.snapshot_name(BASE, T_MS, "w1")) == mp.ManifestName(
        "snapshot", T_MS, "w1", None
    )
    record = mp.access_name(BASE, T_MS, "w1r0", 3)
    assert mp.parse_name(BASE, record) == mp.ManifestName("access", T_MS, "w1r0", 3)
    assert mp.is_segment(BASE, mp.segment_name(BASE, T_MS, "w1", 7)) and not mp.is_segment(BASE, record)
    for junk in (
        BASE + "seg/",  # a folder marker
        BASE + "seg/123-w1-000001",  # a short stamp
        mp.segment_name(BASE, T_MS, "w1", 7) + ".partial",
        BASE + "other/" + mp.stamp(T_MS) + "-w1",
        "elsewhere/" + mp.segment_name(BASE, T_MS, "w1", 7),
    ):
        assert mp.parse_name(BASE, junk) is None, junk


def test_access_hours_are_built_and_read_in_one_place():
    record = mp.access_name(BASE, T_MS, "w", 1)
    assert mp.access_hour(T_MS) == "2023111422" == mp.record_hour(BASE, record)
    hour_end = (T_MS // mp.HOUR_MS + 1) * mp.HOUR_MS / 1000  # 23:00 UTC
    assert mp.access_hour_end(record, now=T_MS / 1000 + 7200) == hour_end
    assert mp.access_hour_end(record, now=T_MS / 1000 + 60) == T_MS / 1000 + 60  # not past now
    # The last millisecond of an hour is still that hour.
    last = (T_MS // mp.HOUR_MS + 1) * mp.HOUR_MS - 1
    assert mp.access_hour(last) == "2023111422" and mp.access_hour(last + 1) == "2023111423"


def test_writer_ids():
    a, b = mp.new_writer_id(), mp.new_writer_id()
    assert a != b and len(a) == 12 and a.isalnum()
    assert mp.gc_writer_id().startswith("gc")
    assert mp.replica_of(mp.rank_writer(a, 3)) == a == mp.replica_of(a)
    assert mp.replica_of(mp.rank_writer(a, 12) + "j") == a  # a journal published by the front end
    for w in (a, mp.rank_writer(a, 3) + "j", mp.gc_writer_id()):
        assert mp.parse_name(BASE, mp.segment_name(BASE, T_MS, w, 1)).writer == w


def test_the_hybrid_clock_never_stamps_before_what_it_saw():
    now = [T_MS / 1000]
    clock = mp.HybridClock(lambda: now[0])
    assert clock.next() == T_MS and clock.last_ms == T_MS
    assert clock.next() == T_MS + 1  # the clock stood still
    clock.observe(T_MS + 5000)  # another writer's, ahead of us
    assert clock.next() == T_MS + 5001 and clock.seen_ms == T_MS + 5001
    clock.observe(T_MS)  # an older stamp changes nothing
    now[0] += 10
    assert clock.next() == T_MS + 10_000
    assert clock.next(now_ms=T_MS) == T_MS + 10_001  # a given now, too
    assert mp.HybridClock(lambda: 0.0, seen_ms=T_MS).next() == T_MS + 1


def test_the_hybrid_clock_stamps_are_unique_across_threads():
    clock = mp.HybridClock(lambda: T_MS / 1000)
    stamps: list[int] = []

    def take():
        stamps.extend(clock.next() for _ in range(500))

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(stamps) == list(range(T_MS, T_MS + 2000))


def test_a_listers_stamps_skip_names_in_the_future():
    now = T_MS / 1000
    listed = [
        mp.segment_name(BASE, T_MS - 5000, "w0", 1),
        mp.snapshot_name(BASE, T_MS - 9000, "w0"),
        mp.segment_name(BASE, T_MS + 61_000, "junk", 1),  # beyond now + skew
        BASE + "seg/garbage",
    ]
    stamps = mp.Stamps("gc0", listed, skew_s=60, clock=lambda: now)
    assert stamps.seen_ms == stamps.max_listed == T_MS - 5000
    assert stamps.next() == T_MS and stamps.seq == 1
    assert stamps.next_seq() == 2
    stamps.seen([mp.segment_name(BASE, T_MS + 30_000, "w1", 1)])  # ahead, within the skew
    assert stamps.next() == T_MS + 30_001 and stamps.max_listed == T_MS + 30_000 and stamps.seq == 3


def test_listing_floors_are_a_margin_before_the_newest_stamp():
    floor = mp.segment_floor(BASE, T_MS, 60_000)
    assert floor == BASE + "seg/" + mp.stamp(T_MS - 60_000)
    assert mp.segment_name(BASE, T_MS - 59_999, "w", 1) > floor > mp.segment_name(BASE, T_MS - 60_001, "w", 1)
    assert mp.segment_floor(BASE, 1000, 60_000) == BASE + "seg/" + mp.stamp(0)


def test_a_snapshot_horizon_covers_its_newest_segment_and_the_recent_ones():
    names = [mp.segment_name(BASE, T_MS - d, f"w{d}", 1) for d in (90_000, 61_000, 30_000, 0)]
    horizon = mp.Horizon.over(names, skew_ms=60_000)
    assert horizon.last == names[-1] and horizon.recent == {names[2], names[3]}
    assert horizon.meta() == {"horizon": names[-1], "recent": sorted(names[2:])}
    assert mp.Horizon.of({**horizon.meta(), "writer": "w"}) == horizon
    assert mp.Horizon.last_of(horizon.meta()) == names[-1]
    later = mp.segment_name(BASE, T_MS + 1, "w", 1)
    early_but_late = mp.segment_name(BASE, T_MS - 1, "slow", 1)  # stamped before, landed after
    assert all(horizon.covers(n) for n in names) and not horizon.covers(later)
    assert horizon.covers(early_but_late)  # by name; a reader lists from a floor before it anyway
    assert mp.Horizon.over([], 60_000) == mp.Horizon() == mp.Horizon.of({})
    assert not mp.Horizon().covers(names[0])


def test_epoch_names_parse_back_and_sort_by_epoch():
    name = mp.epoch_name(BASE, 42, 5000)
    assert name == BASE + "ep/005000/000000000042"
    assert mp.parse_name(BASE, name) == mp.ManifestName("epoch", mp.epoch_end(42, 5000), "", 42)
    assert mp.parse_epoch(BASE, name) == (42, 5000)
    assert mp.epoch_name(BASE, 9, 5000) < name < mp.epoch_name(BASE, 100, 5000)
    assert mp.epoch_of(mp.epoch_start(42, 5000), 5000) == 42 == mp.epoch_of(mp.epoch_end(42, 5000), 5000)
    assert mp.epoch_ms(5.0) == 5000 and mp.epoch_ms(0.25) == 250
    for junk in (BASE + "ep/", BASE + "ep/5000/000000000042", BASE + "ep/000000/000000000001", name + "x"):
        assert mp.parse_name(BASE, junk) is None and mp.parse_epoch(BASE, junk) is None, junk
