"""``s3kv ls``, ``stats`` and ``inspect`` on a namespace of a model with
several KV cache groups, against a real S3 server: they name its groups,
and count its chunk keys as the parts they are (one a group); a namespace
of one group reads as before, and one whose groups are not what a replica
writes is shown as such."""

from __future__ import annotations

import pytest

from s3kv.cli import main
from s3kv.keys import namespace_prefix
from tests.ops.dataset import PREFIX
from tests.ops.groups import FRAME_BYTES, FRAMES, kv_group, layer_names, namespace, seed
from tests.ops.helpers import run_json, store_args

CHUNKS = 5


@pytest.fixture(scope="module")
def bucket(seeded_s3):
    """A grouped namespace (TP 2), a namespace of one group, and one whose kv_groups name a
    kind s3kv does not share (its id hashes right: anyone may make such a namespace)."""
    s3 = seeded_s3
    name = s3.new_bucket()
    grouped = seed(s3, name, namespace("gemma", tp=2), CHUNKS, tp=2)
    plain = namespace("llama", num_layers=2, kv_groups=None)
    seed(s3, name, plain, 4, groups=[kv_group("full", 0, layer_names(0, 1))])
    odd_groups = [
        kv_group("full", 0, layer_names(0)),
        {**kv_group("full", 0, layer_names(1)), "kind": "mamba"},
    ]
    odd = seed(s3, name, namespace("odd", kv_groups=odd_groups), 2, groups=odd_groups)
    return name, grouped, plain, odd


def test_ls_names_the_groups_and_counts_parts(seeded_s3, bucket, capsys):
    name, grouped, plain, odd = bucket
    rc, doc = run_json(capsys, seeded_s3, name, "ls")
    assert rc == 0
    rows = {r["namespace"]: r for r in doc["namespaces"]}
    g = rows[grouped.ns.id]
    assert g["layout"] == (
        "bfloat16, 3 groups (2x sliding_window 1024 + 1x full, 2-3 layers each), ?x?, block 16, chunk 64, tp2"
    )
    assert g["groups"] == 3 and g["kv_groups"] == [
        {"group": 0, "kind": "sliding_window", "window": 1024, "layers": 3},
        {"group": 1, "kind": "sliding_window", "window": 1024, "layers": 2},
        {"group": 2, "kind": "full", "window": 0, "layers": 3},
    ]
    # Its chunk keys are parts: one a group; each with an object a rank.
    assert (g["chunks"], g["objects"], g["chunks_estimate"]) == (3 * CHUNKS, 3 * CHUNKS * 2, CHUNKS)
    p = rows[plain.id]
    assert p["layout"].startswith("bfloat16, 2L, ") and p["groups"] == 1 and p["kv_groups"] is None
    assert p["chunks"] == p["chunks_estimate"] == 4
    o = rows[odd.ns.id]
    assert "KV cache groups unread" in o["layout"] and o["groups"] is None and o["chunks_estimate"] is None

    capsys.readouterr()
    assert main(["ls", *store_args(seeded_s3, name)]) == 0
    text = capsys.readouterr().out
    assert f"~{CHUNKS} ({3 * CHUNKS} parts)" in text
    assert "3 groups (2x sliding_window 1024" in text  # the layout cell (folded in the table)
    assert (
        f"3 namespace(s), ~{CHUNKS + 4 + 2 * 2} chunks in {3 * CHUNKS + 4 + 2 * 2} chunk and part keys"
        in text
    )


