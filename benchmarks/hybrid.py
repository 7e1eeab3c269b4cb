"""Hybrid models (issue 28): the TTFT of 8k and 32k-token hits of a
sliding-window model from s3kv's CPU, NVMe and S3 tiers against recompute,
and the bytes its hits load and its prompts store against a full-attention
model of the same width and depth.

Families (:data:`FAMILIES`), each a random-weights model of the demo's width
(hidden 1024, 16 heads / 4 KV heads of 64, MLP 2816, bf16) and one depth:

- ``sliding``: a Gemma 3 text model, Gemma 3's pattern of five
  sliding-window layers (window 1024, Gemma 3's own) to one full-attention
  layer; vLLM's hybrid KV cache manager makes six KV cache groups of it;
- ``full``: a Llama of the same width and depth, one full-attention group:
  what the sliding model's bytes are compared with;
- ``ssm``: a hybrid SSM model (Mamba or linear attention beside full
  attention): s3kv refuses its Mamba groups at start-up, so its rows say
  "not measured" until s3kv serves them; it becomes a measured family like
  the others (a builder and the same engines).

Per family, engines alive at once take turns (each a process of
``benchmarks._multi_runner``'s; the order turning with every prompt), so
the machine's drift falls on each alike:

- ``vllm`` (the sliding family only): no connector, vLLM's prefix cache on:
  each prompt computed (the recompute every ratio is to), then again as hits
  of its own prefix cache (the outputs' reference for hits);
- ``store``: s3kv with a CPU tier, an NVMe directory and the loopback S3
  bucket, empty: it computes and stores each prompt, then hits it from its
  CPU tier;
- ``nvme``: started once the stores drained, on the same disk directory, no
  CPU tier: hits from NVMe, the files' pages dropped from the page cache
  before each round (cold reads);
- ``s3``: S3 the only tier, prefetch off: hits from S3.

A prompt is a whole number of chunks and blocks and two tokens more, so
every hit loads the same tokens and vLLM computes the last two. Each engine
first serves an uncounted short warm-up prompt. TTFT figures are medians
over the repeated hits of one prompt per length; bytes are the workers'
counters of each hit (``load_bytes`` and ``load_chunks`` by tier) and of
each store (``store_raw_bytes``, ``store_bytes`` by tier).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from benchmarks.common import Bar, Result, main_for, median, s3kv_transfer_config, verdict
from benchmarks.ttft import drop_page_cache

NAME = "hybrid"
TITLE = (
    "Hybrid models: TTFT of 8k and 32k-token hits of a sliding-window model from CPU, NVMe and S3 vs "
    "recompute; bytes per hit and per prompt vs a full-attention model of the same width and depth"
)
GOAL = (
    "sliding-window model (Gemma 3's 5:1 pattern): hit TTFT <= 0.1x recompute from CPU, <= 0.2x from "
    "NVMe, <= 0.3x from S3 at 8k and 32k tokens; bytes loaded per hit from CPU and NVMe <= (full layers "
    "+ sliding layers x the window's chunks) / all layers of a full-attention Llama's of the same width "
    "and depth (the window rounded up to whole chunks, plus one); raw KV bytes stored per prompt <= 1.02x "
    "the Llama's; a hybrid SSM model likewise once s3kv serves Mamba groups"
)

BUCKET = "bench-hybrid"
CHUNK_TOKENS = 256
WARMUP_TOKENS = 512
MAX_TOKENS = 8
TAIL_TOKENS = 2
"""Tokens past the last chunk (and block) boundary: what every hit leaves vLLM to compute."""
LAYERS = 6
"""Depth of every family: Gemma 3's pattern once (five sliding, one full).
The demo's Llama has 8; at 6 a 32k prefill of the Llama still takes
minutes on this machine (its full attention is quadratic)."""
WINDOW = 1024
WIDTH = {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16, "num_key_value_heads": 4}
"""The demo's width (s3kv.demo.model.DEMO_SPEC), head size 64."""
KV_CACHE_BYTES = 512 << 20
CPU_TIER = "512MiB"
GOALS = {"cpu": 0.1, "nvme": 0.2, "s3": 0.3}
GOAL_STORED = 1.02
TIERS = {"cpu": "CPU", "nvme": "NVMe", "s3": "S3"}
COUNTER_TIER = {"cpu": "cpu", "nvme": "disk", "s3": "s3"}
"""s3kv's name of each hit row's tier in its counters (load_chunks_disk, ...)."""


