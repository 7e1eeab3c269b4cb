"""Replicas sharing one bucket, each a fresh vLLM engine process (CPU build),
against a real S3 server on loopback."""

from __future__ import annotations

import pytest

from s3kv import codec
from s3kv.chunk_reader import decode_chunk
from s3kv.keys import Namespace, parse_object_key
from tests.e2e.conftest import PROMPTS
from tests.e2e.harness import (
    CHUNK_TOKENS,
    chunk_objects,
    copy_bucket,
    engine_keys,
    kv_config,
    lookalike_model,
    metric,
    run_replica,
    worker_total,
)

pytestmark = pytest.mark.engine

SHARED_CHUNKS = 320 // CHUNK_TOKENS


def test_replica_a_stores_full_chunks(replica_a, baseline, s3_server, bucket_a):
    assert replica_a["outputs"] == baseline["outputs"]
    objects = chunk_objects(s3_server.client(), bucket_a)
    # Full chunks, shared prefix stored once: 5 shared + 2 + 1 + 0 suffix
    # chunks of the family, 3 of the whole-chunk prompt, and 1 of the short
    # one, whose 59 prompt tokens fill a chunk with generated ones.
    assert len(objects) == SHARED_CHUNKS + 2 + 1 + 0 + 3 + 1
    assert worker_total(replica_a, "store_chunks_s3") == len(objects)
    assert all(w["drained"] for w in replica_a["workers"])
    for key, blob in objects.items():
        ns, chunk_key, rank = parse_object_key(key)
        header, layers = decode_chunk(blob, namespace=ns, key=chunk_key.hex(), rank=rank)
        assert header.tokens == CHUNK_TOKENS and len(layers) == 6


def test_replica_b_loads_instead_of_computing(replica_a, baseline, workdir, model, s3_server, bucket_a):
    b = run_replica(workdir, "B", model, PROMPTS, kv_config(s3_server.endpoint_url, bucket_a))
    assert b["outputs"] == baseline["outputs"]
    # The first prompt of the family finds its whole shared prefix in S3.
    assert b["num_cached_tokens"][0] >= SHARED_CHUNKS * CHUNK_TOKENS
    assert metric(b, "hit_tokens") >= SHARED_CHUNKS * CHUNK_TOKENS
    assert worker_total(b, "load_chunks_s3") >= SHARED_CHUNKS
    assert worker_total(b, "store_chunks_s3") == 0  # everything was there already
    assert (
        sum(
            worker_total(b, f"load_errors_{k}")
            for k in ("missing", "corrupt", "timeout", "unavailable", "other")
        )
        == 0
    )
    # The whole-chunk prompt is loaded too (vLLM recomputes only its last token).
    assert b["num_cached_tokens"][3] >= 3 * CHUNK_TOKENS - 1


def _rotate_pages(objects: dict[str, bytes]):
    """Negative control: valid objects (right namespace, key, checksums) whose
    pages are another chunk's, i.e. plausible but wrong KV."""
    keys = sorted(objects)
    decoded = {}
    for key in keys:
        ns, chunk_key, rank = parse_object_key(key)
        decoded[key] = decode_chunk(objects[key], namespace=ns, key=chunk_key.hex(), rank=rank)

    def transform(key: str, body: bytes) -> bytes:
        header, _ = decoded[key]
        donor = keys[(keys.index(key) + 1) % len(keys)]
        return codec.encode_chunk(
            namespace=header.namespace,
            key=header.key,
            rank=header.rank,
            tokens=header.tokens,
            layers=decoded[donor][1],
            dtype=header.dtype,
            itemsize=2,
            page_shape=header.page_shape,
        )

    return transform


def test_negative_control_wrong_kv_changes_output(replica_a, baseline, workdir, model, s3_server, bucket_a):
    objects = chunk_objects(s3_server.client(), bucket_a)
    wrong = copy_bucket(s3_server, bucket_a, _rotate_pages(objects))
    n = run_replica(workdir, "wrong-kv", model, PROMPTS, kv_config(s3_server.endpoint_url, wrong))
    assert metric(n, "hit_tokens") >= SHARED_CHUNKS * CHUNK_TOKENS
    assert worker_total(n, "load_chunks_s3") >= SHARED_CHUNKS
    # The loaded (wrong) KV was used: outputs differ from the baseline's.
    assert n["outputs"][0] != baseline["outputs"][0]
    assert n["outputs"] != baseline["outputs"]


def _flip_bytes(key: str, body: bytes) -> bytes:
    data = bytearray(body)
    at = len(data) - 1 - (len(data) // 3)  # inside a frame, past the header
    data[at] ^= 0xFF
    return bytes(data)


def test_corrupt_objects_are_recomputed_and_replaced(
    replica_a, baseline, workdir, model, s3_server, bucket_a
):
    corrupt = copy_bucket(s3_server, bucket_a, _flip_bytes)
    client = s3_server.client()
    before = chunk_objects(client, corrupt)
    # This replica loads the connector by module path, not by the plugin's name.
    c = run_replica(
        workdir, "C", model, PROMPTS, kv_config(s3_server.endpoint_url, corrupt, module_path=True)
    )
    assert c["outputs"] == baseline["outputs"]
    assert metric(c, "hit_tokens") > 0  # the corrupt chunks were offered, then rejected
    assert worker_total(c, "load_errors_corrupt") >= SHARED_CHUNKS
    # Self-healing: the corrupt objects C read were removed and good ones
    # written. (An object no prompt looks up, such as the chunk that holds
    # generated tokens, is not read, so not checked: that is `s3kv verify`'s.)
    after = chunk_objects(client, corrupt)
    assert set(after) == set(before)
    checked = 0
    for key, blob in after.items():
        ns, chunk_key, rank = parse_object_key(key)
        looked_up = {k for p in PROMPTS for k in engine_keys(Namespace(ns, {}), p, CHUNK_TOKENS)}
        if chunk_key in looked_up:
            decode_chunk(blob, namespace=ns, key=chunk_key.hex(), rank=rank)
            checked += 1
    assert checked == len(after) - 1


def test_different_model_gets_no_hits(
    replica_a, baseline, model, workdir, tmp_path_factory, s3_server, bucket_a
):
    # A look-alike: the same config.json and file sizes, and the same bytes
    # but for one layer's K and V projections in the middle of the file,
    # between the windows that s3kv once sampled instead of hashing it all.
    other, changed = lookalike_model(model, tmp_path_factory.mktemp("other") / "llama")
    size = (model / "model.safetensors").stat().st_size
    windows = [((size - (64 << 10)) * i // 7, (size - (64 << 10)) * i // 7 + (64 << 10)) for i in range(8)]
    assert all(end <= w0 or start >= w1 for start, end in changed for w0, w1 in windows)
    assert all(0.25 < start / size < 0.75 for start, _ in changed)
    d = run_replica(workdir, "D", other, PROMPTS, kv_config(s3_server.endpoint_url, bucket_a))
    assert d["outputs"] != baseline["outputs"]  # its KV differs: sharing A's would be wrong
    assert metric(d, "lookup_requests") == len(PROMPTS)
    assert metric(d, "hit_tokens") == 0
    assert worker_total(d, "load_chunks_s3") == 0
    assert d["metrics"].get("vllm:external_prefix_cache_hits", 0) == 0
    namespaces = {parse_object_key(k)[0] for k in chunk_objects(s3_server.client(), bucket_a)}
    assert len(namespaces) == 2  # D stored under its own namespace
