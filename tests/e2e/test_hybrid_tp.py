"""The random Gemma 3 of ``test_hybrid.py`` (five sliding-window layers of
64 tokens to one global layer, six KV cache groups) at tensor parallel 2,
with vLLM's hybrid KV cache manager on: each rank stores its shard of every
group's part, and a fresh TP 2 replica loads both ranks' shards and says
exactly the TP 2 baseline's tokens. A negative control gives one rank's
shards of one group wrong KV."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from s3kv.keys import parse_object_key
from tests.e2e.harness import (
    chunk_objects,
    copy_bucket,
    group_kinds,
    kv_config,
    part_keys,
    run_replica,
    worker_total,
    wrong_group,
)
from tests.e2e.test_hybrid_families import load_errors, stays_hybrid

pytestmark = pytest.mark.engine

CHUNK = 128
ENGINE = {
    "kv_cache_memory_bytes": 64 << 20,
    "tensor_parallel_size": 2,
    "distributed_executor_backend": "mp",
}
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
"""One core per rank."""
GEMMA3_GROUPS = ["SlidingWindowSpec"] * 5 + ["FullAttentionSpec"]

_rng = random.Random(282)


def _toks(n: int) -> list[int]:
    return [_rng.randrange(3, 2048) for _ in range(n)]


SHARED = _toks(6 * CHUNK)
STORE = [SHARED + _toks(50)]
PROBES = [SHARED[: 5 * CHUNK] + _toks(40)]
LOADS = 5 + 5
"""Parts of a hit of 5 chunks, per rank: the global group's 5, each sliding group's last one."""


def _kv(s3_server: Any, bucket: str) -> dict[str, Any]:
    return kv_config(s3_server.endpoint_url, bucket, chunk_tokens=CHUNK)


def _run(workdir: Path, name: str, model: Path, prompts: list[list[int]], kv: Any) -> dict[str, Any]:
    return run_replica(workdir, name, model, prompts, kv, engine_args=ENGINE, env=TP_ENV)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> Path:
    from s3kv.demo.model import build_gemma3

    return build_gemma3(tmp_path_factory.mktemp("gemma3_tp") / "gemma3", seed=0)


@pytest.fixture(scope="module")
def tp_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hybrid_tp")


@pytest.fixture(scope="module")
def tp_baseline(tp_dir, gemma) -> dict[str, Any]:
    return _run(tp_dir, "baseline", gemma, STORE + PROBES, None)


@pytest.fixture(scope="module")
def tp_bucket(s3_server) -> str:
    return s3_server.new_bucket()


@pytest.fixture(scope="module")
def tp_a(tp_dir, gemma, s3_server, tp_bucket) -> dict[str, Any]:
    return _run(tp_dir, "A", gemma, STORE, _kv(s3_server, tp_bucket))


def test_tp2_keeps_the_groups_and_each_rank_stores_every_part(tp_a, tp_baseline, s3_server, tp_bucket):
    assert len(tp_a["kv_cache"]) == 2
    stays_hybrid(tp_a, tp_baseline, GEMMA3_GROUPS)
    assert tp_a["outputs"] == tp_baseline["outputs"][:1]
    client = s3_server.client()
    stored = {parse_object_key(k)[1:] for k in chunk_objects(client, tp_bucket)}
    parts = {k for keys in part_keys(client, tp_bucket, STORE[0], CHUNK).values() for k in keys}
    assert stored == {(k, rank) for k in parts for rank in (0, 1)}  # 6 groups x 6 chunks x 2 ranks
    assert worker_total(tp_a, "store_chunks_s3") == 2 * 36


def test_tp2_fresh_replica_loads_both_ranks_and_matches(
    tp_a, tp_baseline, tp_dir, gemma, s3_server, tp_bucket
):
    own = copy_bucket(s3_server, tp_bucket)  # B stores its probe: not into the bucket other tests copy
    b = _run(tp_dir, "B", gemma, PROBES, _kv(s3_server, own))
    assert b["outputs"] == tp_baseline["outputs"][1:]
    assert b["num_cached_tokens"] == [5 * CHUNK]
    assert [w["load_chunks_s3"] for w in b["workers"]] == [LOADS, LOADS]
    assert load_errors(b) == 0


def test_tp2_negative_control_wrong_kv_on_one_rank_of_one_group(
    tp_a, tp_baseline, tp_dir, gemma, s3_server, tp_bucket
):
    client = s3_server.client()
    sliding = group_kinds(client, tp_bucket).index("sliding_window")
    wrong = copy_bucket(s3_server, tp_bucket, wrong_group(client, tp_bucket, STORE, CHUNK, sliding, rank=1))
    n = _run(tp_dir, "wrong", gemma, PROBES, _kv(s3_server, wrong))
    assert [w["load_chunks_s3"] for w in n["workers"]] == [LOADS, LOADS]
    assert load_errors(n) == 0  # valid objects: loaded, and used
    assert n["outputs"] != tp_baseline["outputs"][1:]
