"""S3 Express One Zone directory buckets (issue 18.3): they list in no
order, ignore StartAfter and take only prefixes that end with '/', so on
them the manifest files its segments under minute prefixes and lists each
minute whole. The bucket kind comes from the config (``bucket_kind``, auto
by the ``--x-s3`` name suffix) at start-up. The sharing tests of
test_manifest_sync.py run on both kinds; these test what is particular to
directory buckets, on :class:`DirectoryBucketStore` (any store, listed as a
directory bucket lists)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from s3kv.config import ConfigError, parse_config
from s3kv.errors import PermissionDenied
from s3kv.keys import fingerprint
from s3kv.manifest import format as mf
from s3kv.manifest import protocol as mp
from s3kv.manifest.keyset import Manifest
from s3kv.manifest.listing import MAX_MINUTES, SegmentLister
from s3kv.manifest.sync import ManifestSync, SyncSettings
from s3kv.manifest.tombstones import publish_tombstones
from s3kv.ops.inventory import scan_namespace
from s3kv.stores.memory import MemoryStore
from s3kv.stores.s3 import S3Options, S3Store
from tests.stores.wrappers import DirectoryBucketStore

BASE = "pfx/" + "ab" * 16 + "/manifest/"
T0 = 1_700_000_000.0
SKEW_S = 60


def run(coro):
    return asyncio.run(coro)


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") * 2


def replica(store, clock, writer, **kw) -> ManifestSync:
    settings = SyncSettings(publish_s=1, refresh_s=1, skew_s=SKEW_S, **kw)
    return ManifestSync(store, BASE, Manifest(), settings, writer=writer, clock=lambda: clock[0])


# -- names -------------------------------------------------------------------------


def test_directory_names_sort_by_time_across_minutes_and_parse():
    t = int(T0 * 1000)
    stamps = [t + d for d in (0, 39_999, 40_000, 3_600_000)]  # t is 20 s into its minute
    names = [mp.segment_name(BASE, ts, "w", 1, directory=True) for ts in stamps]
    assert names == sorted(names)
    assert [n.rsplit("/", 1)[0] + "/" for n in names] == [mp.segment_dir(BASE, ts) for ts in stamps]
    assert names[0].startswith(BASE + "seg/" + f"{t // 60_000:09d}/")
    assert len({mp.segment_dir(BASE, ts) for ts in stamps}) == 3
    assert mp.parse_name(BASE, names[1]) == mp.ManifestName("segment", t + 39_999, "w", 1)
    assert mp.name_ts(names[2]) == t + 40_000
    # Filed under another minute than its stamp's: not a name s3kv writes.
    wrong = BASE + "seg/" + f"{t // 60_000 + 1:09d}/" + mp.stamp(t) + "-w-000001"
    assert mp.parse_name(BASE, wrong) is None
    # The floor is in the same layout, so names compare with it as before.
    floor = mp.segment_floor(BASE, t, 60_000, directory=True)
    assert mp.segment_name(BASE, t - 59_999, "w", 1, directory=True) > floor
    assert mp.segment_name(BASE, t - 60_001, "w", 1, directory=True) < floor


# -- listing -----------------------------------------------------------------------


def test_a_quiet_fleet_lists_a_few_minutes_a_poll_not_every_minute_since():
    inner = MemoryStore()
    store = DirectoryBucketStore(inner)
    clock = [T0]
    a, b = replica(store, clock, "aaaa"), replica(store, clock, "bbbb")
    run(a.load())
    run(b.load())
    a.manifest.add(key(1))
    run(a.publish())
    run(b.refresh())
    assert key(1) in b.manifest
    # Nobody writes for two hours: b's floor stays put, yet a poll lists only
    # the minutes of three skews (60 s) and the 30 s since the last poll.
    per_poll = []
    for _ in range(240):
        clock[0] += 30
        before = len(store.listed)
        run(b.refresh())
        per_poll.append(len(store.listed) - before)
    assert max(per_poll) <= (3 * SKEW_S + 30) // 60 + 2, per_poll
    # ... and a segment stamped now is still seen.
    a.manifest.add(key(2))
    run(a.publish())
    run(b.refresh())
    assert key(2) in b.manifest
    assert store.start_after_ignored == 0 and store.shuffled == 0  # one object a listing: nothing to shuffle


def test_a_segment_stamped_at_the_end_of_a_minute_and_a_slow_writer_within_the_skew_are_seen():
    store = DirectoryBucketStore(MemoryStore())
    fast = [T0 - T0 % 60 + 59.999]  # the last millisecond of a minute
    slow = [fast[0] - 45]  # 45 s behind, within the 60 s skew
    a, b = replica(store, fast, "aaaa"), replica(store, slow, "bbbb")
    run(a.load())
    run(b.load())
    for i in range(3):
        a.manifest.add(key(10 + i))
        run(a.publish())
    run(b.refresh())
    b.manifest.add(key(20))
    run(b.publish())  # b has seen a's segments: stamped after them whatever b's clock says
    fast[0] += 1  # the next minute
    slow[0] += 1
    run(a.refresh())
    assert key(20) in a.manifest and all(key(10 + i) in b.manifest for i in range(3))
    dirs = {n.rsplit("/", 1)[0] for n in run(store.list_keys(BASE + "seg/"))}
    assert all(d.startswith(BASE + "seg/") and len(d.rsplit("/", 1)[1]) == mp.MINUTE_DIGITS for d in dirs)


def test_a_start_from_an_old_snapshot_lists_every_segment_once_not_each_minute():
    store = DirectoryBucketStore(MemoryStore())
    clock = [T0]
    a = replica(store, clock, "aaaa", snapshot_every=1, snapshot_interval_s=0)
    run(a.load())
    a.manifest.add(key(1))
    run(a.publish())
    assert run(a.maybe_snapshot())
    clock[0] += 3 * 86400  # three days, 4320 minutes later
    a.manifest.add(key(2))
    run(a.publish())
    fresh = replica(store, clock, "bbbb")
    before = len(store.listed)
    run(fresh.load())
    assert key(1) in fresh.manifest and key(2) in fresh.manifest
    listed = store.listed[before:]
    assert listed == [BASE + "snap/", BASE + "seg/"], listed  # 3 days > MAX_MINUTES minutes
    assert MAX_MINUTES < 3 * 1440


def test_unordered_listings_still_apply_a_tombstone_after_the_store_it_removes():
    """Directory listings come shuffled: the segments are applied in name
    (time) order all the same, so a removal after an add wins."""
    for seed in range(6):
        store = DirectoryBucketStore(MemoryStore(), seed=seed)
        clock = [T0]
        a = replica(store, clock, "aaaa")
        run(a.load())
        for i in range(5):
            a.manifest.add(key(i))
            run(a.publish())
            clock[0] += 0.01
        now = clock[0]
        stamps = mp.Stamps("gc00", clock=lambda t=now: t)
        name = run(publish_tombstones(store, BASE, [key(0), key(3)], stamps, SKEW_S, clock=lambda t=now: t))
        assert name.startswith(BASE + "seg/") and name.count("/") == BASE.count("/") + 2
        fresh = replica(store, clock, "bbbb")
        run(fresh.load())
        assert [i for i in range(5) if key(i) in fresh.manifest] == [1, 2, 4]
        assert store.start_after_ignored == 0
    assert store.shuffled > 0


def test_the_control_a_general_bucket_lister_asks_a_directory_bucket_for_start_after():
    """The wrapper's count can fail: the general-purpose listing, pointed
    at a directory bucket, asks for StartAfter (and misses bucketed names)."""
    store = DirectoryBucketStore(MemoryStore())
    clock = [T0]
    writer = replica(store, clock, "aaaa")
    run(writer.load())
    writer.manifest.add(key(1))
    run(writer.publish())
    general = SegmentLister(store, BASE, skew_s=SKEW_S, clock=lambda: clock[0])
    general.directory = False
    floor = general.floor(int(T0 * 1000), SKEW_S * 1000)
    listed = run(general.after(floor))
    assert store.start_after_ignored == 1
    # What it got came only because StartAfter was ignored: the minute
    # layout's names sort before a general-purpose floor.
    assert len(listed) == 1 and listed[0].key < floor


def test_inventory_lists_a_directory_bucket_by_whole_prefixes():
    store = DirectoryBucketStore(MemoryStore())
    ns = "ab" * 16
    base = f"pfx/{ns}/"
    for i in range(40):
        k = f"{i:02x}" + "0" * 30
        run(store.put(f"{base}{k[:2]}/{k}.r0", b"x" * 10))
    run(store.put(mp.segment_name(base + "manifest/", int(T0 * 1000), "w", 1, directory=True), b"y" * 64))
    info = run(scan_namespace(store, "pfx", ns, read_access=False))
    assert len(info.chunks) == 40 and len(info.segments) == 1 and not info.foreign
    assert all(p == "" or p.endswith("/") for p in store.listed)


@pytest.mark.parametrize("when", ["refresh", "load"])
def test_a_segment_whose_get_was_refused_for_the_credentials_is_listed_again_once_its_minute_closed(when):
    """A GET refused for the caller's credentials (an expired session, say)
    fails the whole refresh or load, to be retried with the listing: the
    minutes that listing closed are listed again, as a general-purpose
    bucket's listing from the same floor would list their names again."""

    class Refusing(MemoryStore):
        refuse: set[str] = set()

        async def get(self, key, range=None):
            if key in self.refuse:
                raise PermissionDenied(f"{key}: ExpiredToken", credentials=True)
            return await super().get(key, range)

    inner = Refusing()
    store = DirectoryBucketStore(inner)
    clock = [T0]
    a = replica(store, clock, "aaaa", snapshot_every=1, snapshot_interval_s=0)
    b = replica(store, clock, "bbbb")
    run(a.load())
    run(b.load())
    a.manifest.add(key(0))
    run(a.publish())
    run(b.refresh())  # b has a floor now: it lists minutes from there
    assert run(a.maybe_snapshot())  # a new replica starts after key(0)'s segment
    clock[0] += 1
    a.manifest.add(key(1))
    run(a.publish())
    (name,) = [n for n in run(store.list_keys(BASE + "seg/")) if mp.name_ts(n) > int(T0 * 1000)]
    clock[0] += 4 * 60  # its minute is closed by now
    inner.refuse = {name}
    reader = b if when == "refresh" else replica(store, clock, "cccc")
    with pytest.raises(PermissionDenied):
        run(reader.refresh() if when == "refresh" else reader.load())
    inner.refuse = set()
    clock[0] += 5
    run(reader.refresh() if when == "refresh" else reader.load())
    assert key(0) in reader.manifest and key(1) in reader.manifest


