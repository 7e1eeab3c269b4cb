"""Load path: s3kv moving chunks into a KV cache tensor versus plain clients
moving the same bytes from the same place.

- S3: s3kv's :class:`~s3kv.tiering.worker.transfer.TransferEngine` loads every chunk
  of one job from a loopback S3 server (moto) with ``sources=[S3]`` and the
  worker's own pages (:meth:`s3kv.connector.pages.PageIO.load_pages`, its target:
  each layer's frame read or copied straight into the KV tensor, per run of
  consecutive blocks); the baseline is a plain
  aiobotocore client on the same endpoint: parallel ranged GETs of
  ``range_bytes``, the same connection limit, each body copied into the same
  tensor's blocks, no checksums, no decoding.
- Disk: the same engine with ``sources=[DISK]`` versus plain ``os.preadv``
  of each file straight into the tensor's blocks, in as many threads as
  s3kv's executor has; once from the page cache, once cold (the files
  evicted from it before every run).

Both codecs: ``none`` (pure transport) and the default (``codec``, level
1); the goal is judged on the default. On S3 there are two plain clients,
aiobotocore and obstore, and the goal is against the faster. Each comparison is a median of pairs run
back to back in alternating order; CPU seconds per GB of each client are
reported too, since on a small machine the loopback server and the client
share the cores.

Chunks are 256 tokens of the demo model's KV cache (8 layers, 4 KV heads,
head size 64, bf16, vLLM CPU block size 128: 2 MiB a chunk before
compression), random bf16 values at random block ids; every load is checked
against the expected cache once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import Bar, Result, main_for, median, server_arg, start_server, verdict

NAME = "load_path"
TITLE = "Load path: s3kv vs a plain client, from loopback S3 and from disk"
GOAL = "s3kv >= 0.9x a plain parallel ranged-GET client (S3) and plain file reads (disk), default config"

LAYERS = 8
KV_HEADS = 4
BLOCK_SIZE = 128  # vLLM's CPU block size for this model
HEAD_SIZE = 64
CHUNK_TOKENS = 256
BLOCKS_PER_CHUNK = CHUNK_TOKENS // BLOCK_SIZE
BUCKET = "bench"
GOAL_RATIO = 0.9
POLL_S = 0.001
"""How often the benchmark polls the transfer engine (vLLM polls once a step)."""
COLUMNS = (
    "tier",
    "codec",
    "ratio raw/stored",
    "s3kv MB/s",
    "s3kv KV MB/s",
    "plain MB/s",
    "s3kv / plain",
    "s3kv CPU s/GB",
    "plain CPU s/GB",
    "goal >= 0.9x",
)
CHUNK_RAW = LAYERS * CHUNK_TOKENS * KV_HEADS * 2 * HEAD_SIZE * 2
"""Bytes of one chunk before compression (bf16: 2 bytes an item)."""


class Case:
    """One codec's chunks: in S3 under their own prefix, and in a disk directory."""

    def __init__(self, codec: str, engine: Any, chunks: list[Any], blobs: list[bytes]) -> None:
        self.codec = codec
        self.engine = engine
        self.chunks = chunks
        self.object_bytes = sum(len(b) for b in blobs)
        self.raw_bytes = len(chunks) * CHUNK_RAW
        # What a plain client knows of each object: its key, size and where
        # each layer's bytes sit in it (from the header, once, untimed).
        from s3kv import codec as c
        from s3kv.testing.chunks import chunk_id

        self.layout = []
        for chunk, blob in zip(chunks, blobs):
            h = c.parse_header(blob)
            self.layout.append(
                (chunk_id(engine, chunk.key).object_key, len(blob), [(f.offset, f.length) for f in h.frames])
            )


def _kv_cache(num_blocks: int) -> list[Any]:
    import torch

    return [
        torch.zeros((num_blocks, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE), dtype=torch.bfloat16)
        for _ in range(LAYERS)
    ]


def kv_pages(num_blocks: int) -> tuple[list[Any], Any, Any]:
    """A zeroed KV cache of ``num_blocks`` blocks (its tensors), the worker's
    PageIO over it and the PageFormat of a chunk of it."""
    from s3kv.chunk_reader import PageFormat
    from s3kv.connector.pages import PageIO

    target = _kv_cache(num_blocks)
    names = [f"layer.{i}" for i in range(LAYERS)]
    pages = PageIO(dict(zip(names, target)), names, num_blocks)
    first = pages.layers[0]
    fmt = PageFormat(
        first.dtype,
        first.itemsize,
        first.shape_for(BLOCKS_PER_CHUNK),
        CHUNK_TOKENS,
        BLOCKS_PER_CHUNK * first.page_bytes,
    )
    return target, pages, fmt


