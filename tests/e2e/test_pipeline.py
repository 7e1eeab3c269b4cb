"""Pipeline parallelism 2 (TP 1, vLLM's CPU build; vLLM runs its pipeline
there only with its compiled graphs, so ``enforce_eager`` is off): each
stage stores its own layers' part of every chunk as a shard of its own
(``.r0`` the first stage's layers, ``.r1`` the second's), a fresh PP 2
replica loads both stages' shards and says the store run's tokens, and
wrong KV in the second stage's shards alone changes what it says."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from s3kv.keys import parse_object_key
from tests.e2e.harness import (
    CHUNK_TOKENS,
    chunk_objects,
    copy_bucket,
    kv_config,
    part_keys,
    run_replica,
    worker_total,
    wrong_group,
)

pytestmark = pytest.mark.engine

ENGINE = {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp", "enforce_eager": False}
PP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
"""One core per stage."""
CHUNKS = 4

_rng = random.Random(2929)


def _toks(n: int) -> list[int]:
    return [_rng.randrange(3, 2048) for _ in range(n)]


PROMPTS = [_toks(CHUNKS * CHUNK_TOKENS + 20), _toks(CHUNKS * CHUNK_TOKENS + 20)]


def _run(workdir: Path, name: str, model: Path, kv: Any) -> dict[str, Any]:
    return run_replica(workdir, name, model, PROMPTS, kv, engine_args=ENGINE, env=PP_ENV)


@pytest.fixture(scope="module")
def pp_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pipeline")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from s3kv.demo.model import build_model

    return build_model(tmp_path_factory.mktemp("pp_model") / "llama", seed=0)  # 6 layers: 3 a stage


@pytest.fixture(scope="module")
def pp_bucket(s3_server) -> str:
    return s3_server.new_bucket()


@pytest.fixture(scope="module")
def stored(pp_dir, model, s3_server, pp_bucket) -> dict[str, Any]:
    return _run(pp_dir, "store", model, kv_config(s3_server.endpoint_url, pp_bucket))


def test_each_stage_stores_its_layers_as_its_own_shard(stored, s3_server, pp_bucket):
    client = s3_server.client()
    keys = {k for p in PROMPTS for k in part_keys(client, pp_bucket, p, CHUNK_TOKENS)[0]}
    assert len(keys) == 2 * CHUNKS
    objects = {parse_object_key(k)[1:] for k in chunk_objects(client, pp_bucket)}
    assert objects == {(k, stage) for k in keys for stage in (0, 1)}
    assert [w["store_chunks_s3"] for w in stored["workers"]] == [2 * CHUNKS, 2 * CHUNKS]  # each stage its own


def test_a_fresh_pp2_replica_loads_both_stages_and_wrong_kv_in_one_stage_changes_it(
    stored, pp_dir, model, s3_server, pp_bucket
):
    client = s3_server.client()
    # The second prompt's second-stage shards get the first prompt's KV (valid objects, wrong KV).
    transform = wrong_group(client, pp_bucket, PROMPTS[1:], CHUNK_TOKENS, 0, rank=1, donors=PROMPTS[:1])
    bucket = copy_bucket(s3_server, pp_bucket, transform)
    got = _run(pp_dir, "load", model, kv_config(s3_server.endpoint_url, bucket))
    assert got["num_cached_tokens"] == [CHUNKS * CHUNK_TOKENS] * 2
    assert [w["load_chunks_s3"] for w in got["workers"]] == [2 * CHUNKS, 2 * CHUNKS]
    assert worker_total(got, "load_errors_corrupt") + worker_total(got, "load_errors_missing") == 0
    assert got["outputs"][0] == stored["outputs"][0]  # both stages' KV loaded: the store run's tokens
    assert got["outputs"][1] != stored["outputs"][1]  # the second stage's KV wrong alone: other tokens