def test_segments_in_the_other_kind_of_bucket_layout_are_foreign():
    """Names compare as strings only within one layout (a flat
    ``seg/{stamp}`` sorts after every ``seg/{minute}/...``): on a directory
    bucket a flat segment name, junk or an old s3kv's, is skipped, never
    applied or made a snapshot's horizon; and the other way round."""
    t = int(T0 * 1000)
    flat, filed = mp.segment_name(BASE, t, "w", 1), mp.segment_name(BASE, t, "w", 1, directory=True)
    assert flat > filed
    assert mp.parse_name(BASE, flat) is not None and mp.parse_name(BASE, filed) is not None  # tools: both
    assert mp.parse_name(BASE, flat, directory=True) is None
    assert mp.parse_name(BASE, filed, directory=False) is None
    assert mp.is_segment(BASE, filed, directory=True) and not mp.is_segment(BASE, flat, directory=True)

    store = DirectoryBucketStore(MemoryStore())
    clock = [T0]
    a = replica(store, clock, "aaaa", snapshot_every=1, snapshot_interval_s=0)
    run(a.load())
    a.manifest.add(key(1))
    run(a.publish())
    # A flat segment whose removal would drop key(1), stamped after it.
    gc = mf.ManifestObject("segment", removed=np.array([fingerprint(key(1))], dtype=np.uint64))
    run(store.put(mp.segment_name(BASE, t + 5_000, "gc00", 1), mf.encode(gc)))
    clock[0] += 10
    fresh = replica(store, clock, "bbbb")
    run(fresh.load())
    assert key(1) in fresh.manifest
    assert fresh.counters.totals()["manifest_skipped_foreign"] >= 1
    assert run(a.maybe_snapshot())
    (snap,) = run(store.list_keys(BASE + "snap/"))
    horizon = mf.decode(run(store.get(snap))).meta["horizon"]
    assert mp.parse_name(BASE, horizon, directory=True) is not None  # not the flat name


