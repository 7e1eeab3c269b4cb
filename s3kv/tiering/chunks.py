"""Moving one chunk object between a store and memory: ranged, parallel,
checked. Pure asyncio over an :class:`~s3kv.stores.base.ObjectStore`; the
CPU work (checksums, zstd, shuffling) runs in an executor so several chunks
decode at once."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from s3kv import codec
from s3kv.errors import AlreadyExists, CorruptChunk
from s3kv.stores.base import ByteRange, ObjectStore, PutMode

FrameSink = Callable[[int, np.ndarray], None]
"""Called once per layer with that layer's decoded page bytes (uint8)."""


@dataclass(frozen=True)
class ChunkId:
    """Which object a chunk shard is, and what its header must say."""

    object_key: str
    namespace: str
    key_hex: str
    rank: int


@dataclass(frozen=True)
class PageFormat:
    """What a writer records about the pages it stores."""

    dtype: str
    itemsize: int
    page_shape: tuple[int, ...]
    tokens: int


def plan_ranges(
    frames: Sequence[codec.Frame], have_until: int, range_bytes: int
) -> list[tuple[int, int, list[int]]]:
    """Group the frames not yet fetched into ranged GETs of about ``range_bytes``:
    (start, end, frame indexes), each group whole frames in layer order."""
    groups: list[tuple[int, int, list[int]]] = []
    current: list[int] = []
    start = end = 0
    for i, f in enumerate(frames):
        if f.end <= have_until:
            continue
        if current and f.end - start > range_bytes:
            groups.append((start, end, current))
            current = []
        if not current:
            start = f.offset
        current.append(i)
        end = f.end
    if current:
        groups.append((start, end, current))
    return groups


async def load_chunk(
    store: ObjectStore,
    chunk: ChunkId,
    sink: FrameSink,
    *,
    num_layers: int,
    range_bytes: int,
    expect: PageFormat | None = None,
    executor: concurrent.futures.Executor | None = None,
) -> int:
    """Fetch, check and decode every frame of ``chunk``, handing each layer to
    ``sink`` as soon as its range arrives. Returns the bytes fetched.

    Raises NotFound, CorruptChunk (wrong identity, layer count, checksum...),
    Transient; ``sink`` sees only verified bytes, but may have seen some
    layers before a later one fails.
    """
    loop = asyncio.get_running_loop()
    first = await store.get(chunk.object_key, ByteRange(0, max(range_bytes, codec.PREFIX_LEN)))
    fetched = len(first)
    need = codec.header_length(first)
    if need > len(first):
        first += await store.get(chunk.object_key, ByteRange(len(first), need))
        fetched = len(first)
    header = codec.parse_header(first)
    header.check_identity(chunk.namespace, chunk.key_hex, chunk.rank)
    if len(header.frames) != num_layers:
        raise CorruptChunk(f"{chunk.object_key}: {len(header.frames)} layers, this model has {num_layers}")
    if expect is not None and (
        header.dtype != expect.dtype
        or header.page_shape != expect.page_shape
        or header.tokens != expect.tokens
    ):
        raise CorruptChunk(
            f"{chunk.object_key}: pages are {header.dtype}{list(header.page_shape)} x {header.tokens} tokens, "
            f"this engine's are {expect.dtype}{list(expect.page_shape)} x {expect.tokens}"
        )
    if len(first) > header.object_length:
        raise CorruptChunk(f"{chunk.object_key}: object is longer than its header says")

    def decode(buf: bytes, base: int, indexes: list[int]) -> None:
        mv = memoryview(buf)
        for i in indexes:
            f = header.frames[i]
            if f.end - base > len(buf):
                raise CorruptChunk(f"{chunk.object_key}: truncated in frame {i}")
            sink(i, codec.decode_frame(header, i, mv[f.offset - base : f.end - base]))

    have = len(first)
    ready = [i for i, f in enumerate(header.frames) if f.end <= have]
    jobs = [loop.run_in_executor(executor, decode, first, 0, ready)] if ready else []

    async def fetch_and_decode(start: int, end: int, indexes: list[int]) -> int:
        buf = await store.get(chunk.object_key, ByteRange(start, end))
        if len(buf) != end - start:
            raise CorruptChunk(f"{chunk.object_key}: truncated (range {start}-{end} gave {len(buf)} bytes)")
        await loop.run_in_executor(executor, decode, buf, start, indexes)
        return len(buf)

    jobs += [fetch_and_decode(*g) for g in plan_ranges(header.frames, have, range_bytes)]
    results = await asyncio.gather(*jobs, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return fetched + sum(r for r in results if isinstance(r, int))


async def store_chunk(
    store: ObjectStore,
    chunk: ChunkId,
    layers: Sequence[np.ndarray],
    fmt: PageFormat,
    *,
    codec_name: str,
    level: int,
    executor: concurrent.futures.Executor | None = None,
) -> tuple[int, int, bool]:
    """Encode and write one chunk shard, create-only.

    Returns (raw bytes, stored bytes, written): ``written`` is False when the
    object already existed (another writer won the race: not an error)."""
    loop = asyncio.get_running_loop()
    blob = await loop.run_in_executor(
        executor,
        lambda: codec.encode_chunk(
            namespace=chunk.namespace,
            key=chunk.key_hex,
            rank=chunk.rank,
            tokens=fmt.tokens,
            layers=layers,
            dtype=fmt.dtype,
            itemsize=fmt.itemsize,
            page_shape=fmt.page_shape,
            codec=codec_name,
            level=level,
        ),
    )
    raw = sum(layer.nbytes for layer in layers)
    try:
        await store.put(chunk.object_key, blob, mode=PutMode.CREATE)
    except AlreadyExists:
        return raw, len(blob), False
    return raw, len(blob), True
