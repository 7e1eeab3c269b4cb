"""s3kv under ``vllm serve`` (its OpenAI server): the connector loads from its --kv-transfer-config
name, serves completions, and its figures show on ``/metrics`` and in the
server's periodic "KV Transfer metrics" log line."""

from __future__ import annotations

import json
import random
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.harness import CHUNK_TOKENS, kv_config, start_serve

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
def server(workdir: Path, model: Path, s3_server):
    bucket = s3_server.new_bucket()
    log_path = workdir / "serve.log"
    config = kv_config(s3_server.endpoint_url, bucket, cpu_bytes="32MiB")
    proc, url = start_serve(model, config, log_path)
    try:
        yield {"url": url, "log": log_path, "model": str(model)}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


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
    deadline = time.monotonic() + 120
    while "KV Transfer metrics:" not in server["log"].read_text():
        assert time.monotonic() < deadline, "no KV Transfer metrics log line"
        time.sleep(0.5)
    line = next(s for s in server["log"].read_text().splitlines() if "KV Transfer metrics:" in s)
    assert "lookup_requests=" in line
