"""s3kv's ``zstd`` frames: a layer's page bytes byte-shuffled (numpy, plane
by plane), then zstd with the content size in the frame; and the way back,
where nothing is decompressed into more than the frame's raw length.

Compressors and the decompressor are kept per thread (zstandard's are not
thread-safe), one compressor per level.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from s3kv.errors import CorruptChunk

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


def shuffle(data: memoryview | bytes | np.ndarray, itemsize: int) -> np.ndarray:
    """Byte-shuffle: all first bytes of the items, then all second bytes, ...
    Exponent bytes of bf16/fp16 values end up together and compress."""
    arr = (
        np.frombuffer(data, dtype=np.uint8)
        if not isinstance(data, np.ndarray)
        else data.reshape(-1).view(np.uint8)
    )
    if itemsize <= 1:
        return arr
    if arr.size % itemsize:
        raise ValueError(f"{arr.size} bytes is not a whole number of {itemsize}-byte items")
    # Plane by plane: a strided gather per byte position is ~3x faster than
    # numpy's copy of the transposed view.
    out = np.empty(arr.size, dtype=np.uint8)
    planes, cols = out.reshape(itemsize, -1), arr.reshape(-1, itemsize)
    for j in range(itemsize):
        planes[j] = cols[:, j]
    return out


def unshuffle(
    data: bytes | memoryview | np.ndarray, itemsize: int, out: np.ndarray | None = None
) -> np.ndarray:
    """Inverse of :func:`shuffle`, optionally into ``out`` (uint8, same size)."""
    arr = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    if out is None:
        out = np.empty(arr.size, dtype=np.uint8)
    if itemsize <= 1:
        np.copyto(out, arr)
        return out
    planes, cols = arr.reshape(itemsize, -1), out.reshape(-1, itemsize)
    for j in range(itemsize):  # see shuffle()
        cols[:, j] = planes[j]
    return out


def zstd_compress(raw: np.ndarray, itemsize: int, level: int) -> bytes:
    """One frame: ``raw`` shuffled by ``itemsize``, then zstd at ``level``."""
    return _compressor(level).compress(shuffle(raw, itemsize))


def zstd_decompress(index: int, stored: bytes | memoryview, raw_length: int) -> np.ndarray:
    """Frame ``index``'s still shuffled bytes, refused (CorruptChunk) unless
    its zstd frame says it holds exactly ``raw_length`` bytes: a stream of
    unknown size, or a decompression bomb, is never decompressed."""
    try:
        content = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as e:
        raise CorruptChunk(f"frame {index}: not a zstd frame: {e}") from e
    if content != raw_length:  # -1: unknown (a stream), or a decompression bomb
        raise CorruptChunk(f"frame {index}: zstd content size {content}, the page holds {raw_length}")
    try:
        return np.frombuffer(_decompressor().decompress(stored, max_output_size=raw_length), dtype=np.uint8)
    except zstandard.ZstdError as e:
        raise CorruptChunk(f"frame {index}: zstd: {e}") from e
