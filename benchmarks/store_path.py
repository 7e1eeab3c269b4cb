"""Store path: what storing costs a decode-heavy workload's step time.

A batch of prompts prefills in one step and then decodes together (greedy,
``ignore_eos``) on vLLM's CPU engine with the demo's random Llama; its decode
steps cross chunk boundaries, so with ``save_generated`` (the default) s3kv
copies out and stores chunks that fill *during* decode, besides the prompt's
own chunks. Variants, each its own engine process
(``benchmarks._batch_runner``):

- ``none``: no connector (``kv_transfer_config`` null), the baseline;
- ``s3+disk``: s3kv writing through to a loopback S3 bucket (moto) and an
  NVMe directory, no CPU tier;
- ``cpu``: s3kv with only a CPU tier (``local_only``): the copies out of the
  KV cache without the background write-through.

A step's time comes from the engine core's own timestamps (the time between
two consecutive steps that each gave every request of the batch a token: no
prefill in them), so engine start-up and the prefill are outside it. A
batch's figure is the mean of its decode steps (the steps that copy chunks
out count with their weight); a variant's is the median over its batches.
Engines alternate (A B C, then C B A) so drift on the machine hits every
variant alike; prompts are distinct everywhere and vLLM's prefix cache is
off, so nothing is ever a hit.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, Bar, Result, main_for, median, verdict
from s3kv.testing.replica import run_replica, worker_total

NAME = "store_path"
TITLE = "Store path: decode step time with s3kv storing vs without a connector"
GOAL = (
    "decode step time with the connector storing <= 1.03x without the connector (mean), "
    "and its p99 step <= 1.3x the p99 without"
)

GOAL_RATIO = 1.03
P99_GOAL_RATIO = 1.3
BUCKET = "bench"
CHUNK_TOKENS = 256
BATCH = 8
VARIANTS = ("none", "s3+disk", "cpu")
LABELS = {
    "none": "no connector",
    "s3+disk": "s3kv: write-through to S3 + NVMe",
    "cpu": "s3kv: CPU tier only (local_only)",
}


def omp_cores() -> set[int]:
    """The cores vLLM binds its worker's OpenMP team to (VLLM_CPU_OMP_THREADS_BIND, a list such
    as "0" or "0-3,8"); empty when it binds automatically or not at all."""
    spec = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    cores: set[int] = set()
    try:
        for part in spec.replace("|", ",").split(","):
            lo, _, hi = part.partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        return set()
    return cores


def keep_off_forward(pid: int) -> None:
    """Keep a helper process (the loopback S3 server) off the forward's cores,
    as a real S3 would be: its request threads, started later, inherit this."""
    allowed = os.sched_getaffinity(0)
    rest = allowed - omp_cores()
    if rest and rest != allowed:
        os.sched_setaffinity(pid, rest)


def server_alive(server: Any) -> bool:
    """Is the loopback S3 server still up (it is a separate process)?"""
    if server.proc.poll() is not None:
        return False
    try:
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()
        return True
    except OSError:
        return False


def _kv(variant: str, endpoint: str, disk: Path) -> dict[str, Any] | None:
    if variant == "none":
        return None
    extra: dict[str, Any] = {"chunk_tokens": CHUNK_TOKENS, "save_generated": True}
    if variant == "s3+disk":
        extra.update(bucket=BUCKET, endpoint_url=endpoint, region="us-east-1", disk_path=str(disk))
    else:
        extra.update(write_policy="local_only", cpu_bytes="1GiB")
    return {
        "kv_connector": "S3KVConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def run_batches(work: Path, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One engine process (benchmarks._batch_runner) running ``spec``."""
    return run_replica(work, name, spec, module="benchmarks._batch_runner", cwd=ROOT)


