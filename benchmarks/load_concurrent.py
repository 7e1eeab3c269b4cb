"""Loads under concurrency: 8 and 32 requests loading at once, s3kv against a
plain client moving the same bytes from the same place, interleaved.

Each request is a prefix of several chunks (8 of 256 tokens; 2 in a quick
run). All the requests of a level are submitted at once:

- s3kv: one :meth:`~s3kv.tiering.worker.transfer.TransferEngine.submit_load`
  per request (a job each, as the connector submits a request's load), the
  engine's default settings and the worker's pages
  (:meth:`s3kv.connector.pages.PageIO.load_pages`), polled every
  millisecond until every job is reported;
- plain S3: one obstore ``S3Store`` (the faster plain client in
  :mod:`benchmarks.load_path`), every chunk's ranged GETs at once behind the
  same connection limit as s3kv's store, each body copied into the
  tensor's blocks; no header, no decode, no checksum of its own;
- plain disk: one ``os.preadv`` per file straight into the tensor's blocks,
  in as many threads as s3kv's executor has (page cache, and cold: the
  files evicted before every run).

The default config: S3 objects in ``codec``, NVMe files in ``disk_codec``.
Figures: aggregate GB/s (object bytes of every request over the time from
the first submit until the last request is done) and the p99 of per-chunk
load time, from its request's submit until the chunk's pages are in place
(s3kv: the commit or write of the chunk's last layer into the pages, seen
by a thin wrapper around the worker's page sink; plain: the copy or
``preadv`` of its last byte). Pairs of runs alternate their order.

Built on :mod:`benchmarks.load_path`'s pieces (KV shape, scatter, obstore
range GET, page-cache eviction); ``--server radosgw`` runs the S3 rows
against Ceph's radosgw (:mod:`benchmarks.radosgw`) and skips the disk rows,
which do not touch the server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import Bar, Result, main_for, median, server_arg, start_server, verdict
from benchmarks.load_path import (
    BLOCKS_PER_CHUNK,
    BUCKET,
    CHUNK_RAW,
    CHUNK_TOKENS,
    LAYERS,
    POLL_S,
    Case,
    _drop_cached,
    _obstore_range,
    _scatter,
    expected_chunks,
    kv_pages,
    make_engine,
    obstore_client,
    preadv_chunk,
    store_case,
)

NAME = "load_concurrent"
TITLE = "Loads under concurrency: 8 and 32 requests at once, s3kv vs a plain client"
GOALS = {"S3": 0.9, "disk, page cache": 0.5, "disk, cold": 0.9}
"""s3kv / plain aggregate throughput, per tier: issue 31's S3 (0.9x) and
page-cache NVMe (0.5x) goals, issue 17's cold NVMe (0.9x)."""
GOAL = (
    "aggregate GB/s under 8 and 32 concurrent requests, default config: s3kv >= 0.9x plain on S3, "
    ">= 0.5x plain preadv from the page cache, >= 0.9x cold (issue 31's load goals; p99 per-chunk "
    "load reported beside the plain client's, no goal of its own)"
)
LEVELS = (8, 32)
"""Requests loading at once."""
COLUMNS = (
    "tier",
    "requests x chunks",
    "s3kv GB/s",
    "plain GB/s",
    "s3kv / plain",
    "s3kv per-chunk p50 / p99 ms",
    "plain per-chunk p50 / p99 ms",
    "p99 s3kv / plain",
    "CPU s/GB s3kv / plain",
    "goal",
)


# ---------------------------------------------------------------- pure parts


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of ``xs`` (0-100) by nearest rank: the
    smallest sample with at least ``q`` % of them at or below it (numpy's
    "inverted_cdf"), a sample itself, never an interpolation."""
    if not xs:
        raise ValueError("percentile of no samples")
    return float(np.percentile(np.asarray(xs, dtype=float), q, method="inverted_cdf"))


@dataclasses.dataclass
class Run:
    """One run of one side at one level: its wall time (first submit to the
    last request done) and each chunk's load time (its request's submit to
    the chunk's pages in place)."""

    wall_s: float
    chunk_s: list[float]
    cpu_s: float = 0.0
    """CPU seconds of this process (all its threads) during the run."""


