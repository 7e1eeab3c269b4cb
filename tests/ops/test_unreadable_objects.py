"""One object the ops commands may not read (a 403: another KMS key, a
bucket policy) or that fails to read (a 503) stops neither ``s3kv gc`` nor
``s3kv verify`` nor ``inspect --check``: it is skipped, counted or reported
with why, and judged again the next run; a 403 that refuses the caller's
own credentials stops them. And neither verify nor gc reads a manifest
object past the replicas' ``manifest_max_bytes``. Through the CLI, against
a real S3 server on loopback, the faults injected by a wrapper around the
store the CLI opens."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

import s3kv.cli.ops as cli_ops
from s3kv import descriptor
from s3kv.auth import ENV_VAR
from s3kv.cli import main
from s3kv.keys import fingerprint, object_key
from s3kv.manifest import format as mf
from s3kv.manifest import protocol as mp
from s3kv.stores.base import ByteRange, GetResult
from s3kv.stores.factory import make_store
from tests.ops.dataset import DAY, PREFIX
from tests.ops.helpers import run_json, store_args
from tests.ops.test_gc import manifest_of
from tests.ops.test_hostile_chunks import junk, key, namespace, seed_namespace, sound
from tests.stores.wrappers import Get, WrappedStore

OLD = time.time() - 2 * DAY


@dataclass
class Faulty(WrappedStore):
    """:class:`WrappedStore` as the CLI opens a store: the bucket check,
    ETags and conditional deletes passed through; the faults apply."""

    async def check_access(self) -> None:
        await self.inner.check_access()

    async def get_object(self, key: str, range: ByteRange | None = None) -> GetResult:
        if key in self.denied or key in self.refused or key in self.failing:
            await self.get(key, range)  # raises as a GET of it does (recorded)
        got = await self.inner.get_object(key, range)
        self.gets.append(Get(key, range, len(got.data)))
        return got

    async def delete_if(self, key: str, etag: str) -> None:
        await self.inner.delete_if(key, etag)

    async def list_uploads(self, prefix: str = "") -> list:
        return await self.inner.list_uploads(prefix)


@pytest.fixture
def faults(monkeypatch):
    """Set ``faults.store`` to the keyword arguments of the :class:`Faulty`
    store the CLI opens next; ``faults.opened`` holds the stores opened."""
    state = SimpleNamespace(store={}, opened=[])

    def opening(config):
        store = Faulty(make_store(config), **state.store)
        state.opened.append(store)
        return store

    monkeypatch.setattr(cli_ops, "make_store", opening)
    return state


def segment(s3, bucket: str, ns: str, seq: int, **meta) -> str:
    """A replica's segment (naming nothing) with ``meta`` in its header."""
    name = mp.segment_name(f"{PREFIX}/{ns}/manifest/", int(time.time() * 1000) - 60_000, "replica", seq)
    s3.seed(bucket, name, mf.encode(mf.ManifestObject("segment", meta=meta)), time.time() - 60)
    return name


def test_gc_skips_and_counts_a_reported_bad_object_it_may_not_read(seeded_s3, capsys, faults):
    """Before: the 403 aborted gc (exit 3, nothing deleted, no compaction),
    every run while it lasted; so did a 503 on a segment of reports."""
    s3, bucket = seeded_s3, seeded_s3.new_bucket()
    ns = namespace("reported")
    seed_namespace(s3, bucket, ns)
    names = {i: object_key(PREFIX, ns.id, key(i), 0) for i in (1, 2, 3, 4)}
    for i, name in names.items():  # all torn: shorter than their headers say
        s3.seed(bucket, name, sound(ns.id, key(i))[:-100], OLD)
    segment(s3, bucket, ns.id, 1, bad=[[names[i], '"etag"'] for i in (1, 2, 3)])
    seg = segment(s3, bucket, ns.id, 2, bad=[[names[4], '"etag"']])
    # A dry run (no compaction: it reads segments for their reports only) while that one fails to read.
    faults.store = {"failing": {seg}}
    rc, out = run_json(capsys, s3, bucket, "gc", "--dry-run")
    assert rc == 0, out
    assert sorted(b["object"] for b in out["bad_objects"]) == [names[1], names[2], names[3]]
    assert (out["bad_objects_skipped"], out["bad_report_segments_skipped"]) == (0, 1)

    # 1: a 403; 2: a 503 that lasts; 3: readable.
    faults.store = {"denied": {names[1]}, "failing": {names[2]}}
    rc, out = run_json(capsys, s3, bucket, "gc")
    assert rc == 0, out
    assert sorted(b["object"] for b in out["bad_objects"]) == [names[3], names[4]]
    assert (out["bad_objects_skipped"], out["bad_report_segments_skipped"]) == (2, 0)
    assert out["result"]["bad_objects_deleted"] == 2
    left = s3.listing(bucket)
    assert names[3] not in left and names[4] not in left and {names[1], names[2]} <= set(left)
    assert out["result"]["orphan_chunks_skipped"] == 2  # the compaction went on

    # Judged again the next run, readable now: bad, deleted.
    faults.store = {}
    rc, out = run_json(capsys, s3, bucket, "gc")
    assert rc == 0, out
    assert sorted(b["object"] for b in out["bad_objects"]) == [names[1], names[2]]
    assert (out["bad_objects_skipped"], out["bad_report_segments_skipped"]) == (0, 0)
    assert out["result"]["bad_objects_deleted"] == 2
    assert not set(names.values()) & set(s3.listing(bucket))


