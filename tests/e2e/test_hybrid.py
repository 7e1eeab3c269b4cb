"""A hybrid model with vLLM's hybrid KV cache manager on: a random Gemma 3
(five sliding-window layers to one global layer, six KV cache groups),
replicas sharing one bucket on a real S3 server on loopback.

The window (64 tokens) is shorter than a chunk (128): a hit of k chunks
needs every chunk of the global group, and of each sliding group only the
last chunk's last two pages."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from s3kv.chunk_reader import decode_chunk
from s3kv.keys import parse_object_key
from tests.e2e.harness import (
    chunk_objects,
    copy_bucket,
    group_kinds,
    kv_config,
    metric,
    part_keys,
    run_replica,
    worker_total,
    wrong_group,
)

pytestmark = pytest.mark.engine

CHUNK = 128
ENGINE = {"kv_cache_memory_bytes": 64 << 20}
"""A fixed KV cache size: its block count is the same from run to run."""
LOAD_ERRORS = ("missing", "corrupt", "timeout", "unavailable", "other")

_rng = random.Random(28)


def _toks(n: int) -> list[int]:
    return [_rng.randrange(3, 2048) for _ in range(n)]


SHARED = _toks(6 * CHUNK)
OTHER = _toks(6 * CHUNK)
STORE = [SHARED + _toks(50), OTHER + _toks(50)]
"""Replica A's prompts: six whole chunks of the shared prefix, and of another, stored."""
PROBE_ENDS = [5 * CHUNK, 5 * CHUNK + 1, 4 * CHUNK + 63, 4 * CHUNK + 64, 4 * CHUNK + 65, 3 * CHUNK + 127]
"""Where fresh replicas' prompts leave the shared prefix: at a chunk
boundary, and a token, a window, or most of a chunk past one."""
PROBES = [SHARED[:end] + _toks(40) for end in PROBE_ENDS]
OTHER_PROBE = OTHER[: 5 * CHUNK] + _toks(40)
"""A hit of the other prefix (its outputs follow the probes' in the baseline's)."""


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
    return run_replica(
        hybrid_dir, "baseline", gemma, STORE + PROBES + [OTHER_PROBE], None, engine_args=ENGINE
    )


@pytest.fixture(scope="module")
def hybrid_bucket(s3_server) -> str:
    return s3_server.new_bucket()


@pytest.fixture(scope="module")
def hybrid_a(hybrid_dir, gemma, s3_server, hybrid_bucket) -> dict[str, Any]:
    return run_replica(hybrid_dir, "A", gemma, STORE, _kv(s3_server, hybrid_bucket), engine_args=ENGINE)


def test_the_hybrid_manager_stays_on_with_the_capacity_of_no_connector(hybrid_baseline, hybrid_a, hybrid_dir):
    (base,) = hybrid_baseline["kv_cache"]
    (a,) = hybrid_a["kv_cache"]
    assert a["groups"] == base["groups"]
    assert a["groups"].count("SlidingWindowSpec") == 5 and a["groups"].count("FullAttentionSpec") == 1
    assert a["num_blocks"] == base["num_blocks"]
    assert metric(hybrid_a, "kv_cache_groups") == 6
    assert "Turning off hybrid kv cache manager" not in (hybrid_dir / "A.log").read_text()
    assert hybrid_a["outputs"] == hybrid_baseline["outputs"][:2]


