"""s3kv's metrics as vLLM exports them (Prometheus, via the connector-stats
path), read from a real engine after a workload whose every figure is known:
loads from each tier, one corrupt and one missing object, the re-stores they
cause, and what ends up in the tiers."""

from __future__ import annotations

import os

import pytest

from s3kv.keys import Namespace, object_key, parse_object_key
from tests.e2e.conftest import PROMPTS
from tests.e2e.harness import (
    CHUNK_TOKENS,
    chunk_objects,
    copy_bucket,
    engine_keys,
    kv_config,
    metric,
    run_replica,
    worker_total,
)

pytestmark = pytest.mark.engine

SHARED = 320 // CHUNK_TOKENS  # the family's shared chunks, all in A's bucket
FLUSH = [7] * 10  # shorter than a chunk: neither loads nor stores


@pytest.fixture(scope="module")
def metered(replica_a, baseline, workdir, model, s3_server, bucket_a, tmp_path_factory):
    client = s3_server.client()
    ns = {parse_object_key(n)[0] for n in chunk_objects(client, bucket_a)}.pop()

    def name(prompt, c):
        return object_key("s3kv", ns, engine_keys(Namespace(ns, {}), prompt, CHUNK_TOKENS)[c], 0)

    corrupt = name(PROMPTS[1], 6)  # prompt 1's 2nd chunk of its own
    missing = name(PROMPTS[2], 5)  # prompt 2's only chunk of its own

    def flip(key: str, body: bytes) -> bytes:
        if key != corrupt:
            return body
        b = bytearray(body)
        b[-100] ^= 0xFF  # in the last layer's frame: its checksum fails
        return bytes(b)

    bucket = copy_bucket(s3_server, bucket_a, flip)
    client.delete_object(Bucket=bucket, Key=missing)
    before = chunk_objects(client, bucket)
    disk = tmp_path_factory.mktemp("metrics-disk")
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    r = run_replica(
        workdir,
        "metrics",
        model,
        prompts,
        kv_config(s3_server.endpoint_url, bucket, cpu_bytes="64MiB", disk_path=str(disk)),
        engine_args={"enable_prefix_caching": False},  # so that repeats hit s3kv's CPU tier
        spec_extra={"flush_prompt": FLUSH},
    )
    return {
        "r": r,
        "prompts": prompts,
        "before": before,
        "after": chunk_objects(client, bucket),
        "corrupt": corrupt,
        "missing": missing,
        "disk": disk,
    }


def test_outputs_are_correct(metered, baseline):
    out = metered["r"]["outputs"]
    assert out == [baseline["outputs"][i] for i in (0, 0, 1, 2)]


def test_lookups_and_hits_per_tier(metered):
    r = metered["r"]
    assert metric(r, "lookup_requests") == len(metered["prompts"]) + 1
    assert metric(r, "lookup_tokens") == sum(map(len, metered["prompts"])) + len(FLUSH)
    # 1st: the shared prefix from S3; 2nd: from the CPU tier it was promoted
    # to; 3rd and 4th: the prefix from CPU, their own chunks from S3 (one of
    # them corrupt, one deleted: offered, then failed).
    ct = CHUNK_TOKENS
    assert metric(r, "hit_tokens_s3") == SHARED * ct + 2 * ct + ct
    assert metric(r, "hit_tokens_cpu") == 3 * SHARED * ct
    assert metric(r, "hit_tokens_disk") == 0
    assert metric(r, "hit_tokens") == metric(r, "hit_tokens_s3") + metric(r, "hit_tokens_cpu")
    # vLLM's own count of the same hits, by the source s3kv reported.
    assert r["metrics"]["vllm:prompt_tokens_cached_by_source{source=host}"] == metric(r, "hit_tokens_cpu")


def test_loads_errors_and_latency(metered):
    r = metered["r"]
    assert metric(r, "load_chunks_s3") == SHARED + 1  # prompt 1's first own chunk loaded fine
    assert metric(r, "load_chunks_cpu") == 3 * SHARED
    assert metric(r, "load_chunks_disk") == 0
    assert metric(r, "load_errors_corrupt") == 1
    assert metric(r, "load_errors_missing") == 1
    for kind in ("timeout", "throttled", "unavailable", "other"):
        assert metric(r, f"load_errors_{kind}") == 0, kind
    for tier in ("cpu", "s3"):
        assert metric(r, f"load_seconds_{tier}_count") == metric(r, f"load_chunks_{tier}")
        assert metric(r, f"load_seconds_{tier}_sum") > 0
    # Requests whose load succeeded: the 1st (async, S3) and 2nd (sync, CPU).
    assert metric(r, "request_load_seconds_count") == 2
    assert metric(r, "load_bytes_s3") == worker_total(r, "load_bytes_s3") > 0
    assert metric(r, "s3_requests_get") >= metric(r, "load_chunks_s3") + 2  # the two failed loads GET too
    assert metric(r, "manifest_dropped") == 2  # both broken keys


def test_stores_bytes_and_compression(metered):
    r = metered["r"]
    before, after = metered["before"], metered["after"]
    # The deleted and the corrupt (deleted on detection) chunks were recomputed
    # and stored again; nothing else was new.
    restored = {metered["missing"], metered["corrupt"]}
    assert set(after) == set(before) | restored
    assert after[metered["corrupt"]] != before[metered["corrupt"]]
    assert metric(r, "store_chunks_s3") == 2 == worker_total(r, "store_chunks_s3")
    assert metric(r, "store_bytes_s3") == sum(len(after[k]) for k in restored)
    assert metric(r, "store_encoded_bytes") == metric(r, "store_bytes_s3")  # one encoding per chunk
    assert metric(r, "store_seconds_s3_count") == 2
    ratio = r["metrics"]["vllm:s3kv_compression_ratio"]
    assert ratio == pytest.approx(metric(r, "store_raw_bytes") / metric(r, "store_encoded_bytes"))
    assert ratio > 1  # zstd with byte shuffle wins something even on random weights
    # NVMe: the 6 chunks loaded from S3 were promoted, the 2 recomputed ones stored.
    assert metric(r, "store_chunks_disk") == SHARED + 1 + 2
    assert metric(r, "store_seconds_disk_count") == 2  # promotions are not stores from the KV cache
    for kind in ("backpressure", "no_slot", "disk_full"):
        assert metric(r, f"store_dropped_{kind}") == 0, kind


def test_gauges(metered):
    r, m = metered["r"], metered["r"]["metrics"]
    files = [p for p in metered["disk"].rglob("*.r[0-9]*") if not p.name.endswith(".partial")]
    on_disk = sum(os.path.getsize(p) for p in files)
    assert len(files) == SHARED + 1 + 2
    assert m["vllm:s3kv_tier_used_bytes_disk"] == metric(r, "store_bytes_disk") == on_disk > 0
    assert m["vllm:s3kv_tier_capacity_bytes_disk"] >= on_disk
    slot = metric(r, "load_bytes_cpu") / metric(r, "load_chunks_cpu")
    # CPU: the 6 promoted chunks and the 2 recomputed ones.
    assert m["vllm:s3kv_tier_used_bytes_cpu"] == (SHARED + 1 + 2) * slot
    assert m["vllm:s3kv_tier_capacity_bytes_cpu"] >= m["vllm:s3kv_tier_used_bytes_cpu"]
    assert m["vllm:s3kv_manifest_keys"] == len(metered["after"])
    assert 0 <= m["vllm:s3kv_manifest_staleness_seconds"] <= 15
    assert m["vllm:s3kv_inflight_bytes"] == 0  # everything was written by the flush step
