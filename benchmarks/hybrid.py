"""Hybrid models (issue 28): the TTFT of 8k and 32k-token hits of a
sliding-window model and of a hybrid SSM model from s3kv's CPU, NVMe and S3
tiers against recompute, and the bytes their hits load and their prompts
store against a full-attention model of the same width and depth.

Families (:data:`FAMILIES`), each a random-weights model of the demo's width
(hidden 1024, 16 heads / 4 KV heads of 64, MLP 2816, bf16) and one depth:

- ``sliding``: a Gemma 3 text model, Gemma 3's pattern of five
  sliding-window layers (window 1024, Gemma 3's own) to one full-attention
  layer; vLLM's hybrid KV cache manager makes six KV cache groups of it;
- ``full``: a Llama of the same width and depth, one full-attention group:
  what the other families' bytes are compared with, per token;
- ``ssm``: a Qwen3-Next, Qwen3-Next's rule of a full-attention layer every
  fourth layer (at this depth five gated-delta-net linear-attention layers
  to one full), its linear heads 128 wide (vLLM's CPU kernel's), its MLP a
  mixture of experts as wide per token as the Llama's; six KV cache groups
  (five of a state, one of full attention). vLLM gives it 640-token blocks
  (a state's page) and keeps a state only where a step ended on a block
  boundary, with prefix caching on (``mamba_cache_mode="align"``), which
  s3kv needs to share it: its hits are whole 640-token chunks (the nearest
  to 8k and 32k), and a prompt's first step ends at its last chunk boundary
  (vLLM splits the prefill there), so the prompt stores the very states its
  hits need.

Per family, engines alive at once take turns (each a process of
``benchmarks._multi_runner``'s; the order turning with every prompt), so
the machine's drift falls on each alike:

- ``vllm`` (the hybrid families, not the Llama): no connector, vLLM's prefix cache on:
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
every hit loads the same tokens and vLLM computes the last two. An engine
with vLLM's prefix cache on and s3kv (the SSM family's) empties vLLM's
cache before every turn, so that its hits are s3kv's. Each engine
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
    "Hybrid models: TTFT of 8k and 32k-token hits of a sliding-window and a hybrid SSM model from CPU, "
    "NVMe and S3 vs recompute; bytes per hit and per prompt vs a full-attention model of the same width "
    "and depth"
)
GOAL = (
    "sliding-window model (Gemma 3's 5:1 pattern) and hybrid SSM model (Qwen3-Next's gated delta net + "
    "full attention): hit TTFT <= 0.1x recompute from CPU, <= 0.2x from NVMe, <= 0.3x from S3 at 8k and "
    "32k tokens; bytes loaded per hit from CPU and NVMe <= (full layers + sliding layers x the window's "
    "chunks + state layers x one chunk) / all layers of a full-attention Llama's of the same width and "
    "depth, per token (the window rounded up to whole chunks, plus one); raw KV bytes stored per prompt "
    "<= 1.02x the Llama's, per token"
)

BUCKET = "bench-hybrid"
CHUNK_TOKENS = 256
WARMUP_TOKENS = 512
MAX_TOKENS = 8
TAIL_TOKENS = 2
"""Tokens past the last chunk (and block) boundary: what every hit leaves vLLM to compute."""
LAYERS = 6
"""Depth of every family: Gemma 3's pattern once (five sliding, one full);
Qwen3-Next's rule (a full layer every fourth) gives one full layer too.
The demo's Llama has 8; at 6 a 32k prefill of the Llama still takes
minutes on this machine (its full attention is quadratic)."""
WINDOW = 1024
WIDTH = {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16, "num_key_value_heads": 4}
"""The demo's width (s3kv.demo.model.DEMO_SPEC), head size 64."""
SSM_WIDTH = {
    **{k: v for k, v in WIDTH.items() if k != "intermediate_size"},
    "head_dim": 64,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 1024,
    "shared_expert_intermediate_size": 768,
}
"""The Qwen3-Next at the demo's width: full attention's heads the Llama's
(its KV per token the Llama's per layer); linear attention's 128 wide (vLLM's
CPU kernel wants them so), 8 value heads (1024 wide, the hidden size) to 4
key heads (Qwen3-Next's 2:1); an MoE MLP (vLLM's Qwen3-Next has no dense
one), two experts of 1024 and a shared expert of 768 per token: 2816, the
Llama's MLP."""
SSM_CHUNK_TOKENS = 640
"""vLLM's block for the SSM model (full attention's pages made as large as a
state's, 640 tokens) and s3kv's default chunk for it (the fewest whole
blocks that hold 256 tokens)."""
KV_CACHE_BYTES = 512 << 20
CPU_TIER = "512MiB"
GOALS = {"cpu": 0.1, "nvme": 0.2, "s3": 0.3}
GOAL_STORED = 1.02
TIERS = {"cpu": "CPU", "nvme": "NVMe", "s3": "S3"}
COUNTER_TIER = {"cpu": "cpu", "nvme": "disk", "s3": "s3"}
"""s3kv's name of each hit row's tier in its counters (load_chunks_disk, ...)."""
HEADERS = {"cpu": 1.0, "nvme": 1.001}
"""What the bytes goal allows a tier beyond raw KV: the CPU tier's bytes are
pages; an NVMe file has a header (about 250 bytes), more of them per
byte in smaller parts (0.04% of a 640 KiB part, 0.02% of a Llama chunk)."""


