"""``s3kv verify`` and ``gc`` on a namespace of a model with several KV
cache groups, against a real S3 server: each part object is a chunk object
of ``num_layers`` frames (a group of fewer layers pads with zero frames), so
verify passes sound parts and reports a damaged one (a padding frame
included) and no other part of its chunk; gc ages, deletes and publishes
parts as it does chunks; and a descriptor naming fewer frames than a
group's layers is not held against the parts."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np

from s3kv import codec
from s3kv.keys import fingerprint, namespace_prefix, object_key
from s3kv.kvgroups import part_key
from s3kv.manifest import format as mf
from s3kv.manifest import protocol as mp
from tests.ops.dataset import DAY, HOUR, PREFIX
from tests.ops.groups import KV_GROUPS, namespace, part, seed
from tests.ops.helpers import run_json
from tests.ops.test_gc import manifest_of


def _get(s3, bucket: str, name: str) -> bytes:
    return s3.client().get_object(Bucket=bucket, Key=name)["Body"].read()


def test_verify_passes_sound_parts_and_reports_a_damaged_one_only(seeded_s3, capsys):
    s3, bucket = seeded_s3, seeded_s3.new_bucket()
    ns = namespace("gemma", tp=2)
    seeded = seed(s3, bucket, ns, 4, tp=2)
    rc, clean = run_json(capsys, s3, bucket, "verify", "--all")
    assert rc == 0 and clean["corrupt"] == [] and clean["foreign"] == []
    assert clean["checked"] == len(seeded.objects()) + 2  # and the descriptor and segment

    # A bit flipped in the zero frame that pads group 1 (2 layers) to 3 frames.
    padded = seeded.parts[2, 1][1]
    data = bytearray(_get(s3, bucket, padded))
    data[codec.parse_header(bytes(data)).frames[2].offset] ^= 0x01
    s3.client().put_object(Bucket=bucket, Key=padded, Body=bytes(data))
    # A part without its padding: 2 frames where every part of the namespace has 3.
    short = seeded.parts[0, 1][0]
    key = part_key(seeded.chains[0], 1)
    s3.client().put_object(Bucket=bucket, Key=short, Body=part(ns.id, key, 0, 2, frames=2))
    rc, rep = run_json(capsys, s3, bucket, "verify", "--all")
    assert rc == 1
    problems = {p["key"]: p["reason"] for p in rep["corrupt"]}
    assert set(problems) == {padded, short}
    assert "2 layers, this model has 3" in problems[short]

    # --delete-corrupt: both ranks of each damaged part; the chunk's other parts stay.
    rc, fixed = run_json(capsys, s3, bucket, "verify", "--all", "--delete-corrupt")
    assert rc == 1
    damaged = {*seeded.parts[2, 1], *seeded.parts[0, 1]}
    assert set(fixed["deleted"]) == damaged
    listing = set(s3.listing(bucket, namespace_prefix(PREFIX, ns.id)))
    assert listing & seeded.objects() == seeded.objects() - damaged
    rc, after = run_json(capsys, s3, bucket, "verify", "--all")
    assert rc == 0 and after["corrupt"] == []


def test_a_descriptor_naming_fewer_frames_than_a_groups_layers_is_not_held_against_its_parts(
    seeded_s3, capsys
):
    """num_layers 2, a group of 3 layers: the descriptor does not say what
    its parts hold, so its parts (3 frames) are checked without its pages,
    not found corrupt against it (nor deleted by --delete-corrupt); what is
    damaged still is."""
    s3, bucket = seeded_s3, seeded_s3.new_bucket()
    ns = namespace("gemma", num_layers=2)
    seeded = seed(s3, bucket, ns, 3)
    junk = seeded.parts[1, 2][0]
    s3.client().put_object(Bucket=bucket, Key=junk, Body=b"not a chunk at all")
    rc, rep = run_json(capsys, s3, bucket, "verify", "--all", "--delete-corrupt")
    assert rc == 1 and [p["key"] for p in rep["corrupt"]] == [junk]
    assert rep["deleted"] == [junk]
    assert set(s3.listing(bucket, namespace_prefix(PREFIX, ns.id))) >= seeded.objects() - {junk}


def test_gc_ages_deletes_and_publishes_parts_as_chunk_objects(seeded_s3, capsys):
    s3, bucket = seeded_s3, seeded_s3.new_bucket()
    ns = namespace("gemma")
    now = time.time()
    seeded = seed(s3, bucket, ns, 4, written=now - 30 * DAY)
    base = namespace_prefix(PREFIX, ns.id) + "manifest/"
    # Hits of late used only the full-attention group's parts (the windows had moved on).
    full = [part_key(c, 2) for c in seeded.chains]
    used = np.array(sorted(fingerprint(k) for k in full), np.uint64)
    s3.seed(
        bucket, mp.access_name(base, int((now - 3 * HOUR) * 1000), "w0", 1),
        mf.encode(mf.ManifestObject("access", used)), now - 3 * HOUR,
    )  # fmt: skip
    # A chunk whose parts a replica stored but never published: one part lacks its padding.
    orphan = bytes(range(16))
    orphans = {}
    for g, group in enumerate(KV_GROUPS):
        k = part_key(orphan, g)
        name = orphans[g] = object_key(PREFIX, ns.id, k, 0)
        body = part(ns.id, k, 0, len(group["layers"]), frames=2 if g == 1 else 3)
        s3.seed(bucket, name, body, now - 2 * DAY)

    stale = {n for (_c, g), names in seeded.parts.items() if g != 2 for n in names}
    rc, dry = run_json(capsys, s3, bucket, "gc", "--max-age", "7d", "--dry-run")
    assert rc == 0 and set(dry["objects"]) == stale
    rc, done = run_json(capsys, s3, bucket, "gc", "--max-age", "7d")
    assert rc == 0 and set(done["objects"]) == stale
    listing = set(s3.listing(bucket, namespace_prefix(PREFIX, ns.id)))
    assert listing >= {n for (_c, g), names in seeded.parts.items() if g == 2 for n in names}
    assert not listing & stale
    res = done["result"]
    assert (res["orphan_chunks_published"], res["orphan_chunks_refused"]) == (2, 1)
    # A replica starting now loads the full group's parts and the orphan's sound parts.
    expect = {fingerprint(k) for k in full} | {fingerprint(part_key(orphan, g)) for g in (0, 2)}
    assert manifest_of(s3, SimpleNamespace(bucket=bucket), ns.id) == expect