def test_stats_counts_each_namespaces_parts(seeded_s3, bucket, capsys):
    name, grouped, plain, odd = bucket
    rc, st = run_json(capsys, seeded_s3, name, "stats", "--sample", "4")
    assert rc == 0
    assert st["chunks"] == 3 * CHUNKS + 4 + 2 * 2  # as before: chunk keys, parts among them
    by = st["by_namespace"]
    assert by[grouped.ns.id]["groups"] == 3 and by[grouped.ns.id]["chunks_estimate"] == CHUNKS
    assert by[grouped.ns.id]["objects"] == 3 * CHUNKS * 2
    assert [g["kind"] for g in by[grouped.ns.id]["kv_groups"]] == ["sliding_window", "sliding_window", "full"]
    assert by[plain.id]["groups"] == 1 and by[plain.id]["chunks_estimate"] == 4
    assert by[odd.ns.id]["groups"] is None
    assert sum(r["objects"] for r in by.values()) == st["objects"]
    assert sum(r["bytes"] for r in by.values()) == st["bytes"]

    capsys.readouterr()
    assert main(["stats", *store_args(seeded_s3, name), "--sample", "4"]) == 0
    text = capsys.readouterr().out
    assert "chunks by namespace" in text and "one part object per group" in text
    cells = [c.strip() for c in next(r for r in text.splitlines() if grouped.ns.id in r).split("│")]
    assert cells[2:5] == ["3", str(3 * CHUNKS), str(3 * CHUNKS * 2)] and cells[6] == str(CHUNKS)


def test_inspect_a_namespace_lists_its_groups(seeded_s3, bucket, capsys):
    name, grouped, plain, odd = bucket
    ns = grouped.ns.id
    rc, doc = run_json(capsys, seeded_s3, name, "inspect", ns)  # by its id
    assert rc == 0 and doc["problems"] == []
    assert doc["type"] == "namespace descriptor" and doc["namespace"] == ns
    assert (doc["tp_size"], doc["frames"], doc["frame_bytes"], doc["chunk_tokens"]) == (
        2,
        FRAMES,
        FRAME_BYTES,
        64,
    )
    assert [(g["kind"], g["window"], g["layers"]) for g in doc["kv_groups"]] == [
        ("sliding_window", 1024, 3),
        ("sliding_window", 1024, 2),
        ("full", 0, 3),
    ]
    assert doc["kv_groups"][2]["layer_names"] == layer_names(3, 6, 7)
    rc, same = run_json(capsys, seeded_s3, name, "inspect", f"{namespace_prefix(PREFIX, ns)}namespace.json")
    assert rc == 0 and same == doc

    capsys.readouterr()
    assert main(["inspect", *store_args(seeded_s3, name), ns]) == 0
    text = capsys.readouterr().out
    assert "KV cache groups" in text
    assert (
        "model.layers.0.self_attn.attn, model.layers.1.self_attn.attn, model.layers.2.self_attn.attn" in text
    )
    assert "sliding_window" in text and "1024" in text

    rc, plain_doc = run_json(capsys, seeded_s3, name, "inspect", plain.id)
    assert rc == 0 and plain_doc["kv_groups"] is None and plain_doc["frames"] == 2
    rc, odd_doc = run_json(capsys, seeded_s3, name, "inspect", odd.ns.id)
    assert rc == 1 and odd_doc["kv_groups"] is None and odd_doc["frames"] is None
    assert "kv_groups are not KV cache groups s3kv writes" in odd_doc["problems"][0]


def test_inspect_of_a_forged_descriptor_says_the_ops_commands_ignore_it(seeded_s3, capsys):
    s3, name = seeded_s3, seeded_s3.new_bucket()
    ns = namespace("forged")
    seed(s3, name, ns, 1)
    key = f"{namespace_prefix(PREFIX, ns.id)}namespace.json"
    body = s3.client().get_object(Bucket=name, Key=key)["Body"].read()
    s3.client().put_object(Bucket=name, Key=key, Body=body.replace(b'"window": 1024', b'"window": 4096', 1))
    rc, doc = run_json(capsys, s3, name, "inspect", ns.id)
    assert rc == 1 and "kv_groups" not in doc
    assert "do not hash to that id" in doc["problems"][0]
    rc, layout = run_json(capsys, s3, name, "ls")
    assert layout["namespaces"][0]["groups"] is None  # nor does ls take its groups