def test_every_group_of_every_chunk_is_stored(hybrid_a, s3_server, hybrid_bucket):
    client = s3_server.client()
    objects = chunk_objects(client, hybrid_bucket)
    parts = part_keys(client, hybrid_bucket, STORE[0], CHUNK)
    other = part_keys(client, hybrid_bucket, STORE[1], CHUNK)
    stored = {parse_object_key(k)[1] for k in objects}
    want = {k for keys in parts.values() for k in keys} | {k for keys in other.values() for k in keys}
    assert stored == want  # 6 groups x 6 chunks, of each prompt
    assert worker_total(hybrid_a, "store_chunks_s3") == 72
    kinds = group_kinds(client, hybrid_bucket)
    sliding = kinds.index("sliding_window")
    for key, blob in objects.items():
        ns, chunk_key, rank = parse_object_key(key)
        header, layers = decode_chunk(blob, namespace=ns, key=chunk_key.hex(), rank=rank)
        assert header.tokens == CHUNK and len(layers) == 1
        if chunk_key in parts[sliding] or chunk_key in other[sliding]:
            # A window of 64 tokens never reaches a chunk's first two pages again: zeros.
            half = layers[0].nbytes // 2
            assert not layers[0][:half].any() and layers[0][half:].any()


def test_a_fresh_replica_loads_the_window_only_and_matches(
    hybrid_a, hybrid_baseline, hybrid_dir, gemma, s3_server, hybrid_bucket
):
    b = run_replica(hybrid_dir, "B", gemma, PROBES[:1], _kv(s3_server, hybrid_bucket), engine_args=ENGINE)
    assert b["outputs"] == hybrid_baseline["outputs"][2:3]
    assert b["num_cached_tokens"][0] >= 5 * CHUNK
    # 5 chunks: the global group's 5 parts, each sliding group's last one, not 6 x 5.
    assert worker_total(b, "load_chunks_s3") == 5 + 5
    assert sum(worker_total(b, f"load_errors_{k}") for k in LOAD_ERRORS) == 0
    assert metric(b, "hit_tokens") >= 5 * CHUNK


def test_partial_hits_around_window_and_chunk_boundaries(
    hybrid_a, hybrid_baseline, hybrid_dir, gemma, s3_server, hybrid_bucket
):
    c = run_replica(hybrid_dir, "C", gemma, PROBES, _kv(s3_server, hybrid_bucket), engine_args=ENGINE)
    assert c["outputs"] == hybrid_baseline["outputs"][2 : 2 + len(PROBES)]
    assert worker_total(c, "load_chunks_s3") > 0
    assert sum(worker_total(c, f"load_errors_{k}") for k in LOAD_ERRORS) == 0


def _flip(victim: bytes):
    """A bit flipped inside a frame of the object of key ``victim``."""

    def transform(name: str, body: bytes) -> bytes:
        if parse_object_key(name)[1] != victim:
            return body
        data = bytearray(body)
        data[len(data) - 1 - len(data) // 3] ^= 0xFF
        return bytes(data)

    return transform


def test_wrong_kv_in_a_sliding_group_changes_output_a_corrupt_part_is_recomputed(
    hybrid_a, hybrid_baseline, hybrid_dir, gemma, s3_server, hybrid_bucket
):
    """One replica (one engine start), two prefixes: the first's sliding
    group holds another chunk's pages (valid objects: the negative control),
    the second's part in the window is corrupt."""
    client = s3_server.client()
    kinds = group_kinds(client, hybrid_bucket)
    wrong = wrong_group(client, hybrid_bucket, STORE[:1], CHUNK, kinds.index("sliding_window"))
    victim = part_keys(client, hybrid_bucket, STORE[1], CHUNK)[kinds.index("sliding_window")][
        4
    ]  # in the window
    flip = _flip(victim)
    bucket = copy_bucket(s3_server, hybrid_bucket, lambda name, body: flip(name, wrong(name, body)))
    r = run_replica(
        hybrid_dir, "wrong", gemma, [PROBES[0], OTHER_PROBE], _kv(s3_server, bucket), engine_args=ENGINE
    )
    base = hybrid_baseline["outputs"]
    assert r["outputs"][0] != base[2]  # the wrong KV was loaded and used
    assert r["outputs"][1] == base[-1]  # the corrupt part: recomputed
    assert worker_total(r, "load_chunks_s3") >= 5 + 5
    assert worker_total(r, "load_errors_corrupt") >= 1
