"""TTFT of a burst of requests whose prefixes are only in S3, with and
without prefetch at arrival.

A writer engine computes and stores every burst's prompts (distinct 2k-token
prefixes). Then, for each S3 delay (a loopback proxy holds each object
GET's first byte back, :class:`s3kv.testing.latency_proxy.LatencyProxy`),
engines with a CPU tier and room for only two running requests
(``max_num_seqs=2``) take bursts, one after another, each of prompts of
its own: two short requests that decode for a while (the running batch,
full), then N prompts. vLLM looks a waiting request up only while a
running slot is free, so without prefetch (``prefetch_bytes: 0``) the N
start their S3 loads once the two finish and wait for them there; with it
(the default), every request's chunks are fetched into the CPU tier as it
arrives, while the batch runs.
(Submitted to an idle engine instead, the N would all be looked up at
once, their asynchronous loads needing no running slot: nothing left for
a prefetch to hide.)

The three variants' engines (off, on, a 32 MiB budget) are alive at once
(``benchmarks._multi_runner``: one driver, a process per engine) and take
the bursts in turns, the order turning with each burst, so that the
machine's drift over the run falls on each alike (engines started one
after another drift 20% apart here).
"""

from __future__ import annotations

import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, Bar, Result, main_for, run_replica, s3kv_transfer_config, verdict

NAME = "prefetch"
TITLE = "TTFT of a burst of requests whose prefixes are only in S3: prefetch at arrival vs none"
GOAL = (
    "prefetch lowers the burst's mean TTFT at every S3 delay (issue 18: the later requests' S3 time hidden)"
)
BUCKET = "bench-prefetch"
CHUNK_TOKENS = 256
PROMPT_TOKENS = 2048 + 16
MAX_TOKENS = 8
MAX_MODEL_LEN = 4096
BLOCKERS = 2
"""Requests that fill the running batch (``max_num_seqs``) when the burst arrives."""
BLOCKER_PROMPT_TOKENS = 64
"""Under a chunk: nothing to store or load."""
BLOCKER_TOKENS = 48
"""Decode steps the blockers run: longer than the slowest S3 delay's fetch."""
BURSTS = 3
"""Bursts per engine, each of prompts of its own (their chunks only in S3):
one burst's mean moves by several percent from run to run."""
CPU_BYTES = "1GiB"
"""Each engine's CPU tier: every burst's chunks fit (3 x 8 x 8 chunk shards of 2 MiB)."""
KV_CACHE_BYTES = 512 << 20
"""Each engine's KV cache (three are alive at once): a burst's 10 requests fit."""
VARIANTS = {"off": {"prefetch_bytes": 0}, "on": {}, "on, 32 MiB": {"prefetch_bytes": "32MiB"}}


def _s3kv(endpoint: str, **extra: Any) -> dict[str, Any]:
    return s3kv_transfer_config(endpoint, BUCKET, CHUNK_TOKENS, **extra)


