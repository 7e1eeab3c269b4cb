"""``s3kv gc`` while a replica (a real vLLM CPU engine) serves from the same
bucket: the replica keeps returning correct tokens, and the chunks gc
deleted stop being offered as hits once the replica has read gc's
tombstones (no load errors: they are not offered at all)."""

from __future__ import annotations

import json
import subprocess
import threading

import pytest

from s3kv import descriptor
from s3kv.connector.replica import metrics
from s3kv.keys import Namespace, fingerprint, object_key, parse_object_key
from s3kv.manifest import format as mf
from s3kv.ops.chunks import check_chunk
from tests.conftest import wait_until
from tests.e2e.harness import (
    CHUNK_TOKENS,
    ENGINE_ARGS,
    MAX_TOKENS,
    REPLICA_ENV,
    engine_keys,
    gc_command,
    kv_config,
    run_replica,
    wait_for_value,
    workload,
)

pytestmark = pytest.mark.engine

SHARED = 320
FAMILIES = [workload(seed=40 + i)[0] for i in range(6)]  # 360 tokens each: 5 chunks
HOT, COLD = FAMILIES[:3], FAMILIES[3:]
REFRESH_S = 1.0


def listing(client, bucket: str) -> dict[str, int]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", ()):
            out[o["Key"]] = o["Size"]
    return out


def accessed(client, bucket: str) -> set[int]:
    """Fingerprints of the keys the bucket's access records say were used."""
    out: set[int] = set()
    for name in listing(client, bucket):
        if "/access/" in name:
            body = client.get_object(Bucket=bucket, Key=name)["Body"].read()
            out.update(int(x) for x in mf.decode(body).added)
    return out


def test_gc_while_a_replica_serves(workdir, model, s3_server, monkeypatch):
    bucket = s3_server.new_bucket()
    client = s3_server.client()
    writer = run_replica(workdir, "gc-writer", model, FAMILIES, kv_config(s3_server.endpoint_url, bucket))
    expected = writer["outputs"]
    chunks = {k: v for k, v in listing(client, bucket).items() if parse_object_key(k)}
    ns = {parse_object_key(k)[0] for k in chunks}.pop()

    def objects(prompts) -> set[str]:
        return {
            object_key("s3kv", ns, k, 0)
            for p in prompts
            for k in engine_keys(Namespace(ns, {}), p, CHUNK_TOKENS)
        }

    hot, cold = objects(HOT), objects(COLD)
    assert hot | cold == set(chunks) and not hot & cold  # each family's 5 chunks, nothing else
    # The descriptor the replica left is its namespace's: gc takes its TP size
    # from it, and gc and verify decode no more than the pages it names, which
    # are exactly the replica's.
    body = client.get_object(Bucket=bucket, Key=f"s3kv/{ns}/{descriptor.NAME}")["Body"].read()
    described = descriptor.parse_descriptor(ns, body)
    assert described is not None and described.tp_size == 1 and described.pages is not None
    assert described.pages.tokens == CHUNK_TOKENS
    for name in sorted(chunks):
        data = client.get_object(Bucket=bucket, Key=name)["Body"].read()
        assert check_chunk(name, data, pages=described.pages).raw_bytes == (
            described.pages.num_layers * described.pages.layer_bytes
        )

    for k, v in REPLICA_ENV.items():
        monkeypatch.setenv(k, v)
    from vllm import LLM, SamplingParams

    config = kv_config(
        s3_server.endpoint_url, bucket, manifest_refresh_s=REFRESH_S, manifest_publish_s=REFRESH_S
    )
    # No local prefix cache: every request asks s3kv, so each one exercises S3.
    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        kv_transfer_config=config,
        disable_log_stats=False,
        enable_prefix_caching=False,
        **ENGINE_ARGS,
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    def serve(i: int) -> tuple[list[int], int]:
        (out,) = llm.generate([{"prompt_token_ids": FAMILIES[i]}], params, use_tqdm=False)
        return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)

    try:
        for i in range(3):  # the hot families are used (recorded in access records)
            tokens, cached = serve(i)
            assert tokens == expected[i] and cached >= SHARED
        used = {fingerprint(parse_object_key(k)[1]) for k in hot}
        wait_until(
            "access records of the hot families", lambda: used <= accessed(client, bucket), every_s=0.5
        )

        # gc to the hot families' size: least recently used first deletes the cold ones.
        budget = sum(chunks[k] for k in hot)
        cmd = gc_command(
            bucket,
            s3_server.endpoint_url,
            *("--region", "us-east-1", "--max-bytes", str(budget), "--min-age", "0", "--json"),
        )
        gc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        served: list[tuple[int, list[int], int]] = []
        stop = threading.Event()

        def keep_serving() -> None:
            while not stop.is_set():
                for i in range(3):
                    served.append((i, *serve(i)))

        t = threading.Thread(target=keep_serving)
        t.start()
        out, err = gc.communicate(timeout=300)
        stop.set()
        t.join(timeout=120)
        assert gc.returncode == 0, err
        assert served  # requests ran while gc did
        for i, tokens, cached in served:
            assert tokens == expected[i] and cached >= SHARED

        doc = json.loads(out)
        assert set(doc["objects"]) == cold
        left = {k for k in listing(client, bucket) if parse_object_key(k)}
        assert left == hot

        # The replica reads gc's tombstone segment: its view shrinks to the hot keys.
        assert wait_for_value(llm, "manifest_keys", lambda n: n <= len(hot)) == len(hot)
        before = metrics(llm)
        for i in range(3, 6):  # deleted: computed, not offered as hits
            tokens, cached = serve(i)
            assert tokens == expected[i] and cached == 0
        tokens, cached = serve(0)  # control: kept chunks are still hits
        assert tokens == expected[0] and cached >= SHARED
        after = metrics(llm)
        assert (
            after.get("vllm:s3kv_load_errors_missing", 0)
            == before.get("vllm:s3kv_load_errors_missing", 0)
            == 0
        )

        # Negative control: an object deleted behind the manifest's back (no
        # tombstone) is still offered, fails to load, and shows as a load error.
        gone = object_key("s3kv", ns, engine_keys(Namespace(ns, {}), FAMILIES[1], CHUNK_TOKENS)[2], 0)
        client.delete_object(Bucket=bucket, Key=gone)
        tokens, _ = serve(1)
        assert tokens == expected[1]
        serve(2)  # one more step publishes the counter
        assert metrics(llm).get("vllm:s3kv_load_errors_missing", 0) >= 1
    finally:
        llm.llm_engine.engine_core.shutdown()
