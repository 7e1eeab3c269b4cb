"""Hybrid model families beside Gemma 3 (``test_hybrid.py``), each a real
vLLM engine (CPU build) with its hybrid KV cache manager on and replicas
sharing one bucket on a real S3 server on loopback:

- gpt-oss: sliding-window (128 tokens) and full attention layers, two KV
  cache groups of three layers each, mixture of experts;
- Llama 4 text: chunked-local attention (128-token attention chunks) and
  full attention, four groups of two layers;
- Qwen3-Next without prefix caching: s3kv shares its gated delta net
  layers' state only in vLLM's prefix-caching mode for it, so the engine
  must not start, and say so (``test_hybrid_mamba.py`` shares it).

A fresh replica B loads the prefixes replica A stored and must say exactly
the baseline's (no connector) tokens; the parts it loads are counted, at
and around each family's window or attention-chunk boundaries. Every probe
has a prefix of its own (A stores one prompt per probe), so that no probe
hits vLLM's own prefix cache of another and each loads only from S3. A
negative control gives one group wrong KV (another chunk's pages): the
output changes, so these models' greedy output depends on that group's KV.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from s3kv.keys import parse_object_key
from tests.e2e.harness import (
    REPLICA_TIMEOUT_S,
    chunk_objects,
    copy_bucket,
    group_kinds,
    kv_config,
    part_keys,
    run_replica,
    start_replica,
    worker_total,
    wrong_group,
)

pytestmark = pytest.mark.engine

ENGINE = {"kv_cache_memory_bytes": 64 << 20}
"""A fixed KV cache size: its block count is the same from run to run."""
LOAD_ERRORS = ("missing", "corrupt", "timeout", "unavailable", "other")
PREFIX = 384
"""Tokens of each probe's own prefix, which replica A stores."""