def expected_chunks(
    n_chunks: int, num_blocks: int, seed: int, key_seed: int
) -> tuple[list[Any], list[bytes], list[tuple[int, ...]]]:
    """The expected KV cache (random bf16 pages from ``seed``, the blocks no
    chunk loads into zero), ``n_chunks`` random keys (from ``key_seed``) and
    each chunk's random block ids."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    expected = _kv_cache(num_blocks)
    for t in expected:
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(torch.bfloat16))
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    for t in expected:  # blocks no chunk loads into stay zero
        t[perm[n_chunks * BLOCKS_PER_CHUNK :]] = 0
    rng = np.random.default_rng(key_seed)
    keys = [rng.bytes(16) for _ in range(n_chunks)]
    block_ids = [tuple(perm[i * BLOCKS_PER_CHUNK : (i + 1) * BLOCKS_PER_CHUNK]) for i in range(n_chunks)]
    return expected, keys, block_ids


def obstore_client(endpoint_url: str, max_connections: int) -> Any:
    """The plain obstore client of the benchmark's bucket: path-style, plain
    HTTP, keeping up to ``max_connections`` idle connections to the endpoint."""
    from obstore.store import S3Store as ObstoreS3

    return ObstoreS3(
        BUCKET,
        endpoint=endpoint_url,
        region="us-east-1",
        access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        virtual_hosted_style_request=False,
        client_options={"allow_http": True, "pool_max_idle_per_host": str(max_connections)},
    )


def _scatter(data: bytes, offset: int, length: int, pages: list[np.ndarray], skip: int = 0) -> None:
    """Copy ``data[offset:offset+length]``, the bytes of a layer's frame from
    ``skip`` on, into that layer's block pages in order (a none-codec frame
    fills them exactly; a compressed one, its first bytes)."""
    src = memoryview(data)[offset : offset + length]
    done = 0
    for page in pages:
        if skip >= page.nbytes:
            skip -= page.nbytes
            continue
        n = min(page.nbytes - skip, length - done)
        np.copyto(page[skip : skip + n], np.frombuffer(src[done : done + n], dtype=np.uint8))
        done += n
        skip = 0
        if done >= length:
            break


async def _aiobotocore_range(client: Any, key: str, start: int, end: int) -> bytes:
    resp = await client.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={start}-{end - 1}")
    async with resp["Body"] as body:
        return await body.read()


async def _obstore_range(store: Any, key: str, start: int, end: int) -> Any:
    """obstore's body, shared from Rust's memory (not copied)."""
    import obstore

    got = await obstore.get_async(store, key, options={"range": (start, end)})
    return await got.bytes_async()


async def _plain_s3(
    client: Any, case: Case, blocks: list[list[np.ndarray]], range_bytes: int, get_range: Any
) -> None:
    """Every object with parallel ranged GETs (``get_range(client, key, start,
    end)``), each range copied into the blocks."""

    async def one(i: int, key: str, size: int, frames: list[tuple[int, int]]) -> None:
        async def part(start: int) -> None:
            end = min(start + range_bytes, size)
            data = await get_range(client, key, start, end)
            ids = case.chunks[i].block_ids
            for layer, (off, length) in enumerate(frames):
                lo, hi = max(off, start), min(off + length, end)
                if lo < hi:  # the part of this layer's frame inside this range
                    _scatter(data, lo - start, hi - lo, [blocks[layer][b] for b in ids], lo - off)

        await asyncio.gather(*(part(s) for s in range(0, size, range_bytes)))

    await asyncio.gather(*(one(i, *entry) for i, entry in enumerate(case.layout)))


def _run_plain_s3(
    loop: Any, client: Any, case: Case, blocks: list[list[np.ndarray]], range_bytes: int, get_range: Any
) -> None:
    loop.run_until_complete(_plain_s3(client, case, blocks, range_bytes, get_range))


def preadv_chunk(case: Case, i: int, path: str, blocks: list[list[np.ndarray]]) -> None:
    """The plain client's read of chunk ``i``'s file: one ``preadv`` straight
    into the tensor's blocks (the header read aside)."""
    _key, size, frames = case.layout[i]
    ids = case.chunks[i].block_ids
    iov: list[Any] = [bytearray(frames[0][0])]  # the header, read aside
    for layer, (_off, length) in enumerate(frames):
        left = length
        for b in ids:
            page = blocks[layer][b]
            n = min(page.nbytes, left)
            if n <= 0:
                break
            iov.append(memoryview(page)[:n])
            left -= n
    fd = os.open(path, os.O_RDONLY)
    try:
        got = os.preadv(fd, iov, 0)
    finally:
        os.close(fd)
    if got != size:
        raise OSError(f"{path}: read {got} of {size} bytes")