@dataclasses.dataclass
class Summary:
    gbps: float
    """Median over runs of object bytes / wall time, in GB/s."""
    p50_ms: float
    p99_ms: float
    """Per-chunk load time, pooled over every chunk of every run."""
    cpu_s_per_gb: float
    """Median over runs of the process's CPU seconds per GB of object bytes."""


def summarize(runs: Sequence[Run], nbytes: int, chunks: int) -> Summary:
    """One side's figures over its runs; each run must time ``chunks`` chunks."""
    for r in runs:
        if len(r.chunk_s) != chunks:
            raise ValueError(f"a run timed {len(r.chunk_s)} chunks, not {chunks}")
    pooled = [x for r in runs for x in r.chunk_s]
    return Summary(
        gbps=median([nbytes / r.wall_s / 1e9 for r in runs]),
        p50_ms=percentile(pooled, 50) * 1000,
        p99_ms=percentile(pooled, 99) * 1000,
        cpu_s_per_gb=median([r.cpu_s for r in runs]) / (nbytes / 1e9),
    )


def pair_ratio(s3kv: Sequence[Run], plain: Sequence[Run]) -> float:
    """Median over pairs run back to back of plain's wall time over s3kv's
    (> 1: s3kv faster)."""
    if len(s3kv) != len(plain) or not s3kv:
        raise ValueError("pairs need as many s3kv runs as plain ones, at least one")
    return median([p.wall_s / s.wall_s for s, p in zip(s3kv, plain)])


def chunk_times(submitted: dict[bytes, float], done: dict[bytes, float]) -> list[float]:
    """Each chunk's load time: done less its request's submit (every
    submitted chunk must be done)."""
    missing = set(submitted) - set(done)
    if missing:
        raise RuntimeError(f"{len(missing)} chunks loaded without their pages being seen in place")
    return [done[k] - t for k, t in submitted.items()]


# ---------------------------------------------------------------- s3kv's side


class TimedPages:
    """The worker's page sink, noting when each chunk's last layer is in
    place: a frame written (:meth:`write`) or committed (a target's
    ``commit``) counts once, the ``layers``-th marks the chunk done.
    Everything else is the wrapped sink's."""

    def __init__(self, pages: Any, layers: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self._pages = pages
        self._layers = layers
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[bytes, int] = {}
        self.done: dict[bytes, float] = {}

    def reset(self) -> None:
        with self._lock:
            self._seen.clear()
            self.done = {}

    def _landed(self, key: bytes) -> None:
        now = self._clock()
        with self._lock:
            n = self._seen.get(key, 0) + 1
            self._seen[key] = n
            if n == self._layers:
                self.done[key] = now

    def write(self, chunk: Any, layer: int, data: np.ndarray) -> None:
        self._pages.write(chunk, layer, data)
        self._landed(chunk.key)

    def target(self, chunk: Any, layer: int) -> Any:
        t = self._pages.target(chunk, layer)
        if t is None:
            return None
        commit = t.commit

        def timed_commit() -> None:
            commit()
            self._landed(chunk.key)

        return dataclasses.replace(t, commit=timed_commit)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pages, name)


def _s3kv_run(engine: Any, requests: list[list[Any]], sink: TimedPages, tag: str) -> Run:
    sink.reset()
    submitted: dict[bytes, float] = {}
    jobs = set()
    t0 = time.perf_counter()
    for i, chunks in enumerate(requests):
        job = f"{tag}-{i}"
        at = time.perf_counter()
        engine.submit_load(job, chunks, sink)
        jobs.add(job)
        for c in chunks:
            submitted[c.key] = at
    while jobs:
        r = engine.poll()
        for job, failed in r.finished_loads.items():
            if failed:
                raise RuntimeError(f"s3kv: {len(failed)} chunks failed to load ({job})")
            jobs.discard(job)
        if jobs:
            time.sleep(POLL_S)
    wall = time.perf_counter() - t0
    return Run(wall, chunk_times(submitted, sink.done))


# ---------------------------------------------------------------- plain clients