def _prompts(seed: int, ends: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """(A's prompts, the probes): probe i leaves prefix i after ``ends[i]`` tokens."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 2048) for _ in range(n)]

    prefixes = [toks(PREFIX) for _ in ends]
    return [p + toks(50) for p in prefixes], [
        p[:end] + toks(40) for p, end in zip(prefixes, ends, strict=True)
    ]


# -- reading and rewriting a bucket's parts ---------------------------------


def load_errors(result: dict[str, Any]) -> float:
    return sum(worker_total(result, f"load_errors_{k}") for k in LOAD_ERRORS)


def stays_hybrid(a: dict[str, Any], baseline: dict[str, Any], groups: list[str]) -> None:
    """vLLM's hybrid KV cache manager stayed on with s3kv: A's KV cache
    groups and block count are the baseline's (no connector), ``groups``."""
    assert [r["groups"] for r in a["kv_cache"]] == [r["groups"] for r in baseline["kv_cache"]]
    assert all(r["groups"] == groups for r in a["kv_cache"])
    assert [r["num_blocks"] for r in a["kv_cache"]] == [r["num_blocks"] for r in baseline["kv_cache"]]
    assert "Turning off hybrid kv cache manager" not in Path(a["log"]).read_text()


def varied(outputs: list[list[int]]) -> None:
    """A random model can say one token whatever the prompt: these say many, and differ by prompt."""
    assert all(len(set(o)) >= len(o) // 2 for o in outputs)
    assert len({tuple(o) for o in outputs}) == len(outputs)


# -- gpt-oss: a sliding window of 128 tokens beside full attention ----------

OSS_CHUNK = 64
"""Two of the tests' 32-token blocks; the window is two chunks."""
OSS_ENDS = [5 * OSS_CHUNK, 5 * OSS_CHUNK + 1, 128, 191, 192, 96]
"""Where the probes leave their prefixes: at a chunk boundary and a token
past it, at the window (128), a token before and a chunk past it, and
inside the first chunk."""
OSS_LOADS = [5 + 2, 5 + 2, 2 + 2, 2 + 2, 3 + 2, 1 + 1]
"""Parts each probe's hit loads, full group + sliding group: the window
reaches back 127 tokens from the hit's end, so a hit of 320 tokens needs
the sliding group's chunks 3 and 4 only (tokens 193 on), and hits of up to
the window (64, 128) need all their chunks of both groups."""
OSS_HITS = [320, 320, 128, 128, 192, 64]
OSS_STORE, OSS_PROBES = _prompts(120, OSS_ENDS)


def _oss_kv(s3_server: Any, bucket: str) -> dict[str, Any]:
    return kv_config(s3_server.endpoint_url, bucket, chunk_tokens=OSS_CHUNK)


@pytest.fixture(scope="module")
def oss_model(tmp_path_factory) -> Path:
    from s3kv.demo.model import build_gpt_oss

    return build_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "gpt_oss", seed=0)


@pytest.fixture(scope="module")
def oss_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("oss")


@pytest.fixture(scope="module")
def oss_baseline(oss_dir, oss_model) -> dict[str, Any]:
    return run_replica(oss_dir, "baseline", oss_model, OSS_STORE + OSS_PROBES, None, engine_args=ENGINE)


@pytest.fixture(scope="module")
def oss_bucket(s3_server) -> str:
    return s3_server.new_bucket()


@pytest.fixture(scope="module")
def oss_a(oss_dir, oss_model, s3_server, oss_bucket) -> dict[str, Any]:
    return run_replica(oss_dir, "A", oss_model, OSS_STORE, _oss_kv(s3_server, oss_bucket), engine_args=ENGINE)


def test_gpt_oss_keeps_its_two_groups_and_stores_both(oss_a, oss_baseline, s3_server, oss_bucket):
    stays_hybrid(oss_a, oss_baseline, ["SlidingWindowSpec", "FullAttentionSpec"])
    assert oss_a["outputs"] == oss_baseline["outputs"][: len(OSS_STORE)]
    varied(oss_baseline["outputs"])
    client = s3_server.client()
    assert group_kinds(client, oss_bucket) == ["sliding_window", "full"]
    stored = {parse_object_key(k)[1] for k in chunk_objects(client, oss_bucket)}
    wanted = {
        k for p in OSS_STORE for keys in part_keys(client, oss_bucket, p, OSS_CHUNK).values() for k in keys
    }
    assert stored == wanted  # 6 prompts x 6 chunks x 2 groups
    assert worker_total(oss_a, "store_chunks_s3") == len(wanted) == 72


def test_gpt_oss_fresh_replica_loads_the_window_and_matches(
    oss_a, oss_baseline, oss_dir, oss_model, s3_server, oss_bucket
):
    own = copy_bucket(s3_server, oss_bucket)  # B stores its probes: not into the bucket other tests copy
    b = run_replica(oss_dir, "B", oss_model, OSS_PROBES, _oss_kv(s3_server, own), engine_args=ENGINE)
    assert b["outputs"] == oss_baseline["outputs"][len(OSS_STORE) :]
    assert b["num_cached_tokens"] == OSS_HITS
    assert worker_total(b, "load_chunks_s3") == sum(OSS_LOADS)
    assert load_errors(b) == 0


def test_gpt_oss_negative_control_wrong_kv_in_the_sliding_group(
    oss_a, oss_baseline, oss_dir, oss_model, s3_server, oss_bucket
):
    client = s3_server.client()
    sliding = group_kinds(client, oss_bucket).index("sliding_window")
    wrong = copy_bucket(
        s3_server, oss_bucket, wrong_group(client, oss_bucket, OSS_STORE[:1], OSS_CHUNK, sliding)
    )
    n = run_replica(
        oss_dir, "wrong", oss_model, OSS_PROBES[:1], _oss_kv(s3_server, wrong), engine_args=ENGINE
    )
    assert worker_total(n, "load_chunks_s3") == OSS_LOADS[0]
    assert load_errors(n) == 0  # valid objects: loaded, and used
    assert n["outputs"] != oss_baseline["outputs"][len(OSS_STORE) : len(OSS_STORE) + 1]


# -- Llama 4: chunked-local attention (128-token chunks) beside full ---------

L4_CHUNK = 32
"""One block per stored chunk, so that a hit can end a block before an attention-chunk boundary."""
L4_ENV = {"VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": "1"}
"""Without it vLLM turns its hybrid manager off for chunked-local attention."""
L4_ENDS = [256, 257, 224, 288]
"""Where the probes leave their prefixes: at an attention-chunk boundary,
a token past it (both hits end at the boundary), a block before it and a
block past it."""
L4_LOADS = [8, 8, 7 + 3 * 3, 9 + 3 * 1]
"""Parts each probe's hit loads, full group + three chunked groups: a hit
ending at an attention-chunk boundary needs no chunked group's page (the
next token starts a new attention chunk); one of 224 tokens needs their
blocks 4-6 (tokens 128-223), one of 288 their block 8."""
L4_HITS = [256, 256, 224, 288]
L4_CHUNKED = ["ChunkedLocalAttentionSpec"] * 3 + ["FullAttentionSpec"]
L4_STORE, L4_PROBES = _prompts(4, L4_ENDS)


def _l4_kv(s3_server: Any, bucket: str) -> dict[str, Any]:
    return kv_config(s3_server.endpoint_url, bucket, chunk_tokens=L4_CHUNK)


def _l4_run(workdir: Path, name: str, model: Path, prompts: list[list[int]], kv: Any) -> dict[str, Any]:
    return run_replica(workdir, name, model, prompts, kv, engine_args=ENGINE, env=L4_ENV)


@pytest.fixture(scope="module")
def l4_model(tmp_path_factory) -> Path:
    from s3kv.demo.model import build_llama4

    return build_llama4(tmp_path_factory.mktemp("llama4") / "llama4", seed=0)


@pytest.fixture(scope="module")
def l4_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("l4")


@pytest.fixture(scope="module")
def l4_baseline(l4_dir, l4_model) -> dict[str, Any]:
    return _l4_run(l4_dir, "baseline", l4_model, L4_STORE + L4_PROBES, None)


@pytest.fixture(scope="module")
def l4_bucket(s3_server) -> str:
    return s3_server.new_bucket()


@pytest.fixture(scope="module")
def l4_a(l4_dir, l4_model, s3_server, l4_bucket) -> dict[str, Any]:
    return _l4_run(l4_dir, "A", l4_model, L4_STORE, _l4_kv(s3_server, l4_bucket))


def test_llama4_keeps_its_chunked_groups_and_stores_them(l4_a, l4_baseline, s3_server, l4_bucket):
    stays_hybrid(l4_a, l4_baseline, L4_CHUNKED)
    assert l4_a["outputs"] == l4_baseline["outputs"][: len(L4_STORE)]
    varied(l4_baseline["outputs"])
    client = s3_server.client()
    assert group_kinds(client, l4_bucket) == ["chunked_local"] * 3 + ["full"]
    stored = {parse_object_key(k)[1] for k in chunk_objects(client, l4_bucket)}
    # A chunked group's part of a chunk that ends an attention chunk (chunks
    # 3, 7, 11) is one no hit needs: a hit ending there or later starts a
    # new attention chunk. Not stored; every other part is.
    wanted = {
        k
        for p in L4_STORE
        for g, keys in part_keys(client, l4_bucket, p, L4_CHUNK).items()
        for c, k in enumerate(keys)
        if g == 3 or (c + 1) * L4_CHUNK % 128 != 0
    }
    assert stored == wanted
    assert worker_total(l4_a, "store_chunks_s3") == len(wanted) == 4 * (13 * 4 - 3 * 3)


def test_llama4_fresh_replica_loads_around_attention_chunk_boundaries_and_matches(
    l4_a, l4_baseline, l4_dir, l4_model, s3_server, l4_bucket
):
    own = copy_bucket(s3_server, l4_bucket)  # B stores its probes: not into the bucket other tests copy
    b = _l4_run(l4_dir, "B", l4_model, L4_PROBES, _l4_kv(s3_server, own))
    assert b["outputs"] == l4_baseline["outputs"][len(L4_STORE) :]
    assert b["num_cached_tokens"] == L4_HITS
    assert worker_total(b, "load_chunks_s3") == sum(L4_LOADS)
    assert load_errors(b) == 0


def test_llama4_negative_control_wrong_kv_in_one_chunked_group(
    l4_a, l4_baseline, l4_dir, l4_model, s3_server, l4_bucket
):
    """Wrong KV in the first chunked group changes the output of the hit a
    block before the boundary, and not that of the hit at the boundary,
    which loads none of it."""
    client = s3_server.client()
    chunked = group_kinds(client, l4_bucket).index("chunked_local")
    probes = [0, 2]  # at the boundary, a block before it
    rewrite = wrong_group(client, l4_bucket, [L4_STORE[i] for i in probes], L4_CHUNK, chunked)
    wrong = copy_bucket(s3_server, l4_bucket, rewrite)
    n = _l4_run(l4_dir, "wrong", l4_model, [L4_PROBES[i] for i in probes], _l4_kv(s3_server, wrong))
    assert worker_total(n, "load_chunks_s3") == L4_LOADS[0] + L4_LOADS[2]
    assert load_errors(n) == 0  # valid objects: loaded, and used
    base = l4_baseline["outputs"][len(L4_STORE) :]
    assert n["outputs"][0] == base[0]
    assert n["outputs"][1] != base[2]


# -- Qwen3-Next without prefix caching: no state to share -------------------


def test_qwen3_next_without_prefix_caching_fails_at_start_up_naming_what_to_do(tmp_path, s3_server):
    """s3kv shares a gated delta net's state where vLLM keeps it at block
    boundaries (``mamba_cache_mode="align"``, which prefix caching turns
    on): without it the engine must not start, and the log must say why."""
    from s3kv.demo.model import build_qwen3_next

    model = build_qwen3_next(tmp_path / "qwen3_next", seed=0)
    kv = kv_config(s3_server.endpoint_url, s3_server.new_bucket(), chunk_tokens=640)
    engine = {**ENGINE, "block_size": None, "enable_prefix_caching": False}
    proc = start_replica(tmp_path, "qwen3_next", model, [list(range(3, 300))], kv, engine_args=engine)
    try:
        returncode = proc.wait(REPLICA_TIMEOUT_S)
    finally:
        proc.s3kv_log.close()  # type: ignore[attr-defined]
    log = (tmp_path / "qwen3_next.log").read_text()
    assert returncode != 0
    assert not (tmp_path / "qwen3_next.result.json").exists()
    assert "s3kv shares Mamba / linear-attention state only in vLLM's prefix-caching mode for it" in log
    assert "turn prefix caching on (--enable-prefix-caching)" in log