def _plain_disk(case: Case, paths: list[str], blocks: list[list[np.ndarray]], pool: Any) -> None:
    """Every file with one ``preadv`` straight into the tensor's blocks."""
    list(pool.map(lambda i: preadv_chunk(case, i, paths[i], blocks), range(len(case.chunks))))


def make_engine(
    config: Any, namespace: str, prefix: str, codec: str, fmt: Any, disk: Path | None = None
) -> Any:
    """A configured TransferEngine with the default config's settings, storing
    ``codec`` on S3 under ``prefix`` (and in a fresh ``disk`` directory, when given)."""
    from s3kv.config import S3KVConfig
    from s3kv.stores.factory import make_store
    from s3kv.tiering.placement import Tier
    from s3kv.tiering.tiers.nvme.settings import NvmeSettings
    from s3kv.tiering.tiers.s3.settings import S3Settings
    from s3kv.tiering.worker.transfer import EngineSettings, TransferEngine

    defaults = S3KVConfig(bucket=BUCKET)
    wings: dict[Any, Any] = {}
    if disk is not None:
        shutil.rmtree(disk, ignore_errors=True)
        wings[Tier.DISK] = NvmeSettings(str(disk), codec=codec)
    wings[Tier.S3] = S3Settings(range_bytes=defaults.range_bytes)
    engine = TransferEngine(
        make_store(config),
        EngineSettings(
            namespace=namespace,
            prefix=prefix,
            rank=0,
            num_layers=LAYERS,
            codec=codec,
            zstd_level=defaults.zstd_level,
            wings=wings,
        ),
    )
    engine.configure(fmt)
    return engine


def store_case(
    codec: str, engine: Any, put: Any, keys: list[bytes], block_ids: list[tuple[int, ...]], exp_u8: list[Any]
) -> Case:
    """Every chunk (``exp_u8``'s pages at ``block_ids``) put in S3 with ``put``
    and written (fsynced) to ``engine``'s disk, as one :class:`Case`."""
    import torch

    from s3kv.testing.chunks import chunk_id
    from s3kv.tiering.chunks import ChunkData
    from s3kv.tiering.placement import Tier
    from s3kv.tiering.plan import LoadChunk, Place

    chunks, blobs = [], []
    for key, ids in zip(keys, block_ids):
        idx = torch.tensor(ids)
        layers = [u.index_select(0, idx).contiguous().view(-1).numpy() for u in exp_u8]
        data = ChunkData(key, engine.codec, layers=layers)
        blob = data.blob
        put.put_object(Bucket=BUCKET, Key=chunk_id(engine, key).object_key, Body=blob)
        files = engine.handlers[Tier.DISK].files
        files.write(key, data)
        _fsync(files.path(key))
        blobs.append(blob)
        chunks.append(LoadChunk(key, ids, 0, BLOCKS_PER_CHUNK, (Place(Tier.S3),)))
    return Case(codec, engine, chunks, blobs)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _fsync(path: Path) -> None:
    """Written back, so that dropping its cached pages works."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _drop_cached(paths: list[str]) -> None:
    """Evict these files (only) from the page cache: the next read goes to the device."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _s3kv_load(case: Case, tier: Any, into: Any, job: str) -> None:
    import dataclasses

    from s3kv.tiering.plan import Place

    chunks = [dataclasses.replace(c, sources=(Place(tier),)) for c in case.chunks]
    case.engine.submit_load(job, chunks, into)
    while True:
        r = case.engine.poll()
        if job in r.finished_loads:
            if r.finished_loads[job]:
                raise RuntimeError(f"s3kv: {len(r.finished_loads[job])} chunks failed to load ({job})")
            return
        time.sleep(POLL_S)