def test_verify_reports_an_object_it_may_not_read_and_checks_the_rest(seeded_s3, capsys, faults):
    """Before: the first 403 or 503 aborted verify (exit 3), reporting
    nothing of the other objects, the corrupt one included."""
    s3, bucket = seeded_s3, seeded_s3.new_bucket()
    ns = namespace("verified")
    seed_namespace(s3, bucket, ns)
    names = {i: object_key(PREFIX, ns.id, key(i), 0) for i in (1, 2, 3, 4)}
    for i in (1, 2, 3):
        s3.seed(bucket, names[i], sound(ns.id, key(i)), OLD)
    s3.seed(bucket, names[4], sound(ns.id, key(4))[:-100], OLD)  # torn
    seg = segment(s3, bucket, ns.id, 1)
    unreadable = {names[1]: "AccessDenied", names[2]: "HTTP 503", seg: "AccessDenied"}
    faults.store = {"denied": {names[1], seg}, "failing": {names[2]}}

    rc, rep = run_json(capsys, s3, bucket, "verify", "--all", "--delete-corrupt")
    assert rc == 1, rep  # problems found, as for a corrupt object
    reasons = {p["key"]: p["reason"] for p in rep["unreadable"]}
    assert set(reasons) == set(unreadable) and all(why in reasons[k] for k, why in unreadable.items())
    assert [p["key"] for p in rep["corrupt"]] == [names[4]]
    assert rep["checked"] == rep["population"] - 3  # the sound chunk, the torn one, the descriptor
    assert rep["deleted"] == [names[4]]  # an unreadable object is never deleted
    assert {names[1], names[2], names[3], seg} <= set(s3.listing(bucket))

    capsys.readouterr()  # the text says it too (the torn object deleted)
    assert main(["verify", *store_args(s3, bucket), "--all"]) == 1
    assert "0 corrupt, 0 foreign, 3 unreadable (checked again the next run)" in capsys.readouterr().out

    faults.store = {}  # readable again: checked, sound
    rc, rep = run_json(capsys, s3, bucket, "verify", "--all")
    assert rc == 0 and rep["unreadable"] == [] and rep["checked"] == rep["population"]


