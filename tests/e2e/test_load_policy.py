"""The load policy in a real engine, behind an S3 whose object GETs answer
late (a loopback proxy holds their first byte back): with ``cost`` a long
prefix is loaded and a short one computed; with ``always`` both load. The
answers are the same tokens either way."""

from __future__ import annotations

import random

import pytest

from s3kv.testing.latency_proxy import LatencyProxy
from tests.e2e.harness import (
    CHUNK_TOKENS,
    REPLICA_ENV,
    greedy_params,
    kv_config,
    s3kv_value,
    start_engine,
    wait_for_value,
)

pytestmark = pytest.mark.engine

rng = random.Random(18)
LONG = [rng.randrange(3, 2048) for _ in range(30 * CHUNK_TOKENS + 20)]  # 30 chunks
SHORT = [rng.randrange(3, 2048) for _ in range(2 * CHUNK_TOKENS + 20)]  # 2 chunks, another prefix


def test_cost_policy_computes_a_short_prefix_on_a_slow_s3_and_loads_a_long_one(s3_server, model, monkeypatch):
    for k, v in REPLICA_ENV.items():
        monkeypatch.setenv(k, v)
    bucket = s3_server.new_bucket()
    params = greedy_params()
    engines = []
    with LatencyProxy(s3_server.endpoint_url) as proxy:

        def engine(policy: str):
            llm = start_engine(
                model, kv_config(proxy.endpoint_url, bucket, load_policy=policy), enable_prefix_caching=False
            )
            engines.append(llm)
            return llm

        def generate(llm, prompt):
            (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            return list(out.outputs[0].token_ids), out.num_cached_tokens

        try:
            llm = engine("cost")
            # Computed and stored: nothing is in the bucket yet. The
            # forwards of these prefills time the engine's prefill rate.
            want = {name: generate(llm, p)[0] for name, p in (("long", LONG), ("short", SHORT))}
            stored = len(LONG) // CHUNK_TOKENS + len(SHORT) // CHUNK_TOKENS
            assert wait_for_value(llm, "store_chunks_s3", lambda v: v >= stored) >= stored
            rate = wait_for_value(llm, "cost_prefill_tokens_per_second_2048", lambda v: v > 0)
            assert rate > 0, "the long prefill was not timed"
            # S3 now answers a third of the long prefix's compute time late:
            # several times what the short prefix takes to compute.
            proxy.delay_s = 0.35 * len(LONG) / rate
            assert 2 * CHUNK_TOKENS / rate < proxy.delay_s / 2

            tokens, cached = generate(llm, LONG)
            assert tokens == want["long"]
            assert cached >= 29 * CHUNK_TOKENS, "the long prefix was not loaded"
            assert proxy.delayed >= 29
            # The estimate followed S3: its first chunk takes the delay now.
            first = wait_for_value(llm, "cost_first_chunk_seconds_s3", lambda v: v >= 0.9 * proxy.delay_s)
            assert first >= 0.9 * proxy.delay_s
            declined = s3kv_value(llm, "load_policy_tokens_declined")

            tokens, cached = generate(llm, SHORT)
            assert tokens == want["short"]
            assert cached == 0, "the short prefix was loaded from the slow S3"
            wait_for_value(llm, "load_policy_tokens_declined", lambda v: v >= declined + 2 * CHUNK_TOKENS)
            assert s3kv_value(llm, "load_policy_tokens_declined") == declined + 2 * CHUNK_TOKENS
            assert s3kv_value(llm, "hit_tokens_s3") == 30 * CHUNK_TOKENS  # the long prefix's only
            # A request may ask for its own policy (kv_transfer_params).
            always = params.clone()
            always.extra_args = {"kv_transfer_params": {"s3kv_load_policy": "always"}}
            (out,) = llm.generate([{"prompt_token_ids": SHORT}], always, use_tqdm=False)
            assert list(out.outputs[0].token_ids) == want["short"]
            assert out.num_cached_tokens >= 2 * CHUNK_TOKENS
            llm.llm_engine.engine_core.shutdown()
            engines.remove(llm)

            # The control: the same S3, the same prompts, ``always``: both load.
            llm = engine("always")
            assert wait_for_value(llm, "manifest_keys", lambda v: v >= stored) >= stored
            delayed = proxy.delayed
            tokens, cached = generate(llm, SHORT)
            assert tokens == want["short"] and cached >= 2 * CHUNK_TOKENS
            tokens, cached = generate(llm, LONG)
            assert tokens == want["long"] and cached >= 29 * CHUNK_TOKENS
            assert proxy.delayed >= delayed + 31
            assert s3kv_value(llm, "load_policy_tokens_declined") == 0
        finally:
            for llm in engines:
                llm.llm_engine.engine_core.shutdown()


QUEUE = [[rng.randrange(3, 2048) for _ in range(8 * CHUNK_TOKENS + 10)] for _ in range(4)]  # 4 prefixes
ALONE = [rng.randrange(3, 2048) for _ in range(8 * CHUNK_TOKENS + 10)]  # a fifth
BLOCKER = [rng.randrange(3, 2048) for _ in range(CHUNK_TOKENS // 2)]  # under a chunk: nothing stored


def test_prefetch_at_arrival_serves_a_queue_of_s3_prefixes_from_the_cpu_tier(s3_server, model, monkeypatch):
    """Four requests arrive at once on an engine that runs one at a time,
    behind a request that takes its one slot (vLLM looks a waiting request
    up only once a slot is free); their prefixes are only in S3, which
    answers late. With prefetch their chunks are fetched into the CPU tier
    while they wait, and every hit comes from there; without it (the
    control) every hit comes from S3. A request that arrives alone at the
    idle engine is looked up at once: it loads from S3 either way, with
    nothing prefetched."""
    for k, v in REPLICA_ENV.items():
        monkeypatch.setenv(k, v)
    bucket = s3_server.new_bucket()
    params = greedy_params()
    chunks = sum(len(p) // CHUNK_TOKENS for p in QUEUE)
    engines = []
    with LatencyProxy(s3_server.endpoint_url) as proxy:

        def engine(**extra):
            llm = start_engine(
                model,
                kv_config(proxy.endpoint_url, bucket, **extra),
                enable_prefix_caching=False,
                max_num_seqs=1,
            )
            engines.append(llm)
            return llm

        first = params.clone()
        # Still decoding when the queue arrives (its requests reach the
        # engine while it prefills), done long before S3 answers.
        first.max_tokens = 4

        def burst(llm):
            prompts = [{"prompt_token_ids": p} for p in [BLOCKER, *QUEUE]]
            outs = llm.generate(prompts, [first] + [params] * len(QUEUE), use_tqdm=False)[1:]
            return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]

        def alone(llm):
            (out,) = llm.generate([{"prompt_token_ids": ALONE}], params, use_tqdm=False)
            return list(out.outputs[0].token_ids), out.num_cached_tokens

        def close(llm):
            llm.llm_engine.engine_core.shutdown()
            engines.remove(llm)

        try:
            writer = engine()  # S3 only: computes and stores
            want, _ = burst(writer)
            want_alone, _ = alone(writer)
            chunks_alone = len(ALONE) // CHUNK_TOKENS
            stored = chunks + chunks_alone
            assert wait_for_value(writer, "store_chunks_s3", lambda v: v >= stored) >= stored
            close(writer)
            proxy.delay_s = 1.0

            for prefetch in (True, False):
                llm = engine(cpu_bytes="256MiB", prefetch_bytes="1GiB" if prefetch else 0)
                assert wait_for_value(llm, "manifest_keys", lambda v: v >= stored) >= stored
                outputs, cached = burst(llm)
                assert outputs == want
                assert all(c >= 8 * CHUNK_TOKENS for c in cached), cached
                cpu, s3 = s3kv_value(llm, "hit_tokens_cpu"), s3kv_value(llm, "hit_tokens_s3")
                started = s3kv_value(llm, "prefetch_chunks_started")
                if prefetch:
                    # Every chunk was fetched while its request waited: the hits are the CPU tier's.
                    assert started == chunks and s3 == 0 and cpu == chunks * CHUNK_TOKENS
                    assert s3kv_value(llm, "prefetch_waits") >= 1
                else:
                    assert started == 0 and cpu == 0 and s3 == chunks * CHUNK_TOKENS
                # Alone at the idle engine: an S3 load at once, prefetch or not.
                tokens, hit = alone(llm)
                assert tokens == want_alone and hit >= 8 * CHUNK_TOKENS
                s3_then = s3 + chunks_alone * CHUNK_TOKENS
                assert wait_for_value(llm, "hit_tokens_s3", lambda v, want=s3_then: v >= want) == s3_then
                assert s3kv_value(llm, "hit_tokens_cpu") == cpu
                assert s3kv_value(llm, "prefetch_chunks_started") == started
                close(llm)
        finally:
            for llm in engines:
                llm.llm_engine.engine_core.shutdown()