@dataclass(frozen=True)
class Family:
    """One kind of model the benchmark measures."""

    key: str
    label: str
    full_layers: int
    recompute: bool
    """Whether vLLM without a connector recomputes its prompts here (the
    ratios' reference); without it, ratios are to s3kv's own compute."""
    windowed_layers: int = 0
    state_layers: int = 0
    """Mamba / linear-attention layers: a hit needs each one's state at its end only."""
    chunk_tokens: int = CHUNK_TOKENS
    prefix_caching: bool = False
    """vLLM's prefix cache on in the s3kv engines (s3kv shares a state only
    so), emptied before each of their turns."""

    @property
    def layers(self) -> int:
        return self.full_layers + self.windowed_layers + self.state_layers


FAMILIES = (
    Family(
        "sliding",
        f"Gemma 3 (5 sliding, window {WINDOW} : 1 full)",
        1,
        recompute=True,
        windowed_layers=LAYERS - 1,
    ),
    Family("full", "Llama (full attention)", LAYERS, recompute=False),
    Family(
        "ssm",
        "Qwen3-Next (5 gated delta net : 1 full)",
        1,
        recompute=True,
        state_layers=LAYERS - 1,
        chunk_tokens=SSM_CHUNK_TOKENS,
        prefix_caching=True,
    ),
)


def hit_tokens(family: Family, n: int) -> int:
    """The tokens of a family's hit at nominal length ``n``: the nearest whole number of its chunks."""
    return max(1, round(n / family.chunk_tokens)) * family.chunk_tokens


def build(family: Family, work: Path, max_position: int) -> Path:
    """The family's random model under ``work`` (built once, then reused)."""
    from s3kv.demo.model import DEMO_SPEC, build_gemma3, build_model, build_qwen3_next

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
    if family.key == "ssm":
        return build_qwen3_next(
            work / f"qwen3-next-{LAYERS}",
            **SSM_WIDTH,
            num_hidden_layers=LAYERS,
            # Qwen3-Next's rule (its config's default): every fourth layer full attention.
            layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(LAYERS)],
            max_position_embeddings=max_position,
        )
    raise ValueError(f"no model builder for family {family.key!r}")


