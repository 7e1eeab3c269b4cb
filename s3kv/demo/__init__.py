"""``s3kv demo``: two replicas share one prefix cache through S3.

Replica A serves a family of prompts that share a long prefix and stores
their KV chunks; a fresh replica B (a new engine process, cold) serves the
same prompts and loads those chunks instead of computing them. With no bucket
given, an S3-compatible server (moto) is started on loopback
(:mod:`s3kv.testing.loopback_s3`). Each replica is a run of the replica tool,
:mod:`s3kv.testing.replica`, through its :func:`~s3kv.testing.replica.run_replica`.
"""

from __future__ import annotations

import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

from s3kv.config import DEFAULTS
from s3kv.testing.loopback_s3 import LoopbackS3
from s3kv.testing.replica import run_replica, worker_total
from s3kv.units import format_size


@dataclass
class DemoOptions:
    model: str | None = None
    workdir: str = ".s3kv-demo"
    bucket: str | None = None
    endpoint_url: str | None = None
    region: str = "us-east-1"
    prefix: str = "s3kv-demo"
    prompts: int = 4
    shared_tokens: int = 1536
    unique_tokens: int = 128
    max_tokens: int = 16
    chunk_tokens: int = DEFAULTS.chunk_tokens


def _prompts(o: DemoOptions) -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, 2000) for _ in range(o.shared_tokens)]
    return [shared + [rng.randrange(3, 2000) for _ in range(o.unique_tokens)] for _ in range(o.prompts)]


def run_demo(o: DemoOptions) -> int:
    workdir = Path(o.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    server = None
    if o.bucket is None:
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "demo")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "demo")
        server = LoopbackS3(region=o.region).start()
        o.endpoint_url = server.endpoint_url
        o.bucket = server.create_bucket("s3kv-demo")
        print(f"S3: a loopback S3 server at {o.endpoint_url}, bucket {o.bucket}")
    else:
        print(f"S3: bucket {o.bucket} ({o.endpoint_url or 'AWS'}), prefix {o.prefix}")
    try:
        model = o.model
        if model is None:
            from s3kv.demo.model import DEMO_SPEC, build_model

            model = str(build_model(workdir / "model", **DEMO_SPEC))
            print(f"Model: a random-weights Llama built at {model} (no model hub needed)")
        else:
            print(f"Model: {model}")
        kv = {
            "kv_connector": "S3KVConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "bucket": o.bucket,
                "prefix": o.prefix,
                "region": o.region,
                "chunk_tokens": o.chunk_tokens,
                **({"endpoint_url": o.endpoint_url} if o.endpoint_url else {}),
            },
        }
        prompts = _prompts(o)
        spec = {
            "model": model,
            "engine_args": {"gpu_memory_utilization": 0.15, "max_model_len": 4096, "enforce_eager": True},
            "kv_transfer_config": kv,
            "prompts": prompts,
            "max_tokens": o.max_tokens,
        }
        print(
            f"Workload: {len(prompts)} prompts of {len(prompts[0])} tokens sharing a "
            f"{o.shared_tokens}-token prefix, {o.max_tokens} greedy tokens each\n"
        )
        # A first computes the shared prefix alone (whole chunks: its cold
        # cost, and what it stores), then every prompt on top of it through
        # vLLM's own prefix cache. B loads that prefix from S3 and computes
        # the same suffixes: the same arithmetic, so the tokens must be equal.
        # (Computing a whole prompt in one prefill instead sums in another
        # order, which can flip a near-tied greedy token of a random model.)
        warm = prompts[0][: o.shared_tokens // o.chunk_tokens * o.chunk_tokens]
        a = run_replica(workdir, "replica-A", {**spec, "prompts": [warm, *prompts]} if warm else spec)
        b = run_replica(workdir, "replica-B", spec)
        if warm:
            a = {**a, "outputs": a["outputs"][1:]}
        print()
        rows = [("replica", "prompts", "hit tokens", "stored", "loaded", "TTFT 1st", "TTFT median")]
        for name, r in (("A (cold, computes)", a), ("B (fresh, loads)", b)):
            ttft = sorted(r["ttft_s"])
            rows.append(
                (
                    name,
                    (f"1+{len(r['outputs'])}" if r is a and warm else str(len(r["outputs"]))),
                    str(int(r["metrics"].get("vllm:s3kv_hit_tokens", 0))),
                    format_size(worker_total(r, "store_bytes_s3")),
                    format_size(worker_total(r, "load_bytes_s3")),
                    f"{r['ttft_s'][0] * 1000:.0f} ms",
                    f"{ttft[len(ttft) // 2] * 1000:.0f} ms",
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
        same = a["outputs"] == b["outputs"]
        if warm:
            print(
                f"\n(A's first request is the {len(warm)}-token shared prefix alone: its TTFT is the cold cost.)"
            )
        print(f"\nB's outputs equal A's: {'yes' if same else 'NO'}")
        return 0 if same else 1
    finally:
        if server is not None:
            server.stop()


def default_workdir() -> str:
    return os.environ.get("S3KV_DEMO_DIR", os.path.join(tempfile.gettempdir(), "s3kv-demo"))