def run(work: Path, quick: bool) -> Result:
    from s3kv.demo.model import DEMO_SPEC, build_model
    from s3kv.testing.latency_proxy import LatencyProxy
    from s3kv.testing.loopback_s3 import LoopbackS3

    started = time.perf_counter()
    n = 6 if quick else 8
    repeats = 1 if quick else BURSTS
    delays_ms = (200,) if quick else (100, 400)
    model = str(build_model(work / "model", **DEMO_SPEC))
    rng = random.Random(182)
    prompts = [[rng.randrange(3, 2000) for _ in range(PROMPT_TOKENS)] for _ in range(n * repeats)]
    blockers = [
        {
            "prompt": [rng.randrange(3, 2000) for _ in range(BLOCKER_PROMPT_TOKENS)],
            "max_tokens": BLOCKER_TOKENS,
        }
        for _ in range(BLOCKERS)
    ]
    engine = {
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "max_model_len": MAX_MODEL_LEN,
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "max_num_seqs": 2,
    }

    def spec(kv: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {
            "model": model,
            "engine_args": engine,
            "kv_transfer_config": kv,
            "max_tokens": MAX_TOKENS,
            **extra,
        }

    from s3kv.testing.replica import run_replica as run_module

    variants = VARIANTS
    names = list(variants)
    runs: dict[tuple[int, str], dict[str, Any]] = {}
    orders: dict[int, list[list[str]]] = {}
    server = LoopbackS3().start()
    try:
        server.create_bucket(BUCKET)
        with LatencyProxy(server.endpoint_url) as proxy:
            writer = run_replica(work, "prefetch-writer", spec(_s3kv(proxy.endpoint_url), prompts=prompts))
            for delay in delays_ms:
                proxy.delay_s = delay / 1000
                # Burst b goes to every variant's engine in turn, the order turning with b.
                orders[delay] = [names[b % len(names) :] + names[: b % len(names)] for b in range(repeats)]
                turns = [
                    {"engine": variant, "prompts": [*blockers, *prompts[b * n : (b + 1) * n]]}
                    for b in range(repeats)
                    for variant in orders[delay][b]
                ]
                side = {
                    "engines": {
                        variant: {
                            "model": model,
                            "engine_args": engine,
                            "kv_transfer_config": _s3kv(proxy.endpoint_url, cpu_bytes=CPU_BYTES, **extra),
                        }
                        for variant, extra in variants.items()
                    },
                    "max_tokens": MAX_TOKENS,
                    "turns": turns,
                }
                result = run_module(
                    work, f"prefetch-{delay}ms", side, module="benchmarks._multi_runner", cwd=ROOT
                )
                for variant in names:  # its bursts in order, as one engine's run
                    mine = [t for t in result["turns"] if t["engine"] == variant]
                    runs[(delay, variant)] = {
                        "ttft_s": [x for t in mine for x in t["ttft_s"]],
                        "outputs": [x for t in mine for x in t["outputs"]],
                        "metrics": result["engines"][variant]["metrics"],
                    }
    finally:
        server.stop()
    shutil.rmtree(work / "model", ignore_errors=True)

    rows: list[list[Any]] = []
    bars: list[Bar] = []
    misses: list[str] = []
    same, spread = [], []

    def burst_requests(values: list[Any]) -> list[Any]:
        """The burst prompts' entries, every burst's in turn (not the blockers')."""
        size = BLOCKERS + n
        return [v for b in range(repeats) for v in values[b * size + BLOCKERS : (b + 1) * size]]

    for delay in delays_ms:
        means, burst_means = {}, {}
        off_outputs = burst_requests(runs[(delay, "off")]["outputs"])
        for variant in variants:
            r = runs[(delay, variant)]
            ttft = burst_requests(r["ttft_s"])
            m = r["metrics"]
            means[variant] = statistics.mean(ttft)
            burst_means[variant] = [statistics.mean(ttft[b * n : (b + 1) * n]) for b in range(repeats)]
            # A random model's near-ties flip with the batch a request shares
            # and with a prompt computed or loaded: an output must equal the
            # writer's (computed) or the no-prefetch run's (loaded) one.
            outputs = burst_requests(r["outputs"])
            for i, out in enumerate(outputs):
                if out != writer["outputs"][i] and out != off_outputs[i]:
                    misses.append(f"{delay} ms, prefetch {variant}: request {i}'s output matches neither run")
            same.append(
                f"{delay} ms {variant}: {sum(o == w for o, w in zip(outputs, writer['outputs']))}/{n * repeats}"
            )
            rows.append(
                [
                    delay,
                    variant,
                    round(statistics.mean(ttft) * 1000, 1),
                    round(statistics.median(ttft) * 1000, 1),
                    round(max(ttft) * 1000, 1),
                    int(m.get("vllm:s3kv_hit_tokens_cpu", 0)),
                    int(m.get("vllm:s3kv_hit_tokens_s3", 0)),
                    int(m.get("vllm:s3kv_prefetch_chunks_started", 0)),
                ]
            )
        for variant in ("on", "on, 32 MiB"):
            ratio = means[variant] / means["off"]
            bars.append(Bar(f"{delay} ms {variant}", round(ratio, 3)))
            rows.append([delay, f"{variant} / off", "", "", "", "", "", f"mean TTFT {ratio:.3f}x"])
            per_burst = [on / off for on, off in zip(burst_means[variant], burst_means["off"])]
            spread.append(f"{delay} ms {variant}: " + ", ".join(f"{x:.3f}x" for x in per_burst))
            if ratio >= 1.0:
                misses.append(f"{delay} ms: prefetch ({variant})'s mean TTFT is {ratio:.3f}x none's")
    notes = [
        f"{repeats} burst(s) per engine, one after another, each of {n} requests of {PROMPT_TOKENS} tokens (8 "
        f"chunks of {CHUNK_TOKENS} each in S3, distinct prefixes: no burst finds another's in the CPU tier), "
        f"{MAX_TOKENS} greedy tokens each, submitted at once to an engine with max_num_seqs=2, a "
        f"{CPU_BYTES} CPU tier, a {KV_CACHE_BYTES >> 20} MiB KV cache and vLLM's prefix cache off, behind "
        f"{BLOCKERS} requests of {BLOCKER_PROMPT_TOKENS} "
        f"tokens decoding {BLOCKER_TOKENS} (the running batch, full when the burst arrives; not counted); "
        "TTFT is vLLM's first_token_latency (from each request's arrival). Outputs are checked against the "
        "writer's (which computed them).",
        "S3 is moto on loopback behind a proxy that holds every object GET's first byte back by the delay. "
        "Without prefetch, vLLM looks a waiting request up (and starts its S3 load) only while a running slot "
        "is free: here once the batch ahead finishes; with prefetch (the default prefetch_bytes), each "
        "arriving request's S3 chunks are fetched into the CPU tier at once, while the batch runs, and its "
        "lookup waits for them, so its hit is a CPU-tier load.",
        "mean TTFT: over every burst's requests; hit tokens: from the scheduler side's counters (by the tier "
        "each load came from), over every burst.",
        "Interleaved: per S3 delay, the three variants' engines are alive at once (a process each, one "
        "driver) and take "
        "each burst in turn (after each turn the engine's uploads and copies drain), the order turning with "
        "each burst: "
        + "; ".join(f"{d} ms " + ", ".join("/".join(order) for order in orders[d]) for d in delays_ms)
        + ".",
        "Each burst's mean TTFT over the same burst's without prefetch (the same prompts): "
        + "; ".join(spread),
        "Variants: 'on' has the default prefetch_bytes (1 GiB: every chunk of the burst at once here, a "
        "2 MiB chunk shard each); 'on, 32 MiB' lets 16 chunks be in flight, the rest queued in arrival "
        "order. Outputs equal to the writer's (which computed each prompt, in its own batches): "
        + ", ".join(same)
        + "; the others equal the no-prefetch run's.",
    ]
    return Result(
        name=NAME,
        title=TITLE,
        goal=GOAL,
        columns=[
            "S3 delay ms",
            "prefetch",
            "mean TTFT ms",
            "median ms",
            "max ms",
            "hit tokens: CPU",
            "hit tokens: S3",
            "chunks prefetched",
        ],
        rows=rows,
        verdict=verdict(not misses, "; ".join(misses)),
        notes=notes,
        bars=bars,
        ylabel="mean TTFT, prefetch / none",
        goal_line=1.0,
        seconds=round(time.perf_counter() - started, 1),
    )


if __name__ == "__main__":
    sys.exit(main_for(run, "s3kv-bench-prefetch"))
