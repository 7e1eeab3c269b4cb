"""``s3kv ls``, ``stats``, ``inspect`` and ``verify`` against a real S3
server, and the one-line errors every command gives for bad input."""

from __future__ import annotations

import json
import random

import pytest

from s3kv import codec
from s3kv.keys import namespace_prefix
from tests.ops import dataset
from tests.ops.dataset import PREFIX
from tests.ops.helpers import run_json, run_process, store_args


@pytest.fixture(scope="module")
def bucket(seeded_s3):
    """One bucket the read-only tests share (≥ 10,000 chunk objects)."""
    return dataset.build(seeded_s3)


def test_ls_reports_every_namespace(seeded_s3, bucket, capsys):
    ds = bucket
    rc, doc = run_json(capsys, seeded_s3, ds.bucket, "ls")
    assert rc == 0
    rows = {r["namespace"]: r for r in doc["namespaces"]}
    assert set(rows) == set(ds.namespaces)
    for ns, row in rows.items():
        chunks = ds.of(ns)
        assert row["chunks"] == len(chunks)
        assert row["objects"] == len(chunks) * ds.namespaces[ns]
        assert row["bytes"] == sum(c.size for c in chunks)
        assert row["oldest_write"] == min(c.written for c in chunks)
        assert row["newest_write"] == max(c.written for c in chunks)
        assert row["last_access"] == max(c.accessed for c in chunks if c.accessed)
        assert row["model"] == f"model-{list(ds.namespaces).index(ns)}"
        assert row["layout"].endswith(f"tp{ds.namespaces[ns]}")


