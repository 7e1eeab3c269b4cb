"""The S3 server goes away while a replica serves: requests still complete,
with the baseline's tokens (vLLM recomputes what cannot be loaded)."""

from __future__ import annotations

import pytest

from tests.conftest import S3Server, free_port
from tests.e2e.conftest import PROMPTS
from tests.e2e.harness import ENGINE_ARGS, MAX_TOKENS, REPLICA_ENV, kv_config

pytestmark = pytest.mark.engine


def _counter(llm, name: str) -> float:
    """An s3kv counter by its flat name (``load_errors_unavailable`` is
    ``vllm:s3kv_load_errors{kind="unavailable"}``)."""
    from s3kv.stats import SERIES

    family, value = SERIES[name]
    return sum(
        m.value
        for m in llm.get_metrics()
        if m.name == f"vllm:s3kv_{family.name}"
        and (family.label is None or m.labels.get(family.label) == value)
    )


def test_s3_stopped_while_serving(replica_a, baseline, s3_server, bucket_a, model, monkeypatch):
    for k, v in REPLICA_ENV.items():
        monkeypatch.setenv(k, v)
    # A server of its own, holding replica A's objects, that this test can stop.
    server = S3Server(free_port())
    server.start()
    engines = []
    try:
        bucket = server.new_bucket()
        src = s3_server.client()
        dst = server.client()
        for obj in src.list_objects_v2(Bucket=bucket_a)["Contents"]:
            body = src.get_object(Bucket=bucket_a, Key=obj["Key"])["Body"].read()
            dst.put_object(Bucket=bucket, Key=obj["Key"], Body=body)

        from vllm import LLM, SamplingParams

        config = kv_config(
            server.endpoint_url, bucket, load_timeout_s=20, s3_connect_timeout_s=1, s3_max_attempts=2
        )
        llm = LLM(
            model=str(model),
            skip_tokenizer_init=True,
            disable_log_stats=False,
            kv_transfer_config=config,
            **ENGINE_ARGS,
        )
        engines.append(llm)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

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
        assert _counter(llm, "load_errors_unavailable") >= 1
    finally:
        for engine in engines:
            engine.llm_engine.engine_core.shutdown()
        server.stop()