def test_a_descriptor_the_scan_may_not_read_is_taken_for_none_and_reported(seeded_s3, capsys, faults):
    """Before: a 403 or 503 on the descriptor aborted the scan, so gc and
    verify (and ls, stats) of the whole prefix (exit 3)."""
    s3, bucket = seeded_s3, seeded_s3.new_bucket()
    ns = namespace("undescribed")
    base = seed_namespace(s3, bucket, ns)
    desc = base + descriptor.NAME
    orphan = object_key(PREFIX, ns.id, key(1), 0)
    s3.seed(bucket, orphan, sound(ns.id, key(1)), OLD)
    where = SimpleNamespace(bucket=bucket)

    faults.store = {"denied": {desc}}
    rc, out = run_json(capsys, s3, bucket, "gc")
    assert rc == 0, out
    assert (
        list(out["unreadable_descriptors"]) == [ns.id]
        and "AccessDenied" in out["unreadable_descriptors"][ns.id]
    )
    res = out["result"]
    assert (res["orphan_chunks_published"], res["orphan_chunks_skipped"]) == (0, 1)  # TP size unknown
    assert manifest_of(s3, where, ns.id) == set()

    faults.store = {"failing": {desc}}
    rc, rep = run_json(capsys, s3, bucket, "verify", "--all")
    assert rc == 1, rep
    assert [(p["key"], p["kind"]) for p in rep["unreadable"]] == [(desc, "unreadable")]
    assert "HTTP 503" in rep["unreadable"][0]["reason"] and rep["corrupt"] == []
    rc, rep = run_json(capsys, s3, bucket, "verify", "--sample", "1")  # a sample reports it too
    assert rc == 1 and [p["key"] for p in rep["unreadable"]] == [desc]

    faults.store = {}  # readable again: the orphan is published
    rc, out = run_json(capsys, s3, bucket, "gc")
    assert rc == 0 and out["unreadable_descriptors"] == {}
    assert out["result"]["orphan_chunks_published"] == 1
    assert manifest_of(s3, where, ns.id) == {fingerprint(key(1))}


def test_verify_reads_no_manifest_object_past_the_replicas_cap(seeded_s3, capsys, faults, tmp_path):
    """Before: both objects were read whole (3 MiB each, no range) and
    called corrupt; now neither is read past manifest_max_bytes + 1."""
    s3, bucket = seeded_s3, seeded_s3.new_bucket()
    ns = namespace("capped")
    seed_namespace(s3, bucket, ns)
    cap = 1 << 20  # the smallest manifest_max_bytes
    big = segment(s3, bucket, ns.id, 1)
    s3.seed(bucket, big, junk(3 << 20), OLD)
    grown = segment(s3, bucket, ns.id, 2)  # listed small, 3 MiB when read
    s3.seed(bucket, grown, junk(3 << 20), OLD)
    fine = segment(s3, bucket, ns.id, 3, note="x")
    config = tmp_path / "kv.json"
    config.write_text(json.dumps({"manifest_max_bytes": "1MiB"}))
    faults.store = {"listed_sizes": {grown: 100}}

    rc, rep = run_json(capsys, s3, bucket, "verify", "--all", "--config", str(config))
    assert rc == 1, rep
    oversized = {p["key"]: p["reason"] for p in rep["oversized"]}
    assert set(oversized) == {big, grown} and rep["corrupt"] == []
    assert f"{3 << 20} bytes, more than {cap}" in oversized[big] and f"more than {cap}" in oversized[grown]
    store = faults.opened[-1]
    assert store.gets_of(big) == []  # refused by its listed size, unread
    assert [(g.range, g.returned) for g in store.gets_of(grown)] == [(ByteRange(0, cap + 1), cap + 1)]
    assert [g.range for g in store.gets_of(fine)] == [ByteRange(0, cap + 1)]


def fps(*keys: bytes) -> np.ndarray:
    return np.array(sorted(fingerprint(k) for k in keys), np.uint64)


def snapshots_of(s3, bucket: str, ns: str) -> set[str]:
    return set(s3.listing(bucket, f"{PREFIX}/{ns}/manifest/{mp.SNAPSHOTS}"))


