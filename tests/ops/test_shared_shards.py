"""``s3kv ls``, ``inspect``, ``gc`` and ``verify`` on namespaces that
replicas of every TP size share (``kv_shards``, :mod:`s3kv.shards`),
against a real S3 server: a chunk is whole once each of its shard objects
(``.r0`` to ``.r{S-1}``) is stored, whatever TP size wrote them, so gc
publishes a complete unnamed chunk of 4 shards and not one of 3, and a
rank segment's chunk is not taken for whole from shard objects that are no
rank's; ls and inspect name the shards, not a TP size."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np

from s3kv import descriptor
from s3kv.keys import Namespace, fingerprint, namespace_prefix, object_key
from s3kv.manifest import format as mf
from s3kv.manifest import protocol as mp
from tests.ops.dataset import DAY, PREFIX
from tests.ops.groups import BLOCK, PAGE, TOKENS, part
from tests.ops.helpers import run_json
from tests.ops.test_gc import manifest_of

LAYERS = 2
BY_HEAD = {"mode": "heads", "shards": 4, "heads_per_shard": 2}
REPLICATED = {"mode": "replicated", "shards": 1, "heads_per_shard": 0}


def shared(model: str, kv_shards: dict) -> Namespace:
    """A namespace as a replica of any TP size makes it: ``kv_shards``, no ``tp_size``."""
    return Namespace.from_fields(
        {
            "model": model,
            "num_layers": LAYERS,
            "block_size": BLOCK,
            "page_size_bytes": PAGE,
            "num_kv_heads": 8,
            "head_size": 64,
            "model_dtype": "torch.bfloat16",
            "kv_cache_dtype": "auto",
            "kv_shards": kv_shards,
        }
    )


def store(s3, bucket: str, ns: Namespace, key: bytes, shards, written: float) -> list[str]:
    """``key``'s objects of shards ``shards``, each a sound chunk object of that shard."""
    names = [object_key(PREFIX, ns.id, key, s) for s in shards]
    for s, name in zip(shards, names):
        s3.seed(bucket, name, part(ns.id, key, s, LAYERS, frames=LAYERS), written)
    return names


def describe(s3, bucket: str, ns: Namespace, written: float) -> str:
    base = namespace_prefix(PREFIX, ns.id)
    s3.seed(bucket, base + descriptor.NAME, descriptor.encode(ns, "m", TOKENS), written)
    return base


def segment(s3, bucket: str, base: str, keys: list[bytes], ts: float, writer: str, **meta) -> None:
    obj = mf.ManifestObject("segment", np.array([fingerprint(k) for k in keys], np.uint64), meta=meta)
    s3.seed(bucket, mp.segment_name(base + "manifest/", int(ts * 1000), writer, 1), mf.encode(obj), ts)


def test_gc_takes_a_chunk_of_every_shard_for_whole_and_one_of_fewer_not(seeded_s3, capsys):
    s3 = seeded_s3
    bucket = s3.new_bucket()
    now = time.time()
    ns = shared("sliced", BY_HEAD)
    base = describe(s3, bucket, ns, now - DAY)
    named, orphan, forged, three, ranked = (bytes([i]) * 16 for i in (1, 2, 3, 4, 5))
    for key in (named, orphan, forged):
        store(s3, bucket, ns, key, range(4), now - 2 * DAY)
    bad = object_key(PREFIX, ns.id, forged, 3)
    body = s3.client().get_object(Bucket=bucket, Key=bad)["Body"].read()
    s3.seed(bucket, bad, body[:-7] + b"garbage", now - 2 * DAY)  # a frame that does not verify
    # Shards 0 to 2 of 4: the chunk is not whole, unnamed or named by one rank of a TP 2 replica.
    store(s3, bucket, ns, three, range(3), now - 2 * DAY)
    store(s3, bucket, ns, ranked, range(3), now - 2 * DAY)
    segment(s3, bucket, base, [named], now - 2 * DAY, "w0")
    segment(s3, bucket, base, [ranked], now - 60, "w1", rank=0, ranks=2)

    where = SimpleNamespace(bucket=bucket)
    assert manifest_of(s3, where, ns.id) == {fingerprint(named)}  # what replicas see before gc

    rc, out = run_json(capsys, s3, bucket, "gc")
    assert rc == 0, out
    res = out["result"]
    # The orphan of 4 shards verifies and is published, the forged one is refused; the
    # chunks of 3 shards are not whole, so neither judged nor published.
    assert res["orphan_chunks_published"] == 1 and res["orphan_chunks_refused"] == 1
    assert res["orphan_chunks_skipped"] == 0 and res["snapshots_written"] == 1
    assert manifest_of(s3, where, ns.id) == {fingerprint(named), fingerprint(orphan)}


