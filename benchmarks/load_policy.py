"""TTFT by prompt length behind an S3 that answers late: the cost policy
against always loading and against recomputing.

Every prompt is in the bucket (a writer engine computed and stored it);
the engines that read it have no CPU or NVMe tier and vLLM's prefix cache
off, so each request either loads its prefix from S3 again or computes
it. A loopback proxy (:class:`s3kv.demo.latency_proxy.LatencyProxy`) holds
the first byte of every object GET back by 0, 50 or 200 ms, as a distant
bucket would. For each delay, two engines read through it, one per
policy (``load_policy: always`` and ``cost``), with the same warm-up: three
prompts computed (the engine's prefill rate: 512, 2k and 8k tokens of
context) and two 4k-token prompts loaded (S3's latency and bandwidth).
``recompute`` is vLLM without a connector. The goal (issue 18): at every
length and delay, the cost policy's TTFT is within 10% of the better of
the other two.
"""

from __future__ import annotations

import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Bar, Result, main_for, median, run_replica, verdict
from benchmarks.ttft import _engine_args

NAME = "load_policy"
TITLE = "TTFT by prompt length behind a slow S3: the cost policy vs always loading vs recomputing"
GOAL = "cost TTFT <= 1.1x min(always, recompute) at every prompt length and S3 delay"
BUCKET = "bench-policy"
CHUNK_TOKENS = 256
MAX_TOKENS = 1
GOAL_RATIO = 1.1
MAX_MODEL_LEN = 8448


def _s3kv(endpoint: str, policy: str) -> dict[str, Any]:
    return {
        "kv_connector": "S3KVConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "bucket": BUCKET,
            "endpoint_url": endpoint,
            "region": "us-east-1",
            "chunk_tokens": CHUNK_TOKENS,
            "load_policy": policy,
        },
    }


