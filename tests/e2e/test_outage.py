"""The S3 server goes away while a replica serves: requests still complete,
with the baseline's tokens (vLLM recomputes what cannot be loaded)."""

from __future__ import annotations

import pytest

from tests.conftest import S3Server, free_port
from tests.e2e.conftest import PROMPTS
from tests.e2e.harness import (
    REPLICA_ENV,
    copy_objects,
    greedy_params,
    kv_config,
    s3kv_value,
    start_engine,
    wait_for_value,
)

pytestmark = pytest.mark.engine


def test_s3_stopped_while_serving(replica_a, baseline, s3_server, bucket_a, model, monkeypatch):
    for k, v in REPLICA_ENV.items():
        monkeypatch.setenv(k, v)
    # A server of its own, holding replica A's objects, that this test can stop.
    server = S3Server(free_port())
    server.start()
    engines = []
    try:
        bucket = server.new_bucket()
        copy_objects(s3_server.client(), bucket_a, server.client(), bucket)
        config = kv_config(
            server.endpoint_url, bucket, load_timeout_s=20, s3_connect_timeout_s=1, s3_max_attempts=2
        )
        llm = start_engine(model, config)
        engines.append(llm)
        params = greedy_params()

        def generate(i: int):
            (out,) = llm.generate([{"prompt_token_ids": PROMPTS[i]}], params, use_tqdm=False)
            return out

        # S3 up: the first prompt loads its shared prefix from S3.
        first = generate(0)
        assert list(first.outputs[0].token_ids) == baseline["outputs"][0]
        assert first.num_cached_tokens >= 5 * 64
        # S3 down: the next prompts' own chunks are in the index but cannot
        # be fetched; they are recomputed, and the answers stay right.
        server.stop()
        for i in (1, 2, 3):
            assert list(generate(i).outputs[0].token_ids) == baseline["outputs"][i]
        assert s3kv_value(llm, "load_errors_unavailable") >= 1
    finally:
        for engine in engines:
            engine.llm_engine.engine_core.shutdown()
        server.stop()


def test_s3_hanging_pauses_s3_while_host_hits_go_on(
    replica_a, baseline, s3_server, bucket_a, model, monkeypatch
):
    import os
    import random
    import signal
    import time

    for k, v in REPLICA_ENV.items():
        monkeypatch.setenv(k, v)
    server = S3Server(free_port())
    server.start()
    engines = []
    try:
        bucket = server.new_bucket()
        copy_objects(s3_server.client(), bucket_a, server.client(), bucket)
        config = kv_config(server.endpoint_url, bucket, cpu_bytes="8MiB", load_timeout_s=3, s3_max_attempts=1)
        llm = start_engine(model, config, enable_prefix_caching=False)  # every hit is s3kv's
        engines.append(llm)
        params = greedy_params()

        def generate(prompt):
            (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            return out

        first = generate(PROMPTS[0])  # the family's prefix from S3, promoted to host memory
        assert list(first.outputs[0].token_ids) == baseline["outputs"][0] and first.num_cached_tokens >= 320
        os.kill(server.proc.pid, signal.SIGSTOP)  # S3 hangs: connections open, nothing answers
        # Prompt 1's own chunks are in S3 only: that load times out, the
        # prompt is recomputed, and the S3 breaker opens.
        assert list(generate(PROMPTS[1]).outputs[0].token_ids) == baseline["outputs"][1]
        assert s3kv_value(llm, "breaker_trips_s3") >= 1
        cpu_before = s3kv_value(llm, "load_chunks_cpu")
        for i in (0, 2, 0):  # host-memory hits go on, with the right answers
            out = generate(PROMPTS[i])
            assert list(out.outputs[0].token_ids) == baseline["outputs"][i] and out.num_cached_tokens >= 320
        assert s3kv_value(llm, "load_chunks_cpu") >= cpu_before + 3 * 5
        assert s3kv_value(llm, "breaker_open_s3") == 1  # they did not close S3's breaker
        os.kill(server.proc.pid, signal.SIGCONT)
        # S3 is back: within the backoff, one probe (a store of new chunks)
        # finds out, the breaker closes and S3 is written again.
        rng = random.Random(5)
        deadline = time.monotonic() + 120
        while s3kv_value(llm, "breaker_open_s3") != 0:
            assert time.monotonic() < deadline, "the S3 breaker never closed"
            generate([rng.randrange(3, 2048) for _ in range(2 * 64 + 5)])
        stored = s3kv_value(llm, "store_chunks_s3")
        generate([rng.randrange(3, 2048) for _ in range(2 * 64 + 5)])
        # the stores are reported as the engine steps once their PUTs are done
        assert wait_for_value(llm, "store_chunks_s3", lambda v: v >= stored + 2) >= stored + 2
    finally:
        if server.proc is not None:
            os.kill(server.proc.pid, signal.SIGCONT)
        for engine in engines:
            engine.llm_engine.engine_core.shutdown()
        server.stop()
