"""One cache for every parallelism (issue 29), end to end on the CPU build:
parts cut by KV head shared between TP 1 and TP 2 replicas
(``share_across_tp``), a GQA model with fewer KV heads than ranks storing
its one head once, and an MLA model (random DeepSeek V2, vLLM's CPU MLA)
storing its latent KV once, at TP 2.

The cross-TP Llama runs in float32: a head's KV is the same whatever the
TP size only in the first layer; later layers differ in their last bits
(the all-reduce of a row-parallel projection sums in another order), which
in bfloat16 flips near-tied greedy tokens of a random model, while in
float32 TP 1 and TP 2 say the same tokens. Within one TP size the models
run in their checkpoint's bfloat16.

Engine starts are the cost here (one TP 2 start is most of a minute on a
busy machine): each replica is a module fixture that runs several prompts,
and a store run's cold tokens are the baseline of the replicas that load
what it stored (the same computation, so the same tokens)."""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from s3kv import codec
from s3kv.chunk_reader import decode_chunk
from s3kv.keys import Namespace, fingerprint, parse_object_key
from s3kv.manifest.protocol import replica_of
from tests.e2e.harness import (
    CHUNK_TOKENS,
    MAX_TOKENS,
    chunk_objects,
    copy_bucket,
    descriptor,
    engine_keys,
    kv_config,
    run_replica,
    segments_by_writer,
    worker_total,
)
from tests.e2e.test_hybrid_families import load_errors

pytestmark = pytest.mark.engine

KV_MEMORY = {"kv_cache_memory_bytes": 64 << 20}
TP2 = {**KV_MEMORY, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
"""One core per rank (TP 1 keeps the harness's one core)."""
F32 = {"dtype": "float32"}
SHARE = {"share_across_tp": True}

_rng = random.Random(29)


def _toks(n: int) -> list[int]:
    return [_rng.randrange(3, 2048) for _ in range(n)]


def _chunks(prompt: list[int]) -> int:
    """Whole chunks a replica stores of ``prompt`` and its generated tokens."""
    return (len(prompt) + MAX_TOKENS) // CHUNK_TOKENS


def _run(workdir: Path, name: str, model: Path, prompts: list[list[int]], kv: Any, tp: int, **engine: Any):
    if tp == 2:
        return run_replica(workdir, name, model, prompts, kv, engine_args={**TP2, **engine}, env=TP2_ENV)
    return run_replica(workdir, name, model, prompts, kv, engine_args={**KV_MEMORY, **engine})


def _kv(s3_server: Any, bucket: str, **extra: Any) -> dict[str, Any]:
    return kv_config(s3_server.endpoint_url, bucket, **extra)


def _shards_by_chunk(client: Any, bucket: str) -> dict[bytes, set[int]]:
    """Each stored chunk's shard indexes (the ``r{index}`` of its objects' names)."""
    out: dict[bytes, set[int]] = defaultdict(set)
    for name in chunk_objects(client, bucket):
        _, key, shard = parse_object_key(name)
        out[key].add(shard)
    return dict(out)


def _chunk_names(client: Any, bucket: str, prompt: list[int], index: int) -> dict[int, str]:
    """The object names of chunk ``index`` of ``prompt``, by shard."""
    key = engine_keys(Namespace.from_fields(descriptor(client, bucket)["fields"]), prompt, CHUNK_TOKENS)[
        index
    ]
    return {
        parse_object_key(name)[2]: name
        for name in chunk_objects(client, bucket)
        if parse_object_key(name)[1] == key
    }


def swap_shards(client: Any, bucket: str, names: dict[int, str], a: int, b: int, *, reencode: bool):
    """A :func:`copy_bucket` transform: shards ``a`` and ``b`` of one chunk
    (``names``, by shard) trade their pages. ``reencode``: each object is
    written again with its own name's shard in its header, so it is valid
    and holds the other head's KV (a negative control); else the bodies
    trade places as they are, each header naming the other shard (a
    reader must refuse them)."""
    bodies = {s: client.get_object(Bucket=bucket, Key=names[s])["Body"].read() for s in (a, b)}
    other = {names[a]: b, names[b]: a}

    def transform(name: str, body: bytes) -> bytes:
        if name not in other:
            return body
        donor = bodies[other[name]]
        if not reencode:
            return donor
        ns, key, shard = parse_object_key(name)
        header, _ = decode_chunk(body, namespace=ns, key=key.hex(), rank=shard)
        donor_ns, donor_key, donor_shard = parse_object_key(names[other[name]])
        _, layers = decode_chunk(donor, namespace=donor_ns, key=donor_key.hex(), rank=donor_shard)
        return codec.encode_chunk(
            namespace=header.namespace,
            key=header.key,
            rank=header.rank,
            tokens=header.tokens,
            layers=layers,
            dtype=header.dtype,
            itemsize=header.shuffle,
            page_shape=header.page_shape,
        )

    return transform


# -- 1. share_across_tp: a Llama with 4 KV heads, TP 2 and TP 1 read each other's heads

P_A = _toks(5 * CHUNK_TOKENS + 30)
"""Stored by TP 2, loaded by TP 1, then (two heads swapped) by TP 2 again."""
P_B = _toks(4 * CHUNK_TOKENS + 20)
"""Stored by TP 1, loaded by TP 2."""
P_C = _toks(3 * CHUNK_TOKENS + 10)
"""Stored by TP 2, loaded (two shard objects renamed) by TP 2."""
HEADS4 = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}