async def _plain_s3(
    store: Any,
    requests: list[list[int]],
    case: Case,
    blocks: list[list[np.ndarray]],
    range_bytes: int,
    connections: int,
) -> Run:
    slots = asyncio.Semaphore(connections)
    submitted: dict[bytes, float] = {}
    done: dict[bytes, float] = {}

    async def chunk(i: int, at: float) -> None:
        key, size, frames = case.layout[i]
        ids = case.chunks[i].block_ids

        async def part(start: int) -> None:
            end = min(start + range_bytes, size)
            async with slots:
                data = await _obstore_range(store, key, start, end)
            for layer, (off, length) in enumerate(frames):
                lo, hi = max(off, start), min(off + length, end)
                if lo < hi:
                    _scatter(data, lo - start, hi - lo, [blocks[layer][b] for b in ids], lo - off)

        await asyncio.gather(*(part(s) for s in range(0, size, range_bytes)))
        done[case.chunks[i].key] = time.perf_counter()

    t0 = time.perf_counter()
    tasks = []
    for indices in requests:
        at = time.perf_counter()
        for i in indices:
            submitted[case.chunks[i].key] = at
            tasks.append(chunk(i, at))
    await asyncio.gather(*tasks)
    return Run(time.perf_counter() - t0, chunk_times(submitted, done))


def _plain_disk(
    requests: list[list[int]], case: Case, paths: list[str], blocks: list[list[np.ndarray]], pool: Any
) -> Run:
    submitted: dict[bytes, float] = {}
    done: dict[bytes, float] = {}

    def one(i: int) -> None:
        preadv_chunk(case, i, paths[i], blocks)
        done[case.chunks[i].key] = time.perf_counter()

    t0 = time.perf_counter()
    futures = []
    for indices in requests:
        at = time.perf_counter()
        for i in indices:
            submitted[case.chunks[i].key] = at
            futures.append(pool.submit(one, i))
    for f in futures:
        f.result()
    return Run(time.perf_counter() - t0, chunk_times(submitted, done))


# ---------------------------------------------------------------- the benchmark


def _run_async(loop: asyncio.AbstractEventLoop, coro_fn: Callable[[], Any]) -> Any:
    return loop.run_until_complete(coro_fn())