@dataclass(frozen=True)
class Family:
    """One kind of model the benchmark measures (or says why it does not)."""

    key: str
    label: str
    full_layers: int
    windowed_layers: int
    recompute: bool
    """Whether vLLM without a connector recomputes its prompts here (the
    ratios' reference); without it, ratios are to s3kv's own compute."""
    refused: str = ""
    """Why the family is not measured (no engine starts for it)."""


FAMILIES = (
    Family("sliding", f"Gemma 3 (5 sliding, window {WINDOW} : 1 full)", 1, LAYERS - 1, recompute=True),
    Family("full", "Llama (full attention)", LAYERS, 0, recompute=False),
    Family(
        "ssm",
        "hybrid SSM (Mamba / linear attention + full)",
        0,
        0,
        recompute=True,
        refused="not measured: s3kv refuses Mamba groups (issue 28, next step)",
    ),
)


def build(family: Family, work: Path, max_position: int) -> Path:
    """The family's random model under ``work`` (built once, then reused)."""
    from s3kv.demo.model import DEMO_SPEC, build_gemma3, build_model

    if family.key == "sliding":
        return build_gemma3(
            work / f"gemma3-{LAYERS}",
            **WIDTH,
            num_hidden_layers=LAYERS,
            head_dim=64,
            query_pre_attn_scalar=64,
            sliding_window=WINDOW,
            layer_types=["sliding_attention"] * (LAYERS - 1) + ["full_attention"],
            max_position_embeddings=max_position,
        )
    if family.key == "full":
        spec = {**DEMO_SPEC, **WIDTH, "num_hidden_layers": LAYERS, "max_position_embeddings": max_position}
        return build_model(work / f"llama-{LAYERS}", **spec)
    raise ValueError(f"no model builder for family {family.key!r}: {family.refused}")