@pytest.fixture(scope="module")
def par_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("parallel")


@pytest.fixture(scope="module")
def llama_kv4(tmp_path_factory) -> Path:
    from s3kv.demo.model import build_model

    return build_model(tmp_path_factory.mktemp("llama_kv4") / "llama", seed=0, **HEADS4)


@pytest.fixture(scope="module")
def share_bucket(s3_server) -> str:
    return s3_server.new_bucket()


@pytest.fixture(scope="module")
def share_tp2(par_dir, llama_kv4, s3_server, share_bucket) -> dict[str, Any]:
    """TP 2 stores P_A and P_C (cold: its tokens are the TP 2 baseline)."""
    kv = _kv(s3_server, share_bucket, **SHARE)
    return _run(par_dir, "share-tp2", llama_kv4, [P_A, P_C], kv, 2, **F32)


@pytest.fixture(scope="module")
def share_tp1_bucket(share_tp2, s3_server, share_bucket) -> str:
    return copy_bucket(s3_server, share_bucket)


@pytest.fixture(scope="module")
def share_tp1(par_dir, llama_kv4, s3_server, share_tp1_bucket) -> dict[str, Any]:
    """TP 1 loads P_A (stored by TP 2) and stores P_B (cold: the TP 1 baseline)."""
    kv = _kv(s3_server, share_tp1_bucket, **SHARE)
    return _run(par_dir, "share-tp1", llama_kv4, [P_A, P_B], kv, 1, **F32)


@pytest.fixture(scope="module")
def share_tp2_again(share_tp1, par_dir, llama_kv4, s3_server, share_tp1_bucket) -> dict[str, Any]:
    """A fresh TP 2 replica on a copy of TP 1's bucket: P_B as TP 1 stored
    it; P_A with the second and third heads of its last chunk swapped
    (valid objects: the negative control); P_C with its last chunk's first
    and last shard objects renamed into each other (refused)."""
    client = s3_server.client()
    swapped = swap_shards(
        client, share_tp1_bucket, _chunk_names(client, share_tp1_bucket, P_A, 4), 1, 2, reencode=True
    )
    renamed = swap_shards(
        client, share_tp1_bucket, _chunk_names(client, share_tp1_bucket, P_C, 2), 0, 3, reencode=False
    )
    bucket = copy_bucket(s3_server, share_tp1_bucket, lambda name, body: renamed(name, swapped(name, body)))
    kv = _kv(s3_server, bucket, **SHARE)
    return _run(par_dir, "share-tp2-again", llama_kv4, [P_B, P_A, P_C], kv, 2, **F32)