def test_ls_table_and_stats(seeded_s3, bucket, capsys):
    from s3kv.cli import main

    ds = bucket
    capsys.readouterr()
    assert main(["ls", *store_args(seeded_s3, ds.bucket)]) == 0
    text = capsys.readouterr().out
    for ns in ds.namespaces:
        assert ns in text
    rc, st = run_json(capsys, seeded_s3, ds.bucket, "stats", "--sample", "200")
    assert rc == 0
    assert st["objects"] == len(ds.objects()) and st["chunks"] == len(ds.chunks)
    assert sum(r["objects"] for r in st["size_histogram"]) == st["objects"]
    assert sum(r["bytes"] for r in st["size_histogram"]) == st["bytes"]
    assert sum(r["chunks"] for r in st["age_histogram"]) == len(ds.chunks)
    assert sum(r["chunks"] for r in st["idle_histogram"]) == len(ds.chunks)
    # Half the seeded pages are zeros: the sampled ratio is well above 1.
    assert st["compression"]["sampled"] == 200 and st["compression"]["ratio"] > 1.3
    for ns, m in st["manifest"].items():
        assert m["segments"] == -(-len(ds.of(ns)) // 200) and len(m["snapshots"]) == 1
        assert m["snapshots"][0]["keys"] == len(ds.of(ns)) and m["segments_after_snapshot"] == 0
    rc, one = run_json(capsys, seeded_s3, ds.bucket, "stats", "--namespace", sorted(ds.namespaces)[0][:6])
    assert rc == 0 and one["namespaces"] == 1 and one["chunks"] == len(ds.of(sorted(ds.namespaces)[0]))


def test_inspect_shows_a_chunk_header(seeded_s3, bucket, capsys):
    ds = bucket
    chunk = next(c for c in ds.chunks if ds.namespaces[c.ns] == 2)
    name = sorted(chunk.objects)[1]
    body = seeded_s3.client().get_object(Bucket=ds.bucket, Key=name)["Body"].read()
    header = codec.parse_header(body)
    rc, doc = run_json(capsys, seeded_s3, ds.bucket, "inspect", name, "--check")
    assert rc == 0 and doc["problems"] == []
    assert (doc["namespace"], doc["key"], doc["shard"], doc["frames"]) == (chunk.ns, chunk.key.hex(), 1, 2)
    assert doc["raw_bytes"] == header.raw_bytes and doc["object_bytes"] == len(body)
    # By chunk key: both shards (one a rank); with .r0: one; a name relative to the prefix works too.
    rc, both = run_json(capsys, seeded_s3, ds.bucket, "inspect", chunk.key.hex())
    assert rc == 0 and sorted(d["shard"] for d in both) == [0, 1]
    rc, r0 = run_json(capsys, seeded_s3, ds.bucket, "inspect", chunk.key.hex() + ".r0")
    assert rc == 0 and r0["shard"] == 0
    rc, rel = run_json(capsys, seeded_s3, ds.bucket, "inspect", name.removeprefix(PREFIX + "/"))
    assert rc == 0 and rel["object"] == name
    seg = next(k for k in ds.other if "/manifest/seg/" in k)
    rc, m = run_json(capsys, seeded_s3, ds.bucket, "inspect", seg)
    assert rc == 0 and m["type"] == "manifest segment" and m["added"] > 0


def _corrupt(seeded_s3, ds, rng: random.Random) -> dict[str, str]:
    """Damage objects in a new namespace-sharing copy: returns name -> how."""
    client = seeded_s3.client()
    names = sorted(ds.objects())
    picks = rng.sample(names, 6)
    how: dict[str, str] = {}

    def put(name: str, data: bytes) -> None:
        client.put_object(Bucket=ds.bucket, Key=name, Body=data)

    def get(name: str) -> bytes:
        return client.get_object(Bucket=ds.bucket, Key=name)["Body"].read()

    a, b, c, d, e, f = picks
    data = bytearray(get(a))
    data[-1] ^= 0x10  # a bit flip in the last frame
    put(a, bytes(data))
    how[a] = "checksum"
    put(b, get(b)[:-7])  # truncated
    how[b] = "length"
    put(c, get(d))  # another chunk's object under this name
    how[c] = "identity"
    put(e, b"not a chunk at all")
    how[e] = "magic"
    data = bytearray(get(f))
    data[30] ^= 0x01  # inside the JSON header
    put(f, bytes(data))
    how[f] = "header"
    seg = sorted(k for k in ds.other if "/manifest/seg/" in k)[0]
    put(seg, get(seg)[:-8])
    how[seg] = "manifest"
    return how


def test_verify_finds_every_corrupted_object_and_no_other(seeded_s3, capsys):
    # Smaller than the gc tests' buckets: verify --all reads every object, five times.
    ds = dataset.build(seeded_s3, sizes=(250, 150, 100), tp=(1, 2, 1), seed=7)
    rc, clean = run_json(capsys, seeded_s3, ds.bucket, "verify", "--all")
    assert rc == 0 and clean["corrupt"] == [] and clean["foreign"] == []
    assert clean["checked"] == len(ds.objects()) + len(ds.other)

    damaged = _corrupt(seeded_s3, ds, random.Random(1))
    ns = sorted(ds.namespaces)[0]
    foreign = [f"{PREFIX}/notes.txt", f"{namespace_prefix(PREFIX, ns)}stray.bin", f"{PREFIX}/backup/x"]
    for name in foreign:
        seeded_s3.client().put_object(Bucket=ds.bucket, Key=name, Body=b"x")
    rc, rep = run_json(capsys, seeded_s3, ds.bucket, "verify", "--all")
    assert rc == 1
    assert {p["key"] for p in rep["corrupt"]} == set(damaged)
    assert {p["key"] for p in rep["foreign"]} == set(foreign)

    # A sample checks that many objects; the foreign ones are reported anyway.
    rc, sample = run_json(capsys, seeded_s3, ds.bucket, "verify", "--sample", "50", "--seed", "3")
    assert rc == 1 and sample["checked"] == 50 and len(sample["foreign"]) == 3

    # --delete-corrupt removes them (every rank of a damaged chunk), never foreign objects.
    rc, fixed = run_json(capsys, seeded_s3, ds.bucket, "verify", "--all", "--delete-corrupt")
    assert rc == 1
    chunks = {c.key: c for c in ds.chunks}
    from s3kv.keys import parse_object_key

    expect = set()
    for name in damaged:
        parsed = parse_object_key(name)
        expect |= set(chunks[parsed[1]].objects) if parsed else {name}
    assert set(fixed["deleted"]) == expect
    listing = seeded_s3.listing(ds.bucket)
    assert not expect & set(listing) and set(foreign) <= set(listing)
    for name in foreign:
        seeded_s3.client().delete_object(Bucket=ds.bucket, Key=name)
    rc, after = run_json(capsys, seeded_s3, ds.bucket, "verify", "--all")
    assert rc == 0 and after["corrupt"] == []
    tombstones = len({parse_object_key(n)[0] for n in damaged if parse_object_key(n)})
    assert after["checked"] == len(ds.objects()) + len(ds.other) - len(expect) + tombstones


@pytest.fixture
def cfg(tmp_path, seeded_s3, bucket):
    path = tmp_path / "kv.json"
    path.write_text(
        json.dumps(
            {
                "kv_connector": "S3KVConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "bucket": bucket.bucket,
                    "prefix": PREFIX,
                    "endpoint_url": seeded_s3.endpoint_url,
                    "region": "us-east-1",
                },
            }
        )
    )
    return path


def test_config_file_and_environment_name_the_bucket(seeded_s3, bucket, cfg, capsys):
    from s3kv.cli import main

    capsys.readouterr()
    assert main(["ls", "--config", str(cfg), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["namespaces"]) == len(bucket.namespaces)
    env = {
        "S3KV_BUCKET": bucket.bucket,
        "S3KV_PREFIX": PREFIX,
        "S3KV_ENDPOINT_URL": seeded_s3.endpoint_url,
        "S3KV_REGION": "us-east-1",
    }
    p = run_process("ls", "--json", env=env)
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)["namespaces"]) == len(bucket.namespaces)


