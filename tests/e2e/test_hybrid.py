"""A hybrid model with vLLM's hybrid KV cache manager on: a random Gemma 3
(five sliding-window layers to one global layer, six KV cache groups),
replicas sharing one bucket on a real S3 server on loopback.

The window (64 tokens) is shorter than a chunk (128): a hit of k chunks
needs every chunk of the global group, and of each sliding group only the
last chunk's last two pages."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from s3kv import codec
from s3kv.chunk_reader import decode_chunk
from s3kv.keys import Namespace, chain_keys, parse_object_key
from s3kv.kvgroups import part_key
from tests.e2e.harness import chunk_objects, copy_bucket, kv_config, metric, run_replica, worker_total

pytestmark = pytest.mark.engine

CHUNK = 128
ENGINE = {"kv_cache_memory_bytes": 64 << 20}
"""A fixed KV cache size: its block count is the same from run to run."""
LOAD_ERRORS = ("missing", "corrupt", "timeout", "unavailable", "other")

_rng = random.Random(28)


def _toks(n: int) -> list[int]:
    return [_rng.randrange(3, 2048) for _ in range(n)]


SHARED = _toks(6 * CHUNK)
STORE = [SHARED + _toks(50)]
"""Replica A's prompt: six whole chunks of the shared prefix, stored."""
PROBE_ENDS = [5 * CHUNK, 5 * CHUNK + 1, 4 * CHUNK + 63, 4 * CHUNK + 64, 4 * CHUNK + 65, 3 * CHUNK + 127]
"""Where fresh replicas' prompts leave the shared prefix: at a chunk
boundary, and a token, a window, or most of a chunk past one."""
PROBES = [SHARED[:end] + _toks(40) for end in PROBE_ENDS]


def _kv(s3_server: Any, bucket: str, **extra: Any) -> dict[str, Any]:
    return kv_config(s3_server.endpoint_url, bucket, chunk_tokens=CHUNK, **extra)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> Path:
    from s3kv.demo.model import build_gemma3

    return build_gemma3(tmp_path_factory.mktemp("gemma3") / "gemma3", seed=0)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hybrid")


@pytest.fixture(scope="module")
def hybrid_baseline(hybrid_dir, gemma) -> dict[str, Any]:
    return run_replica(hybrid_dir, "baseline", gemma, STORE + PROBES, None, engine_args=ENGINE)


@pytest.fixture(scope="module")
def hybrid_bucket(s3_server) -> str:
    return s3_server.new_bucket()


@pytest.fixture(scope="module")
def hybrid_a(hybrid_dir, gemma, s3_server, hybrid_bucket) -> dict[str, Any]:
    return run_replica(hybrid_dir, "A", gemma, STORE, _kv(s3_server, hybrid_bucket), engine_args=ENGINE)


def _descriptor(client: Any, bucket: str) -> dict[str, Any]:
    (key,) = [
        o["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for o in page.get("Contents", ())
        if o["Key"].endswith("/namespace.json")
    ]
    return json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())


def _parts(client: Any, bucket: str, tokens: list[int]) -> dict[int, list[bytes]]:
    """Each KV cache group's part keys of the chunks of ``tokens``, from the namespace's descriptor."""
    d = _descriptor(client, bucket)
    chain = chain_keys(Namespace.from_fields(d["fields"]), tokens, CHUNK)
    return {g: [part_key(k, g) for k in chain] for g in range(len(d["fields"]["kv_groups"]))}


def test_the_hybrid_manager_stays_on_with_the_capacity_of_no_connector(hybrid_baseline, hybrid_a, hybrid_dir):
    (base,) = hybrid_baseline["kv_cache"]
    (a,) = hybrid_a["kv_cache"]
    assert a["groups"] == base["groups"]
    assert a["groups"].count("SlidingWindowSpec") == 5 and a["groups"].count("FullAttentionSpec") == 1
    assert a["num_blocks"] == base["num_blocks"]
    assert metric(hybrid_a, "kv_cache_groups") == 6
    assert "Turning off hybrid kv cache manager" not in (hybrid_dir / "A.log").read_text()
    assert hybrid_a["outputs"] == hybrid_baseline["outputs"][:1]


def test_every_group_of_every_chunk_is_stored(hybrid_a, s3_server, hybrid_bucket):
    client = s3_server.client()
    objects = chunk_objects(client, hybrid_bucket)
    parts = _parts(client, hybrid_bucket, STORE[0])
    stored = {parse_object_key(k)[1] for k in objects}
    assert stored == {k for keys in parts.values() for k in keys}  # 6 groups x 6 chunks
    assert worker_total(hybrid_a, "store_chunks_s3") == 36
    kinds = [g["kind"] for g in _descriptor(client, hybrid_bucket)["fields"]["kv_groups"]]
    sliding = kinds.index("sliding_window")
    for key, blob in objects.items():
        ns, chunk_key, rank = parse_object_key(key)
        header, layers = decode_chunk(blob, namespace=ns, key=chunk_key.hex(), rank=rank)
        assert header.tokens == CHUNK and len(layers) == 1
        if chunk_key in parts[sliding]:
            # A window of 64 tokens never reaches a chunk's first two pages again: zeros.
            half = layers[0].nbytes // 2
            assert not layers[0][:half].any() and layers[0][half:].any()