def hit_bound(family: Family, tokens: int) -> float:
    """The goal on a family's bytes per hit of ``tokens`` tokens, as a share
    of a full-attention model's of the same depth for as many tokens: every
    full layer's chunks; of each windowed layer the window's chunks rounded
    up, plus one (a window straddles a chunk boundary); of each state layer
    one chunk's part (its state at the hit's end)."""
    k = tokens // family.chunk_tokens
    reach = min(k, -(-(WINDOW - 1) // family.chunk_tokens) + 1)
    kept = family.full_layers * k + family.windowed_layers * reach + family.state_layers * min(k, 1)
    return kept / (family.layers * k)


def expected_parts(family: Family, tokens: int) -> int:
    """The parts (objects of one KV cache group of one chunk) a hit of
    ``tokens`` tokens loads: a one-group model's chunks; else each layer is
    a group of its own (vLLM's hybrid manager groups layers by the fewest
    of one kind: one full-attention layer here): every full layer's chunks,
    each windowed layer's chunks its window reaches from the hit's end,
    each state layer's one state."""
    k = tokens // family.chunk_tokens
    if not (family.windowed_layers or family.state_layers):
        return k
    reach = k - max(0, tokens - WINDOW + 1) // family.chunk_tokens
    return family.full_layers * k + family.windowed_layers * reach + family.state_layers * min(k, 1)


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
    """A family's engines, side by side: per engine and prompt (by its hit
    tokens) the compute turn (``compute``) and the hit turns (``hits``)."""
    disk = work / f"disk-{family.key}"
    shutil.rmtree(disk, ignore_errors=True)
    bucket = f"{BUCKET}-{family.key}"

    def s3kv(**extra: Any) -> dict[str, Any]:
        return s3kv_transfer_config(endpoint, bucket, family.chunk_tokens, **extra)

    def spec(kv: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": str(model),
            "engine_args": _engine_args(max_model_len, **extra),
            "kv_transfer_config": kv,
        }
        if kv is not None and family.prefix_caching:
            out["engine_args"]["enable_prefix_caching"] = True
            out["reset_prefix_cache"] = True  # a repeat's hit is s3kv's, not vLLM's own
        return out

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
    hits = {f.key: [hit_tokens(f, n) for n in lengths] for f in FAMILIES}
    every = list(dict.fromkeys([*lengths, *(h for f in FAMILIES for h in hits[f.key])]))
    max_model_len = max(every) + 256
    rng = random.Random(28)
    warm = [rng.randrange(3, 2000) for _ in range(WARMUP_TOKENS)]
    prompts = {n: [rng.randrange(3, 2000) for _ in range(n + TAIL_TOKENS)] for n in every}
    models = {f.key: build(f, work, max_model_len + 512) for f in FAMILIES}
    got: dict[str, dict[str, Any]] = {}
    server = LoopbackS3().start()
    try:
        for f in FAMILIES:
            server.create_bucket(f"{BUCKET}-{f.key}")
            mine = {h: prompts[h] for h in hits[f.key]}
            got[f.key] = measure(
                f, models[f.key], server.endpoint_url, work, warm, mine, repeats, max_model_len
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
    "x Llama's bytes per token",
    "outputs",
    "goal",
]
STORED = {"raw": "store_raw_bytes", "NVMe": "store_bytes_disk", "S3": "store_bytes_s3"}
"""A prompt's bytes stored, from its compute turn's counters: KV before encoding, NVMe files, S3 objects."""


FULL_KEY = "full"
"""The family every other's bytes are compared with."""


def _family(key: str) -> Family:
    return next(f for f in FAMILIES if f.key == key)


def _engine(tier: str) -> str:
    """The engine whose hits come from ``tier``: the storing one holds the CPU tier."""
    return "store" if tier == "cpu" else tier


class _Table:
    """The rows, bars and misses of the families' figures, each family's
    bytes judged against the full-attention family's at the same nominal
    length, per token (a family's hits are whole chunks of its own)."""

    def __init__(self, got: dict[str, dict[str, Any]]) -> None:
        self.got = got
        self.rows: list[list[Any]] = []
        self.bars: list[Bar] = []
        self.misses: list[str] = []
        self.invalid: list[str] = []
        self.compute_s: dict[tuple[str, int], float] = {}

    def hit_bytes(self, family: str, tier: str, h: int) -> float:
        """One hit's bytes from ``tier`` (every repeat must load alike)."""
        turns = self.got[family]["hits"][_engine(tier)][h]
        return _same([t["workers"].get(f"load_bytes_{COUNTER_TIER[tier]}", 0) for t in turns])

    def stored(self, family: str, h: int) -> dict[str, float]:
        w = self.got[family]["compute"]["store"][h]["workers"]
        return {k: w.get(c, 0) for k, c in STORED.items()}

    def _vs_full(self, f: Family, n: int, h: int, mine: float, full: Any) -> float | None:
        """``mine`` (bytes of ``h`` tokens) per token over the Llama's at
        nominal length ``n`` (``full``: its bytes), None without the Llama."""
        if f.key == FULL_KEY or FULL_KEY not in self.got:
            return None
        hf = hit_tokens(_family(FULL_KEY), n)
        theirs = full(hf) / hf
        return (mine / h) / theirs if theirs else 0.0

    def family(self, f: Family, n: int) -> None:
        """The rows of family ``f`` at nominal length ``n`` (its hit: ``h`` tokens)."""
        h = hit_tokens(f, n)
        comp, hits = self.got[f.key]["compute"], self.got[f.key]["hits"]
        self.compute_s[f.key, h] = comp["store"][h]["ttft_s"]
        if f.recompute:
            base = comp["vllm"][h]["ttft_s"]
            refs = {"recompute": comp["vllm"][h]["outputs"], "vllm_hit": hits["vllm"][h][0]["outputs"]}
            self._row(
                f, h, "recompute (vLLM, no connector)", base, 1.0, comp["vllm"][h]["cached"], "reference"
            )
            vh = hits["vllm"][h]
            ttft = median([t["ttft_s"] for t in vh])
            cell, _ = _judge([t["outputs"] for t in vh], refs)
            self._row(
                f,
                h,
                "vLLM's own prefix-cache hit (no connector)",
                ttft,
                ttft / base,
                min(t["cached"] for t in vh),
                cell,
            )
            self.bars.append(Bar(f"{f.key} {_label(h)} vLLM hit", round(ttft / base, 4)))
        else:
            base = comp["store"][h]["ttft_s"]
            refs = {"compute": comp["store"][h]["outputs"]}
        self._store(f, n, base, refs)
        for tier in COUNTER_TIER:
            self._hit(f, n, tier, base, refs)

    def _row(
        self,
        f: Family,
        h: int,
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
                _label(h),
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
        h = hit_tokens(f, n)
        st = self.got[f.key]["compute"]["store"][h]
        cell, ok = _judge([st["outputs"]], refs)
        if not ok:
            self.misses.append(
                f"{f.label} {_label(h)}: s3kv's compute: outputs differ from {' and '.join(refs)}"
            )
        mine = self.stored(f.key, h)
        path = "s3kv, empty tiers: computes and stores" + ("" if f.recompute else " (its ratios' reference)")
        vs, goal = "", ""
        ratio = {
            k: self._vs_full(f, n, h, v, lambda hf, k=k: self.stored(FULL_KEY, hf)[k])
            for k, v in mine.items()
        }
        if ratio["raw"] is not None:
            vs, goal = "; ".join(f"{k} {v:.3f}" for k, v in ratio.items()), f"raw <= {GOAL_STORED}x"
            if ratio["raw"] > GOAL_STORED:
                self.misses.append(
                    f"{f.label} {_label(h)}: raw KV stored {ratio['raw']:.3f}x the Llama's (goal {GOAL_STORED}x)"
                )
        mib = "; ".join(f"{k} {_mib(v)}" for k, v in mine.items())
        self._row(
            f,
            h,
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

    def _check(self, f: Family, h: int, tier: str, what: str, turns: list[dict[str, Any]]) -> None:
        """A hit row is invalid unless every hit loaded from its tier alone,
        the parts the family's hit needs (a state group's state at the hit's
        end, each), and vLLM took all ``h`` tokens."""
        want = expected_parts(f, h)
        for t in turns:
            loaded = {c: t["workers"].get(f"load_chunks_{c}", 0) for c in COUNTER_TIER.values()}
            if not loaded[COUNTER_TIER[tier]] or sum(loaded.values()) != loaded[COUNTER_TIER[tier]]:
                self.invalid.append(f"invalid: {what} loaded {_parts(t['workers'], 'load_chunks_')} parts")
            elif sum(loaded.values()) != want:
                self.invalid.append(f"invalid: {what} loaded {sum(loaded.values()):.0f} parts, not {want}")
            if t["cached"] != h:
                self.invalid.append(f"invalid: {what} had {t['cached']} tokens cached, not {h}")

    def _hit(self, f: Family, n: int, tier: str, base: float, refs: dict[str, list[int]]) -> None:
        """The row of ``tier``'s hits: TTFT to recompute, and (a hybrid
        family) bytes to the Llama's; invalid if a hit came from elsewhere."""
        h = hit_tokens(f, n)
        turns = self.got[f.key]["hits"][_engine(tier)][h]
        what = f"{f.label} {_label(h)} {TIERS[tier]} hit"
        ttft = median([t["ttft_s"] for t in turns])
        ratio = ttft / base
        cell, ok = _judge([t["outputs"] for t in turns], refs)
        if not ok:
            self.misses.append(f"{what}: outputs differ from {' and '.join(refs)}")
        self._check(f, h, tier, what, turns)
        nbytes = self.hit_bytes(f.key, tier, h)
        vs_full = self._vs_full(f, n, h, nbytes, lambda hf: self.hit_bytes(FULL_KEY, tier, hf))
        goals = []
        if f.recompute:
            goals.append(f"<= {GOALS[tier]}x")
            if ratio > GOALS[tier]:
                self.misses.append(f"{what} {ratio:.3f}x recompute (goal {GOALS[tier]}x)")
            if tier != "s3":  # S3's bytes are compressed: not judged
                bound = hit_bound(f, h)
                goals.append(f"bytes <= {bound:.3f}x")
                if vs_full is not None and vs_full > bound * HEADERS[tier] + 1e-9:
                    self.misses.append(f"{what} loads {vs_full:.3f}x the Llama's bytes (goal {bound:.3f}x)")
            self.bars.append(Bar(f"{f.key} {_label(h)} {tier}", round(ratio, 4)))
        path = f"s3kv hit: {TIERS[tier]}" + (" (S3 the only tier, prefetch off)" if tier == "s3" else "")
        parts = _parts(turns[0]["workers"], "load_chunks_")
        self._row(
            f,
            h,
            path,
            ttft,
            ratio,
            min(t["cached"] for t in turns),
            cell,
            parts,
            _mib(nbytes),
            "" if vs_full is None else round(vs_full, 3),
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
        if f.key in got:
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


def _expected(f: Family, lengths: tuple[int, ...]) -> str:
    """A hybrid family's parts per hit against the Llama's layer-chunks, as the notes say them."""
    out = []
    for n in lengths:
        h = hit_tokens(f, n)
        k = h // f.chunk_tokens
        reach = k - max(0, h - WINDOW + 1) // f.chunk_tokens
        terms = [f"{f.full_layers} x {k}"]
        if f.windowed_layers:
            terms.append(f"{f.windowed_layers} x {reach}")
        if f.state_layers:
            terms.append(f"{f.state_layers} x 1")
        parts = expected_parts(f, h)
        out.append(
            f"{_label(h)}: {k} chunks of {f.chunk_tokens}, {' + '.join(terms)} = {parts} parts of one layer "
            f"against {f.layers} x {k} layer-chunks, {parts / (f.layers * k):.3f}x; goal {hit_bound(f, h):.3f}x"
        )
    return "; ".join(out)


def _notes(
    got: dict[str, dict[str, Any]],
    lengths: tuple[int, ...],
    repeats: int,
    quick: bool,
    compute_s: dict[tuple[str, int], float],
    loads: tuple[tuple[float, ...], tuple[float, ...]],
) -> list[str]:
    from benchmarks.ttft import _defaults

    sliding, ssm = _family("sliding"), _family("ssm")
    ssm_hits = [hit_tokens(ssm, n) for n in lengths]
    engines = sum(len(g["startup_s"]) for g in got.values())
    startup = [s for g in got.values() for s in g["startup_s"].values()]
    longest = max(lengths)
    took = {
        f.label.split(" (")[0]: compute_s.get((f.key, hit_tokens(f, longest)))
        for f in FAMILIES
        if (f.key, hit_tokens(f, longest)) in compute_s
    }
    return [
        f"Prompts of {' and '.join(str(n + TAIL_TOKENS) for n in lengths)} tokens (the SSM model's "
        f"{' and '.join(str(h + TAIL_TOKENS) for h in ssm_hits)}: whole {ssm.chunk_tokens}-token chunks, the "
        "nearest to the others')"
        + (" (quick run: shorter prompts, fewer repeats)" if quick else "")
        + f": one per length and model, computed once, then hit {repeats} times from each tier, the engines "
        "taking turns (the order turning every prompt); TTFT is vLLM's first_token_latency (arrival to first "
        f"token, so it includes the wait for an asynchronous load), the median of the {repeats} hits; each "
        f"engine first serves one uncounted {WARMUP_TOKENS}-token warm-up request.",
        f"Models: random weights, the demo's width (hidden 1024, 16 heads / 4 KV heads of 64, MLP 2816, bf16), "
        f"{LAYERS} layers each: the Gemma 3 model five sliding-window layers (window {WINDOW}) then one global "
        f"layer; the Qwen3-Next model Qwen3-Next's rule of a full-attention layer every fourth (layer 4 of "
        f"{LAYERS}, the other five gated-delta-net linear attention, 8 value / 4 key heads of 128, vLLM's CPU "
        "kernel's width; full attention's KV per token the Llama's per layer; an MoE MLP, 2 of 4 experts of "
        "1024 and a shared one of 768 per token, as vLLM's Qwen3-Next has no dense MLP); vLLM's hybrid KV cache "
        f"manager on for both (six KV cache groups of one layer); the Llama {LAYERS} full-attention layers "
        "(one group). The demo's Llama has 8 layers; 6 keeps Gemma 3's pattern whole and the Llama's 32k "
        "prefill (quadratic attention) within minutes"
        + (
            " (the "
            + _label(longest)
            + " prefills took "
            + ", ".join(f"{k} {v:.0f} s" for k, v in took.items())
            + " in s3kv's storing engine this run)"
            if took
            else ""
        )
        + f". vLLM gives the Qwen3-Next model {ssm.chunk_tokens}-token blocks (a state's page), its chunks "
        "are one block (s3kv's default for it). The whole prompt in one step, except that with the "
        "Qwen3-Next model vLLM ends the first step at the prompt's last block boundary (where it keeps the "
        "state, mamba_cache_mode align) and computes the 2 tokens after it in a second; vLLM's prefix cache "
        "off in the Gemma 3 and Llama models' s3kv engines, on in every no-connector engine and in the "
        "Qwen3-Next model's s3kv engines (s3kv shares a state only so), where it is emptied before every turn "
        f"(the rows' cached tokens and tiers show each hit was s3kv's). KV cache {KV_CACHE_BYTES >> 20} MiB "
        "per engine, one OpenMP thread bound to core 0 (VLLM_CPU_OMP_THREADS_BIND=0); s3kv with its defaults "
        f"({_defaults()}) except where a row says.",
        "Bytes are the workers' counters, exact: a hit row's MiB are its tier's load_bytes of one hit (equal "
        "in every repeat; CPU: the pages copied, NVMe: the files read, S3: the objects fetched, compressed); "
        "'parts' are objects of one KV cache group of one chunk (the Llama's one group: a chunk). The "
        "compute row's MiB are one prompt's store_raw_bytes (KV before encoding, counted per write), "
        "store_bytes on NVMe and in S3. Ratios to the Llama are per token (the SSM model's hits are not the "
        "Llama's lengths; each Llama chunk holds as many bytes). The Gemma 3 model's hit needs the global "
        "layer's every chunk and each sliding layer's chunks its window reaches from the hit's end: "
        + _expected(sliding, lengths)
        + ". The Qwen3-Next model's needs the full layer's every chunk and each linear layer's state after "
        "exactly the hit's chunks (one part, the state in its last page, padded to the block): "
        + _expected(ssm, lengths)
        + "; its prompt stores the full layer's chunks and the states where its first step ended, the same "
        "parts. A hit that loads other parts than these is invalid. The goal judges the CPU bytes (pages) "
        "and the NVMe bytes (files: a header of about 250 bytes each, allowed 0.1%); S3's are compressed, "
        "and two random models' KV compress unlike, so its ratio is shown, not judged.",
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
        f"{engines} engines start (~{median(startup):.0f} s each here), one at a time, each family's alive "
        f"side by side. Load average (1 min) at the start {loads[0][0]:.1f}, at the end {loads[1][0]:.1f} on "
        "2 cores shared with other work.",
    ]


if __name__ == "__main__":
    sys.exit(main_for(run, "s3kv-bench-hybrid"))
