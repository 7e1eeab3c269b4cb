"""benchmarks/parallel.py: what a store added to the bucket (named as s3kv
names chunk objects), its figures per million tokens, and the verdict and
rows its report makes of stores and hits (written here, no engine)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from benchmarks.parallel import (
    CHUNK_TOKENS,
    GQA_KV_HEADS,
    HITS,
    STORES,
    new_objects,
    per_million,
    report,
    stored_tokens,
)
from s3kv.keys import object_key

NS = "ab" * 16
NS2 = "cd" * 16
LENGTH = 1024
PROMPTS = 2
TOKENS = PROMPTS * LENGTH
CHUNKS = TOKENS // CHUNK_TOKENS
RAW = 64 << 10
"""Raw KV bytes of one chunk (every rank's, every shard's)."""


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_stored_tokens_are_those_in_full_chunks():
    assert stored_tokens([[1] * 1026, [2] * 255, [3] * 512]) == 1024 + 0 + 512
    assert per_million(3, 1 << 20) == pytest.approx(3 / 1.048576)
    assert per_million(3, 0) == 0.0


def test_new_objects_counts_the_chunk_objects_a_store_added():
    before = {object_key("", NS, _key(0), 0): 100, "manifest/old": 5}
    after = dict(before)
    after.update({object_key("p", NS, _key(1), r): 10 + r for r in range(4)})  # a prefix, 4 shards
    after.update({object_key("p", NS2, _key(2), r): 20 for r in range(2)})
    after["p/manifest/" + NS + "/seg-1"] = 7  # not a chunk object
    got = new_objects(before, after)
    assert got == {
        "objects": 6,
        "bytes": 10 + 11 + 12 + 13 + 40,
        "other": 1,
        "chunks": 2,
        "namespaces": 2,
        "shards": {4: 1, 2: 1},
    }
    assert new_objects(after, after)["objects"] == 0


def _turn(ttft_s: float, cached: int, index: int = 0, outputs: tuple[int, ...] = (5, 6), **w: float) -> dict:
    return {"ttft_s": ttft_s, "outputs": list(outputs), "cached": cached, "workers": w, "index": index}


def _store(shards: int, ranks: int, raw_per_chunk: int = RAW, s3_per_object: int = 1000) -> dict[str, Any]:
    """A store of PROMPTS prompts of LENGTH tokens, each chunk ``shards`` objects."""
    objects = CHUNKS * shards
    return {
        "bucket": {
            "objects": objects,
            "bytes": objects * s3_per_object,
            "other": 3,
            "chunks": CHUNKS,
            "namespaces": 1,
            "shards": {shards: CHUNKS},
        },
        "workers": {
            "store_chunks_s3": objects,
            "s3_requests_put": objects + 2,
            "store_bytes_s3": objects * s3_per_object,
            "store_raw_bytes": CHUNKS * raw_per_chunk,
        },
        "ranks": ranks,
        "turns": [_turn(9.0, 0, i) for i in range(PROMPTS)],
        "startup_s": 20.0,
        "tokens": TOKENS,
    }


def _hits(ttft: dict[str, float]) -> dict[str, Any]:
    chunks = LENGTH // CHUNK_TOKENS
    out: dict[str, Any] = {"hits": {}, "startup_s": {"shared": 20.0, "own": 20.0}}
    for row, *_ in HITS:
        per_hit = chunks * (1 if row == "own" else GQA_KV_HEADS)
        out["hits"][row] = [
            _turn(ttft[row], LENGTH, i, load_chunks_s3=per_hit, load_bytes_s3=per_hit << 16)
            for i in range(PROMPTS)
        ]
    out["recompute"] = [_turn(4.0, 0)]
    return out


@pytest.fixture
def got() -> dict[str, Any]:
    stores = {s.key: _store(s.shards, s.tp, s3_per_object=4000 // s.shards) for s in STORES}
    return {
        "stores": stores,
        "hits": _hits({"cross": 0.12, "same": 0.1, "own": 0.05}),
        "length": LENGTH,
        "prompts": PROMPTS,
        "repeats": 1,
        "loads": ((1.0,), (1.0,)),
    }


def _row(result: Any, first: str, tp: int | None = None, config: str | None = None, model: str = "") -> list:
    (row,) = [
        r
        for r in result.rows
        if r[0].startswith(first)
        and model in r[1]
        and (tp is None or r[2] == tp)
        and (config is None or r[3] == config)
    ]
    return row


def test_stored_once_at_every_tp_size_meets_the_goal(got):
    r = report(got, False, 0.0)
    assert r.verdict == "met"
    per_m = 1e6 / TOKENS
    default2 = _row(r, "stored", 2, "default", "Llama")
    assert default2[4] == 2 and default2[5] == pytest.approx(CHUNKS * 2 * per_m, abs=0.1)
    assert default2[6] == f"{CHUNKS * 2 * per_m:.1f}; {(CHUNKS * 2 + 2) * per_m:.1f}"
    assert default2[9].startswith("2.000; ")  # two objects a chunk, one per rank
    assert _row(r, "stored", 2, "default", "DeepSeek")[9] == "1.000; 1.000; 1.000; 1.000"
    assert _row(r, "stored", 2, "share_across_tp")[9] == "1.000; 1.000; 1.000; 1.000"
    assert _row(r, "stored", 1, "share_across_tp")[9] == ""
    cross = _row(r, "cross-TP hit")
    assert (
        cross[10] == 120.0
        and cross[11] == pytest.approx(1.2)
        and cross[12] == "16; 1.0"
        and cross[14] == "2/2"
    )
    assert _row(r, "same-TP hit: stored at TP 1, default")[11] == pytest.approx(0.5)
    assert _row(r, "recompute")[11] == pytest.approx(40.0)


def test_an_mla_model_stored_per_rank_misses(got):
    got["stores"]["mla-tp2"] = _store(2, 2, raw_per_chunk=2 * RAW)  # every rank wrote the latent KV
    r = report(got, False, 0.0)
    assert r.verdict.startswith("missed:")
    assert "invalid: mla TP 2 default stored 8 chunks as {2: 8}" in r.verdict
    assert "DeepSeek V2 (MLA, latent 512 + 64) default: TP 2 stores 2.000x TP 1's objects" in r.verdict
    assert "TP 2 stores 2.000x TP 1's raw KV bytes" in r.verdict


def test_a_hit_short_of_its_objects_or_tokens_is_invalid(got):
    hits = got["hits"]["hits"]
    hits["cross"][0] = copy.deepcopy(hits["cross"][0])
    hits["cross"][0]["workers"]["load_chunks_s3"] = 8  # half the head slices
    hits["own"][1] = copy.deepcopy(hits["own"][1])
    hits["own"][1]["cached"] = 768
    hits["same"][1] = copy.deepcopy(hits["same"][1])
    hits["same"][1]["workers"]["load_chunks_disk"] = 1
    r = report(got, False, 0.0)
    assert (
        "invalid: cross-TP hit: stored at TP 2, share_across_tp: loaded S3 8, CPU/NVMe 0 objects" in r.verdict
    )
    assert (
        "invalid: same-TP hit: stored at TP 1, default config (one object per chunk): 768 tokens" in r.verdict
    )
    assert "same-TP hit: stored at TP 1, share_across_tp: loaded S3 16, CPU/NVMe 1 objects" in r.verdict


def test_bytes_the_workers_counted_must_be_the_buckets(got):
    got["stores"]["gqa-tp1"]["workers"]["store_bytes_s3"] += 1
    assert "invalid: gqa TP 1 default: workers counted" in report(got, False, 0.0).verdict


def test_outputs_unlike_the_storers_are_counted_not_judged(got):
    got["hits"]["hits"]["cross"][1] = _turn(0.12, LENGTH, 1, outputs=(9, 9), load_chunks_s3=16)
    r = report(got, False, 0.0)
    assert r.verdict == "met"
    assert _row(r, "cross-TP hit")[14] == "1/2"