def run(work: Path, quick: bool, server_kind: str = "moto") -> Result:
    import torch
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    from s3kv.config import S3KVConfig
    from s3kv.keys import Namespace
    from s3kv.tiering.placement import Tier
    from s3kv.tiering.tiers.nvme.files import shard_path
    from s3kv.tiering.worker.transfer import EngineSettings

    n_chunks = 16 if quick else 64
    repeats = 3 if quick else 9
    defaults = S3KVConfig(bucket=BUCKET)
    codecs = ("none", defaults.codec)
    range_bytes = defaults.range_bytes
    max_conn = defaults.max_connections
    threads = EngineSettings("x", "x", 0, 1).threads
    namespace = Namespace.from_fields({"bench": NAME}).id

    # The expected KV cache: random bf16 pages at random block ids.
    num_blocks = n_chunks * BLOCKS_PER_CHUNK + 3  # no other axis has this length
    expected, keys, block_ids = expected_chunks(n_chunks, num_blocks, seed=1, key_seed=2)
    target, pages, fmt = kv_pages(num_blocks)
    exp_u8 = [t.view(torch.uint8) for t in expected]
    blocks = [t.view(torch.uint8).reshape(num_blocks, -1).numpy() for t in target]

    into = pages.load_pages(None)  # the worker's: frames read straight in, or written

    def check(what: str, exact: bool) -> None:
        if exact and not all(torch.equal(a, b) for a, b in zip(target, expected)):
            raise AssertionError(f"{what}: the KV cache does not hold the expected pages")
        for t in target:
            t.zero_()

    server, creds, server_pids = start_server(server_kind, work)
    os.environ.update(creds)  # both sides find them the standard way
    cases: list[Case] = []
    server_s_per_gb: dict[str, float] = {}
    host_us: dict[str, float] = {}
    rows: list[list[Any]] = []
    bars: list[Bar] = []
    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="plain-read")
    loop = asyncio.new_event_loop()
    try:
        server.create_bucket(BUCKET)
        put = server.client()
        config = S3KVConfig(bucket=BUCKET, endpoint_url=server.endpoint_url, region="us-east-1")
        for codec_name in codecs:
            # each case on disk too; the default disk codec is none
            engine = make_engine(
                config, namespace, f"bench-{codec_name}", codec_name, fmt, disk=work / f"disk-{codec_name}"
            )
            cases.append(store_case(codec_name, engine, put, keys, block_ids, exp_u8))

        session = get_session()
        aio_config = AioConfig(
            region_name="us-east-1",
            max_pool_connections=max_conn,
            retries={"mode": "standard", "max_attempts": defaults.s3_max_attempts},
            s3={"addressing_style": "path"},
            tcp_keepalive=True,
        )
        stack_cm = session.create_client("s3", endpoint_url=server.endpoint_url, config=aio_config)
        client = loop.run_until_complete(stack_cm.__aenter__())
        native = obstore_client(server.endpoint_url, max_conn)
        plain_names: dict[str, str] = {}
        try:
            for case in cases:
                exact = case.codec == "none"
                paths = [
                    str(shard_path(work / f"disk-{case.codec}", namespace, c.key, 0)) for c in case.chunks
                ]
                tiers = (
                    ("S3", Tier.S3, None),
                    ("disk, page cache", Tier.DISK, None),
                    ("disk, cold", Tier.DISK, functools.partial(_drop_cached, paths)),
                )
                for tier_name, tier, prepare in tiers:
                    runs: dict[str, Any] = {"s3kv": functools.partial(_s3kv_load, case, tier, into)}
                    if tier is Tier.S3:  # two plain clients: the goal is against the faster
                        aio = functools.partial(
                            _run_plain_s3, loop, client, case, blocks, range_bytes, _aiobotocore_range
                        )
                        nat = functools.partial(
                            _run_plain_s3, loop, native, case, blocks, range_bytes, _obstore_range
                        )
                        runs["plain"] = lambda job, aio=aio: aio()
                        runs["plain obstore"] = lambda job, nat=nat: nat()
                    else:
                        plain_run = functools.partial(_plain_disk, case, paths, blocks, pool)
                        runs["plain"] = lambda job, plain_run=plain_run: plain_run()
                    # Warm-up (connections, page cache) and a check of each path.
                    for who in runs:
                        if prepare is not None:
                            prepare()
                        runs[who](f"warm-{case.codec}-{tier_name}")
                        check(f"{who} {tier_name} {case.codec}", who == "s3kv" or exact)
                    times: dict[str, list[float]] = {who: [] for who in runs}
                    pair_ratios: dict[str, list[float]] = {who: [] for who in runs if who != "s3kv"}
                    cpu: dict[str, list[float]] = {who: [] for who in runs}
                    server_cpu: dict[str, list[float]] = {who: [] for who in runs}
                    for r in range(repeats):
                        order = list(runs) if r % 2 == 0 else list(reversed(runs))
                        got: dict[str, float] = {}
                        for who in order:
                            if prepare is not None:
                                prepare()
                            t0, c0, s0 = time.perf_counter(), time.process_time(), _server_cpu(server_pids)
                            runs[who](f"{case.codec}-{tier_name}-{r}")
                            got[who] = time.perf_counter() - t0
                            cpu[who].append(time.process_time() - c0)
                            server_cpu[who].append(_server_cpu(server_pids) - s0)
                            for t in target:
                                t.zero_()
                        for who, t in got.items():
                            times[who].append(t)
                            if who != "s3kv":
                                pair_ratios[who].append(t / got["s3kv"])
                    # The plain client to beat: the faster one (its median time).
                    best = min(pair_ratios, key=lambda who: median(times[who]))
                    plain_names[f"{tier_name} {case.codec}"] = best
                    t_s3kv, t_plain, ratios = times["s3kv"], times[best], pair_ratios[best]
                    if "plain obstore" in times:
                        print(
                            f"  {tier_name} {case.codec}: plain aiobotocore "
                            f"{case.object_bytes / 1e6 / median(times['plain']):.0f} MB/s "
                            f"({median(cpu['plain']) / (case.object_bytes / 1e9):.2f} CPU s/GB), plain obstore "
                            f"{case.object_bytes / 1e6 / median(times['plain obstore']):.0f} MB/s "
                            f"({median(cpu['plain obstore']) / (case.object_bytes / 1e9):.2f} CPU s/GB)"
                        )
                    cpu["plain"] = cpu[best]
                    mb = case.object_bytes / 1e6
                    ratio = median(ratios)
                    is_default = case.codec == (defaults.codec if tier is Tier.S3 else defaults.disk_codec)
                    codec_label = (
                        "none" if case.codec == "none" else f"{case.codec} {defaults.zstd_level}"
                    ) + (" (default)" if is_default else "")
                    row = [
                        tier_name,
                        codec_label,
                        round(case.raw_bytes / case.object_bytes, 3),
                        round(mb / median(t_s3kv)),
                        round(case.raw_bytes / 1e6 / median(t_s3kv)),
                        round(mb / median(t_plain)),
                        round(ratio, 3),
                        round(median(cpu["s3kv"]) / mb * 1000, 2),
                        round(median(cpu["plain"]) / mb * 1000, 2),
                        "met" if ratio >= GOAL_RATIO else f"missed ({ratio:.2f}x)",
                    ]
                    rows.append(row)
                    if tier is Tier.S3:
                        server_s_per_gb[case.codec] = (
                            median([x for v in server_cpu.values() for x in v]) / mb * 1000
                        )
                    bars.append(Bar(f"{tier_name}, {case.codec}", round(ratio, 3)))
                    print(
                        f"  {tier_name}, {codec_label}: "
                        + ", ".join(f"{c} {v}" for c, v in zip(COLUMNS[2:], row[2:]))
                    )
                    if tier is Tier.DISK:  # CPU beyond the plain read's, per frame (a layer of a chunk)
                        frames = len(case.chunks) * LAYERS
                        host_us[f"{tier_name} {case.codec}"] = (
                            (median(cpu["s3kv"]) - median(cpu["plain"])) / frames * 1e6
                        )
                        print(
                            f"  {tier_name}, {codec_label}: s3kv host work {host_us[f'{tier_name} {case.codec}']:.1f} us a frame beyond plain"
                        )
        finally:
            loop.run_until_complete(stack_cm.__aexit__(None, None, None))
    finally:
        for case in cases:
            case.engine.close(5)
        pool.shutdown()
        loop.close()
        server.stop()
        for codec_name in codecs:
            shutil.rmtree(work / f"disk-{codec_name}", ignore_errors=True)

    # The default config: S3 in codec, the disk in disk_codec.
    default_rows = [r for r in rows if r[1].endswith("(default)")]
    met = all(r[6] >= GOAL_RATIO for r in default_rows)
    miss = "; ".join(f"{r[0]} {r[6]:.2f}x" for r in default_rows if r[6] < GOAL_RATIO)
    miss += f" (the default: {defaults.codec} {defaults.zstd_level} on S3, {defaults.disk_codec} on disk)"
    n_cores = os.cpu_count() or 1
    notes = [
        f"{n_chunks} chunks of {CHUNK_TOKENS} tokens per load ({cases[0].object_bytes / 1e6:.0f} MB of "
        f"objects with codec none, {cases[-1].object_bytes / 1e6:.0f} MB with {defaults.codec}), one job, "
        "all chunks "
        f"submitted at once; pages shaped like the demo model's KV cache ({LAYERS} layers x "
        f"[{BLOCKS_PER_CHUNK} blocks, {KV_HEADS} KV heads, {BLOCK_SIZE} tokens, 2x{HEAD_SIZE}] bf16 = "
        f"{CHUNK_RAW >> 20} MiB a chunk), random normal bf16 values at random block ids: they compress "
        "about as badly as random-weights KV does (the codec benchmark's ratio).",
        "MB/s are of object bytes (what crosses the wire or is read from the file), 'KV MB/s' the same "
        "s3kv time in decoded KV bytes. s3kv / plain is plain time over s3kv time, the median of "
        f"{repeats} pairs run back to back in alternating order after one warm-up each (the MB/s columns "
        "are medians of each side alone). Each path was checked once to leave the expected pages in "
        "the tensor (the plain client's zstd copy is of compressed bytes, so only its size is right).",
        "s3kv: TransferEngine.submit_load with sources=[S3] or [DISK] and no promotion, its default "
        f"settings (range_bytes {range_bytes >> 20} MiB, {max_conn} connections, {threads} codec "
        "threads), the worker's pages (PageIO.load_pages, its target: frames of codec none read or copied "
        "straight into the pages, one buffer per run of consecutive blocks and K/V; others decoded "
        "into a scratch buffer, then copied per run); timed "
        f"from submit until poll() reports the job, polled every {POLL_S * 1000:.0f} ms.",
        "Plain S3, the faster of two clients in each row ("
        + ", ".join(f"{k}: {v}" for k, v in plain_names.items())
        + "): one aiobotocore client (or one obstore S3Store), the same endpoint, config and "
        "connection limit, every "
        f"object's {range_bytes >> 20} MiB ranged GETs in flight at once (a chunk is smaller than a "
        "range: one GET per object, as s3kv does), each body copied into the tensor's blocks on the "
        "event loop thread: no header, no decode, no checksum of its own (botocore's CRC32 check of "
        "each response runs in both clients). Plain disk: one os.preadv per file "
        f"straight into the tensor's blocks, in {threads} threads.",
        "'disk, page cache' reads files just written and still cached (the CPU cost of each path); "
        "'disk, cold' evicts the files from the page cache (posix_fadvise DONTNEED, after an fsync) "
        "before every run, so both sides read the block device. s3kv's host work a frame (a layer "
        "of a chunk: its CPU seconds, every thread, less the plain read's, over the frames): "
        + ", ".join(f"{k} {v:.1f} us" for k, v in host_us.items())
        + ".",
        "CPU s/GB: CPU seconds of the client process (all threads) per GB of object bytes; the "
        f"{server_kind} server spent "
        + ", ".join(f"{v:.2f} s/GB with codec {k}" for k, v in server_s_per_gb.items())
        + f". On this {n_cores}-core machine client and server share the cores, so S3 throughput is "
        "bounded by their CPU together: a client that spends more CPU per byte (checksums, zstd, copies) "
        "slows the server down too, which real S3 would not."
        + (
            " moto also closes every connection (each GET is a new TCP connection, for both clients)."
            if server_kind == "moto"
            else ""
        ),
        f"torch runs {torch.get_num_threads()} intra-op threads here (its default, as in a vLLM CPU "
        "worker); s3kv's host sink uses no torch op, so its codec threads start no OpenMP work.",
        f"The goal applies to the default config ({defaults.codec} level {defaults.zstd_level}) on every "
        "tier; "
        "codec none rows show pure transport.",
    ]
    return Result(
        name=NAME,
        title=TITLE if server_kind == "moto" else f"{TITLE} ({server_kind})",
        goal=GOAL + f" (S3: {defaults.codec} level {defaults.zstd_level}; disk: {defaults.disk_codec})",
        columns=list(COLUMNS),
        rows=rows,
        verdict=verdict(met, miss),
        notes=notes,
        bars=bars,
        ylabel="s3kv / plain client (throughput)",
        goal_line=GOAL_RATIO,
    )


def _server_cpu(pids: list[int]) -> float:
    return sum(_cpu_seconds(p) for p in pids)


if __name__ == "__main__":
    kind = server_arg()
    sys.exit(main_for(lambda work, quick: run(work, quick, kind), "s3kv-bench-load_path"))