def test_a_replicated_chunk_is_whole_with_its_one_shard(seeded_s3, capsys):
    """One shard a chunk (MLA's latent KV, written by one rank of any TP
    size): an unnamed chunk with its ``.r0`` is whole, and gc publishes it."""
    s3 = seeded_s3
    bucket = s3.new_bucket()
    now = time.time()
    ns = shared("latent", REPLICATED)
    base = describe(s3, bucket, ns, now - DAY)
    named, orphan = bytes([1]) * 16, bytes([2]) * 16
    for key in (named, orphan):
        store(s3, bucket, ns, key, [0], now - 2 * DAY)
    segment(s3, bucket, base, [named], now - 2 * DAY, "w0")
    rc, out = run_json(capsys, s3, bucket, "gc")
    assert rc == 0, out
    assert out["result"]["orphan_chunks_published"] == 1 and out["result"]["orphan_chunks_skipped"] == 0
    assert manifest_of(s3, SimpleNamespace(bucket=bucket), ns.id) == {fingerprint(named), fingerprint(orphan)}


def test_ls_and_inspect_name_the_shards_not_a_tp_size(seeded_s3, capsys):
    s3 = seeded_s3
    bucket = s3.new_bucket()
    now = time.time()
    sliced, latent = shared("sliced", BY_HEAD), shared("latent", REPLICATED)
    for ns, shards in ((sliced, range(4)), (latent, [0])):
        describe(s3, bucket, ns, now - DAY)
        store(s3, bucket, ns, bytes([7]) * 16, shards, now - DAY)
    rc, doc = run_json(capsys, s3, bucket, "ls")
    assert rc == 0
    rows = {r["namespace"]: r for r in doc["namespaces"]}
    assert rows[sliced.id]["layout"].endswith(", tp any, 4 shards by head")
    assert rows[latent.id]["layout"].endswith(", tp any, 1 shard (replicated)")
    assert (rows[sliced.id]["shards"], rows[sliced.id]["objects"]) == (4, 4)
    assert (rows[latent.id]["shards"], rows[latent.id]["objects"]) == (1, 1)

    rc, d = run_json(capsys, s3, bucket, "inspect", sliced.id)
    assert rc == 0 and d["problems"] == []
    assert (d["tp_size"], d["shards"], d["shard_mode"]) == (None, 4, "heads")
    assert d["frame_bytes"] == TOKENS // BLOCK * PAGE  # one shard's pages

    odd = shared("odd", {**BY_HEAD, "shards": 3.5})  # its id hashes right: anyone may make one
    describe(s3, bucket, odd, now - DAY)
    rc, d = run_json(capsys, s3, bucket, "inspect", odd.id)
    assert rc == 1 and d["shards"] is None and d["frame_bytes"] is None
    assert any("kv_shards" in p for p in d["problems"])
    rc, doc = run_json(capsys, s3, bucket, "ls")
    row = next(r for r in doc["namespaces"] if r["namespace"] == odd.id)
    assert row["layout"].endswith(", kv_shards unread") and row["shards"] is None


def test_verify_deletes_every_shard_of_a_damaged_chunk(seeded_s3, capsys):
    s3 = seeded_s3
    bucket = s3.new_bucket()
    now = time.time()
    ns = shared("sliced", BY_HEAD)
    describe(s3, bucket, ns, now - DAY)
    sound, damaged = bytes([1]) * 16, bytes([2]) * 16
    kept = store(s3, bucket, ns, sound, range(4), now - DAY)
    gone = store(s3, bucket, ns, damaged, range(4), now - DAY)
    s3.seed(bucket, gone[2], part(ns.id, damaged, 1, LAYERS, frames=LAYERS), now - DAY)  # shard 1's bytes
    rc, rep = run_json(capsys, s3, bucket, "verify", "--all", "--delete-corrupt")
    assert rc == 1
    assert [p["key"] for p in rep["corrupt"]] == [gone[2]]
    assert set(rep["deleted"]) == set(gone)
    listing = set(s3.listing(bucket, namespace_prefix(PREFIX, ns.id)))
    assert set(kept) <= listing and not set(gone) & listing
