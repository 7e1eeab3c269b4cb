"""Codec choice: what ``codec: auto`` picks per link, and the load time of
each codec on that link, side by side.

Two links to one moto server: loopback (the server on this machine, sharing
its cores with the client) and the same server behind
:class:`~s3kv.testing.latency_proxy.LatencyProxy` capped at ``--mbps`` MB/s
each way (a distant bucket's link). On each, three transfer engines store
the same chunks through the link with ``codec`` none, blosc2 (level 1) and
auto. The auto engine first stores a set of its own and loads it
:data:`LEARN_LOADS` times (its transfers are what it measures; its first
store calibrates the decode on its own chunk); then it stores the timed set
in the codec it picked. The three engines' loads of their timed sets are
then timed in alternating order, every load checked into the KV pages once.

Chunks are load_path's: 256 tokens of the demo model's KV (8 layers, 2 MiB
a chunk), random normal bf16 values, which blosc2 stores at ~1.45x.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import Bar, Result, main_for, median, start_server, verdict
from benchmarks.load_path import BLOCKS_PER_CHUNK, CHUNK_TOKENS, LAYERS, kv_pages, make_engine

NAME = "codec_choice"
TITLE = "Codec choice: what codec auto picks per link, and each codec's load time there"
GOAL = (
    "codec auto's loads within 10% of the faster fixed codec's on each link (none where the link is "
    "faster than the decode, compression where it is slower)"
)
BUCKET = "bench"
LEARN_LOADS = 4
IDLE_S = 0.2
"""The link idle between auto's learning loads (its baseline of the machine's CPU is measured then)."""
POLL_S = 0.001


def _poll_until(engine: Any, done: Any, what: str, timeout_s: float = 300.0) -> Any:
    deadline = time.monotonic() + timeout_s
    acc: dict[str, Any] = {"written": set(), "failed": set(), "loads": {}}
    while True:
        r = engine.poll()
        acc["written"] |= {k for (t, k) in r.report.written}
        acc["failed"] |= {k for (t, k) in r.report.failed}
        acc["loads"].update(r.finished_loads)
        if done(acc):
            return acc
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out: {what}")
        time.sleep(POLL_S)


def _store(engine: Any, chunks: list[tuple[bytes, list[np.ndarray]]]) -> None:
    from s3kv.tiering.placement import Tier
    from s3kv.tiering.plan import Place
    from s3kv.tiering.worker.stores import StoreJob

    keys = {k for k, _ in chunks}
    for key, layers in chunks:
        engine.submit_store(StoreJob(key, layers, (Place(Tier.S3),)))
    acc = _poll_until(engine, lambda a: keys <= a["written"] | a["failed"], "stores")
    if acc["failed"] & keys:
        raise RuntimeError(f"{len(acc['failed'] & keys)} stores failed")


def _load(engine: Any, loads: list[Any], into: Any, job: str) -> float:
    t0 = time.perf_counter()
    engine.submit_load(job, loads, into)
    acc = _poll_until(engine, lambda a: job in a["loads"], f"load {job}")
    took = time.perf_counter() - t0
    if acc["loads"][job]:
        raise RuntimeError(f"{len(acc['loads'][job])} chunks failed to load ({job})")
    return took


def run(work: Path, quick: bool, mbps: float = 100.0) -> Result:
    import torch

    from s3kv.config import S3KVConfig
    from s3kv.keys import Namespace
    from s3kv.testing.latency_proxy import LatencyProxy
    from s3kv.tiering.placement import Tier
    from s3kv.tiering.plan import LoadChunk, Place

    n_chunks = 16 if quick else 32
    repeats = 3 if quick else 7
    namespace = Namespace.from_fields({"bench": NAME}).id
    num_blocks = 2 * n_chunks * BLOCKS_PER_CHUNK + 3
    gen = torch.Generator().manual_seed(1)
    target, pages, fmt = kv_pages(num_blocks)
    into = pages.load_pages(None)
    raw_chunk = fmt.layer_bytes * LAYERS
    rng = np.random.default_rng(2)

    def chunk_set(n: int) -> list[tuple[bytes, list[np.ndarray]]]:
        out = []
        for _ in range(n):
            layers = []
            for _ in range(LAYERS):
                bf16 = torch.randn(fmt.layer_bytes // 2, generator=gen).to(torch.bfloat16)
                layers.append(bf16.view(torch.uint8).numpy().copy())
            out.append((rng.bytes(16), layers))
        return out

    def loads_of(chunks: list[tuple[bytes, list[np.ndarray]]]) -> list[Any]:
        ids = list(range(num_blocks))
        return [
            LoadChunk(
                key,
                tuple(ids[i * BLOCKS_PER_CHUNK : (i + 1) * BLOCKS_PER_CHUNK]),
                0,
                BLOCKS_PER_CHUNK,
                (Place(Tier.S3),),
            )
            for i, (key, _) in enumerate(chunks)
        ]

    def check(chunks: list[tuple[bytes, list[np.ndarray]]], what: str) -> None:
        for i, (_key, layers) in enumerate(chunks):
            for layer, want in enumerate(layers):
                got = target[layer][i * BLOCKS_PER_CHUNK : (i + 1) * BLOCKS_PER_CHUNK].contiguous()
                if not np.array_equal(got.view(torch.uint8).reshape(-1).numpy(), want):
                    raise AssertionError(f"{what}: chunk {i} layer {layer} is not in the pages")
        for t in target:
            t.zero_()

    timed_set = chunk_set(n_chunks)
    learn_set = chunk_set(n_chunks)

    load_before = os.getloadavg()[0]
    server, creds, _pids = start_server("moto", work)
    os.environ.update(creds)
    rows: list[list[Any]] = []
    bars: list[Bar] = []
    picks: dict[str, tuple[str, str]] = {}
    judged: list[tuple[str, float]] = []
    try:
        server.create_bucket(BUCKET)
        proxy = LatencyProxy(server.endpoint_url, bytes_per_s=mbps * 1e6).start()
        links = (
            ("loopback moto", server.endpoint_url),
            (f"proxy capped at {mbps:.0f} MB/s", proxy.endpoint_url),
        )
        try:
            for li, (link, endpoint) in enumerate(links):
                config = S3KVConfig(bucket=BUCKET, endpoint_url=endpoint, region="us-east-1")
                engines: dict[str, Any] = {}
                for codec in ("none", "blosc2", "auto"):
                    engines[codec] = make_engine(config, namespace, f"bench-{li}-{codec}", codec, fmt)
                auto = engines["auto"]
                choice = auto.codec_choices[Tier.S3]
                # auto learns from its own stores and loads, then stores the timed set in its pick.
                _store(auto, learn_set)
                for r in range(LEARN_LOADS):
                    time.sleep(IDLE_S)  # the link idle, as between requests: the machine's baseline
                    _load(auto, loads_of(learn_set), into, f"learn-{li}-{r}")
                    check(learn_set, f"{link}: auto's learning load")
                picked = choice.codec
                est = choice.estimate()
                picks[link] = (picked, est.explain() if est is not None else "no estimate yet")
                print(f"  {link}: auto picked {picked}: {picks[link][1]}")
                for codec in ("none", "blosc2", "auto"):
                    _store(engines[codec], timed_set)
                times: dict[str, list[float]] = {c: [] for c in engines}
                for codec in engines:  # warm-up and check
                    _load(engines[codec], loads_of(timed_set), into, f"warm-{li}-{codec}")
                    check(timed_set, f"{link}: {codec}")
                for r in range(repeats):
                    order = list(engines) if r % 2 == 0 else list(reversed(engines))
                    for codec in order:
                        times[codec].append(
                            _load(engines[codec], loads_of(timed_set), into, f"{li}-{codec}-{r}")
                        )
                        for t in target:
                            t.zero_()
                raw_mb = n_chunks * raw_chunk / 1e6
                med = {c: median(v) for c, v in times.items()}
                best_fixed = min(("none", "blosc2"), key=med.__getitem__)
                ratio = med[best_fixed] / med["auto"]
                judged.append((link, ratio))
                rows.append(
                    [
                        link,
                        round(med["none"] * 1000, 1),
                        round(med["blosc2"] * 1000, 1),
                        picked,
                        "none" if choice.switches == 0 else f"{choice.switches}, now {choice.codec}",
                        round(med["auto"] * 1000, 1),
                        round(raw_mb / med["auto"]),
                        best_fixed,
                        round(ratio, 3),
                    ]
                )
                for c in engines:
                    bars.append(Bar(f"{link}: {c}", round(raw_mb / med[c])))
                print("  " + " | ".join(str(x) for x in rows[-1]))
                for e in engines.values():
                    e.close(5)
        finally:
            proxy.stop()
    finally:
        server.stop()

    load_after = os.getloadavg()[0]
    met = all(r >= 0.9 for _l, r in judged)
    miss = "; ".join(f"{link}: auto {r:.2f}x the faster fixed codec" for link, r in judged)
    miss += "; picks: " + ", ".join(f"{link} {p[0]}" for link, p in picks.items())
    notes = [
        f"Load average {load_before:.1f} before the run, {load_after:.1f} after it ({os.cpu_count()} cores): what "
        "else the machine runs moves the loopback link between CPU-bound (its transfers add most of the "
        "cores: the rule compares CPU, none wins) and a machine busy without it (the rule sees the wire).",
        f"{n_chunks} chunks of {CHUNK_TOKENS} tokens per load ({n_chunks * raw_chunk / 1e6:.0f} MB of KV), one "
        "job, all chunks at once, into a host KV cache through the worker's sink (PageIO.load_pages); "
        f"medians of {repeats} loads per codec, run in alternating order after a warm-up and a check.",
        f"auto learned from storing {n_chunks} chunks and loading them {LEARN_LOADS} times through the same link; "
        "what it measured and why it picked: "
        + "; ".join(f"{link}: {p[0]}, {p[1]}" for link, p in picks.items()),
        "On loopback the server (moto, a Python process) runs on the same cores as the client: on a quiet "
        "machine its transfers add most of the cores (>= 60% over the baseline of the link's idle gaps), the "
        "link is CPU-bound and the rule compares CPU alone; a remote bucket's server costs this machine nothing.",
        "The proxy runs in this benchmark's process: its CPU counts as the link's client CPU per byte.",
    ]
    return Result(
        name=NAME,
        title=TITLE,
        goal=GOAL,
        columns=[
            "link",
            "none ms",
            "blosc2 ms",
            "auto picked",
            "auto's switches (to the end)",
            "auto ms",
            "auto KV MB/s",
            "faster fixed codec",
            "auto vs faster (time ratio)",
        ],
        rows=rows,
        verdict=verdict(met, miss),
        notes=notes,
        bars=bars,
        ylabel="KV MB/s loaded",
    )


if __name__ == "__main__":
    mbps = 100.0
    if "--mbps" in sys.argv:
        i = sys.argv.index("--mbps")
        mbps = float(sys.argv[i + 1])
        del sys.argv[i : i + 2]
    sys.exit(main_for(lambda work, quick: run(work, quick, mbps), "s3kv-bench-codec_choice"))
