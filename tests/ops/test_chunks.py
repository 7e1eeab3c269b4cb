"""How the ops commands judge a chunk object (:mod:`s3kv.ops.chunks`): by
its bytes (``check_chunk``), within the bounds of the pages its namespace's
descriptor names (``check_bounds``)."""

import dataclasses

import pytest

from s3kv import codec
from s3kv.descriptor import ChunkPages
from s3kv.errors import CorruptChunk, Unchecked
from s3kv.keys import object_key
from s3kv.ops.chunks import MAX_UNDESCRIBED_RAW, check_bounds, check_chunk
from tests.unit.test_codec import KEY, NS, _encode


def test_the_ops_commands_decode_no_more_than_the_descriptors_pages(monkeypatch):
    """``check_chunk`` with the pages a namespace's descriptor names (3
    layers of 4096 bytes, chunks of 64 tokens) reads what the engine reads;
    frames of other pages are corrupt, a chunk of another size is not
    decoded (Unchecked, never deleted), nor, without a descriptor, one
    claiming more than MAX_UNDESCRIBED_RAW; none of them decodes a frame."""
    decoded: list[int] = []
    real = codec.decode_frame
    monkeypatch.setattr(codec, "decode_frame", lambda h, i, *a, **k: decoded.append(i) or real(h, i, *a, **k))
    pages = ChunkPages(num_layers=3, tokens=64, layer_bytes=4096)
    name = object_key("fleet", NS, bytes.fromhex(KEY), 0)
    blob = _encode()
    assert check_chunk(name, blob, pages=pages).raw_bytes == 3 * 4096 and decoded == [0, 1, 2]
    decoded.clear()
    for other, error, match in (
        (ChunkPages(2, 64, 4096), CorruptChunk, "3 layers, this model has 2"),
        (ChunkPages(3, 64, 2048), CorruptChunk, "a layer's pages are 2048 bytes"),
        (ChunkPages(3, 128, 8192), Unchecked, "chunk of 64 tokens; its namespace's descriptor names .* 128"),
    ):
        with pytest.raises(error, match=match):
            check_chunk(name, blob, pages=other)
    header = codec.parse_header(blob)
    wide = dataclasses.replace(header, frames=(codec.Frame(header.frames[0].offset, 10, 256 << 20, 0),) * 5)
    with pytest.raises(Unchecked, match=f"more than the {MAX_UNDESCRIBED_RAW}"):
        check_bounds(name, wide, None)
    assert decoded == []
