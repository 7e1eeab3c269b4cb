"""TTFT by prompt length behind an S3 that answers late: the cost policy
against always loading and against recomputing, side by side in one engine.

Every measured prompt is in the bucket (a writer engine computed and
stored it). For each S3 delay, one engine reads through a loopback proxy
that holds the first byte of every object GET back by 0, 50 or 200 ms, as
a distant bucket would (:class:`s3kv.testing.latency_proxy.LatencyProxy`). It
has no CPU or NVMe tier and vLLM's prefix cache off, so each request
either loads its prefix from S3 again or computes it, and it runs each
prompt three ways, interleaved (the order turns with each repeat):

- ``recompute``: vLLM's ``skip_reading_prefix_cache`` (nothing is loaded);
- ``always``: ``kv_transfer_params: {"s3kv_load_policy": "always"}``;
- ``cost``: the replica's default, ``load_policy: cost``.

One engine for all three takes the drift between engine processes (20%
here) out of the comparison; the cost model learns from the other two's
requests as it would from any traffic. Before the measured prompts the
engine computes six warm-up prompts and loads two 4k-token ones. The
goal (issue 18): at every length and delay, the cost policy's TTFT is
within 10% of the better of the other two.
"""

from __future__ import annotations

import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Bar, Result, main_for, median, run_replica, s3kv_transfer_config, verdict
from benchmarks.ttft import _engine_args

NAME = "load_policy"
TITLE = "TTFT by prompt length behind a slow S3: the cost policy vs always loading vs recomputing"
GOAL = "cost TTFT <= 1.1x min(always, recompute) at every prompt length and S3 delay"
BUCKET = "bench-policy"
CHUNK_TOKENS = 256
MAX_TOKENS = 2
"""The second token is a decode step: the cost model times a step's fixed cost from those."""
GOAL_RATIO = 1.1
NEAR_TIE = 0.25
"""Nats between the writer's two likeliest tokens under which a loaded
prompt may take the second: vLLM alone, computing a prompt in one step or
as 4,095 + 1 tokens (the split a whole-prompt load leaves), moves this
random bf16 model's logprobs by up to ~0.2 (ANALYSIS.md, issue 18.1)."""
MAX_MODEL_LEN = 8448
WAYS = ("recompute", "always", "cost")


def _s3kv(endpoint: str) -> dict[str, Any]:
    return s3kv_transfer_config(endpoint, BUCKET, CHUNK_TOKENS, load_policy="cost")


def tie_flip(out: list[int], expect: list[int], top: list[list[list[float]]]) -> bool:
    """Does ``out`` part from ``expect`` (the writer's tokens) where the
    writer's two likeliest tokens were within :data:`NEAR_TIE` nats of each
    other (``top``: the writer's logprobs, likeliest first), by taking the
    second? A prompt computed in other steps than the writer's (a load
    leaves its last token to compute) may, at such a near-tie; wrong KV
    would not pick that very token."""
    k = next((i for i, (a, b) in enumerate(zip(out, expect)) if a != b), None)
    if k is None or k >= len(top) or len(top[k]) < 2:
        return False
    (first, lp1), (second, lp2) = top[k][:2]  # an exact tie may come in either order
    return {int(first), int(second)} == {expect[k], out[k]} and lp1 - lp2 <= NEAR_TIE


def _request(prompt: list[int], way: str) -> Any:
    if way == "recompute":
        return {"prompt": prompt, "skip_reading_prefix_cache": True}
    if way == "always":
        return {"prompt": prompt, "kv_transfer_params": {"s3kv_load_policy": "always"}}
    return prompt