def run(work: Path, quick: bool) -> Result:
    from s3kv.demo.latency_proxy import LatencyProxy
    from s3kv.demo.loopback_s3 import LoopbackS3
    from s3kv.demo.model import DEMO_SPEC, build_model

    started = time.perf_counter()
    lengths = (256, 1024, 4096) if quick else (256, 512, 1024, 2048, 4096, 8192)
    delays_ms = (0, 200) if quick else (0, 50, 200)
    n = 1 if quick else 3
    model = str(build_model(work / "model-8k", **{**DEMO_SPEC, "max_position_embeddings": 9216}))
    rng = random.Random(18)

    def toks(k: int) -> list[int]:
        return [rng.randrange(3, 2000) for _ in range(k)]

    measured = {length: [toks(length) for _ in range(n)] for length in lengths}
    warm_lengths = (500, 2000, 8000)

    def warm_compute() -> list[list[int]]:
        """Prompts no engine saw: computed (each engine stores its own, so each gets new ones)."""
        return [toks(k) for k in warm_lengths]

    warm_load = [toks(4096) for _ in range(2)]
    order = [(length, i) for i in range(n) for length in lengths]  # lengths interleaved
    prompts = [measured[length][i] for length, i in order]

    def spec(kv: dict[str, Any] | None, prompt_list: list[list[int]]) -> dict[str, Any]:
        return {
            "model": model,
            "engine_args": _engine_args(MAX_MODEL_LEN),
            "kv_transfer_config": kv,
            "prompts": prompt_list,
            "max_tokens": MAX_TOKENS,
        }

    runs: dict[tuple[int, str], dict[str, Any]] = {}
    server = LoopbackS3().start()
    try:
        server.create_bucket(BUCKET)
        with LatencyProxy(server.endpoint_url) as proxy:
            writer = run_replica(
                work, "policy-writer", spec(_s3kv(proxy.endpoint_url, "always"), [*warm_load, *prompts])
            )
            base = run_replica(work, "policy-recompute", spec(None, [*warm_compute(), *prompts]))
            for delay in delays_ms:
                proxy.delay_s = delay / 1000
                for policy in ("always", "cost"):
                    runs[(delay, policy)] = run_replica(
                        work,
                        f"policy-{policy}-{delay}ms",
                        spec(_s3kv(proxy.endpoint_url, policy), [*warm_compute(), *warm_load, *prompts]),
                    )
    finally:
        server.stop()
    shutil.rmtree(work / "model-8k", ignore_errors=True)

    skip_base, skip = len(warm_lengths), len(warm_lengths) + len(warm_load)

    def by_length(result: dict[str, Any], key: str, offset: int) -> dict[int, list[Any]]:
        out: dict[int, list[Any]] = {}
        for (length, _), value in zip(order, result[key][offset:]):
            out.setdefault(length, []).append(value)
        return out

    base_ttft = by_length(base, "ttft_s", skip_base)
    base_out = by_length(base, "outputs", skip_base)
    writer_out = by_length(writer, "outputs", len(warm_load))
    rows: list[list[Any]] = []
    bars: list[Bar] = []
    misses: list[str] = []
    wrong: list[str] = []
    worst = 0.0
    for delay in delays_ms:
        always, cost = runs[(delay, "always")], runs[(delay, "cost")]
        a_ttft, c_ttft = by_length(always, "ttft_s", skip), by_length(cost, "ttft_s", skip)
        c_cached = by_length(cost, "num_cached_tokens", skip)
        for name, r in (("always", always), ("cost", cost)):
            for length, outs in by_length(r, "outputs", skip).items():
                if outs != base_out[length] and outs != writer_out[length]:
                    wrong.append(f"{name} at {delay} ms, {length} tokens")
        for length in lengths:
            rec, alw, cst = median(base_ttft[length]), median(a_ttft[length]), median(c_ttft[length])
            better = min(rec, alw)
            ratio = cst / better
            worst = max(worst, ratio)
            loaded = sorted(c_cached[length])
            decision = "loaded" if min(loaded) > 0 else "computed" if max(loaded) == 0 else "mixed"
            if ratio > GOAL_RATIO:
                misses.append(f"{length} tokens at {delay} ms: cost {ratio:.2f}x the better ({decision})")
            rows.append(
                [
                    delay,
                    length,
                    round(rec * 1000, 1),
                    round(alw * 1000, 1),
                    round(cst * 1000, 1),
                    decision,
                    round(ratio, 3),
                    f"<= {GOAL_RATIO}x",
                ]
            )
            bars.append(Bar(f"{delay}ms/{length}", round(ratio, 3)))
    misses += [f"outputs differ from vLLM's: {w}" for w in wrong]
    for (delay, policy), r in runs.items():  # a warm-up that hit would time no prefill
        if any(r["num_cached_tokens"][: len(warm_lengths)]):
            misses.insert(0, f"invalid: the {policy} engine at {delay} ms hit a warm-up prompt")
    cost_metrics = {delay: runs[(delay, "cost")]["metrics"] for delay in delays_ms}
    estimates = "; ".join(
        f"{delay} ms: S3 first chunk {m.get('vllm:s3kv_cost_first_chunk_seconds_s3', 0) * 1000:.0f} ms, "
        f"{m.get('vllm:s3kv_cost_bandwidth_bytes_per_second_s3', 0) / 1e6:.0f} MB/s after it, round trip "
        f"{m.get('vllm:s3kv_cost_round_trip_seconds', 0) * 1000:.0f} ms, prefill "
        f"{m.get('vllm:s3kv_cost_prefill_tokens_per_second_8192', 0):.0f} tokens/s at 8k; declined "
        f"{m.get('vllm:s3kv_load_policy_tokens_declined', 0):.0f} tokens"
        for delay, m in cost_metrics.items()
    )
    notes = [
        f"Prompt lengths {', '.join(map(str, lengths))} tokens, {n} distinct prompt(s) each (the median is shown), "
        "interleaved by length; TTFT is vLLM's first_token_latency. Every prompt is in the bucket; the "
        "reading engines have no CPU or NVMe tier and vLLM's prefix cache off, so each request either loads "
        "its whole prefix from S3 (all full chunks; vLLM computes the last token) or computes it.",
        "S3 is moto on loopback behind a proxy that holds each object GET's first byte back by the delay "
        "(listings and PUTs pass at once). Each delay's two engines (always, cost) run one after the "
        "other with the same warm-up: 3 prompts computed (500, 2000, 8000 tokens) and 2 of 4096 tokens "
        "loaded (cost loads them: 16 chunks take far less than their compute at any delay here).",
        "'decision': what the cost engine did with the prompt's hit (loaded in every repeat, computed in "
        "every repeat, or mixed). 'cost / better': the cost policy's TTFT over the lower of always and "
        "recompute at that length and delay.",
        f"The cost model's estimates at the end of each cost engine's run: {estimates}.",
        f"Model: the demo's random Llama, max_model_len {MAX_MODEL_LEN}, the whole prompt in one step, "
        f"chunk_tokens {CHUNK_TOKENS}. Nine engines start (~30 s each here).",
    ]
    return Result(
        name=NAME,
        title=TITLE,
        goal=GOAL,
        columns=[
            "S3 delay ms",
            "prompt tokens",
            "recompute ms",
            "always ms",
            "cost ms",
            "cost's decision",
            "cost / better",
            "goal",
        ],
        rows=rows,
        verdict=verdict(not misses, "; ".join(misses)) + f" (worst {worst:.3f}x)",
        notes=notes,
        bars=bars,
        ylabel="cost TTFT / better of always and recompute",
        goal_line=GOAL_RATIO,
        seconds=round(time.perf_counter() - started, 1),
    )


if __name__ == "__main__":
    sys.exit(main_for(run, "s3kv-bench-load-policy"))
