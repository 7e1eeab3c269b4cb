"""A hybrid SSM model with vLLM's hybrid KV cache manager on: a random
Qwen3-Next (three gated-delta-net linear-attention layers to one full
attention layer, four KV cache groups), replicas sharing one bucket on a
real S3 server on loopback.

vLLM keeps a linear-attention layer's state only where a step of the
prompt ended on a block boundary (``mamba_cache_mode="align"``): replica A's
prompts leave states at 2 and 3 chunks; a hit of k chunks loads every
chunk's full-attention part and the state after exactly k chunks."""

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

CHUNK = 640
"""vLLM makes the model's block 640 tokens (the linear-attention state's page); a chunk is one block."""
ENGINE = {"kv_cache_memory_bytes": 128 << 20, "block_size": None, "max_model_len": 4096}
LOAD_ERRORS = ("missing", "corrupt", "timeout", "unavailable", "other")

_rng = random.Random(281)


def _toks(n: int) -> list[int]:
    return [_rng.randrange(3, 2048) for _ in range(n)]


SHARED = _toks(3 * CHUNK)
OTHER = _toks(3 * CHUNK)
STORE = [SHARED[: 2 * CHUNK] + _toks(30), SHARED + _toks(50), OTHER + _toks(50)]
"""Replica A: a prompt whose first step ends at 2 chunks, then one at 3,
and another prefix whose first step ends at 3."""
PROBES = [
    SHARED + _toks(40),  # a hit of 3 chunks
    SHARED[: 2 * CHUNK] + _toks(60),  # of 2 chunks
    SHARED[: 2 * CHUNK + 1] + _toks(20),  # 2 chunks and a token past the boundary
    SHARED[: 3 * CHUNK],  # exactly 3 chunks: vLLM must compute a token, so 2
    SHARED[: CHUNK + 5] + _toks(20),  # 1 chunk: no state was kept there, no hit
]
OTHER_PROBE = OTHER + _toks(40)
"""A hit of the other prefix (its outputs follow the probes' in the baseline's)."""


def _kv(s3_server: Any, bucket: str, **extra: Any) -> dict[str, Any]:
    return kv_config(s3_server.endpoint_url, bucket, chunk_tokens=CHUNK, **extra)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    from s3kv.demo.model import build_qwen3_next

    return build_qwen3_next(tmp_path_factory.mktemp("qwen3_next") / "qwen3_next", seed=0)


@pytest.fixture(scope="module")
def ssm_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hybrid_ssm")


@pytest.fixture(scope="module")
def ssm_baseline(ssm_dir, qwen) -> dict[str, Any]:
    return run_replica(ssm_dir, "baseline", qwen, STORE + PROBES + [OTHER_PROBE], None, engine_args=ENGINE)


@pytest.fixture(scope="module")
def ssm_bucket(s3_server) -> str:
    return s3_server.new_bucket()


@pytest.fixture(scope="module")
def ssm_a(ssm_dir, qwen, s3_server, ssm_bucket) -> dict[str, Any]:
    return run_replica(ssm_dir, "A", qwen, STORE, _kv(s3_server, ssm_bucket), engine_args=ENGINE)


def test_the_hybrid_manager_stays_on_with_the_capacity_of_no_connector(ssm_baseline, ssm_a, ssm_dir):
    (base,) = ssm_baseline["kv_cache"]
    (a,) = ssm_a["kv_cache"]
    assert a["groups"] == base["groups"]
    assert a["groups"].count("MambaSpec") == 3 and a["groups"].count("FullAttentionSpec") == 1
    assert a["num_blocks"] == base["num_blocks"]
    assert metric(ssm_a, "kv_cache_groups") == 4
    assert "Turning off hybrid kv cache manager" not in (ssm_dir / "A.log").read_text()
    assert ssm_a["outputs"] == ssm_baseline["outputs"][:3]