def run(work: Path, quick: bool) -> Result:
    from s3kv.demo.model import DEMO_SPEC, build_model
    from s3kv.testing.latency_proxy import LatencyProxy
    from s3kv.testing.loopback_s3 import LoopbackS3

    started = time.perf_counter()
    lengths = (256, 1024, 4096) if quick else (256, 512, 1024, 2048, 4096, 8192)
    delays_ms = (0, 200) if quick else (0, 50, 200)
    n = 1 if quick else 5
    model = str(build_model(work / "model-8k", **{**DEMO_SPEC, "max_position_embeddings": 9216}))
    rng = random.Random(18)

    def toks(k: int) -> list[int]:
        return [rng.randrange(3, 2000) for _ in range(k)]

    measured = {length: [toks(length) for _ in range(n)] for length in lengths}
    warm_lengths = (500, 500, 500, 2000, 2000, 8000)  # the first forward of an engine is slow: medians
    warm_load = [toks(4096) for _ in range(2)]
    order: list[tuple[int, int, str]] = []  # (length, repeat, way)
    for i in range(n):
        for length in lengths:
            turn = (i + lengths.index(length)) % len(WAYS)
            order += [(length, i, way) for way in WAYS[turn:] + WAYS[:turn]]

    def spec(prompts: list[Any]) -> dict[str, Any]:
        return {
            "model": model,
            "engine_args": _engine_args(MAX_MODEL_LEN),
            "kv_transfer_config": _s3kv(proxy.endpoint_url),
            "prompts": prompts,
            "max_tokens": MAX_TOKENS,
            "logprobs": 2,
        }

    stored = [measured[length][i] for length in lengths for i in range(n)]
    runs: dict[int, dict[str, Any]] = {}
    server = LoopbackS3().start()
    try:
        server.create_bucket(BUCKET)
        with LatencyProxy(server.endpoint_url) as proxy:
            writer = run_replica(work, "policy-writer", spec([*warm_load, *stored]))
            for delay in delays_ms:
                proxy.delay_s = delay / 1000
                warm = [toks(k) for k in warm_lengths]  # new to this engine: computed
                prompts = [_request(measured[length][i], way) for length, i, way in order]
                runs[delay] = run_replica(work, f"policy-{delay}ms", spec([*warm, *warm_load, *prompts]))
    finally:
        server.stop()
    shutil.rmtree(work / "model-8k", ignore_errors=True)

    skip = len(warm_lengths) + len(warm_load)
    written = dict(zip(map(tuple, stored), writer["outputs"][len(warm_load) :]))
    tops = dict(zip(map(tuple, stored), writer["logprobs"][len(warm_load) :]))
    flips: list[str] = []
    rows: list[list[Any]] = []
    bars: list[Bar] = []
    misses: list[str] = []
    worst = 0.0
    right = 0
    estimates = []
    for delay in delays_ms:
        r = runs[delay]
        if any(r["num_cached_tokens"][: len(warm_lengths)]):
            misses.append(f"invalid: the engine at {delay} ms hit a warm-up prompt")
        cell: dict[tuple[int, str], list[float]] = {}
        cached: dict[tuple[int, str], list[int]] = {}
        for (length, i, way), ttft, got, out in zip(
            order, r["ttft_s"][skip:], r["num_cached_tokens"][skip:], r["outputs"][skip:]
        ):
            cell.setdefault((length, way), []).append(ttft)
            cached.setdefault((length, way), []).append(got)
            key = tuple(measured[length][i])
            if out != written[key]:
                if tie_flip(out, written[key], tops[key]):
                    flips.append(f"{way} at {delay} ms, {length} tokens, prompt {i}")
                else:
                    misses.append(f"{way} at {delay} ms, {length} tokens: outputs differ from the writer's")
        for length in lengths:
            rec, alw, cst = (median(cell[(length, w)]) for w in WAYS)
            better = min(rec, alw)
            ratio = cst / better
            worst = max(worst, ratio)
            loads = cached[(length, "cost")]
            decision = "loaded" if min(loads) > 0 else "computed" if max(loads) == 0 else "mixed"
            faster = "load" if alw < rec else "compute"
            close = max(alw, rec) <= GOAL_RATIO * better  # either would do
            right += decision == ("loaded" if faster == "load" else "computed") or close
            if ratio > GOAL_RATIO:
                misses.append(f"{length} tokens at {delay} ms: cost {ratio:.2f}x the better ({decision})")
            rows.append(
                [
                    delay,
                    length,
                    round(rec * 1000, 1),
                    round(alw * 1000, 1),
                    round(cst * 1000, 1),
                    faster,
                    decision,
                    round(ratio, 3),
                    f"<= {GOAL_RATIO}x",
                ]
            )
            bars.append(Bar(f"{delay}ms/{length}", round(ratio, 3)))
        m = r["metrics"]
        rates = ", ".join(
            f"{b}: {m[k]:.0f}"
            for b in ("512", "1024", "2048", "4096", "8192")
            if (k := f"vllm:s3kv_cost_prefill_tokens_per_second_{b}") in m
        )
        estimates.append(
            f"{delay} ms: S3 first chunk {m.get('vllm:s3kv_cost_first_chunk_seconds_s3', 0) * 1000:.0f} ms, "
            f"{m.get('vllm:s3kv_cost_bandwidth_bytes_per_second_s3', 0) / 1e6:.0f} MB/s after it, round trip "
            f"{m.get('vllm:s3kv_cost_round_trip_seconds', 0) * 1000:.0f} ms, a step's fixed cost "
            f"{m.get('vllm:s3kv_cost_step_seconds', 0) * 1000:.0f} ms, prefill tokens/s by context ({rates}); "
            f"declined {m.get('vllm:s3kv_load_policy_tokens_declined', 0):.0f} tokens"
        )
    notes = [
        f"Prompt lengths {', '.join(map(str, lengths))} tokens, {n} distinct prompt(s) each, every one run "
        "three ways in the same engine (recompute: vLLM's skip_reading_prefix_cache; always: the request's "
        'kv_transfer_params {"s3kv_load_policy": "always"}; cost: the default), interleaved, the order '
        "turning with each repeat; each cell is the median. TTFT is vLLM's first_token_latency. The engine "
        "has no CPU or NVMe tier and vLLM's prefix cache off: each request loads its whole prefix from S3 "
        "(every full chunk; vLLM computes the last token) or computes it.",
        "S3 is moto on loopback behind a proxy that holds each object GET's first byte back by the delay "
        "(listings and PUTs pass at once). Each delay has an engine of its own; before the measured "
        f"prompts it computes {len(warm_lengths)} new prompts ({', '.join(map(str, warm_lengths))} tokens) "
        "and loads 2 of 4096 tokens.",
        "'faster': which of always and recompute had the lower median; 'cost's decision': what the cost "
        "engine did with the hit (loaded in every repeat, computed in every repeat, or mixed); 'cost / "
        "better': its TTFT over the lower of the other two. Where cost chose what always did, the two "
        "requests did the same work, and their ratio shows only the engine's noise between requests.",
        "The cost model's estimates at the end of each engine's run: " + "; ".join(estimates) + ".",
        f"Model: the demo's random Llama, max_model_len {MAX_MODEL_LEN}, the whole prompt in one step, "
        f"chunk_tokens {CHUNK_TOKENS}, {MAX_TOKENS} tokens generated.",
        "Outputs: every request's tokens equal the writer's (which computed the prompt in one step), "
        f"but where the writer's two likeliest tokens were within {NEAR_TIE} nats and the request took "
        "the second (a load leaves the last token to compute, and vLLM alone computing 4,095 + 1 tokens "
        "moves this model's logprobs as much): "
        + (", ".join(flips) if flips else "none")
        + ". Any other difference fails the run.",
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
            "faster",
            "cost's decision",
            "cost / better",
            "goal",
        ],
        rows=rows,
        verdict=verdict(not misses, "; ".join(misses))
        + f" (worst {worst:.3f}x; the faster option chosen in {right} of {len(rows)} cells)",
        notes=notes,
        bars=bars,
        ylabel="cost TTFT / better of always and recompute",
        goal_line=GOAL_RATIO,
        seconds=round(time.perf_counter() - started, 1),
    )


if __name__ == "__main__":
    sys.exit(main_for(run, "s3kv-bench-load-policy"))