def window_bound(family: Family, hit_tokens: int) -> float:
    """The goal on a family's bytes per hit, as a share of a full-attention
    model's of the same depth: every full layer's chunks, and of each
    windowed layer the window's chunks rounded up, plus one (a window
    straddles a chunk boundary)."""
    k = hit_tokens // CHUNK_TOKENS
    reach = min(k, -(-(WINDOW - 1) // CHUNK_TOKENS) + 1)
    return (family.full_layers * k + family.windowed_layers * reach) / (
        (family.full_layers + family.windowed_layers) * k
    )


class Engines:
    """vLLM engines alive at once, each a process running
    ``benchmarks._multi_runner``'s engine loop, started when asked (one at
    a time: start-up takes the cores) and taking turns; the benchmark can
    act between turns (drop the page cache). After each turn the engine's
    ranks drain (its stores reach every tier before the next turn)."""

    def __init__(self) -> None:
        self._ctx = multiprocessing.get_context("spawn")
        self._engines: dict[str, tuple[Any, Connection]] = {}
        self.startup_s: dict[str, float] = {}

    def __enter__(self) -> Engines:
        return self

    def start(self, name: str, spec: dict[str, Any]) -> None:
        from benchmarks._multi_runner import _engine

        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_engine, args=(child, spec, MAX_TOKENS), name=f"engine-{name}")
        proc.start()
        self._engines[name] = (proc, parent)
        print(f"  starting engine {name} ...", flush=True)
        self.startup_s[name] = self._recv(name)

    def _recv(self, name: str) -> Any:
        proc, conn = self._engines[name]
        try:
            return conn.recv()
        except EOFError:
            proc.join(timeout=10)
            raise SystemExit(f"engine {name} exited (code {proc.exitcode}); see the log above") from None

    def turn(self, name: str, prompt: list[int]) -> dict[str, Any]:
        """One request on an idle engine: its ``ttft_s``, ``outputs``,
        ``num_cached_tokens`` (one each) and the worker counters it moved."""
        self._engines[name][1].send([prompt])
        r = self._recv(name)
        return {
            "ttft_s": r["ttft_s"][0],
            "outputs": r["outputs"][0],
            "cached": r["num_cached_tokens"][0],
            "workers": r["workers"],
        }

    def close(self) -> dict[str, dict[str, Any]]:
        """Stop every engine: each one's ``metrics`` and ``workers`` totals."""
        out = {}
        for name, (_proc, conn) in self._engines.items():
            conn.send(None)
            out[name] = self._recv(name)
        return out

    def __exit__(self, *exc: object) -> None:
        for proc, _conn in self._engines.values():
            proc.join(timeout=120)
            if proc.is_alive():
                proc.kill()


def _engine_args(max_model_len: int, **extra: Any) -> dict[str, Any]:
    return {
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "max_model_len": max_model_len,
        "max_num_batched_tokens": max_model_len,  # the whole prompt in one step
        "enforce_eager": True,
        "enable_prefix_caching": False,
        **extra,
    }


def _rotate(names: list[str], k: int) -> list[str]:
    k %= len(names)
    return names[k:] + names[:k]


def measure(
    family: Family,
    model: Path,
    endpoint: str,
    work: Path,
    warm: list[int],
    prompts: dict[int, list[int]],
    repeats: int,
    max_model_len: int,
) -> dict[str, Any]:
    """A family's engines, side by side: per engine and prompt length the
    compute turn (``compute``) and the hit turns (``hits``)."""
    disk = work / f"disk-{family.key}"
    shutil.rmtree(disk, ignore_errors=True)
    bucket = f"{BUCKET}-{family.key}"

    def s3kv(**extra: Any) -> dict[str, Any]:
        return s3kv_transfer_config(endpoint, bucket, CHUNK_TOKENS, **extra)

    def spec(kv: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
        return {
            "model": str(model),
            "engine_args": _engine_args(max_model_len, **extra),
            "kv_transfer_config": kv,
        }

    computing = {"store": spec(s3kv(cpu_bytes=CPU_TIER, disk_path=str(disk)))}
    if family.recompute:
        computing = {"vllm": spec(None, enable_prefix_caching=True), **computing}
    loading = {
        "nvme": spec(s3kv(disk_path=str(disk))),
        "s3": spec(s3kv(prefetch_bytes=0)),
    }
    out: dict[str, Any] = {"compute": {}, "hits": {}}
    with Engines() as engines:
        for name, s in computing.items():
            engines.start(name, s)
        for name in computing:
            engines.turn(name, warm)
        for i, (n, prompt) in enumerate(prompts.items()):
            for name in _rotate(list(computing), i):
                out["compute"].setdefault(name, {})[n] = engines.turn(name, prompt)
        # The stores drained: the loading engines find them at start-up.
        for name, s in loading.items():
            engines.start(name, s)
        for name in loading:
            engines.turn(name, warm)
        hitting = [*computing, *loading]
        out["evicted"] = 0
        for r in range(repeats):
            for i, (n, prompt) in enumerate(prompts.items()):
                out["evicted"] = drop_page_cache(disk)  # the NVMe hit reads the device
                for name in _rotate(hitting, r + i):
                    out["hits"].setdefault(name, {}).setdefault(n, []).append(engines.turn(name, prompt))
        out["final"] = engines.close()
        out["startup_s"] = dict(engines.startup_s)
    shutil.rmtree(disk, ignore_errors=True)
    return out


def _mib(nbytes: float) -> float:
    return round(nbytes / 2**20, 2)


def _parts(counts: dict[str, float], prefix: str) -> str:
    """Chunk parts (objects of one group of one chunk) by tier, from a turn's counters."""
    tiers = {"CPU": "cpu", "NVMe": "disk", "S3": "s3"}
    return (
        ", ".join(
            f"{t} {counts.get(prefix + c, 0):.0f}" for t, c in tiers.items() if counts.get(prefix + c, 0)
        )
        or "none"
    )


def _same(values: list[float]) -> float:
    """A figure every repeat must give alike (bytes of one prompt's hit)."""
    if len(set(values)) != 1:
        raise SystemExit(f"bytes of one prompt's hit differ between repeats: {values}")
    return values[0]


def _label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def run(work: Path, quick: bool) -> Result:
    from s3kv.testing.loopback_s3 import LoopbackS3

    started = time.perf_counter()
    load_before = os.getloadavg()
    lengths = (2048, 4096) if quick else (8192, 32768)
    repeats = 2 if quick else 5
    max_model_len = max(lengths) + 256
    rng = random.Random(28)
    warm = [rng.randrange(3, 2000) for _ in range(WARMUP_TOKENS)]
    prompts = {n: [rng.randrange(3, 2000) for _ in range(n + TAIL_TOKENS)] for n in lengths}
    measured = [f for f in FAMILIES if not f.refused]
    models = {f.key: build(f, work, max_model_len + 512) for f in measured}
    got: dict[str, dict[str, Any]] = {}
    server = LoopbackS3().start()
    try:
        for f in measured:
            server.create_bucket(f"{BUCKET}-{f.key}")
            got[f.key] = measure(
                f, models[f.key], server.endpoint_url, work, warm, prompts, repeats, max_model_len
            )
    finally:
        server.stop()
    load_after = os.getloadavg()
    (work / "turns.json").write_text(json.dumps(got))  # every turn's figures, to audit the table
    return report(got, lengths, repeats, quick, started, (load_before, load_after))


def _judge(outputs: list[list[int]], refs: dict[str, list[int]]) -> tuple[str, bool]:
    """Whether every turn's greedy tokens equal one of the references'."""
    names = [next((k for k, o in refs.items() if o == out), None) for out in outputs]
    if None in names:
        return f"WRONG (differs from {' and '.join(refs)})", False
    return "= " + " / ".join(sorted({k for k in names if k})), True


COLUMNS = [
    "model",
    "hit tokens",
    "path",
    "TTFT ms (median)",
    "x recompute",
    "cached tokens (min)",
    "parts (by tier)",
    "MiB",
    "x Llama's MiB",
    "outputs",
    "goal",
]
STORED = {"raw": "store_raw_bytes", "NVMe": "store_bytes_disk", "S3": "store_bytes_s3"}
"""A prompt's bytes stored, from its compute turn's counters: KV before encoding, NVMe files, S3 objects."""


def _engine(tier: str) -> str:
    """The engine whose hits come from ``tier``: the storing one holds the CPU tier."""
    return "store" if tier == "cpu" else tier


class _Table:
    """The rows, bars and misses of the families' figures, each family's
    bytes judged against the full-attention family's at the same length."""

    def __init__(self, got: dict[str, dict[str, Any]]) -> None:
        self.got = got
        self.rows: list[list[Any]] = []
        self.bars: list[Bar] = []
        self.misses: list[str] = []
        self.invalid: list[str] = []
        self.compute_s: dict[tuple[str, int], float] = {}

    def hit_bytes(self, family: str, tier: str, n: int) -> float:
        """One hit's bytes from ``tier`` (every repeat must load alike)."""
        turns = self.got[family]["hits"][_engine(tier)][n]
        return _same([t["workers"].get(f"load_bytes_{COUNTER_TIER[tier]}", 0) for t in turns])

    def stored(self, family: str, n: int) -> dict[str, float]:
        w = self.got[family]["compute"]["store"][n]["workers"]
        return {k: w.get(c, 0) for k, c in STORED.items()}

    def family(self, f: Family, n: int) -> None:
        if f.refused:
            self.rows.append([f.label, _label(n), f.refused, *[""] * (len(COLUMNS) - 3)])
            return
        comp, hits = self.got[f.key]["compute"], self.got[f.key]["hits"]
        self.compute_s[f.key, n] = comp["store"][n]["ttft_s"]
        if f.recompute:
            base = comp["vllm"][n]["ttft_s"]
            refs = {"recompute": comp["vllm"][n]["outputs"], "vllm_hit": hits["vllm"][n][0]["outputs"]}
            self._row(
                f, n, "recompute (vLLM, no connector)", base, 1.0, comp["vllm"][n]["cached"], "reference"
            )
            vh = hits["vllm"][n]
            ttft = median([t["ttft_s"] for t in vh])
            cell, _ = _judge([t["outputs"] for t in vh], refs)
            self._row(
                f,
                n,
                "vLLM's own prefix-cache hit (no connector)",
                ttft,
                ttft / base,
                min(t["cached"] for t in vh),
                cell,
            )
            self.bars.append(Bar(f"{f.key} {_label(n)} vLLM hit", round(ttft / base, 4)))
        else:
            base = comp["store"][n]["ttft_s"]
            refs = {"compute": comp["store"][n]["outputs"]}
        self._store(f, n, base, refs)
        for tier in COUNTER_TIER:
            self._hit(f, n, tier, base, refs)

    def _row(
        self,
        f: Family,
        n: int,
        path: str,
        ttft: float,
        ratio: float,
        cached: int,
        outputs: str,
        parts: str = "",
        mib: Any = "",
        vs_full: Any = "",
        goal: str = "",
    ) -> None:
        self.rows.append(
            [
                f.label,
                _label(n),
                path,
                round(ttft * 1000, 1),
                round(ratio, 4),
                cached,
                parts,
                mib,
                vs_full,
                outputs,
                goal,
            ]
        )

    def _store(self, f: Family, n: int, base: float, refs: dict[str, list[int]]) -> None:
        """The row of s3kv computing and storing the prompt, its bytes against the Llama's."""
        st = self.got[f.key]["compute"]["store"][n]
        cell, ok = _judge([st["outputs"]], refs)
        if not ok:
            self.misses.append(
                f"{f.label} {_label(n)}: s3kv's compute: outputs differ from {' and '.join(refs)}"
            )
        mine = self.stored(f.key, n)
        path = "s3kv, empty tiers: computes and stores" + ("" if f.recompute else " (its ratios' reference)")
        vs, goal = "", ""
        if f.key != "full" and "full" in self.got:
            full = self.stored("full", n)
            ratio = {k: mine[k] / full[k] if full[k] else 0.0 for k in mine}
            vs, goal = "; ".join(f"{k} {v:.3f}" for k, v in ratio.items()), f"raw <= {GOAL_STORED}x"
            if ratio["raw"] > GOAL_STORED:
                self.misses.append(
                    f"{f.label} {_label(n)}: raw KV stored {ratio['raw']:.3f}x the Llama's (goal {GOAL_STORED}x)"
                )
        mib = "; ".join(f"{k} {_mib(v)}" for k, v in mine.items())
        self._row(
            f,
            n,
            path,
            st["ttft_s"],
            st["ttft_s"] / base,
            st["cached"],
            cell,
            _parts(st["workers"], "store_chunks_"),
            mib,
            vs,
            goal,
        )

    def _hit(self, f: Family, n: int, tier: str, base: float, refs: dict[str, list[int]]) -> None:
        """The row of ``tier``'s hits: TTFT to recompute, and (a windowed
        family) bytes to the Llama's; invalid if a hit came from elsewhere."""
        turns = self.got[f.key]["hits"][_engine(tier)][n]
        what = f"{f.label} {_label(n)} {TIERS[tier]} hit"
        ttft = median([t["ttft_s"] for t in turns])
        ratio = ttft / base
        cell, ok = _judge([t["outputs"] for t in turns], refs)
        if not ok:
            self.misses.append(f"{what}: outputs differ from {' and '.join(refs)}")
        for t in turns:
            loaded = {c: t["workers"].get(f"load_chunks_{c}", 0) for c in COUNTER_TIER.values()}
            if not loaded[COUNTER_TIER[tier]] or sum(loaded.values()) != loaded[COUNTER_TIER[tier]]:
                self.invalid.append(f"invalid: {what} loaded {_parts(t['workers'], 'load_chunks_')} parts")
            if t["cached"] != n:
                self.invalid.append(f"invalid: {what} had {t['cached']} tokens cached, not {n}")
        nbytes = self.hit_bytes(f.key, tier, n)
        vs_full: Any = ""
        if f.key != "full" and "full" in self.got:
            vs_full = round(nbytes / self.hit_bytes("full", tier, n), 3)
        goals = []
        if f.windowed_layers:
            goals.append(f"<= {GOALS[tier]}x")
            if ratio > GOALS[tier]:
                self.misses.append(f"{what} {ratio:.3f}x recompute (goal {GOALS[tier]}x)")
            if tier != "s3":  # S3's bytes are compressed: not judged
                bound = window_bound(f, n)
                goals.append(f"bytes <= {bound:.3f}x")
                if vs_full != "" and vs_full > bound:
                    self.misses.append(f"{what} loads {vs_full:.3f}x the Llama's bytes (goal {bound:.3f}x)")
            self.bars.append(Bar(f"{f.key} {_label(n)} {tier}", round(ratio, 4)))
        path = f"s3kv hit: {TIERS[tier]}" + (" (S3 the only tier, prefetch off)" if tier == "s3" else "")
        parts = _parts(turns[0]["workers"], "load_chunks_")
        self._row(
            f,
            n,
            path,
            ttft,
            ratio,
            min(t["cached"] for t in turns),
            cell,
            parts,
            _mib(nbytes),
            vs_full,
            "; ".join(goals),
        )


def report(
    got: dict[str, dict[str, Any]],
    lengths: tuple[int, ...],
    repeats: int,
    quick: bool,
    started: float,
    loads: tuple[tuple[float, ...], tuple[float, ...]],
) -> Result:
    """The table, the verdict and the notes of the families' figures."""
    table = _Table(got)
    for f in FAMILIES:
        for n in lengths:
            table.family(f, n)
    misses = sorted(set(table.invalid)) + table.misses
    return Result(
        name=NAME,
        title=TITLE,
        goal=GOAL,
        columns=COLUMNS,
        rows=table.rows,
        verdict=verdict(not misses, "; ".join(misses)),
        notes=_notes(got, lengths, repeats, quick, table.compute_s, loads),
        bars=table.bars,
        ylabel="TTFT / recompute TTFT",
        seconds=round(time.perf_counter() - started, 1),
    )


def _notes(
    got: dict[str, dict[str, Any]],
    lengths: tuple[int, ...],
    repeats: int,
    quick: bool,
    compute_s: dict[tuple[str, int], float],
    loads: tuple[tuple[float, ...], tuple[float, ...]],
) -> list[str]:
    from benchmarks.ttft import _defaults

    sliding = next(f for f in FAMILIES if f.key == "sliding")
    expect = []
    for n in lengths:
        k = n // CHUNK_TOKENS
        reach = k - (n - WINDOW + 1) // CHUNK_TOKENS
        expect.append(
            f"{_label(n)}: {k} chunks, {sliding.full_layers} x {k} + {sliding.windowed_layers} x {reach} = "
            f"{sliding.full_layers * k + sliding.windowed_layers * reach} parts of one layer against the Llama's "
            f"{k} chunks of {LAYERS} layers, {(sliding.full_layers * k + sliding.windowed_layers * reach) / (LAYERS * k):.3f}x; "
            f"goal {window_bound(sliding, n):.3f}x"
        )
    engines = sum(len(g["startup_s"]) for g in got.values())
    startup = [s for g in got.values() for s in g["startup_s"].values()]
    longest = max(lengths)
    llama_longest = compute_s.get(("full", longest))
    return [
        f"Prompts of {' and '.join(str(n + TAIL_TOKENS) for n in lengths)} tokens"
        + (" (quick run: shorter prompts, fewer repeats)" if quick else "")
        + f": one per length and model, computed once, then hit {repeats} times from each tier, the engines "
        "taking turns (the order turning every prompt); TTFT is vLLM's first_token_latency (arrival to first "
        f"token, so it includes the wait for an asynchronous load), the median of the {repeats} hits; each "
        f"engine first serves one uncounted {WARMUP_TOKENS}-token warm-up request.",
        f"Models: random weights, the demo's width (hidden 1024, 16 heads / 4 KV heads of 64, MLP 2816, bf16), "
        f"{LAYERS} layers each: the Gemma 3 model five sliding-window layers (window {WINDOW}) then one global "
        f"layer, vLLM's hybrid KV cache manager on (six KV cache groups of one layer); the Llama {LAYERS} "
        "full-attention layers (one group). The demo's Llama has 8 layers; 6 keeps Gemma 3's pattern whole "
        "and the Llama's 32k prefill (quadratic attention) within minutes"
        + (f" (its {_label(longest)} prefill took {llama_longest:.0f} s this run)" if llama_longest else "")
        + ". The whole prompt in one step, vLLM's prefix cache off except in the no-connector engine, KV "
        f"cache {KV_CACHE_BYTES >> 20} MiB per engine, one OpenMP thread bound to core 0 "
        f"(VLLM_CPU_OMP_THREADS_BIND=0); s3kv with its defaults ({_defaults()}) except where a row says.",
        "Bytes are the workers' counters, exact: a hit row's MiB are its tier's load_bytes of one hit (equal "
        "in every repeat; CPU: the pages copied, NVMe: the files read, S3: the objects fetched, compressed); "
        "'parts' are objects of one KV cache group of one chunk (the Llama's one group: a chunk). The "
        "compute row's MiB are one prompt's store_raw_bytes (KV before encoding, counted per write), "
        "store_bytes on NVMe and in S3. The Gemma 3 model's hit needs the global layer's every chunk and each "
        "sliding layer's chunks its window reaches from the hit's end: " + "; ".join(expect) + ". The goal "
        "judges the CPU and NVMe bytes (raw KV); S3's are compressed, and two random models' KV compress "
        "unlike, so its ratio is shown, not judged.",
        "The Llama's TTFT ratios are to its own s3kv compute-and-store in the same run (the ttft benchmark "
        "measures that within 1% of vLLM's recompute without a connector): its recompute without a "
        "connector is not run, another 32k prefill of minutes. It is here for its bytes; its hit rows show "
        "what the same tiers take for a full-attention model of the same size.",
        "Correctness: a hit's greedy tokens must equal vLLM's own (no connector) for the same prompt, as a full "
        "recompute or as a hit of its prefix cache (a random model's near-ties flip with the split of the "
        "prompt); the Llama's must equal its s3kv compute's.",
        f"NVMe: the disk directory's files written back and dropped from the page cache (posix_fadvise; "
        f"{max(g['evicted'] for g in got.values())} files) before each round, so every NVMe hit reads the "
        "device; the NVMe engine shares the storing engine's directory (s3kv warns: each accounts its own "
        "writes), started once those stores drained. S3 is moto on loopback (objects in RAM), on the same 2 "
        "cores as the engines.",
        f"{engines} engines start (~{median(startup):.0f} s each here), one at a time, and stay alive side by "
        f"side. Load average (1 min) at the start {loads[0][0]:.1f}, at the end {loads[1][0]:.1f} on 2 cores.",
        "Hybrid SSM (Mamba / linear attention beside full attention, e.g. Qwen3-Next, Nemotron-H): s3kv "
        "refuses Mamba groups at start-up (issue 28's next step), so no engine runs for it; once s3kv "
        "serves them it is one more family here, with the same engines and rows.",
    ]


if __name__ == "__main__":
    sys.exit(main_for(run, "s3kv-bench-hybrid"))