def test_gc_skips_the_compaction_of_a_namespace_whose_segment_it_may_not_read(seeded_s3, capsys, faults):
    """Before: the 403 on one namespace's segment aborted gc at that
    namespace's compaction (exit 3), and every namespace after it went
    uncompacted, every run while it lasted. Now that compaction alone is
    skipped (no snapshot written without the segment's keys and
    tombstones, nothing pruned) and reported; the next run compacts it."""
    s3, bucket = seeded_s3, seeded_s3.new_bucket()
    first, second = sorted((namespace("compact-a"), namespace("compact-b")), key=lambda n: n.id)
    for ns in (first, second):
        seed_namespace(s3, bucket, ns)
        s3.seed(bucket, object_key(PREFIX, ns.id, key(1), 0), sound(ns.id, key(1)), OLD)
    base = f"{PREFIX}/{first.id}/manifest/"
    now_ms = int(time.time() * 1000)
    covered = mp.segment_name(base, now_ms - 2 * mp.HOUR_MS, "replica", 1)
    s3.seed(bucket, covered, mf.encode(mf.ManifestObject("segment", fps(key(1)))), OLD)
    snap = mp.snapshot_name(base, now_ms - mp.HOUR_MS, "replica")
    body = mf.encode(mf.ManifestObject("snapshot", fps(key(1)), meta={"horizon": covered, "recent": []}))
    s3.seed(bucket, snap, body, OLD)
    unread = segment(s3, bucket, first.id, 2)  # after the snapshot: the compaction needs it
    where = SimpleNamespace(bucket=bucket)

    for fault, why in (("denied", "AccessDenied"), ("failing", "HTTP 503")):
        faults.store = {fault: {unread}}
        rc, out = run_json(capsys, s3, bucket, "gc")
        assert rc == 0, out
        skipped = out["result"]["compactions_skipped"]
        assert list(skipped) == [first.id] and unread in skipped[first.id] and why in skipped[first.id]
        assert snapshots_of(s3, bucket, first.id) == {snap}  # none written
        assert {covered, unread} <= set(s3.listing(bucket))  # nothing pruned
        assert len(snapshots_of(s3, bucket, second.id)) == 1  # the other namespace compacted (the first run)
        assert manifest_of(s3, where, second.id) == {fingerprint(key(1))}
    capsys.readouterr()  # the text says it too
    assert main(["gc", *store_args(s3, bucket)]) == 0
    text = capsys.readouterr().out
    assert f"namespace {first.id}: compaction skipped" in text and "HTTP 503" in text

    faults.store = {}  # readable again: compacted
    rc, out = run_json(capsys, s3, bucket, "gc")
    assert rc == 0 and out["result"]["compactions_skipped"] == {}
    assert len(snapshots_of(s3, bucket, first.id)) == 2
    assert covered not in s3.listing(bucket) and out["result"]["segments_deleted"] == 1
    assert manifest_of(s3, where, first.id) == {fingerprint(key(1))}


def huge_header(size: int) -> bytes:
    """``size`` bytes under a segment's prefix that says its header fills them."""
    prefix = mf.PREFIX.pack(mf.MAGIC, mf.UNSIGNED_VERSION, mf.KINDS["segment"], 0, size - mf.MIN_BYTES, 0, 0)
    return prefix + junk(size - len(prefix))


def test_gc_reads_no_manifest_object_past_the_replicas_cap(seeded_s3, capsys, faults, tmp_path, monkeypatch):
    """Before: gc read every segment and access record whole (no range), a
    3 MiB one too, and a segment's head up to the end of the header it
    claims. Now none is read past manifest_max_bytes + 1 (one listed larger
    is not read but for its prefix): an oversized segment is left out of its
    namespace's compaction as a corrupt one is (replicas skip it unread too;
    the compaction goes on and publishes the namespace's orphan), an
    oversized access record is left out of the scan and of the merge,
    counted, and kept; with the fleet secret too."""
    s3, bucket = seeded_s3, seeded_s3.new_bucket()
    big_ns, grown_ns, access_ns = (namespace(f"capped-{i}") for i in range(3))
    for ns in (big_ns, grown_ns, access_ns):
        seed_namespace(s3, bucket, ns)
        s3.seed(bucket, object_key(PREFIX, ns.id, key(1), 0), sound(ns.id, key(1)), OLD)
    cap = 1 << 20
    big = segment(s3, bucket, big_ns.id, 1)
    s3.seed(bucket, big, huge_header(3 << 20), OLD)
    grown = segment(s3, bucket, grown_ns.id, 1)  # listed small, 3 MiB when read
    s3.seed(bucket, grown, huge_header(3 << 20), OLD)
    base = f"{PREFIX}/{access_ns.id}/manifest/"
    hour_ago = int(time.time() * 1000) - 2 * mp.HOUR_MS  # a closed hour: its records are merged
    record = mp.access_name(base, hour_ago, "replica", 1)
    s3.seed(bucket, record, mf.encode(mf.ManifestObject("access", fps(key(1)))), OLD)
    big_record = mp.access_name(base, hour_ago + 1, "replica", 2)
    s3.seed(bucket, big_record, junk(3 << 20), OLD)
    config = tmp_path / "kv.json"
    config.write_text(json.dumps({"manifest_max_bytes": "1MiB"}))
    faults.store = {"listed_sizes": {grown: 100}}

    def capped(store: Faulty) -> None:
        assert store.gets_of(big_record) == []  # listed larger: unread
        assert all(g.range is not None and g.returned <= mf.PREFIX.size for g in store.gets_of(big))
        assert store.gets_of(grown) and all(
            g.range is not None and g.returned <= cap + 1 for g in store.gets_of(grown)
        )

    rc, out = run_json(capsys, s3, bucket, "gc", "--config", str(config))
    assert rc == 0, out
    res = out["result"]
    assert res["compactions_skipped"] == {}
    assert out["unread_access_records"] == {access_ns.id: 1}
    assert (res["access_records_merged"], res["access_records_skipped"]) == (1, 1)
    assert big_record in s3.listing(bucket) and record not in s3.listing(bucket)
    assert res["snapshots_written"] == 3 and res["orphan_chunks_published"] == 3
    assert all(len(snapshots_of(s3, bucket, ns.id)) == 1 for ns in (big_ns, grown_ns))
    assert {big, grown} <= set(s3.listing(bucket))  # left for verify to report, not deleted
    capped(faults.opened[-1])

    monkeypatch.setenv(ENV_VAR, "ops-test-fleet-secret-0123456789abcdef")  # heads are read whole then
    rc, out = run_json(capsys, s3, bucket, "gc", "--config", str(config))
    assert rc == 0, out
    assert out["bad_report_segments_skipped"] == 2  # the oversized ones
    assert out["result"]["compactions_skipped"] == {}
    capped(faults.opened[-1])