def test_states_are_stored_where_vllm_kept_them(ssm_a, s3_server, ssm_bucket):
    client = s3_server.client()
    objects = chunk_objects(client, ssm_bucket)
    parts = part_keys(client, ssm_bucket, STORE[1], CHUNK)
    other = part_keys(client, ssm_bucket, STORE[2], CHUNK)
    kinds = group_kinds(client, ssm_bucket)
    full = kinds.index("full")
    states = [g for g, kind in enumerate(kinds) if kind == "mamba"]
    stored = {parse_object_key(k)[1] for k in objects}
    # Full attention: every chunk; each state group: the states after 2 and 3
    # chunks of the shared prefix, after 3 of the other, and no others.
    assert stored == (
        set(parts[full])
        | set(other[full])
        | {parts[g][c] for g in states for c in (1, 2)}
        | {other[g][2] for g in states}
    )
    for key, blob in objects.items():
        ns, chunk_key, rank = parse_object_key(key)
        header, layers = decode_chunk(blob, namespace=ns, key=chunk_key.hex(), rank=rank)
        assert header.tokens == CHUNK and len(layers) == 1 and layers[0].any()


def test_a_fresh_replica_loads_the_state_at_the_hit_end_and_matches(
    ssm_a, ssm_baseline, ssm_dir, qwen, s3_server, ssm_bucket
):
    b = run_replica(ssm_dir, "B", qwen, PROBES[:1], _kv(s3_server, ssm_bucket), engine_args=ENGINE)
    assert b["outputs"] == ssm_baseline["outputs"][3:4]
    assert b["num_cached_tokens"][0] >= 3 * CHUNK
    # 3 chunks: the full-attention group's 3 parts, each state group's state after 3 chunks.
    assert worker_total(b, "load_chunks_s3") == 3 + 3
    assert sum(worker_total(b, f"load_errors_{k}") for k in LOAD_ERRORS) == 0
    assert metric(b, "hit_tokens") >= 3 * CHUNK


def test_hits_at_and_around_chunk_boundaries(ssm_a, ssm_baseline, ssm_dir, qwen, s3_server, ssm_bucket):
    c = run_replica(ssm_dir, "C", qwen, PROBES, _kv(s3_server, ssm_bucket), engine_args=ENGINE)
    assert c["outputs"] == ssm_baseline["outputs"][3 : 3 + len(PROBES)]
    assert c["num_cached_tokens"][0] >= 3 * CHUNK
    assert sum(worker_total(c, f"load_errors_{k}") for k in LOAD_ERRORS) == 0


def test_a_wrong_state_changes_output_a_corrupt_state_is_recomputed(
    ssm_a, ssm_baseline, ssm_dir, qwen, s3_server, ssm_bucket
):
    """One replica (one engine start), two prefixes: the first's state
    group holds another chunk's state (valid objects: the negative
    control), the other's state after 3 chunks is corrupt."""
    client = s3_server.client()
    kinds = group_kinds(client, ssm_bucket)
    wrong = wrong_group(
        client, ssm_bucket, STORE[1:2], CHUNK, kinds.index("mamba")
    )  # its states after 2 and 3 chunks
    victim = part_keys(client, ssm_bucket, STORE[2], CHUNK)[kinds.index("mamba")][2]

    def transform(name: str, body: bytes) -> bytes:
        body = wrong(name, body)
        if parse_object_key(name)[1] != victim:
            return body
        data = bytearray(body)
        data[len(data) - 1 - len(data) // 3] ^= 0xFF
        return bytes(data)

    bucket = copy_bucket(s3_server, ssm_bucket, transform)
    r = run_replica(
        ssm_dir, "wrong", qwen, [PROBES[0], OTHER_PROBE], _kv(s3_server, bucket), engine_args=ENGINE
    )
    base = ssm_baseline["outputs"]
    assert r["outputs"][0] != base[3]  # the wrong state was loaded and used
    assert r["outputs"][1] == base[-1]  # the corrupt state: recomputed
    assert worker_total(r, "load_chunks_s3") >= 3 + 3
    assert worker_total(r, "load_errors_corrupt") >= 1
