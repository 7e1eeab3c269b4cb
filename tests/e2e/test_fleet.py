"""A fleet of replicas sharing one bucket through the hot manifest: separate
vLLM engine processes (CPU build) against a real S3 server on loopback."""

from __future__ import annotations

import pytest

from s3kv.chunk_reader import decode_chunk
from s3kv.keys import Namespace, object_key, parse_object_key
from tests.e2e.conftest import PROMPTS
from tests.e2e.harness import (
    CHUNK_TOKENS,
    REPLICA_ENV,
    chunk_objects,
    copy_bucket,
    engine_keys,
    finish_replica,
    greedy_params,
    kv_config,
    metric,
    run_replica,
    start_engine,
    start_replica,
    wait_for_value,
    workload,
)

pytestmark = pytest.mark.engine

SHARED = 320  # each family's shared prefix (5 chunks)
FAMILY_A = workload(seed=1)[:3]
FAMILY_B = workload(seed=2)[:3]
QUIET = {"manifest_refresh_s": 3600}  # no polling while the test counts requests


@pytest.fixture(scope="module")
def fleet(workdir, model, s3_server):
    """Replicas A and B, at the same time, each on its own prompt family."""
    bucket = s3_server.new_bucket()
    procs = [
        start_replica(workdir, "fleet-A", model, FAMILY_A, kv_config(s3_server.endpoint_url, bucket)),
        start_replica(workdir, "fleet-B", model, FAMILY_B, kv_config(s3_server.endpoint_url, bucket)),
    ]
    a, b = (finish_replica(workdir, p) for p in procs)
    return bucket, a, b


def test_new_replica_is_warm_for_every_family_without_per_request_listing(fleet, workdir, model, s3_server):
    bucket, a, b = fleet
    interleaved = [p for pair in zip(FAMILY_A, FAMILY_B) for p in pair]
    c = run_replica(
        workdir, "fleet-C", model, interleaved, kv_config(s3_server.endpoint_url, bucket, **QUIET)
    )
    # Its first request of each family already hits what A and B stored.
    assert c["num_cached_tokens"][0] >= SHARED and c["num_cached_tokens"][1] >= SHARED
    expected = [out for pair in zip(a["outputs"], b["outputs"]) for out in pair]
    assert c["outputs"] == expected
    assert metric(c, "hit_tokens_s3") >= 2 * SHARED
    # The manifest was read with one listing of snapshots and one of segments
    # at start-up, plus the bucket check; the only other listings are the
    # manifest loop's: one for each epoch it aggregated (protocol epochs; A
    # and B have stopped, so it aggregates alone) and one of the snapshots
    # to prune after each it wrote. No request listed or HEADed anything.
    manifest = sum(
        metric(c, f"manifest_{what}")
        for what in ("epochs_written", "epochs_covered", "epochs_refused", "snapshots_written")
    )
    assert metric(c, "s3_requests_list") == 2 + manifest
    assert metric(c, "s3_requests_head") == 1
    assert metric(c, "manifest_segments_loaded") >= 2  # at least one from each of A and B


def test_running_replica_sees_new_chunks_within_the_refresh_period(workdir, model, s3_server, monkeypatch):
    bucket = s3_server.new_bucket()
    refresh_s = 1.0
    for k, v in REPLICA_ENV.items():
        monkeypatch.setenv(k, v)
    config = kv_config(
        s3_server.endpoint_url, bucket, manifest_refresh_s=refresh_s, manifest_publish_s=refresh_s
    )
    llm = start_engine(model, config)
    try:
        family = workload(seed=3)[:2]
        writer = run_replica(
            workdir, "fleet-writer", model, family, kv_config(s3_server.endpoint_url, bucket)
        )
        stored = metric(writer, "store_chunks_s3")
        assert stored >= SHARED // CHUNK_TOKENS
        # The running replica's refreshes bring in every key the writer stored
        # (waited for as the condition itself, not a fixed time).
        assert wait_for_value(llm, "manifest_keys", lambda n: n >= stored) >= stored
        (out,) = llm.generate([{"prompt_token_ids": family[0]}], greedy_params(), use_tqdm=False)
        assert out.num_cached_tokens >= SHARED
        assert list(out.outputs[0].token_ids) == writer["outputs"][0]
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_racing_replicas_write_each_chunk_once(replica_a, baseline, workdir, model, s3_server, bucket_a):
    """The loser of a race is a replica that stores a chunk it does not know
    is there: here, deterministically, one that reads a bucket holding A's
    chunk objects but no manifest (two replicas started together race only
    when their starts happen to line up)."""
    client = s3_server.client()
    objects = chunk_objects(client, bucket_a)
    assert metric(replica_a, "store_chunks_s3") == len(objects) > 0  # A PUT each object once
    bucket = copy_bucket(s3_server, bucket_a, keep=lambda name: name in objects)  # no manifest
    late = run_replica(
        workdir, "race-late", model, PROMPTS, kv_config(s3_server.endpoint_url, bucket, **QUIET)
    )
    assert late["outputs"] == baseline["outputs"]
    assert metric(late, "hit_tokens") == 0  # it knew of none of them
    # Every store found the object there (412 Precondition Failed) and took it
    # as success: nothing was PUT again, and the objects are A's, unchanged.
    assert metric(late, "store_chunks_s3") == 0
    assert metric(late, "store_chunks_existing") == len(objects)
    assert chunk_objects(client, bucket) == objects
    for name, blob in objects.items():
        ns, key, rank = parse_object_key(name)
        decode_chunk(blob, namespace=ns, key=key.hex(), rank=rank)


def test_deleted_object_is_recomputed_and_dropped(replica_a, baseline, workdir, model, s3_server, bucket_a):
    bucket = copy_bucket(s3_server, bucket_a)  # A's chunks and manifest
    client = s3_server.client()
    ns = {parse_object_key(n)[0] for n in chunk_objects(client, bucket)}.pop()
    chain = engine_keys(Namespace(ns, {}), PROMPTS[0], CHUNK_TOKENS)
    gone = [object_key("s3kv", ns, k, 0) for k in chain[1:3]]  # the family's 2nd and 3rd chunks
    for name in gone:
        client.delete_object(Bucket=bucket, Key=name)
    d = run_replica(workdir, "fleet-D", model, PROMPTS, kv_config(s3_server.endpoint_url, bucket))
    assert d["outputs"] == baseline["outputs"]
    assert metric(d, "load_errors_missing") >= 1
    assert metric(d, "manifest_dropped") >= 1
    # The recomputed chunks were stored again.
    assert set(gone) <= set(chunk_objects(client, bucket))
