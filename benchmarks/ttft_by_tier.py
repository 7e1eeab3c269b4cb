"""TTFT of one long prompt: computed, versus loaded from each s3kv tier.

    .venv/bin/python benchmarks/ttft_by_tier.py [--tokens 1664] [--repeats 3]

Runs the demo's random-weights Llama (1024 wide, 8 layers) on vLLM's CPU
build against a loopback S3 server, as separate engine processes:

- ``compute``: a fresh engine, empty tiers (the prompt is computed and stored);
- ``cpu``: the same engine, the same prompt again (vLLM's own prefix cache is
  off, so the hit is s3kv's CPU tier, a synchronous layer-by-layer load);
- ``disk``: a restarted engine on the same ``disk_path``, no CPU tier;
- ``s3``: a restarted engine with an empty disk and no CPU tier.

Each figure is the median of ``--repeats`` prompts (distinct prompts of the
same length, so every one misses in ``compute``); ratios are to ``compute``
in the same run. Random weights make KV compress worse than real models do.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s3kv.demo import LoopbackS3, _run_replica  # noqa: E402
from s3kv.demo.model import DEMO_SPEC, build_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1664)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "s3kv-bench-tiers"))
    args = ap.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model = str(build_model(work / "model", **DEMO_SPEC))
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 2000) for _ in range(args.tokens)] for _ in range(args.repeats)]
    server = LoopbackS3()
    try:
        import boto3

        boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1").create_bucket(
            Bucket="bench"
        )
        disk = work / "disk"
        shutil.rmtree(disk, ignore_errors=True)

        def spec(prompt_list, **extra):
            kv = {
                "kv_connector": "S3KVConnector",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {
                    "bucket": "bench",
                    "endpoint_url": server.endpoint_url,
                    "region": "us-east-1",
                    "chunk_tokens": 256,
                    **extra,
                },
            }
            return {
                "model": model,
                "engine_args": {
                    "gpu_memory_utilization": 0.15,
                    "max_model_len": 4096,
                    "enforce_eager": True,
                    "enable_prefix_caching": False,
                },
                "kv_transfer_config": kv,
                "prompts": prompt_list,
                "max_tokens": 1,
            }

        n = len(prompts)
        a = _run_replica(
            work, "bench-compute", spec(prompts + prompts, cpu_bytes="2GiB", disk_path=str(disk))
        )
        b = _run_replica(work, "bench-disk", spec(prompts, disk_path=str(disk)))
        c = _run_replica(work, "bench-s3", spec(prompts, disk_path=str(work / "empty-disk")))
        shutil.rmtree(work / "empty-disk", ignore_errors=True)
    finally:
        server.stop()
    runs = {
        "compute": (a["ttft_s"][:n], a["num_cached_tokens"][:n]),
        "cpu": (a["ttft_s"][n:], a["num_cached_tokens"][n:]),
        "disk": (b["ttft_s"], b["num_cached_tokens"]),
        "s3": (c["ttft_s"], c["num_cached_tokens"]),
    }
    base = statistics.median(runs["compute"][0])
    out = {}
    print(f"{args.tokens}-token prompt, median of {n}; ratio to compute in the same run")
    for name, (ttft, cached) in runs.items():
        med = statistics.median(ttft)
        out[name] = {"ttft_ms": round(med * 1000, 1), "ratio": round(med / base, 3), "cached_tokens": cached}
        print(f"  {name:8s} {med * 1000:8.1f} ms  {med / base:6.3f}x  cached {cached}")
    (work / "ttft_by_tier.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
