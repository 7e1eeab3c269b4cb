"""A replica on an S3 Express One Zone directory bucket (issue 18.3), end to
end: the Terraform module's directory option names the bucket, Terraform
renders the --kv-transfer-config, and a fresh vLLM engine with that config
loads a shared prefix that another replica stored and stores the rest,
through :class:`LatencyProxy` in its ``directory`` mode in front of the
loopback server (listings in no order, StartAfter ignored, a prefix that
does not end with '/' refused, CreateSession answered). One engine: the
bucket starts with replica A's shared-prefix chunks and a manifest segment
naming them, filed as on a directory bucket."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from s3kv.config import DEFAULTS
from s3kv.keys import Namespace, fingerprint, namespace_prefix, parse_object_key
from s3kv.manifest import protocol as mp
from s3kv.manifest.keyset import Manifest
from s3kv.manifest.sync import ManifestSync
from s3kv.stores.s3 import S3Options, S3Store
from s3kv.testing.latency_proxy import LatencyProxy
from tests.conftest import load_manifest
from tests.e2e.conftest import PROMPTS
from tests.e2e.harness import CHUNK_TOKENS, chunk_objects, engine_keys, metric, run_replica, worker_total
from tests.infra.terraform import bucket_render_call, tf_outputs

pytestmark = pytest.mark.engine

SHARED_CHUNKS = 320 // CHUNK_TOKENS
ZONE = "use1-az4"


async def _publish(endpoint_url: str, bucket: str, base: str, keys: list[bytes]) -> None:
    """A manifest segment naming ``keys``, written by s3kv's own writer on a
    directory bucket (so filed under its minute)."""
    store = S3Store(bucket, S3Options(endpoint_url=endpoint_url, region="us-east-1", directory=True))
    sync = ManifestSync(store, base, Manifest(), writer="seed")
    try:
        await sync.load()
        for k in keys:
            sync.manifest.add(k)
        await sync.publish()
    finally:
        await store.close()


def test_a_replica_configured_by_terraform_shares_through_a_directory_bucket(
    replica_a, baseline, workdir, tmp_path, model, s3_server, bucket_a
):
    base_name = f"s3kv-{uuid.uuid4().hex[:10]}"
    bucket = s3_server.new_directory_bucket(f"{base_name}--{ZONE}--x-s3")
    # The shared prefix's chunks, as replica A stored them (objects do not
    # depend on the bucket's kind), and a segment naming them.
    a_objects = chunk_objects(s3_server.client(), bucket_a)
    ns = parse_object_key(next(iter(a_objects)))[0]
    shared = engine_keys(Namespace(ns, {}), PROMPTS[0], CHUNK_TOKENS)
    assert len(shared) == SHARED_CHUNKS
    client = s3_server.directory_client()
    for name, body in a_objects.items():
        if parse_object_key(name)[1] in shared:
            client.put_object(Bucket=bucket, Key=name, Body=body)
    base = namespace_prefix(DEFAULTS.prefix, ns) + "manifest/"

    with LatencyProxy(s3_server.endpoint_url, directory=True) as proxy:
        asyncio.run(_publish(proxy.endpoint_url, bucket, base, shared))
        extra = json.dumps(
            {
                "endpoint_url": proxy.endpoint_url,
                "chunk_tokens": CHUNK_TOKENS,
                # As the harness's kv_config pins them (see there).
                "load_policy": "always",
                "prefetch_bytes": 0,
            }
        )
        hcl = bucket_render_call(base_name, "directory", ZONE, DEFAULTS.prefix, extra)
        config = json.loads(tf_outputs(tmp_path, hcl)["json"])
        assert config["kv_connector_extra_config"]["bucket"] == bucket
        assert "bucket_kind" not in config["kv_connector_extra_config"]  # told by the name
        e = run_replica(workdir, "express", model, PROMPTS, config)
        seen = load_manifest(proxy.endpoint_url, bucket, base, directory=True)

    assert e["outputs"] == baseline["outputs"]
    # The shared prefix came from S3, found through the directory bucket's manifest ...
    assert e["num_cached_tokens"][0] >= SHARED_CHUNKS * CHUNK_TOKENS
    assert worker_total(e, "load_chunks_s3") >= SHARED_CHUNKS
    assert metric(e, "manifest_segments_loaded") >= 1
    # ... and the rest was stored there (2 + 1 suffix chunks, 3 of the
    # whole-chunk prompt, 1 of the short one), its segments filed by minute.
    after = chunk_objects(client, bucket)
    assert len(after) == len(a_objects)
    assert worker_total(e, "store_chunks_s3") == len(a_objects) - SHARED_CHUNKS
    segments = [
        o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=base + "seg/").get("Contents", ())
    ]
    assert len(segments) >= 2
    for name in segments:
        parsed = mp.parse_name(base, name)
        assert parsed is not None and parsed.kind == "segment"
        assert name.startswith(mp.segment_dir(base, parsed.ts))
    assert seen >= {fingerprint(parse_object_key(n)[1]) for n in after}  # a replica starting now
    # Listed as a directory bucket allows, signed with session auth: a
    # session per client (the seeding writer, the replica's, the reader
    # above: 3 seen here, where a session per request would be more than
    # its listings), not one per request.
    assert proxy.listings > 0 and proxy.start_after_ignored == 0 and proxy.prefixes_refused == []
    assert 3 <= proxy.sessions <= 5 and proxy.session_signed > proxy.listings, (
        proxy.sessions,
        proxy.session_signed,
        proxy.listings,
    )