def test_a_fresh_replica_loads_the_window_only_and_matches(
    hybrid_a, hybrid_baseline, hybrid_dir, gemma, s3_server, hybrid_bucket
):
    b = run_replica(hybrid_dir, "B", gemma, PROBES[:1], _kv(s3_server, hybrid_bucket), engine_args=ENGINE)
    assert b["outputs"] == hybrid_baseline["outputs"][1:2]
    assert b["num_cached_tokens"][0] >= 5 * CHUNK
    # 5 chunks: the global group's 5 parts, each sliding group's last one, not 6 x 5.
    assert worker_total(b, "load_chunks_s3") == 5 + 5
    assert sum(worker_total(b, f"load_errors_{k}") for k in LOAD_ERRORS) == 0
    assert metric(b, "hit_tokens") >= 5 * CHUNK


def test_partial_hits_around_window_and_chunk_boundaries(
    hybrid_a, hybrid_baseline, hybrid_dir, gemma, s3_server, hybrid_bucket
):
    c = run_replica(hybrid_dir, "C", gemma, PROBES, _kv(s3_server, hybrid_bucket), engine_args=ENGINE)
    assert c["outputs"] == hybrid_baseline["outputs"][1:]
    assert worker_total(c, "load_chunks_s3") > 0
    assert sum(worker_total(c, f"load_errors_{k}") for k in LOAD_ERRORS) == 0


def _wrong_group(client: Any, bucket: str, group_kind: str):
    """Negative control: one group's objects (of the first probe's chunks)
    get another chunk's pages of that group, valid objects of wrong KV."""
    kinds = [g["kind"] for g in _descriptor(client, bucket)["fields"]["kv_groups"]]
    g = kinds.index(group_kind)
    keys = _parts(client, bucket, STORE[0])[g]
    objects = {parse_object_key(k)[1]: (k, v) for k, v in chunk_objects(client, bucket).items()}
    decoded = {}
    for key in keys:
        name, blob = objects[key]
        ns, chunk_key, rank = parse_object_key(name)
        decoded[key] = decode_chunk(blob, namespace=ns, key=chunk_key.hex(), rank=rank)

    def transform(name: str, body: bytes) -> bytes:
        key = parse_object_key(name)[1]
        if key not in decoded:
            return body
        header, _ = decoded[key]
        donor = keys[(keys.index(key) + 1) % len(keys)]
        return codec.encode_chunk(
            namespace=header.namespace,
            key=header.key,
            rank=header.rank,
            tokens=header.tokens,
            layers=decoded[donor][1],
            dtype=header.dtype,
            itemsize=header.shuffle,  # byte shuffle's item: the pages' dtype size
            page_shape=header.page_shape,
        )

    return transform


def test_negative_control_wrong_kv_in_the_sliding_group_changes_output(
    hybrid_a, hybrid_baseline, hybrid_dir, gemma, s3_server, hybrid_bucket
):
    client = s3_server.client()
    wrong = copy_bucket(s3_server, hybrid_bucket, _wrong_group(client, hybrid_bucket, "sliding_window"))
    n = run_replica(hybrid_dir, "wrong", gemma, PROBES[:1], _kv(s3_server, wrong), engine_args=ENGINE)
    assert worker_total(n, "load_chunks_s3") == 5 + 5
    assert n["outputs"] != hybrid_baseline["outputs"][1:2]


def test_a_corrupt_part_of_one_group_is_recomputed(
    hybrid_a, hybrid_baseline, hybrid_dir, gemma, s3_server, hybrid_bucket
):
    client = s3_server.client()
    kinds = [g["kind"] for g in _descriptor(client, hybrid_bucket)["fields"]["kv_groups"]]
    victim = _parts(client, hybrid_bucket, STORE[0])[kinds.index("sliding_window")][4]  # in the window

    def flip(name: str, body: bytes) -> bytes:
        if parse_object_key(name)[1] != victim:
            return body
        data = bytearray(body)
        data[len(data) - 1 - len(data) // 3] ^= 0xFF
        return bytes(data)

    corrupt = copy_bucket(s3_server, hybrid_bucket, flip)
    r = run_replica(hybrid_dir, "corrupt", gemma, PROBES[:1], _kv(s3_server, corrupt), engine_args=ENGINE)
    assert r["outputs"] == hybrid_baseline["outputs"][1:2]
    assert worker_total(r, "load_errors_corrupt") >= 1
