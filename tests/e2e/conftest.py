"""Fixtures shared by the end-to-end tests: the model, the baseline (no
connector) and replica A, which fills a bucket that later replicas read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from s3kv.demo.model import build_model
from tests.e2e.harness import kv_config, run_replica, workload

PROMPTS = workload(seed=0)


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("replicas")


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("model") / "llama", seed=0)


@pytest.fixture(scope="session")
def baseline(workdir, model) -> dict[str, Any]:
    return run_replica(workdir, "baseline", model, PROMPTS, None)


@pytest.fixture(scope="session")
def bucket_a(s3_server) -> str:
    return s3_server.new_bucket()


@pytest.fixture(scope="session")
def replica_a(workdir, model, s3_server, bucket_a) -> dict[str, Any]:
    return run_replica(workdir, "A", model, PROMPTS, kv_config(s3_server.endpoint_url, bucket_a))
