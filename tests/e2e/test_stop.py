"""Nothing stored is lost to the fleet when a replica stops: real ``vllm
serve`` replicas under a concurrent load (8 requests in flight, six prefix
families of 1000 tokens), stopped as autoscalers stop them, then a fresh
replica on the same bucket. Its first requests must hit every chunk the
stopped one stored: none is computed again (a re-store would get a 412),
and its answers are the stopped replica's."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from s3kv.keys import fingerprint, parse_object_key
from tests.conftest import S3Server, free_port, load_manifest
from tests.e2e.harness import (
    REPLICA_ENV,
    complete,
    greedy_params,
    kv_config,
    s3kv_value,
    start_engine,
    start_serve,
)

pytestmark = pytest.mark.engine

FAMILIES, PREFIX_TOKENS, REQUESTS, IN_FLIGHT = 6, 1000, 24, 8
SHUTDOWN_FLUSH_S = 3.0
REQUEST_TIMEOUT_S = 30.0
S3_READ_TIMEOUT_S = 120
"""The hung-S3 test's read timeout: a stop that waited for S3 would take at
least this long (twice, with two attempts)."""
VLLM_STOP_ALLOWANCE_S = 40.0
"""What vLLM's own stop may take here (engine teardown, process joins), on a
busy machine too (about 8-12 s when it is idle); well under the S3 read
timeout, so a stop that waited for S3 still fails."""
assert SHUTDOWN_FLUSH_S + VLLM_STOP_ALLOWANCE_S < S3_READ_TIMEOUT_S / 2


def family_prompts(seed: int, requests: int = REQUESTS) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 2048) for _ in range(PREFIX_TOKENS)] for _ in range(FAMILIES)]
    return [
        prefixes[i % FAMILIES] + [rng.randrange(3, 2048) for _ in range(rng.randint(20, 150))]
        for i in range(requests)
    ]


def run_load(url: str, prompts: list[list[int]]) -> dict[int, list[int]]:
    """The prompts, ``IN_FLIGHT`` at a time: the outputs of those that
    completed (a stop cuts the rest off)."""
    out: dict[int, list[int]] = {}
    with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
        # A bounded wait: after vLLM's default stop the server waits for the
        # connections of the requests it aborted to close.
        futures = {pool.submit(complete, url, p, timeout=REQUEST_TIMEOUT_S): i for i, p in enumerate(prompts)}
        for fut in concurrent.futures.as_completed(futures):
            with contextlib.suppress(OSError):
                out[futures[fut]] = fut.result()
    return out


def chunk_objects(client, bucket: str) -> dict[str, bytes]:
    """Chunk object name -> chunk key, of every chunk object in the bucket."""
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", ()):
            parsed = parse_object_key(obj["Key"])
            if parsed is not None:
                out[obj["Key"]] = parsed[1]
    return out


def manifest_fps(endpoint_url: str, bucket: str, names: dict[str, bytes]) -> set[int]:
    """What a replica starting now loads, for the namespace of ``names``."""
    (ns,) = {parse_object_key(n)[0] for n in names}
    return load_manifest(endpoint_url, bucket, next(iter(names)).split(ns)[0] + ns + "/manifest/")


def stop(proc: subprocess.Popen, sig: int, *, group: bool = False, timeout: float = 120) -> float:
    """Send ``sig`` (to the process group with ``group``); seconds until it exited."""
    start = time.monotonic()
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"the replica did not stop within {timeout} s") from None
    return time.monotonic() - start


def check_fresh_replica(model: Path, endpoint_url: str, bucket: str, prompts, monkeypatch) -> None:
    """A fresh replica on ``bucket`` hits every stored chunk: none of its
    stores finds its object already there (a chunk it computed again would).
    (That loaded KV gives the baseline's answers is test_replicas' part: the
    stopped replica's answers came from batches of 8, whose float sums
    differ from one request's.)"""
    for k, v in REPLICA_ENV.items():
        monkeypatch.setenv(k, v)
    llm = start_engine(model, kv_config(endpoint_url, bucket), enable_prefix_caching=False)
    try:
        params = greedy_params()
        for prompt in prompts:
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        llm.generate(
            [{"prompt_token_ids": [5] * 3}], params, use_tqdm=False
        )  # a step that reports the stores
        # At least the drained replica's families: it stored their whole prefixes.
        assert s3kv_value(llm, "hit_tokens_s3") >= FAMILIES * (PREFIX_TOKENS // 64) * 64
        assert s3kv_value(llm, "store_chunks_existing") == 0  # no stored chunk was computed again
    finally:
        llm.llm_engine.engine_core.shutdown()


def serve_under_load(workdir, model, config, name, prompts, until_objects, *args, **popen):
    """A ``vllm serve`` replica under the load of ``prompts``, stopped (by
    the returned function) once the bucket holds ``until_objects`` chunk
    objects: mid-load."""
    bucket = config["kv_connector_extra_config"]["bucket"]
    endpoint = config["kv_connector_extra_config"]["endpoint_url"]
    proc, url = start_serve(model, config, workdir / f"stop-{name}.log", *args, **popen)
    client = S3Server(int(endpoint.rsplit(":", 1)[1])).client()
    start = len(chunk_objects(client, bucket))
    pool = concurrent.futures.ThreadPoolExecutor(1)
    load = pool.submit(run_load, url, prompts)

    def stop_it(sig: int, *, group: bool = False) -> float:
        try:
            deadline = time.monotonic() + 120
            while len(chunk_objects(client, bucket)) < start + until_objects:
                assert time.monotonic() < deadline and not load.done(), "no stores under load"
                time.sleep(0.2)
            took = stop(proc, sig, group=group)
            load.result()  # (vLLM's default stop aborts the requests in flight: none may complete)
            return took
        finally:
            pool.shutdown()
            if proc.poll() is None:
                proc.kill()

    return stop_it


def unpublished(s3_server, bucket) -> tuple[int, int]:
    """(chunk objects no manifest object names, chunk objects)."""
    names = chunk_objects(s3_server.client(), bucket)
    published = manifest_fps(s3_server.endpoint_url, bucket, names)
    return sum(fingerprint(k) not in published for k in names.values()), len(names)


def segment_writers(s3_server, bucket) -> list[str]:
    """The writer ids of the manifest segments in the bucket."""
    client = s3_server.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", ())]
    return [k.rsplit("/", 1)[1].split("-")[1] for k in keys if "/manifest/seg/" in k]


def test_replicas_stopped_every_way_lose_no_stored_chunk(workdir, model, s3_server, monkeypatch):
    """vLLM's default stop, its drain stop, then a SIGKILL of a replica's
    process group (and one gc run) on one bucket: after each, a replica
    starting would see every chunk object stored; the fresh one at the end
    computes none of them again."""
    from s3kv.cli import main as s3kv_cli

    bucket = s3_server.new_bucket()
    config = kv_config(s3_server.endpoint_url, bucket, shutdown_flush_s=SHUTDOWN_FLUSH_S)
    # The SIGKILL comes once 60 chunk objects are stored: its load is longer,
    # so that on a busy machine (uploads lagging compute) it is still under way.
    prompts = [family_prompts(1), family_prompts(2), family_prompts(3, 3 * REQUESTS)]
    # vLLM's default stop kills the engine at once: the front end publishes
    # the ranks' journals as it exits.
    # (Its ranks publish every 30 s here: none of its stores is in a segment
    # of its own when it stops.)
    slow = kv_config(s3_server.endpoint_url, bucket, manifest_publish_s=30)
    stop_it = serve_under_load(workdir, model, slow, "default", prompts[0], 2 * FAMILIES)
    took = stop_it(signal.SIGTERM)
    missing, total = unpublished(s3_server, bucket)
    by_journal = [n for n in segment_writers(s3_server, bucket) if n.endswith("j")]
    print(f"default stop: {took:.1f} s, {missing} of {total} chunk objects unpublished")
    assert total >= 2 * FAMILIES and missing == 0 and by_journal
    # The drain stop: the engine publishes everything itself.
    stop_it = serve_under_load(
        workdir, model, config, "drain", prompts[1], 2 * FAMILIES, "--shutdown-timeout", "30"
    )
    took = stop_it(signal.SIGTERM)
    missing, total = unpublished(s3_server, bucket)
    print(f"drain stop: {took:.1f} s, {missing} of {total} chunk objects unpublished")
    assert missing == 0
    # SIGKILL of the whole replica: nothing can publish; gc's compaction does.
    stop_it = serve_under_load(
        workdir, model, slow, "kill", prompts[2], 10 * FAMILIES, start_new_session=True
    )
    stop_it(signal.SIGKILL, group=True)
    missing, total = unpublished(s3_server, bucket)
    print(f"SIGKILL: {missing} of {total} chunk objects unpublished before gc")
    assert missing > 0  # killed between its PUTs and its segment: only gc can tell the fleet
    args = ["--bucket", bucket, "--endpoint-url", s3_server.endpoint_url, "--region", "us-east-1"]
    assert s3kv_cli(["gc", *args]) == 0
    assert unpublished(s3_server, bucket)[0] == 0
    # Each family's first prompt: its whole prefix was stored by a stopped replica.
    check_fresh_replica(
        model, s3_server.endpoint_url, bucket, [p for ps in prompts for p in ps[:FAMILIES]], monkeypatch
    )


def test_stop_time_is_bounded_with_s3_unreachable(workdir, model):
    server = S3Server(free_port())
    server.start()
    proc = None
    try:
        bucket = server.new_bucket()
        config = kv_config(
            server.endpoint_url,
            bucket,
            shutdown_flush_s=SHUTDOWN_FLUSH_S,
            s3_read_timeout_s=S3_READ_TIMEOUT_S,  # S3 would hold a stop for minutes
            s3_max_attempts=2,
        )
        proc, url = start_serve(model, config, workdir / "stop-hung.log", "--shutdown-timeout", "30")
        rng = random.Random(3)
        complete(url, [rng.randrange(3, 2048) for _ in range(300)])  # S3 works
        os.kill(server.proc.pid, signal.SIGSTOP)  # S3 hangs: connections open, nothing answers
        for _ in range(2):  # uploads that will never finish
            complete(url, [rng.randrange(3, 2048) for _ in range(5 * 64 + 7)])
        took = stop(proc, signal.SIGTERM)
        print(f"stop with S3 hanging: {took:.1f} s (shutdown_flush_s={SHUTDOWN_FLUSH_S})")
        assert took < SHUTDOWN_FLUSH_S + VLLM_STOP_ALLOWANCE_S
        assert proc.returncode == 0
    finally:
        if server.proc is not None:
            os.kill(server.proc.pid, signal.SIGCONT)
        if proc is not None and proc.poll() is None:
            proc.kill()
        server.stop()