@pytest.mark.parametrize("digit", ["\uff11", "\u00b2", "\u0661"])
def test_names_with_other_scripts_digits_are_foreign_not_a_crash(digit):
    """int() reads fullwidth and Arabic-Indic digits, and '²'.isdigit() is
    true though int() refuses it: a name made of them is no s3kv name (it
    would sort after every real one), and reading its stamp does not raise."""
    name = BASE + "seg/" + digit * mp.TS_DIGITS + "-w-000001"
    assert mp.name_ts(name) is None
    assert mp.parse_name(BASE, name) is None
    filed = BASE + "seg/" + digit * mp.MINUTE_DIGITS + "/" + "1" * mp.TS_DIGITS + "-w-000001"
    assert mp.parse_name(BASE, filed) is None


# -- the bucket kind ---------------------------------------------------------------


def test_bucket_kind_is_told_by_the_name_and_a_contradiction_fails_at_start_up():
    express = "kv-cache--use1-az4--x-s3"
    assert parse_config({"bucket": express}).directory_bucket
    assert not parse_config({"bucket": "kv-cache"}).directory_bucket
    assert parse_config(
        {"bucket": "kv-cache", "bucket_kind": "directory"}
    ).directory_bucket  # a compatible server
    assert not parse_config({"bucket": "kv-cache", "bucket_kind": "general"}).directory_bucket
    with pytest.raises(ConfigError, match=r"bucket_kind.*--x-s3"):
        parse_config({"bucket": express, "bucket_kind": "general"})
    with pytest.raises(ConfigError, match="bucket_kind"):
        parse_config({"bucket": "kv-cache", "bucket_kind": "express"})
    assert S3Options.from_config(parse_config({"bucket": express})).directory
    assert S3Store(express, S3Options.from_config(parse_config({"bucket": express}))).directory


def test_an_s3_store_on_a_directory_bucket_refuses_what_s3_express_would_not_answer():
    store = S3Store("kv--use1-az4--x-s3", S3Options(directory=True, endpoint_url="http://127.0.0.1:9"))

    async def listing(prefix, start_after=None):
        return [m async for m in store.list(prefix, start_after=start_after)]

    with pytest.raises(ValueError, match="StartAfter"):
        run(listing(BASE + "seg/", "x"))
    with pytest.raises(ValueError, match="end with '/'"):
        run(listing(BASE + "seg/17"))
