"""Every parallelism (issue 29): the S3 objects, PUTs and bytes a million
prompt tokens store at TP 1 and TP 2, for a GQA and an MLA model, and the
load time of a hit across TP sizes against a hit within one.

Models, random weights, the demo's width and depth (hidden 1024, MLP 2816,
8 layers, bf16):

- ``gqa``: the demo's Llama, 16 heads / 4 KV heads of 64;
- ``mla``: a DeepSeek V2 of 16 heads, its multi-head latent attention's
  KV one latent of 512 + 64 values per token and layer (vLLM's CPU MLA
  kernel's only size), every layer dense.

Stores (:data:`STORES`), one engine at a time, each storing its own set of
fully distinct prompts (a whole number of chunks and two tokens more) into
one loopback S3 bucket, S3 its only tier: the GQA model at TP 1 and TP 2
with s3kv's default config (a chunk one object per rank) and with
``share_across_tp`` (a chunk cut by KV head, the namespace without the TP
size), the MLA model at TP 1 and TP 2 with the default config (its latent
KV one object per chunk, written by rank 0). Each store's figures are
exact: the chunk objects it added to the bucket (listed before and after,
named by :func:`s3kv.keys.parse_object_key`), their bytes, and its
workers' counters (chunk PUTs, every PUT, raw KV bytes).

Hits (the sets the stores wrote): two fresh TP 1 engines, S3 their only
tier and prefetch off, alive at once and taking turns
(:class:`benchmarks.hybrid.Engines`): ``shared`` (``share_across_tp``)
loads, alternately, set A (stored by the TP 2 ``share_across_tp`` engine:
a cross-TP hit) and set B (stored by the TP 1 one: a same-TP hit); ``own``
(the default config) loads set C (stored by the default TP 1 engine: the
same-TP hit of one object per chunk, what cutting by head is compared
with). ``shared`` also computes a few fresh prompts: the recompute the
hits are set against.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import Bar, Result, main_for, median, s3kv_transfer_config, verdict

NAME = "parallel"
TITLE = (
    "Every parallelism: S3 objects, PUTs and bytes per million prompt tokens stored at TP 1 vs TP 2 "
    "(GQA, MLA); TTFT of a cross-TP hit vs a same-TP hit"
)
GOAL = (
    "issue 29: an MLA model at TP 2 stores one object per chunk, as at TP 1 (S3 objects, PUTs and raw "
    "KV bytes per token TP 2 / TP 1 = 1), as does a GQA model with share_across_tp; report the load "
    "time of a cross-TP hit against a same-TP hit"
)

BUCKET = "bench-parallel"
CHUNK_TOKENS = 256
TAIL_TOKENS = 2
"""Tokens past the last chunk (and block) boundary: every hit leaves vLLM these to compute."""
WARMUP_TOKENS = 512
MAX_TOKENS = 8
LAYERS = 8
WIDTH = {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16}
GQA_KV_HEADS = 4
MLA_SPEC = {
    **WIDTH,
    "num_hidden_layers": LAYERS,
    "num_key_value_heads": 16,
    "moe_intermediate_size": 256,
    "first_k_dense_replace": LAYERS,  # every layer dense: experts are not what is measured
}
"""The DeepSeek V2 (:func:`s3kv.demo.model.build_deepseek_v2`: latent KV of
512 + 64, the only size vLLM's CPU MLA kernel takes) at the demo's width and
this benchmark's depth."""
KV_CACHE_BYTES = 384 << 20
"""Per rank (the figures of 2026-12-05 were measured with it)."""
MODELS = {"gqa": f"Llama (GQA, {GQA_KV_HEADS} KV heads of 64)", "mla": "DeepSeek V2 (MLA, latent 512 + 64)"}
SHARE = "share_across_tp"
DEFAULT = "default"


@dataclass(frozen=True)
class Store:
    """One storing engine: a model at a TP size and config, and the prompt set it stores."""

    key: str
    model: str
    tp: int
    config: str
    prompts: str
    shards: int
    """Objects per chunk s3kv is expected to write (:mod:`s3kv.shards`)."""


STORES = (
    Store("gqa-tp1", "gqa", 1, DEFAULT, "C", 1),
    Store("gqa-tp2", "gqa", 2, DEFAULT, "A", 2),
    Store("gqa-share-tp2", "gqa", 2, SHARE, "A", GQA_KV_HEADS),
    Store("gqa-share-tp1", "gqa", 1, SHARE, "B", GQA_KV_HEADS),
    Store("mla-tp1", "mla", 1, DEFAULT, "A", 1),
    Store("mla-tp2", "mla", 2, DEFAULT, "B", 1),
)
"""Set A is stored at TP 2 and set B at TP 1 in the share_across_tp
namespace (the hits' cross-TP and same-TP sets); C in the default TP 1
namespace (the one-object-per-chunk reference). Namespaces differ by model,
TP size (except with share_across_tp) and config, so a set stored in two
of them is two sets of objects."""
HITS = (
    ("cross", "shared", "A", "gqa-share-tp2", "cross-TP hit: stored at TP 2, share_across_tp"),
    ("same", "shared", "B", "gqa-share-tp1", "same-TP hit: stored at TP 1, share_across_tp"),
    ("own", "own", "C", "gqa-tp1", "same-TP hit: stored at TP 1, default config (one object per chunk)"),
)
"""(row, loading engine, prompt set, the store that wrote it, label)."""


def build(model: str, work: Path, max_position: int) -> Path:
    """The benchmark's random ``model`` under ``work`` (built once, then reused)."""
    from s3kv.demo.model import DEMO_SPEC, build_deepseek_v2, build_model

    if model == "gqa":
        spec = {
            **DEMO_SPEC,
            **WIDTH,
            "num_key_value_heads": GQA_KV_HEADS,
            "num_hidden_layers": LAYERS,
            "max_position_embeddings": max_position,
        }
        return build_model(work / "llama", **spec)
    if model == "mla":
        return build_deepseek_v2(work / "deepseek-v2", **MLA_SPEC, max_position_embeddings=max_position)
    raise ValueError(f"no model builder for {model!r}")


def stored_tokens(prompts: list[list[int]], chunk_tokens: int = CHUNK_TOKENS) -> int:
    """Prompt tokens in full chunks: the tokens s3kv stores of ``prompts``."""
    return sum(len(p) // chunk_tokens * chunk_tokens for p in prompts)


def per_million(value: float, tokens: int) -> float:
    """``value`` per million stored prompt tokens."""
    return value * 1e6 / tokens if tokens else 0.0


def new_objects(before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    """What a store added to the bucket (listings: object key -> size):
    chunk objects (``objects``, ``bytes``, distinct ``chunks``, the
    ``namespaces``, ``shards`` per chunk as {count: chunks}) and other
    objects (``other``: manifest segments, descriptors)."""
    from s3kv.keys import parse_object_key

    added = {k: v for k, v in after.items() if k not in before}
    per_chunk: Counter[tuple[str, bytes]] = Counter()
    out: dict[str, Any] = {"objects": 0, "bytes": 0, "other": 0}
    for key, size in added.items():
        parsed = parse_object_key(key)
        if parsed is None:
            out["other"] += 1
            continue
        out["objects"] += 1
        out["bytes"] += size
        per_chunk[parsed[0], parsed[1]] += 1
    out["chunks"] = len(per_chunk)
    out["namespaces"] = len({ns for ns, _ in per_chunk})
    out["shards"] = dict(Counter(per_chunk.values()))
    return out


def listing(client: Any, bucket: str) -> dict[str, int]:
    """Every object of ``bucket``: key -> size."""
    out: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", []):
            out[o["Key"]] = int(o["Size"])
    return out


def _sum_ranks(workers: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for w in workers:
        for k, v in w.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
    return out


def _engine_args(max_model_len: int, tp: int) -> dict[str, Any]:
    args: dict[str, Any] = {
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "max_model_len": max_model_len,
        "max_num_batched_tokens": max_model_len,  # the whole prompt in one step
        "enforce_eager": True,
        "enable_prefix_caching": False,
    }
    if tp > 1:
        args.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
    return args


def _start(engines: Any, name: str, spec: dict[str, Any], tp: int) -> None:
    """Start one engine, its ranks bound one core each (TP 1: core 0)."""
    bind = "|".join(str(r) for r in range(tp))
    before = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind  # the spawned engine inherits it
    try:
        engines.start(name, spec)
    finally:
        if before is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = before


def measure_store(
    store: Store, model: Path, endpoint: str, client: Any, prompts: list[list[int]], max_model_len: int
) -> dict[str, Any]:
    """One store: its engine computes and stores ``prompts`` (nothing
    else: no warm-up), drains; the bucket's new objects and the workers'
    totals."""
    from benchmarks.hybrid import Engines

    extra = {SHARE: True} if store.config == SHARE else {}
    kv = s3kv_transfer_config(endpoint, BUCKET, CHUNK_TOKENS, prefetch_bytes=0, **extra)
    spec = {
        "model": str(model),
        "engine_args": _engine_args(max_model_len, store.tp),
        "kv_transfer_config": kv,
    }
    before = listing(client, BUCKET)
    with Engines() as engines:
        _start(engines, store.key, spec, store.tp)
        turns = [engines.turn(store.key, p) for p in prompts]
        final = engines.close()[store.key]  # drains every rank's uploads first
        startup = engines.startup_s[store.key]
    return {
        "bucket": new_objects(before, listing(client, BUCKET)),
        "workers": _sum_ranks(final["workers"]),
        "ranks": len(final["workers"]),
        "turns": turns,
        "startup_s": startup,
    }


def measure_hits(
    models: dict[str, Path],
    endpoint: str,
    warm: list[int],
    sets: dict[str, list[list[int]]],
    fresh: list[list[int]],
    repeats: int,
    max_model_len: int,
) -> dict[str, Any]:
    """The two loading TP 1 engines side by side: per hit row its turns
    (``hits``), and ``shared``'s computes of ``fresh`` prompts (``recompute``)."""
    from benchmarks.hybrid import Engines

    def spec(**extra: Any) -> dict[str, Any]:
        kv = s3kv_transfer_config(endpoint, BUCKET, CHUNK_TOKENS, prefetch_bytes=0, **extra)
        return {
            "model": str(models["gqa"]),
            "engine_args": _engine_args(max_model_len, 1),
            "kv_transfer_config": kv,
        }

    out: dict[str, Any] = {"hits": {row: [] for row, *_ in HITS}, "recompute": []}
    with Engines() as engines:
        _start(engines, "shared", spec(**{SHARE: True}), 1)
        _start(engines, "own", spec(), 1)
        for name in ("shared", "own"):
            engines.turn(name, warm)
        n = len(sets["A"])
        turn = 0
        for r in range(repeats):
            for i in range(n):
                # A and B alternate on the shared engine, C's hit between or around them.
                k = (r + i) % len(HITS)
                for row, engine, which, _store, _label in HITS[k:] + HITS[:k]:
                    got = engines.turn(engine, sets[which][i])
                    out["hits"][row].append({**got, "index": i, "turn": turn})
                    turn += 1
        for p in fresh:
            out["recompute"].append(engines.turn("shared", p))
        out["final"] = engines.close()
        out["startup_s"] = dict(engines.startup_s)
    return out


def run(work: Path, quick: bool) -> Result:
    from s3kv.testing.loopback_s3 import LoopbackS3

    started = time.perf_counter()
    load_before = os.getloadavg()
    n_prompts, length = (2, 1024) if quick else (4, 4096)
    repeats = 1 if quick else 2
    n_fresh = 1 if quick else 2
    max_model_len = length + 512
    rng = random.Random(29)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, 2000) for _ in range(n)]

    warm = prompt(WARMUP_TOKENS)
    sets = {s: [prompt(length + TAIL_TOKENS) for _ in range(n_prompts)] for s in "ABC"}
    fresh = [prompt(length + TAIL_TOKENS) for _ in range(n_fresh)]
    models = {m: build(m, work, max_model_len + 512) for m in MODELS}
    got: dict[str, Any] = {"stores": {}, "length": length, "prompts": n_prompts, "repeats": repeats}
    server = LoopbackS3().start()
    try:
        server.create_bucket(BUCKET)
        client = server.client()
        for s in STORES:
            print(f"== store {s.key}", flush=True)
            got["stores"][s.key] = measure_store(
                s, models[s.model], server.endpoint_url, client, sets[s.prompts], max_model_len
            )
            got["stores"][s.key]["tokens"] = stored_tokens(sets[s.prompts])
        print("== hits", flush=True)
        got["hits"] = measure_hits(models, server.endpoint_url, warm, sets, fresh, repeats, max_model_len)
    finally:
        server.stop()
    got["loads"] = (load_before, os.getloadavg())
    (work / "turns.json").write_text(json.dumps(got))  # every figure, to audit the table
    return report(got, quick, started)


COLUMNS = [
    "row",
    "model",
    "TP",
    "config",
    "objects per chunk",
    "S3 objects / 1M tokens",
    "PUTs / 1M tokens (chunk; all)",
    "S3 MiB / 1M tokens (blosc2 L1)",
    "raw KV MiB / 1M tokens",
    "TP 2 / TP 1 (objects; PUTs; S3 MiB; raw)",
    "TTFT ms (median)",
    "x same-TP hit (share_across_tp)",
    "S3 objects; MiB per hit",
    "cached tokens (min)",
    "outputs = storer's",
]


def _mib(nbytes: float) -> float:
    return round(nbytes / 2**20, 1)


class _Table:
    """The rows, bars and misses of a run's figures."""

    def __init__(self, got: dict[str, Any]) -> None:
        self.got = got
        self.rows: list[list[Any]] = []
        self.bars: list[Bar] = []
        self.misses: list[str] = []
        self.invalid: list[str] = []

    def per_m(self, key: str) -> dict[str, float]:
        """A store's figures per 1M stored tokens: objects, chunk PUTs, all PUTs, S3 bytes, raw bytes."""
        st = self.got["stores"][key]
        tokens, w, b = st["tokens"], st["workers"], st["bucket"]
        return {
            "objects": per_million(b["objects"], tokens),
            "chunk_puts": per_million(w.get("store_chunks_s3", 0), tokens),
            "puts": per_million(w.get("s3_requests_put", 0), tokens),
            "s3": per_million(b["bytes"], tokens),
            "raw": per_million(w.get("store_raw_bytes", 0), tokens),
        }

    def store(self, s: Store) -> None:
        st = self.got["stores"][s.key]
        b = st["bucket"]
        chunks = st["tokens"] // CHUNK_TOKENS
        what = f"{s.model} TP {s.tp} {s.config}"
        if b["chunks"] != chunks or b["shards"] != {s.shards: chunks}:
            self.invalid.append(
                f"invalid: {what} stored {b['chunks']} chunks as {b['shards']} (objects per chunk: chunks), "
                f"not {chunks} of {s.shards}"
            )
        if st["workers"].get("store_bytes_s3", 0) != b["bytes"]:
            self.invalid.append(
                f"invalid: {what}: workers counted {st['workers'].get('store_bytes_s3', 0):.0f} bytes to S3, "
                f"the bucket holds {b['bytes']} new"
            )
        m = self.per_m(s.key)
        ratio = ""
        if s.tp == 2:
            one = next(o for o in STORES if o.model == s.model and o.config == s.config and o.tp == 1)
            m1 = self.per_m(one.key)
            r = {k: (m[k] / m1[k] if m1[k] else 0.0) for k in ("objects", "puts", "s3", "raw")}
            ratio = "; ".join(f"{v:.3f}" for v in r.values())
            self.bars.append(Bar(f"{s.model} {s.config}: TP 2 / TP 1 objects", round(r["objects"], 3)))
            self.bars.append(Bar(f"{s.model} {s.config}: TP 2 / TP 1 raw bytes", round(r["raw"], 3)))
            if s.model == "mla" or s.config == SHARE:  # stored once whatever the TP size
                for k, name in (("objects", "objects"), ("raw", "raw KV bytes")):
                    if abs(r[k] - 1.0) > 1e-9:
                        self.misses.append(
                            f"{MODELS[s.model]} {s.config}: TP 2 stores {r[k]:.3f}x TP 1's {name}"
                        )
        self.rows.append(
            [
                "stored",
                MODELS[s.model],
                s.tp,
                s.config,
                s.shards,
                round(m["objects"], 1),
                f"{m['chunk_puts']:.1f}; {m['puts']:.1f}",
                _mib(m["s3"]),
                _mib(m["raw"]),
                ratio,
                "",
                "",
                "",
                "",
                "",
            ]
        )

    def hits(self) -> None:
        h = self.got["hits"]
        length = self.got["length"]
        same = median([t["ttft_s"] for t in h["hits"]["same"]])
        recompute = median([t["ttft_s"] for t in h["recompute"]])
        for row, _engine, _which, store_key, label in HITS:
            turns = h["hits"][row]
            store = next(s for s in STORES if s.key == store_key)
            loader_shards = GQA_KV_HEADS if row != "own" else 1
            want = length // CHUNK_TOKENS * loader_shards
            for t in turns:
                w = t["workers"]
                other = sum(w.get(f"load_chunks_{c}", 0) for c in ("cpu", "disk"))
                if w.get("load_chunks_s3", 0) != want or other:
                    self.invalid.append(
                        f"invalid: {label}: loaded S3 {w.get('load_chunks_s3', 0):.0f}, CPU/NVMe {other:.0f} "
                        f"objects, not {want} from S3"
                    )
                if t["cached"] != length:
                    self.invalid.append(f"invalid: {label}: {t['cached']} tokens cached, not {length}")
            ref = [t["outputs"] for t in self.got["stores"][store.key]["turns"]]
            equal = sum(t["outputs"] == ref[t["index"]] for t in turns)
            ttft = median([t["ttft_s"] for t in turns])
            self.bars.append(Bar(f"{row}: TTFT / same-TP hit", round(ttft / same, 3)))
            self.rows.append(
                [
                    label,
                    MODELS["gqa"],
                    1,
                    SHARE if row != "own" else DEFAULT,
                    loader_shards,
                    "",
                    "",
                    "",
                    "",
                    "",
                    round(ttft * 1000, 1),
                    round(ttft / same, 3),
                    f"{median([t['workers'].get('load_chunks_s3', 0) for t in turns]):.0f}; "
                    f"{_mib(median([t['workers'].get('load_bytes_s3', 0) for t in turns]))}",
                    min(t["cached"] for t in turns),
                    f"{equal}/{len(turns)}",
                ]
            )
        self.rows.append(
            [
                "recompute (s3kv miss: computes and stores)",
                MODELS["gqa"],
                1,
                SHARE,
                "",
                "",
                "",
                "",
                "",
                "",
                round(recompute * 1000, 1),
                round(recompute / same, 3),
                "",
                min(t["cached"] for t in h["recompute"]),
                "",
            ]
        )


def report(got: dict[str, Any], quick: bool, started: float) -> Result:
    """The table, the verdict and the notes of a run's figures."""
    table = _Table(got)
    for s in STORES:
        if s.key in got["stores"]:
            table.store(s)
    if "hits" in got:
        table.hits()
    misses = sorted(set(table.invalid)) + table.misses
    return Result(
        name=NAME,
        title=TITLE,
        goal=GOAL,
        columns=COLUMNS,
        rows=table.rows,
        verdict=verdict(not misses, "; ".join(misses)),
        notes=_notes(got, quick),
        bars=table.bars,
        ylabel="ratio (TP 2 / TP 1 per token; TTFT / same-TP hit)",
        seconds=round(time.perf_counter() - started, 1),
    )


def _notes(got: dict[str, Any], quick: bool) -> list[str]:
    from benchmarks.ttft import _defaults

    length, n, repeats = got["length"], got["prompts"], got["repeats"]
    stores = got["stores"]
    startup = {k: v["startup_s"] for k, v in stores.items()}
    hits = got.get("hits", {})
    startup.update({f"hit-{k}": v for k, v in hits.get("startup_s", {}).items()})
    loads = got.get("loads", ((0.0,), (0.0,)))
    others = {k: v["bucket"]["other"] for k, v in stores.items()}
    puts_extra = {
        k: v["workers"].get("s3_requests_put", 0) - v["workers"].get("store_chunks_s3", 0)
        for k, v in stores.items()
    }
    return [
        f"Each store: one engine computes {n} fully distinct prompts of {length + TAIL_TOKENS} tokens "
        f"({length // CHUNK_TOKENS} chunks of {CHUNK_TOKENS} each, {n * length} tokens stored; the last "
        f"{TAIL_TOKENS} tokens are in no full chunk)"
        + (" (quick run: fewer, shorter prompts)" if quick else "")
        + ", one at a time, S3 its only tier (no CPU or NVMe tier, prefetch off), then drains its ranks "
        "and stops. Per 1M stored tokens (tokens in full chunks): 'S3 objects' are the chunk objects the "
        "store added to the bucket (listed before and after, s3kv.keys.parse_object_key); 'PUTs' the "
        "workers' store_chunks_s3 (chunk objects created) and s3_requests_put (every PUT the workers sent, "
        f"manifest segments included: {', '.join(f'{k} {v:.0f}' for k, v in puts_extra.items())} beyond the "
        "chunks); 'S3 MiB' the new chunk objects' bytes in the bucket (encoded: blosc2 level 1, s3kv's "
        "default codec, over a header and checksums; random weights' KV compresses little), equal to the "
        "workers' store_bytes_s3; 'raw KV' the workers' store_raw_bytes (KV pages before encoding, summed "
        "over ranks). The store also added "
        f"{', '.join(f'{k} {v}' for k, v in others.items())} other objects (manifest segments, the "
        "namespace's descriptor). TP 2 / TP 1 are of these figures per token, in the same run.",
        f"Models: random weights, hidden 1024, MLP 2816, {LAYERS} layers, 16 heads, bf16: the Llama {GQA_KV_HEADS} "
        "KV heads of 64 (1 KiB of KV per token and layer, K and V); the DeepSeek V2 MLA, kv_lora_rank 512, "
        "rope 64 (1152 bytes per token and layer, the same on every rank), qk_nope 128, v 128, no q LoRA, "
        "every layer dense. vLLM's CPU MLA backend forces 16-token blocks and prefix caching off. "
        f"KV cache {KV_CACHE_BYTES >> 20} MiB per rank, the whole prompt in one step, vLLM's prefix cache "
        "off; TP 2 by vLLM's multiprocessing executor, each rank's OpenMP thread bound to a core of its "
        "own (VLLM_CPU_OMP_THREADS_BIND=0|1), TP 1 on core 0. s3kv's defaults "
        f"({_defaults()}) except S3 the only tier and prefetch off.",
        "Objects per chunk, as s3kv.shards cuts them: the default config writes one per rank (the GQA "
        f"model: 1 at TP 1, 2 at TP 2); share_across_tp cuts every chunk by KV head into {GQA_KV_HEADS} "
        "slices whatever the TP size (a TP 2 rank writes its 2) and leaves the TP size out of the "
        "namespace; the MLA model's latent KV is one object per chunk at any TP size, written by rank 0 and "
        "read by every rank (the namespace keeps the TP size). A store is invalid unless the bucket holds "
        "exactly its chunks, each in that many objects.",
        f"Hits: two fresh TP 1 engines (S3 the only tier, prefetch off, one uncounted {WARMUP_TOKENS}-token "
        "warm-up each) alive at once taking turns (benchmarks.hybrid.Engines, the order turning with every "
        "prompt; each idle when its request arrives): the share_across_tp one loads set A (stored by the "
        "TP 2 share_across_tp store: cross-TP) and set B (stored by the TP 1 one: same-TP) alternately; "
        "the default-config one loads set C (stored by the default TP 1 store: one object per chunk). "
        f"{n} prompts a set, each hit {repeats} times; TTFT is vLLM's first_token_latency (arrival to first "
        f"token, the S3 load included), the median of {n * repeats} hits. Each hit must load all {length} "
        "tokens, every object from S3 and none from elsewhere. The recompute row: the share_across_tp "
        "engine computing fresh prompts of the same length (it stores them too, asynchronously). 'outputs "
        "= storer's': hits whose greedy tokens equal those of the engine that computed and stored the "
        "prompt: a TP 2 engine's KV differs from a TP 1 engine's in the low bits past the first layer "
        "(its row-parallel all-reduce), so a cross-TP hit's tokens may differ where a random model's "
        "near-ties flip; not judged here (the end-to-end tests judge the tokens).",
        f"{len(startup)} engines start ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in startup.items())
        + "), one "
        f"at a time. S3 is moto on loopback on the same 2 cores. Load average (1 min) at the start "
        f"{loads[0][0]:.1f}, at the end {loads[1][0]:.1f}.",
    ]


if __name__ == "__main__":
    sys.exit(main_for(run, "s3kv-bench-parallel"))
