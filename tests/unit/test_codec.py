import numpy as np
import pytest

from s3kv import codec
from s3kv.errors import CorruptChunk

NS, KEY = "a" * 32, "b" * 32


def _layers(n=3, size=4096, seed=0):
    rng = np.random.default_rng(seed)
    # bf16-like: two bytes per value, the high byte (exponent) varies little.
    vals = rng.standard_normal(size // 2).astype(np.float32).view(np.uint32) >> 16
    return [((vals + i).astype("<u2")).view(np.uint8).copy() for i in range(n)]


def _encode(codec_name="zstd", layers=None):
    return codec.encode_chunk(
        namespace=NS,
        key=KEY,
        rank=0,
        tokens=64,
        layers=layers or _layers(),
        dtype="bfloat16",
        itemsize=2,
        page_shape=[2, 2, 32, 128],
        codec=codec_name,
    )


@pytest.mark.parametrize("codec_name", ["zstd", "none"])
def test_roundtrip(codec_name):
    layers = _layers()
    blob = _encode(codec_name, layers)
    header, out = codec.decode_chunk(blob, namespace=NS, key=KEY, rank=0)
    assert header.codec == codec_name and header.tokens == 64 and header.page_shape == (2, 2, 32, 128)
    assert len(out) == 3 and all((a == b).all() for a, b in zip(out, layers))
    assert header.object_length == len(blob)


def test_shuffle_makes_bf16_compress():
    layers = _layers(size=1 << 16)
    zstd = len(_encode("zstd", layers))
    none = len(_encode("none", layers))
    assert zstd < 0.8 * none


def test_shuffle_roundtrip():
    data = np.arange(1000, dtype=np.uint16).view(np.uint8)
    assert (codec.unshuffle(codec.shuffle(data, 2), 2) == data).all()


def test_truncated_raises():
    blob = _encode()
    for cut in (0, 10, codec.PREFIX_LEN + 5, len(blob) - 1):
        with pytest.raises(CorruptChunk):
            codec.decode_chunk(blob[:cut], namespace=NS, key=KEY, rank=0)


def test_every_flipped_byte_is_caught():
    blob = _encode("none", _layers(size=256))
    step = max(1, len(blob) // 300)
    for at in range(0, len(blob), step):
        bad = bytearray(blob)
        bad[at] ^= 0x01
        with pytest.raises(CorruptChunk):
            codec.decode_chunk(bytes(bad), namespace=NS, key=KEY, rank=0)


def test_wrong_identity_raises():
    blob = _encode()
    with pytest.raises(CorruptChunk, match="namespace"):
        codec.decode_chunk(blob, namespace="c" * 32, key=KEY, rank=0)
    with pytest.raises(CorruptChunk, match="chunk"):
        codec.decode_chunk(blob, namespace=NS, key="d" * 32, rank=0)
    with pytest.raises(CorruptChunk, match="rank"):
        codec.decode_chunk(blob, namespace=NS, key=KEY, rank=1)


def test_not_a_chunk_and_future_version():
    with pytest.raises(CorruptChunk, match="magic"):
        codec.parse_header(b"<html>not a chunk object</html>")
    blob = bytearray(_encode())
    blob[4] = 99  # format version
    with pytest.raises(CorruptChunk, match="version"):
        codec.parse_header(bytes(blob))


def test_decode_frame_checks_destination_size():
    blob = _encode()
    header = codec.parse_header(blob)
    f = header.frames[0]
    with pytest.raises(CorruptChunk):
        codec.decode_frame(header, 0, blob[f.offset : f.end], out=np.empty(10, np.uint8))
