"""``s3kv gc`` against a real S3 server: each policy deletes exactly what it
should, as the bucket's listing shows before and after; --dry-run deletes
nothing; a second run is a no-op; two gcs at once take turns. Where listing
and deleting at scale is the point (the first and the last test), the
bucket holds ≥ 10,000 chunk objects in several namespaces; elsewhere a few
hundred (what each policy decides is tested on small inventories in
test_gc_plan.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from s3kv.keys import fingerprint, namespace_prefix
from tests.conftest import load_manifest
from tests.ops import dataset
from tests.ops.dataset import DAY, HOUR, PREFIX
from tests.ops.helpers import run_json, store_args

MIN_AGE = HOUR  # gc's default guard


@pytest.fixture
def ds(seeded_s3):
    d = dataset.build(seeded_s3)
    assert len(d.objects()) >= 10_000 and len(d.namespaces) >= 5
    return d


@pytest.fixture
def small_ds(seeded_s3):
    d = dataset.build(seeded_s3, sizes=(120, 120, 80, 80, 60))
    assert len(d.namespaces) >= 5
    return d


def chunk_listing(s3, ds) -> set[str]:
    return {
        k for k in s3.listing(ds.bucket, PREFIX + "/") if "/manifest/" not in k and not k.endswith(".json")
    }


def idle(ds, c) -> int:
    return ds.now - c.last_used


def expected_max_age(ds, max_age: float, chunks=None) -> set[str]:
    return ds.objects([c for c in (chunks or ds.chunks) if idle(ds, c) > max_age and idle(ds, c) >= MIN_AGE])


def expected_lru(ds, budget: int, chunks=None) -> set[str]:
    chunks = list(chunks or ds.chunks)
    remaining = sum(c.size for c in chunks)
    out = []
    for c in sorted(chunks, key=lambda c: (c.last_used, c.ns, c.key)):
        if remaining <= budget:
            break
        if idle(ds, c) < MIN_AGE:
            continue
        out.append(c)
        remaining -= c.size
    return ds.objects(out)


def manifest_of(s3, ds, ns: str) -> set[int]:
    """The keys a replica starting now would load for ``ns``."""
    return load_manifest(s3.endpoint_url, ds.bucket, namespace_prefix(PREFIX, ns) + "manifest/")


def test_max_age_dry_run_then_delete_then_no_op(seeded_s3, ds, capsys):
    before = chunk_listing(seeded_s3, ds)
    expect = expected_max_age(ds, 14 * DAY)
    assert 1000 < len(expect) < len(before)  # the policy has something to do, and something to keep

    rc, dry = run_json(capsys, seeded_s3, ds.bucket, "gc", "--max-age", "14d", "--dry-run")
    assert rc == 0 and dry["dry_run"]
    assert set(dry["objects"]) == expect
    sizes = seeded_s3.listing(ds.bucket)
    assert dry["bytes_freed"] == sum(sizes[k] for k in expect)
    assert dry["monthly_cost_freed_usd"] == pytest.approx(dry["bytes_freed"] / 2**30 * 0.023, abs=1e-6)
    assert chunk_listing(seeded_s3, ds) == before  # nothing deleted
    assert seeded_s3.listing(ds.bucket, PREFIX + "/gc.lock") == {}  # nor locked

    rc, done = run_json(capsys, seeded_s3, ds.bucket, "gc", "--max-age", "14d")
    assert rc == 0 and not done["dry_run"]
    after = chunk_listing(seeded_s3, ds)
    assert before - after == expect and after <= before
    assert set(done["objects"]) == expect
    assert sum(r["objects"] for r in done["namespaces"].values()) == len(expect)
    # Replicas are told: a replica starting now loads exactly the chunks left.
    for ns in ds.namespaces:
        left = {fingerprint(c.key) for c in ds.of(ns) if not (set(c.objects) & expect)}
        assert manifest_of(seeded_s3, ds, ns) == left
    res = done["result"]
    assert res["tombstone_segments"] == len(ds.namespaces)
    assert res["snapshots_written"] == len(ds.namespaces)
    assert res["segments_deleted"] > 0  # the seeded segments are 30 days old, now in the snapshot
    assert res["access_records_merged"] > 0

    manifest_before = {k: v for k, v in seeded_s3.listing(ds.bucket).items() if "/manifest/" in k}
    rc, again = run_json(capsys, seeded_s3, ds.bucket, "gc", "--max-age", "14d")
    assert rc == 0 and again["objects"] == [] and again["bytes_freed"] == 0
    assert chunk_listing(seeded_s3, ds) == after
    manifest_after = {k: v for k, v in seeded_s3.listing(ds.bucket).items() if "/manifest/" in k}
    assert manifest_after == manifest_before  # no new snapshot, segment or merge either
    assert again["result"]["snapshots_written"] == again["result"]["access_records_merged"] == 0


def test_max_bytes_deletes_least_recently_used_first(seeded_s3, small_ds, capsys):
    ds = small_ds
    before = chunk_listing(seeded_s3, ds)
    total = sum(c.size for c in ds.chunks)
    budget = int(total * 0.4)
    expect = expected_lru(ds, budget)
    rc, dry = run_json(capsys, seeded_s3, ds.bucket, "gc", "--max-bytes", str(budget), "--dry-run")
    assert rc == 0 and set(dry["objects"]) == expect
    assert chunk_listing(seeded_s3, ds) == before
    rc, done = run_json(capsys, seeded_s3, ds.bucket, "gc", "--max-bytes", str(budget))
    assert rc == 0
    after = chunk_listing(seeded_s3, ds)
    assert before - after == expect
    left = seeded_s3.listing(ds.bucket)
    assert sum(left[k] for k in after) <= budget
    # Every chunk kept was used more recently than every chunk deleted.
    deleted = [c for c in ds.chunks if set(c.objects) <= expect]
    kept = [c for c in ds.chunks if not set(c.objects) & expect and idle(ds, c) >= MIN_AGE]
    assert max(c.last_used for c in deleted) <= min(c.last_used for c in kept)
    rc, again = run_json(capsys, seeded_s3, ds.bucket, "gc", "--max-bytes", str(budget))
    assert rc == 0 and again["objects"] == [] and chunk_listing(seeded_s3, ds) == after


def test_policies_combine_and_the_guard_keeps_recent_chunks(seeded_s3, small_ds, capsys):
    """--max-bytes 0 with --max-age and a scope: everything in scope goes but
    what was written or used within --min-age."""
    ds = small_ds
    ns = sorted(ds.namespaces)[:2]
    scoped = [c for c in ds.chunks if c.ns in ns]
    before = chunk_listing(seeded_s3, ds)
    args = ["--max-age", "7d", "--max-bytes", "0", "--namespace", ns[0], "--namespace", ns[1][:8]]
    rc, done = run_json(capsys, seeded_s3, ds.bucket, "gc", *args)
    assert rc == 0
    fresh = [c for c in scoped if idle(ds, c) < MIN_AGE]
    assert fresh  # the guard has something to keep
    assert before - chunk_listing(seeded_s3, ds) == ds.objects(scoped) - ds.objects(fresh)
    assert sum(done["guarded_chunks"].values()) == len(fresh)


def test_retire_and_keep_namespace(seeded_s3, small_ds, capsys):
    ds = small_ds
    ids = sorted(ds.namespaces)
    before = seeded_s3.listing(ds.bucket)
    chunks_before = chunk_listing(seeded_s3, ds)
    # Retire one namespace: its chunks go, bar those the guard keeps, and
    # its manifest stays (a replica may still be writing there).
    rc, done = run_json(capsys, seeded_s3, ds.bucket, "gc", "--namespace", ids[0], "--retire")
    assert rc == 0
    fresh = [c for c in ds.of(ids[0]) if idle(ds, c) < MIN_AGE]
    assert fresh and done["retired_namespaces"] == []
    assert chunks_before - chunk_listing(seeded_s3, ds) == ds.objects(ds.of(ids[0])) - ds.objects(fresh)
    assert set(done["objects"]) == ds.objects(ds.of(ids[0])) - ds.objects(fresh)

    # Keep two, retire the rest whole (no guard): chunks, manifest, descriptor.
    rc, done = run_json(
        capsys,
        seeded_s3,
        ds.bucket,
        "gc",
        "--keep-namespace",
        ids[1],
        "--keep-namespace",
        ids[2],
        "--min-age",
        "0",
    )
    assert rc == 0 and sorted(done["retired_namespaces"]) == sorted(set(ids) - {ids[1], ids[2]})
    after = seeded_s3.listing(ds.bucket)
    for ns in ids:
        listed = {k for k in after if k.startswith(namespace_prefix(PREFIX, ns))}
        if ns in (ids[1], ids[2]):  # untouched, but for the compaction of its manifest
            assert {k for k in listed if "/manifest/" not in k} == {
                k for k in before if k.startswith(namespace_prefix(PREFIX, ns)) and "/manifest/" not in k
            }
            assert manifest_of(seeded_s3, ds, ns) == {fingerprint(c.key) for c in ds.of(ns)}
        else:
            assert listed == set()
    rc, ls = run_json(capsys, seeded_s3, ds.bucket, "ls")
    assert sorted(r["namespace"] for r in ls["namespaces"]) == sorted([ids[1], ids[2]])


def test_incomplete_uploads_are_aborted(seeded_s3, capsys):
    ds = dataset.build(seeded_s3, sizes=(300,), tp=(1,))
    client = seeded_s3.client()
    ns = sorted(ds.namespaces)[0]
    ours = [
        client.create_multipart_upload(Bucket=ds.bucket, Key=f"{PREFIX}/{ns}/ab/upload{i}.r0")["UploadId"]
        for i in range(3)
    ]
    client.create_multipart_upload(Bucket=ds.bucket, Key="other-app/big-file")
    rc, dry = run_json(capsys, seeded_s3, ds.bucket, "gc", "--dry-run")
    assert rc == 0 and len(dry["uploads_to_abort"]) == 3
    assert len(client.list_multipart_uploads(Bucket=ds.bucket).get("Uploads", [])) == 4
    rc, done = run_json(capsys, seeded_s3, ds.bucket, "gc")
    assert rc == 0 and done["result"]["aborted_uploads"] == 3
    left = client.list_multipart_uploads(Bucket=ds.bucket).get("Uploads", [])
    assert [u["Key"] for u in left] == ["other-app/big-file"]  # outside the prefix: not ours
    assert all(u not in {x["UploadId"] for x in left} for u in ours)
    rc, again = run_json(capsys, seeded_s3, ds.bucket, "gc")
    assert rc == 0 and again["result"]["aborted_uploads"] == 0


def test_two_gcs_at_once_take_turns(seeded_s3, ds):
    before = chunk_listing(seeded_s3, ds)
    expect = expected_max_age(ds, 14 * DAY)
    cmd = [
        sys.executable,
        "-m",
        "s3kv.cli",
        "gc",
        *store_args(seeded_s3, ds.bucket),
        "--max-age",
        "14d",
        "--json",
    ]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    docs = [json.loads(o) for o, _ in outs]
    deleted = [set(d["objects"]) for d in docs]
    assert deleted[0] | deleted[1] == expect
    assert not deleted[0] & deleted[1]  # nothing deleted twice
    assert sorted(len(d) for d in deleted) == [0, len(expect)]  # the second found nothing left to do
    assert before - chunk_listing(seeded_s3, ds) == expect
    assert seeded_s3.listing(ds.bucket, PREFIX + "/gc.lock") == {}  # both released the lease


def test_gc_on_a_directory_bucket_tells_replicas_and_lists_as_s3_express_allows(seeded_s3, capsys, tmp_path):
    """S3 Express One Zone: gc through a loopback proxy that lists as a
    directory bucket does (in no order, StartAfter ignored, prefixes only
    ending with '/'), configured by ``bucket_kind``, deletes what its policy
    says, and a replica starting now loads exactly the chunks left."""
    import numpy as np

    from s3kv.cli import main
    from s3kv.manifest import format as mf
    from s3kv.manifest import protocol as mp
    from s3kv.testing.latency_proxy import LatencyProxy

    ds = dataset.build(seeded_s3, sizes=(120, 80), tp=(1, 2), directory=True)
    expect = expected_max_age(ds, 14 * DAY)
    assert expect
    # A flat-layout segment in each namespace (junk, or an s3kv that listed
    # the bucket as general purpose) removing every chunk: its name sorts
    # after every minute-filed one, yet it is no segment of this bucket's.
    for ns in ds.namespaces:
        base = namespace_prefix(PREFIX, ns) + "manifest/"
        fps = np.array(sorted({fingerprint(c.key) for c in ds.of(ns)}), dtype=np.uint64)
        flat = mp.segment_name(base, (ds.now - HOUR) * 1000, "zzzz", 1)
        seeded_s3.seed(ds.bucket, flat, mf.encode(mf.ManifestObject("segment", removed=fps)), ds.now - HOUR)
    with LatencyProxy(seeded_s3.endpoint_url, directory=True) as proxy:
        config = tmp_path / "s3kv.json"
        config.write_text(
            json.dumps(
                {
                    "bucket": ds.bucket,
                    "endpoint_url": proxy.endpoint_url,
                    "region": "us-east-1",
                    "prefix": PREFIX,
                    "bucket_kind": "directory",
                }
            )
        )
        capsys.readouterr()
        rc = main(["gc", "--config", str(config), "--json", "--max-age", "14d"])
        done = json.loads(capsys.readouterr().out)
    assert rc == 0 and set(done["objects"]) == expect
    assert done["result"]["tombstone_segments"] == len(ds.namespaces)
    for ns in ds.namespaces:
        left = {fingerprint(c.key) for c in ds.of(ns) if not (set(c.objects) & expect)}
        base = namespace_prefix(PREFIX, ns) + "manifest/"
        assert load_manifest(seeded_s3.endpoint_url, ds.bucket, base, directory=True) == left
        client = seeded_s3.client()
        snap = max(seeded_s3.listing(ds.bucket, base + "snap/"))  # gc's new one
        horizon = mf.decode(client.get_object(Bucket=ds.bucket, Key=snap)["Body"].read()).meta["horizon"]
        assert mp.parse_name(base, horizon, directory=True) is not None
    assert proxy.shuffled > 0 and proxy.start_after_ignored == 0 and proxy.prefixes_refused == []
