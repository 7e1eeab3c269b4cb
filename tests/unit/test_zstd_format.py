"""s3kv's zstd frames (:mod:`s3kv.zstd_format`): the byte shuffle and its
inverse; a frame decompressed only to the size it must hold."""

import numpy as np
import pytest
import zstandard

from s3kv import zstd_format
from s3kv.errors import CorruptChunk


def test_shuffle_roundtrip():
    data = np.arange(1000, dtype=np.uint16).view(np.uint8)
    assert (zstd_format.unshuffle(zstd_format.shuffle(data, 2), 2) == data).all()


def test_a_frame_decompresses_only_to_the_size_it_must_hold():
    """The frame's own content size must be the page's: a frame of another
    size, a stream without one, or bytes that are no zstd frame are corrupt,
    never decompressed; one that holds what it says comes back shuffled."""
    raw = np.arange(4096, dtype=np.uint16).view(np.uint8)
    stored = zstd_format.zstd_compress(raw, 2, 1)
    assert (zstd_format.unshuffle(zstd_format.zstd_decompress(0, stored, raw.size), 2) == raw).all()
    with pytest.raises(CorruptChunk, match=f"frame 3: zstd content size {raw.size}, the page holds 4096"):
        zstd_format.zstd_decompress(3, stored, 4096)
    stream = zstandard.ZstdCompressor(write_content_size=False).compress(raw.tobytes())
    with pytest.raises(CorruptChunk, match="frame 0: zstd content size -1"):
        zstd_format.zstd_decompress(0, stream, raw.size)
    with pytest.raises(CorruptChunk, match="frame 0: not a zstd frame"):
        zstd_format.zstd_decompress(0, b"\0" * 8, raw.size)