def run(work: Path, quick: bool, server_kind: str = "moto") -> Result:
    import torch

    from s3kv.config import S3KVConfig
    from s3kv.keys import Namespace
    from s3kv.tiering.placement import Tier
    from s3kv.tiering.plan import Place
    from s3kv.tiering.tiers.nvme.files import shard_path
    from s3kv.tiering.worker.transfer import EngineSettings

    per_request = 2 if quick else 8
    repeats = 2 if quick else 5
    n_chunks = max(LEVELS) * per_request
    defaults = S3KVConfig(bucket=BUCKET)
    threads = EngineSettings("x", "x", 0, 1).threads
    namespace = Namespace.from_fields({"bench": NAME}).id

    num_blocks = n_chunks * BLOCKS_PER_CHUNK + 3
    expected, keys, block_ids = expected_chunks(n_chunks, num_blocks, seed=3, key_seed=4)
    exp_u8 = [t.view(torch.uint8) for t in expected]
    target, pages, fmt = kv_pages(num_blocks)
    blocks = [t.view(torch.uint8).reshape(num_blocks, -1).numpy() for t in target]
    sink = TimedPages(pages.load_pages(None), LAYERS)

    def clear(check: str | None = None) -> None:
        if check is not None and not all(torch.equal(a, b) for a, b in zip(target, expected)):
            raise AssertionError(f"{check}: the KV cache does not hold the expected pages")
        for t in target:
            t.zero_()

    # The default config's codecs: S3's, and the NVMe tier's.
    tiers: list[tuple[str, str]] = [("S3", defaults.codec)]
    if server_kind == "moto":
        tiers += [("disk, page cache", defaults.disk_codec), ("disk, cold", defaults.disk_codec)]
    codecs = sorted({c for _, c in tiers})

    server, creds, _pids = start_server(server_kind, work)
    os.environ.update(creds)
    cases: dict[str, Case] = {}
    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="plain-read")
    loop = asyncio.new_event_loop()
    rows: list[list[Any]] = []
    bars: list[Bar] = []
    misses: list[str] = []
    try:
        server.create_bucket(BUCKET)
        config = S3KVConfig(bucket=BUCKET, endpoint_url=server.endpoint_url, region="us-east-1")
        put = server.client()
        for codec_name in codecs:
            engine = make_engine(
                config, namespace, f"conc-{codec_name}", codec_name, fmt, disk=work / f"disk-{codec_name}"
            )
            cases[codec_name] = store_case(codec_name, engine, put, keys, block_ids, exp_u8)
        native = obstore_client(server.endpoint_url, defaults.max_connections)
        for tier_name, codec_name in tiers:
            case = cases[codec_name]
            tier = Tier.S3 if tier_name == "S3" else Tier.DISK
            load_chunks = [dataclasses.replace(c, sources=(Place(tier),)) for c in case.chunks]
            paths = [str(shard_path(work / f"disk-{codec_name}", namespace, c.key, 0)) for c in case.chunks]
            cold = tier_name == "disk, cold"
            for level in LEVELS:
                idx = [list(range(r * per_request, (r + 1) * per_request)) for r in range(level)]
                used = [i for r in idx for i in r]
                nbytes = sum(case.layout[i][1] for i in used)
                s3kv_requests = [[load_chunks[i] for i in r] for r in idx]

                evict = functools.partial(_drop_cached, [paths[i] for i in used]) if cold else None
                plain: Callable[[], Run]
                if tier is Tier.S3:
                    s3_plain = functools.partial(
                        _plain_s3, native, idx, case, blocks, defaults.range_bytes, defaults.max_connections
                    )
                    plain = functools.partial(_run_async, loop, s3_plain)
                else:
                    plain = functools.partial(_plain_disk, idx, case, paths, blocks, pool)
                sides: dict[str, Callable[[str], Run]] = {
                    "s3kv": functools.partial(_s3kv_run, case.engine, s3kv_requests, sink),
                    "plain": lambda tag, plain=plain: plain(),  # type: ignore[misc]
                }

                def side(who: str, tag: str, sides: dict[str, Any] = sides, evict: Any = evict) -> Run:
                    if evict is not None:
                        evict()
                    c0 = time.process_time()
                    run = sides[who](tag)
                    run.cpu_s = time.process_time() - c0
                    return run

                # Warm-up (connections, page cache, threads), each side checked
                # once: s3kv's pages must be the expected ones; the plain
                # client's too where it copies raw pages (codec none).
                for who in ("s3kv", "plain"):
                    side(who, f"warm-{tier_name}-{level}")
                    exact = who == "s3kv" or codec_name == "none"
                    if exact:  # only the chunks this level loaded hold data
                        for t, e in zip(target, expected):
                            ids = [b for i in used for b in block_ids[i]]
                            if not torch.equal(t[ids], e[ids]):
                                raise AssertionError(f"{who} {tier_name} x{level}: wrong pages")
                    clear()
                runs: dict[str, list[Run]] = {"s3kv": [], "plain": []}
                for r in range(repeats):
                    order = ("s3kv", "plain") if r % 2 == 0 else ("plain", "s3kv")
                    for who in order:
                        runs[who].append(side(who, f"{tier_name}-{level}-{r}"))
                        clear()
                n = level * per_request
                mine, theirs = summarize(runs["s3kv"], nbytes, n), summarize(runs["plain"], nbytes, n)
                ratio = pair_ratio(runs["s3kv"], runs["plain"])
                goal = GOALS[tier_name]
                ok = ratio >= goal
                if not ok:
                    misses.append(f"{tier_name} x{level} {ratio:.2f}x (goal {goal}x)")
                row = [
                    tier_name,
                    f"{level} x {per_request}",
                    round(mine.gbps, 3),
                    round(theirs.gbps, 3),
                    round(ratio, 3),
                    f"{mine.p50_ms:.1f} / {mine.p99_ms:.1f}",
                    f"{theirs.p50_ms:.1f} / {theirs.p99_ms:.1f}",
                    round(mine.p99_ms / theirs.p99_ms, 3),
                    f"{mine.cpu_s_per_gb:.2f} / {theirs.cpu_s_per_gb:.2f}",
                    f">= {goal}x: " + ("met" if ok else "missed"),
                ]
                rows.append(row)
                bars.append(Bar(f"{tier_name} x{level}", round(ratio, 3)))
                print("  " + ", ".join(f"{c} {v}" for c, v in zip(COLUMNS, row)), flush=True)
    finally:
        for case in cases.values():
            case.engine.close(5)
        pool.shutdown()
        loop.close()
        server.stop()
        for codec_name in codecs:
            shutil.rmtree(work / f"disk-{codec_name}", ignore_errors=True)

    s3_case = cases[defaults.codec]
    notes = [
        f"Each request loads {per_request} chunks of {CHUNK_TOKENS} tokens ({CHUNK_RAW >> 20} MiB of KV a "
        f"chunk: the demo model's shape, random bf16 at random block ids, as in load_path); "
        f"{' and '.join(map(str, LEVELS))} requests submitted at once; every chunk a distinct object "
        f"(S3 objects in {defaults.codec} level {defaults.zstd_level}, raw/stored "
        f"{CHUNK_RAW * len(s3_case.chunks) / s3_case.object_bytes:.2f}x; NVMe files in "
        f"{defaults.disk_codec}: the default config).",
        "GB/s: object bytes (what crosses the wire or is read from the file) of every request over the "
        "time from the first submit until the last request is done (s3kv: poll() reports its job), the "
        f"median of {repeats} runs; s3kv / plain is the median of pairs run back to back in alternating "
        "order, after one warm-up of each side per level (which also checks that s3kv's pages, and the "
        "plain client's with codec none, are the expected ones).",
        "Per-chunk load time: from the submit of the chunk's request to its pages in place (s3kv: the "
        "write or commit of its last layer into the pages, seen by a wrapper around the worker's page "
        "sink, so the engine's own report and poll come after; plain: the copy or preadv of its last "
        f"byte), pooled over every chunk of the {repeats} measured runs; p99 by nearest rank (a "
        "sample, numpy's 'inverted_cdf'). With every request submitted at once, p99 is close to the whole load.",
        "CPU s/GB: CPU seconds of the benchmark's process (all its threads: s3kv's engine, or the plain "
        "client) per GB of object bytes, the median of the runs; the S3 server's CPU is not in it, and "
        "comes out of the same 2 cores.",
        f"s3kv: TransferEngine.submit_load, one job per request, sources=[S3] or [DISK], its default "
        f"settings ({defaults.max_connections} connections, {defaults.range_bytes >> 20} MiB ranges, "
        f"{threads} codec threads), the worker's pages (PageIO.load_pages); polled every "
        f"{POLL_S * 1000:.0f} ms. Plain S3: one obstore S3Store (load_path's faster plain client), "
        f"every chunk's GETs at once behind {defaults.max_connections} slots (s3kv's store has as many), "
        "each body copied into the blocks on the event loop, no header, decode or checksum of its own. "
        f"Plain disk: one os.preadv per file straight into the blocks, in {threads} threads; 'disk, "
        "cold' evicts the files from the page cache before every run of either side.",
        f"S3 server: {server_kind} on loopback"
        + (
            " (a Python process on the same 2 cores; it closes each connection after a response)."
            if server_kind == "moto"
            else " (Ceph 16.2 radosgw, one memstore OSD, on the same 2 cores; the disk rows are in the "
            "moto run: they do not touch the server)."
        ),
    ]
    title = TITLE if server_kind == "moto" else f"{TITLE} ({server_kind})"
    return Result(
        name=NAME if server_kind == "moto" else f"{NAME}_{server_kind}",
        title=title,
        goal=GOAL,
        columns=list(COLUMNS),
        rows=rows,
        verdict=verdict(not misses, "; ".join(misses)),
        notes=notes,
        bars=bars,
        ylabel="s3kv / plain (aggregate throughput)",
        goal_line=None,
    )


if __name__ == "__main__":
    kind = server_arg()
    sys.exit(main_for(lambda work, quick: run(work, quick, kind), "s3kv-bench-load_concurrent"))