def run(work: Path, quick: bool) -> Result:
    from s3kv.demo.model import DEMO_SPEC, build_model
    from s3kv.testing.loopback_s3 import LoopbackS3

    started = time.perf_counter()
    prompt_tokens, max_tokens = (240, 300) if quick else (480, 300)
    rounds, batches = (1, 1) if quick else (2, 2)
    model = str(build_model(work / "model", **DEMO_SPEC))
    # Full chunks of KV per request: the last sampled token has none.
    chunks_per_request = (prompt_tokens + max_tokens - 1) // CHUNK_TOKENS
    in_decode = chunks_per_request - prompt_tokens // CHUNK_TOKENS
    variants = VARIANTS[:2] if quick else VARIANTS  # quick: the goal's pair only
    order = [v for r in range(rounds) for v in (variants if r % 2 == 0 else variants[::-1])]
    rng = random.Random(5)
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    restarts = 0

    def start_server() -> Any:
        server = LoopbackS3().start()
        keep_off_forward(server.proc.pid)
        server.create_bucket(BUCKET)
        return server

    server = start_server()
    try:
        for i, variant in enumerate(order):
            if variant == "s3+disk" and not server_alive(server):
                print("  the loopback S3 server is gone: starting a new one", flush=True)
                server = start_server()
                restarts += 1
            disk = work / f"disk-{i}"
            shutil.rmtree(disk, ignore_errors=True)
            prompts = [
                [[rng.randrange(3, 2000) for _ in range(prompt_tokens)] for _ in range(BATCH)]
                for _ in range(batches)
            ]
            spec = {
                "model": model,
                "engine_args": {
                    "gpu_memory_utilization": 0.15,
                    "max_model_len": 1024,
                    "max_num_batched_tokens": 4096,  # the batch prefills in one step
                    "max_num_seqs": BATCH,
                    "enforce_eager": True,
                    "enable_prefix_caching": False,
                },
                "kv_transfer_config": _kv(variant, server.endpoint_url, disk),
                "max_tokens": max_tokens,
                "batches": prompts,
            }
            results[variant].append(run_batches(work, f"store-{i}-{variant.replace('+', '-')}", spec))
            shutil.rmtree(disk, ignore_errors=True)
    finally:
        server.stop()

    def batch_means(variant: str) -> list[float]:
        return [statistics.fmean(b["decode_step_s"]) for r in results[variant] for b in r["batches"]]

    def all_steps(variant: str) -> list[float]:
        return sorted(s for r in results[variant] for b in r["batches"] for s in b["decode_step_s"])

    base = median(batch_means("none"))
    base_p99 = p99(all_steps("none"))
    expected = chunks_per_request * BATCH * batches * rounds
    rows: list[list[Any]] = []
    bars: list[Bar] = []
    ratios: dict[str, float] = {}
    p99_ratios: dict[str, float] = {}
    checks: list[str] = []
    for variant in variants:
        means = batch_means(variant)
        steps = all_steps(variant)
        step = median(means)
        ratio = step / base
        ratios[variant] = ratio
        p99_ratios[variant] = p99(steps) / base_p99
        rs = results[variant]
        if variant == "s3+disk":
            stored = (
                f"S3 {_total_all(rs, 'store_chunks_s3'):.0f}, NVMe {_total_all(rs, 'store_chunks_disk'):.0f}"
            )
        elif variant == "cpu":
            stored = f"CPU {_total_all(rs, 'store_chunks_cpu'):.0f}"
        else:
            stored = ""
        rows.append(
            [
                LABELS[variant],
                round(step * 1000, 2),
                round(ratio, 3),
                round(statistics.median(steps) * 1000, 2),
                round(p99(steps) * 1000, 1),
                round(p99_ratios[variant], 3),
                stored,
                f"<= {GOAL_RATIO}x (p99 <= {P99_GOAL_RATIO}x)" if variant != "none" else "",
            ]
        )
        bars.append(Bar(variant, round(ratio, 3)))
        if variant != "none":
            dropped = _total_all(rs, "store_dropped_backpressure") + _total_all(rs, "store_dropped_no_slot")
            loads = sum(_total_all(rs, f"load_chunks_{t}") for t in ("cpu", "disk", "s3"))
            got = _total_all(rs, "store_chunks_s3" if variant == "s3+disk" else "store_chunks_cpu")
            checks.append(
                f"{variant}: {got:.0f} of {expected} chunk shards stored, {dropped:.0f} dropped, {loads:.0f} loaded"
            )
            if got < expected:
                checks.append(
                    f"{variant} stored fewer chunks than the workload fills: the comparison is weaker"
                )

    invalid = [c for c in checks if "fewer chunks" in c]
    misses = (
        invalid
        + [
            f"{LABELS[v]} {ratios[v]:.3f}x ({(ratios[v] - 1) * 100:.1f}% slower; goal <= {GOAL_RATIO}x)"
            for v in variants
            if v != "none" and ratios[v] > GOAL_RATIO
        ]
        + [
            f"{LABELS[v]} p99 step {p99_ratios[v]:.2f}x the p99 without a connector (goal <= {P99_GOAL_RATIO}x)"
            for v in variants
            if v != "none" and p99_ratios[v] > P99_GOAL_RATIO
        ]
    )
    n_batches = batches * rounds
    notes = [
        f"{BATCH} requests a batch, {prompt_tokens}-token prompts, {max_tokens} generated tokens each "
        f"(greedy, ignore_eos){' (quick run: smaller)' if quick else ''}; {n_batches} batch(es) per variant "
        f"in {rounds} engine(s) each, alternating; per request {chunks_per_request} full chunks "
        f"of {CHUNK_TOKENS} tokens, {in_decode} of them filled during decode.",
        "Step time: engine-core timestamps of consecutive whole-batch decode steps; the figure is each "
        "batch's mean step (chunk copies included), the median over batches; 'p50'/'p99' are over all "
        "decode steps of the variant (the p99 shows the steps that copy chunks out).",
        "Model: the demo's random Llama (hidden 1024, 8 layers, bf16), vLLM CPU build, enforce_eager, "
        "one OpenMP thread bound to core 0 (VLLM_CPU_OMP_THREADS_BIND=0); the loopback S3 server (moto) "
        "runs for every variant (idle in the baseline), kept off the forward's core as a remote S3 would be; "
        "over plain http botocore also SHA-256-signs each PUT's body (over https to AWS it does not).",
        *(
            [
                "Quick run: shorter prompts (no chunk stored at prefill), one engine per variant, no CPU-tier "
                "variant."
            ]
            if quick
            else []
        ),
        *checks,
        *(
            [f"The loopback S3 server had to be restarted {restarts} time(s) between engines."]
            if restarts
            else []
        ),
    ]
    return Result(
        name=NAME,
        title=TITLE,
        goal=GOAL,
        columns=[
            "variant",
            "decode step ms",
            "x no connector",
            "p50 step ms",
            "p99 step ms",
            "p99 x no connector",
            "chunk shards stored",
            "goal",
        ],
        rows=rows,
        verdict=verdict(not misses, "; ".join(misses)),
        notes=notes,
        bars=bars,
        ylabel="decode step time / no connector",
        goal_line=GOAL_RATIO,
        seconds=round(time.perf_counter() - started, 1),
    )


def p99(sorted_steps: list[float]) -> float:
    """The 99th percentile of sorted step times (nearest rank below)."""
    return sorted_steps[int(0.99 * (len(sorted_steps) - 1))]


def _total_all(results: list[dict[str, Any]], name: str) -> float:
    return sum(worker_total(r, name) for r in results)


if __name__ == "__main__":
    sys.exit(main_for(run, "s3kv-bench-store-path"))