def test_share_tp2_stores_one_object_per_kv_head(share_tp2, share_tp1_bucket, s3_server):
    client = s3_server.client()
    fields = descriptor(client, share_tp1_bucket)["fields"]
    assert "tp_size" not in fields
    assert fields["kv_shards"] == {"mode": "heads", "shards": 4, "heads_per_shard": 1}
    shards = _shards_by_chunk(client, share_tp1_bucket)
    assert len(shards) == _chunks(P_A) + _chunks(P_C)
    assert all(s == {0, 1, 2, 3} for s in shards.values())  # one per head, no .r4
    assert [w["store_chunks_s3"] for w in share_tp2["workers"]] == [2 * len(shards)] * 2
    assert all(w["drained"] for w in share_tp2["workers"])


def test_share_tp2_replica_segment_names_every_chunk(share_tp2, share_tp1_bucket, s3_server):
    """Protocol "epochs" (the default): the scheduler side's one segment per
    interval names every whole chunk its two ranks stored; the ranks hold
    theirs for it (what they publish themselves is only what was still
    unacknowledged at shutdown)."""
    client = s3_server.client()
    by_writer = segments_by_writer(client, share_tp1_bucket)
    stored = {fingerprint(key) for key in _shards_by_chunk(client, share_tp1_bucket)}
    replica = [
        fps for writer, (fps, ranked) in by_writer.items() if replica_of(writer) == writer and not ranked
    ]
    assert len(replica) == 1 and replica[0] == stored


def test_share_tp1_loads_what_tp2_stored_with_its_tokens(share_tp2, share_tp1, s3_server, share_tp1_bucket):
    assert share_tp1["num_cached_tokens"][0] == _chunks(P_A) * CHUNK_TOKENS
    assert share_tp1["outputs"][0] == share_tp2["outputs"][0]
    assert worker_total(share_tp1, "load_chunks_s3") == 4 * _chunks(P_A)  # every head of every chunk
    assert load_errors(share_tp1) == 0
    assert worker_total(share_tp1, "store_chunks_s3") == 4 * _chunks(P_B)
    # TP 1 stored P_B as four heads too: the same names TP 2 reads.
    shards = _shards_by_chunk(s3_server.client(), share_tp1_bucket)
    assert len(shards) == _chunks(P_A) + _chunks(P_C) + _chunks(P_B)
    assert all(s == {0, 1, 2, 3} for s in shards.values())


def test_share_tp2_loads_what_tp1_stored_with_its_tokens(share_tp1, share_tp2_again):
    assert share_tp2_again["num_cached_tokens"][0] == _chunks(P_B) * CHUNK_TOKENS
    assert share_tp2_again["outputs"][0] == share_tp1["outputs"][1]
    # Each rank reads its two heads of every chunk of the three prompts but
    # the one renamed object it holds (refused: see below).
    objects = 2 * (_chunks(P_B) + _chunks(P_A) + _chunks(P_C))
    assert [w["load_chunks_s3"] for w in share_tp2_again["workers"]] == [objects - 1] * 2


def test_share_negative_control_swapped_heads_change_the_output(share_tp2, share_tp2_again):
    """Valid objects of one chunk holding each other's head (rank 0's
    second head and rank 1's first): loaded without an error, and the
    output changes, so each head's object is read into its own head."""
    assert share_tp2_again["num_cached_tokens"][1] == _chunks(P_A) * CHUNK_TOKENS
    assert load_errors(share_tp2_again) == 2  # the renamed objects only: the swapped ones were loaded
    assert share_tp2_again["outputs"][1] != share_tp2["outputs"][0]


def test_share_renamed_head_objects_are_refused_and_recomputed(share_tp2, share_tp2_again):
    """An object under another shard's name (its header names its own
    shard) is refused as corrupt: the chunk is computed, the tokens kept."""
    assert share_tp2_again["outputs"][2] == share_tp2["outputs"][1]
    assert worker_total(share_tp2_again, "load_errors_corrupt") == 2  # .r0 on rank 0, .r3 on rank 1