def test_gc_stops_when_s3_refuses_its_credentials_on_an_orphan(seeded_s3, capsys, faults):
    """Before: an orphan whose GET S3 refused for gc's own credentials (an
    expired token) was taken for this object's refusal, skipped, and gc went
    on (exit 0); as for the objects replicas reported bad, it stops gc now."""
    s3, bucket = seeded_s3, seeded_s3.new_bucket()
    ns = namespace("expired")
    seed_namespace(s3, bucket, ns)
    orphan = object_key(PREFIX, ns.id, key(1), 0)
    s3.seed(bucket, orphan, sound(ns.id, key(1)), OLD)
    faults.store = {"refused": {orphan}}
    capsys.readouterr()
    assert main(["gc", *store_args(s3, bucket), "--json"]) == 3
    assert "ExpiredToken" in capsys.readouterr().err
    assert snapshots_of(s3, bucket, ns.id) == set()


def test_inspect_check_takes_a_descriptor_it_may_not_read_for_none(seeded_s3, capsys, faults):
    """Before: the descriptor's 403 was the object's only problem (exit 1)
    and no frame was read, though it said frames_checked: a flipped frame
    went unseen. Now the frames are checked without the descriptor's pages,
    with a note; a refusal of the caller's credentials stops it (exit 3)."""
    s3, bucket = seeded_s3, seeded_s3.new_bucket()
    ns = namespace("inspected")
    desc = seed_namespace(s3, bucket, ns) + descriptor.NAME
    good, flipped = object_key(PREFIX, ns.id, key(1), 0), object_key(PREFIX, ns.id, key(2), 0)
    s3.seed(bucket, good, sound(ns.id, key(1)), OLD)
    body = bytearray(sound(ns.id, key(2)))
    body[-1] ^= 1  # in the last frame
    s3.seed(bucket, flipped, bytes(body), OLD)

    faults.store = {"denied": {desc}}
    rc, doc = run_json(capsys, s3, bucket, "inspect", good, "--check")
    assert rc == 0 and doc["problems"] == [] and doc["frames_checked"], doc
    assert len(doc["notes"]) == 1 and "AccessDenied" in doc["notes"][0]
    rc, doc = run_json(capsys, s3, bucket, "inspect", flipped, "--check")
    assert rc == 1 and len(doc["problems"]) == 1 and "checksum" in doc["problems"][0], doc
    capsys.readouterr()  # the text says it too
    assert main(["inspect", *store_args(s3, bucket), good, "--check"]) == 0
    assert "descriptor could not be read" in capsys.readouterr().out

    faults.store = {"refused": {desc}}
    capsys.readouterr()
    assert main(["inspect", *store_args(s3, bucket), good, "--check"]) == 3
    assert "ExpiredToken" in capsys.readouterr().err
