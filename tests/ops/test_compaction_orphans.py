"""``s3kv gc`` finds the chunks a replica stored but never published (it was
killed between its PUTs and its segment): complete ones that verify join the
new snapshot, so replicas starting next see them; an object under a chunk
name that does not verify, or a chunk missing a rank, does not."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import numpy as np

from s3kv import descriptor
from s3kv.keys import Namespace, fingerprint, namespace_prefix, object_key
from s3kv.manifest import format as mf
from s3kv.manifest import protocol as mp
from tests.ops.dataset import DAY, PREFIX, _blob
from tests.ops.helpers import run_json
from tests.ops.test_gc import manifest_of


def test_compaction_publishes_complete_unnamed_chunks_that_verify(seeded_s3, capsys):
    s3, rng = seeded_s3, random.Random(7)
    bucket = s3.new_bucket()
    namespace = Namespace.from_fields({"model": "orphans", "tp_size": 2})
    ns = namespace.id
    base = namespace_prefix(PREFIX, ns)
    now = int(time.time())
    s3.seed(bucket, base + "namespace.json", descriptor.encode(namespace, "orphans", 64), now - DAY)
    named, orphan, forged, half = (bytes([i]) * 16 for i in (1, 2, 3, 4))
    for key in (named, orphan, forged):
        for rank in (0, 1):
            body = _blob(ns, key, rank, rng)
            if key == forged and rank == 1:
                body = body[:-7] + b"garbage"  # a frame that does not verify
            s3.seed(bucket, object_key(PREFIX, ns, key, rank), body, now - 2 * DAY)
    s3.seed(bucket, object_key(PREFIX, ns, half, 0), _blob(ns, half, 0, rng), now - 2 * DAY)
    segment = mf.ManifestObject("segment", np.array([fingerprint(named)], dtype=np.uint64))
    s3.seed(
        bucket, mp.segment_name(base + "manifest/", (now - 2 * DAY) * 1000, "w0", 1), mf.encode(segment), now
    )

    where = SimpleNamespace(bucket=bucket)  # what manifest_of needs of a dataset
    assert manifest_of(s3, where, ns) == {fingerprint(named)}  # what replicas see before gc

    rc, out = run_json(capsys, s3, bucket, "gc")
    assert rc == 0, out
    res = out["result"]
    assert res["orphan_chunks_published"] == 1 and res["orphan_chunks_refused"] == 1
    assert res["snapshots_written"] == 1
    assert manifest_of(s3, where, ns) == {fingerprint(named), fingerprint(orphan)}

    rc, again = run_json(capsys, s3, bucket, "gc")
    assert rc == 0 and again["result"]["orphan_chunks_published"] == 0
    assert again["result"]["snapshots_written"] == 0  # nothing new: no snapshot every run
    assert again["result"]["orphan_chunks_refused"] == 1  # still there, still not offered