# -- 2. default config: a Llama with 1 KV head at TP 2 stores its head once

P_G = [*P_A[: 2 * CHUNK_TOKENS], *_toks(2 * CHUNK_TOKENS + 20)]
"""Four chunks (two of them P_A's: another model, another namespace)."""


@pytest.fixture(scope="module")
def llama_kv1(tmp_path_factory) -> Path:
    from s3kv.demo.model import build_model

    return build_model(tmp_path_factory.mktemp("llama_kv1") / "llama", seed=0, num_key_value_heads=1)


@pytest.fixture(scope="module")
def kv1_bucket(s3_server) -> str:
    return s3_server.new_bucket()


@pytest.fixture(scope="module")
def kv1_store(par_dir, llama_kv1, s3_server, kv1_bucket) -> dict[str, Any]:
    return _run(par_dir, "kv1-store", llama_kv1, [P_G], _kv(s3_server, kv1_bucket), 2)


def test_one_kv_head_at_tp2_is_stored_once(kv1_store, s3_server, kv1_bucket):
    client = s3_server.client()
    fields = descriptor(client, kv1_bucket)["fields"]
    assert fields["tp_size"] == 2  # not shared across TP sizes by default
    assert fields["kv_shards"] == {"mode": "heads", "shards": 1, "heads_per_shard": 1}
    shards = _shards_by_chunk(client, kv1_bucket)
    assert len(shards) == _chunks(P_G)
    assert all(s == {0} for s in shards.values())  # one object per chunk, not one per rank
    assert [w.get("store_chunks_s3", 0) for w in kv1_store["workers"]] == [_chunks(P_G), 0]


def test_one_kv_head_fresh_tp2_replica_loads_it_on_both_ranks(
    kv1_store, par_dir, llama_kv1, s3_server, kv1_bucket
):
    b = _run(par_dir, "kv1-load", llama_kv1, [P_G], _kv(s3_server, copy_bucket(s3_server, kv1_bucket)), 2)
    assert b["num_cached_tokens"] == [_chunks(P_G) * CHUNK_TOKENS]
    assert b["outputs"] == kv1_store["outputs"]
    assert [w["load_chunks_s3"] for w in b["workers"]] == [_chunks(P_G)] * 2
    assert load_errors(b) == 0
    assert worker_total(b, "store_chunks_s3") == 0


# -- 3. MLA: a random DeepSeek V2's latent KV, the same on every rank, stored once
#
# vLLM 0.32's CPU MLA does not say a cold run's tokens after a prefix is
# loaded, whichever connector loads it, nor after a hit of its own prefix
# cache (forced on: vLLM turns it off for MLA on CPU). Measured for this
# prompt: the latents a replica loads are the cold run's, bit for bit, in
# every layer; the tokens it then computes are not, because vLLM's CPU
# rotary embedding on MLA's strided rope slice rotates the i-th token of a
# forward at position start + 9*i (576 / 64) while that is inside the
# forward, and leaves the rest unrotated: a token's latent depends on how
# many tokens share its forward. A replica that loads says the cold run's
# first token, then other tokens, in bfloat16 and float32 alike. And TP 1
# and TP 2 say different tokens from the first one on, cold. So on tokens
# these tests assert the first token, which shows whose latents a replica
# loaded, and the object counts and hits in full.

MLA = {"block_size": 16}
"""vLLM's CPU MLA kernel takes 16-token blocks only."""
P_M = _toks(4 * CHUNK_TOKENS + 20)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> Path:
    from s3kv.demo.model import build_deepseek_v2

    return build_deepseek_v2(tmp_path_factory.mktemp("deepseek_v2") / "dsv2", seed=0)


@pytest.fixture(scope="module")
def mla_bucket(s3_server) -> str:
    return s3_server.new_bucket()