BAD = [
    # (arguments after the store options, exit code, words the message must hold)
    (["gc", "--namespace", "feedbeef", "--dry-run"], 2, "unknown namespace 'feedbeef'"),
    (["gc", "--max-age", "7 fortnights"], 2, "--max-age"),
    (["gc", "--max-bytes", "12 parsecs"], 2, "--max-bytes"),
    (["gc", "--min-age", "-5m"], 2, "--min-age"),
    (["gc", "--retire"], 2, "--retire needs --namespace"),
    (["verify", "--sample", "0"], 2, "--sample"),
    (["stats", "--namespace", "0"], 2, "unknown namespace"),
    (["gc", "--frobnicate"], 2, "--frobnicate"),
]


@pytest.mark.parametrize(("args", "code", "words"), BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_gives_one_line_error(seeded_s3, bucket, args, code, words):
    p = run_process(args[0], *store_args(seeded_s3, bucket.bucket), *args[1:])
    assert p.returncode == code
    assert p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("s3kv: error: ") and words in lines[0], p.stderr


def test_storage_problems_give_one_line_error(seeded_s3, bucket, tmp_path):
    cases = [
        # no credentials anywhere in the AWS chain
        (
            store_args(seeded_s3, bucket.bucket),
            {
                "AWS_ACCESS_KEY_ID": None,
                "AWS_SECRET_ACCESS_KEY": None,
                "AWS_SESSION_TOKEN": None,
                "AWS_PROFILE": None,
                "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                "AWS_CONFIG_FILE": str(tmp_path / "none"),
                "AWS_EC2_METADATA_DISABLED": "true",
            },
            3,
            "credentials",
        ),
        (store_args(seeded_s3, "no-such-bucket-here"), {}, 3, "no such bucket"),
        (
            ["--bucket", bucket.bucket, "--endpoint-url", "http://127.0.0.1:9", "--region", "us-east-1"],
            {},
            3,
            "127.0.0.1:9",
        ),
        ([], {}, 2, "no bucket"),
        (["--config", str(tmp_path / "missing.json")], {}, 2, "missing.json"),
    ]
    (tmp_path / "typo.json").write_text(json.dumps({"bucket": bucket.bucket, "bukket": "x"}))
    cases.append((["--config", str(tmp_path / "typo.json")], {}, 2, "unknown s3kv config key 'bukket'"))
    for opts, env, code, words in cases:
        p = run_process("ls", *opts, env={"S3KV_BUCKET": "", **env}, timeout=120)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == code, (opts, p.stderr)
        assert len(lines) == 1 and lines[0].startswith("s3kv: error: ") and words in lines[0], (
            opts,
            p.stderr,
        )


def test_the_tools_on_a_directory_bucket_list_as_s3_express_allows(seeded_s3, capsys, tmp_path):
    """ls, stats, inspect (by chunk key) and verify through a loopback proxy
    that lists as an S3 Express directory bucket (in no order, StartAfter
    ignored, prefixes only ending with '/'), configured by ``bucket_kind``:
    the same answers as on a general-purpose bucket, and no listing that a
    directory bucket would refuse."""
    from s3kv.cli import main
    from s3kv.testing.latency_proxy import LatencyProxy

    ds = dataset.build(seeded_s3, sizes=(120, 80), tp=(1, 2), seed=11, directory=True)
    with LatencyProxy(seeded_s3.endpoint_url, directory=True) as proxy:
        config = tmp_path / "s3kv.json"
        settings = {"bucket": ds.bucket, "endpoint_url": proxy.endpoint_url, "region": "us-east-1"}
        config.write_text(json.dumps({**settings, "prefix": PREFIX, "bucket_kind": "directory"}))

        def run(*args: str):
            capsys.readouterr()
            rc = main([args[0], "--config", str(config), "--json", *args[1:]])
            return rc, json.loads(capsys.readouterr().out)

        rc, ls = run("ls")
        rows = {r["namespace"]: r for r in ls["namespaces"]}
        assert rc == 0 and set(rows) == set(ds.namespaces)
        assert all(rows[ns]["chunks"] == len(ds.of(ns)) for ns in ds.namespaces)
        rc, st = run("stats", "--sample", "20")
        assert rc == 0 and st["objects"] == len(ds.objects()) and st["chunks"] == len(ds.chunks)
        for ns, m in st["manifest"].items():
            assert m["segments"] == -(-len(ds.of(ns)) // 200) and len(m["snapshots"]) == 1
        chunk = next(c for c in ds.chunks if ds.namespaces[c.ns] == 2)
        rc, both = run("inspect", chunk.key.hex())
        assert rc == 0 and sorted(d["shard"] for d in both) == [0, 1]
        rc, clean = run("verify", "--all")
        assert rc == 0 and clean["corrupt"] == [] and clean["foreign"] == []
        assert clean["checked"] == len(ds.objects()) + len(ds.other)
    assert proxy.listings > 0 and proxy.shuffled > 0
    assert proxy.start_after_ignored == 0 and proxy.prefixes_refused == []