@pytest.fixture(scope="module")
def mla_store(par_dir, deepseek, s3_server, mla_bucket) -> dict[str, Any]:
    return _run(par_dir, "mla-store", deepseek, [P_M], _kv(s3_server, mla_bucket), 2, **MLA)


@pytest.fixture(scope="module")
def mla_tp1(mla_store, par_dir, deepseek, s3_server, mla_bucket) -> dict[str, Any]:
    """TP 1 on a copy of TP 2's bucket, default config: TP 1's own cold tokens."""
    kv = _kv(s3_server, copy_bucket(s3_server, mla_bucket))
    return _run(par_dir, "mla-tp1", deepseek, [P_M], kv, 1, **MLA)


def test_mla_at_tp2_writes_one_object_per_chunk(mla_store, s3_server, mla_bucket):
    client = s3_server.client()
    assert [r["groups"] for r in mla_store["kv_cache"]] == [["MLAAttentionSpec"]] * 2
    fields = descriptor(client, mla_bucket)["fields"]
    assert fields["tp_size"] == 2
    assert fields["kv_shards"] == {"mode": "replicated", "shards": 1, "heads_per_shard": 0}
    shards = _shards_by_chunk(client, mla_bucket)
    assert len(shards) == _chunks(P_M)
    assert all(s == {0} for s in shards.values())  # one object per chunk, not one per rank
    assert [w.get("store_chunks_s3", 0) for w in mla_store["workers"]] == [_chunks(P_M), 0]


def test_mla_fresh_tp2_replica_loads_it_on_both_ranks(mla_store, par_dir, deepseek, s3_server, mla_bucket):
    kv = _kv(s3_server, copy_bucket(s3_server, mla_bucket))
    b = _run(par_dir, "mla-load", deepseek, [P_M], kv, 2, **MLA)
    assert b["num_cached_tokens"] == [_chunks(P_M) * CHUNK_TOKENS]
    assert [w["load_chunks_s3"] for w in b["workers"]] == [_chunks(P_M)] * 2
    assert load_errors(b) == 0
    assert worker_total(b, "store_chunks_s3") == 0
    assert b["outputs"][0][0] == mla_store["outputs"][0][0]  # see the note above on later tokens


def test_mla_tp1_misses_tp2_chunks_by_default(mla_tp1, mla_store):
    assert mla_tp1["num_cached_tokens"] == [0]
    assert worker_total(mla_tp1, "load_chunks_s3") == 0
    assert worker_total(mla_tp1, "store_chunks_s3") == _chunks(P_M)  # under its own namespace
    assert mla_tp1["outputs"][0][0] != mla_store["outputs"][0][0]  # TP 1 computes otherwise (above)


def test_mla_tp1_loads_tp2_latents_when_shared_across_tp(mla_tp1, mla_store, par_dir, deepseek, s3_server):
    """With ``share_across_tp`` a TP 1 replica loads the latents TP 2
    stored, and says TP 2's first token, not its own cold one."""
    bucket = s3_server.new_bucket()
    stored = _run(par_dir, "mla-share-tp2", deepseek, [P_M], _kv(s3_server, bucket, **SHARE), 2, **MLA)
    client = s3_server.client()
    assert "tp_size" not in descriptor(client, bucket)["fields"]
    shards = _shards_by_chunk(client, bucket)
    assert len(shards) == _chunks(P_M) and all(s == {0} for s in shards.values())
    assert stored["outputs"] == mla_store["outputs"]  # the same TP 2 computation, another namespace
    kv = _kv(s3_server, copy_bucket(s3_server, bucket), **SHARE)
    hit = _run(par_dir, "mla-share-tp1", deepseek, [P_M], kv, 1, **MLA)
    assert hit["num_cached_tokens"] == [_chunks(P_M) * CHUNK_TOKENS]
    assert worker_total(hit, "load_chunks_s3") == _chunks(P_M)
    assert load_errors(hit) == 0
    assert hit["outputs"][0][0] == mla_store["outputs"][0][0] != mla_tp1["outputs"][0][0]
