"""The chunk object format: encoding, the header's prefix and its
versions (reading whole objects: test_chunk_reader.py), and the manifest
object's versions."""

import json

import numpy as np
import pytest
import xxhash

from s3kv import codec
from s3kv.auth import FleetKeys
from s3kv.errors import (
    CorruptChunk,
    CorruptManifest,
    UnsignedManifest,
    UnsupportedManifestVersion,
)
from s3kv.manifest import format as mf

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


def test_shuffle_makes_bf16_compress():
    layers = _layers(size=1 << 16)
    zstd = len(_encode("zstd", layers))
    none = len(_encode("none", layers))
    assert zstd < 0.8 * none


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


# -- format versions: unsigned is version 1 (what older readers read), signed is 2 --------------

SECRET = "codec-test-fleet-secret-0123456789abcdef"
OTHER = "codec-test-other-secret-0123456789abcdef"

# What s3kv wrote before objects could be signed (the encoders of aba35f5^ and
# 80dd6a2^, before issue 14), byte for byte: an unsigned chunk object (codec
# "none", so no zstd version can change it) and an unsigned segment.
PRE_SIGNING_CHUNK = bytes.fromhex(
    "53334b5601000000f50000007aac5e283569b232000000007b226e73223a226161616161616161616161616161616161"
    "616161616161616161616161616161222c226b6579223a22626262626262626262626262626262626262626262626262"
    "6262626262626262222c2272616e6b223a302c22746f6b656e73223a342c22636f646563223a226e6f6e65222c227368"
    "7566666c65223a312c226474797065223a2262666c6f61743136222c22706167655f7368617065223a5b312c342c325d"
    "2c226672616d6573223a5b5b3236392c31362c31362c393436333732303439383232313737333031395d2c5b3238352c"
    "31362c31362c31363935393132363339343331373930313637345d5d7d000102030405060708090a0b0c0d0e0f010203"
    "0405060708090a0b0c0d0e0f10"
)
PRE_SIGNING_SEGMENT = bytes.fromhex(
    "53334b4d010001000e00000003000000000000000100000000000000f243d945b22189bb7b22777269746572223a2277"
    "227d0100000000000000050000000000000009000000000000000300000000000000"
)


def _small(keys=None, codec_name="none"):
    return codec.encode_chunk(
        namespace=NS,
        key=KEY,
        rank=0,
        tokens=4,
        layers=[np.arange(16, dtype=np.uint8) + i for i in range(2)],
        dtype="bfloat16",
        itemsize=2,
        page_shape=[1, 4, 2],
        codec=codec_name,
        keys=keys,
    )


def _with_version(blob: bytes, version: int) -> bytes:
    """A chunk object with another version in its prefix (the header checksum
    does not cover the prefix; a signed header's MAC does)."""
    out = bytearray(blob)
    out[4:6] = version.to_bytes(2, "little")
    return bytes(out)


def _segment():
    return mf.ManifestObject(
        "segment", np.array([1, 5, 9], np.uint64), np.array([3], np.uint64), {"writer": "w"}
    )


def _manifest_with_version(data: bytes, version: int) -> bytes:
    """A manifest object with another version, its checksum fixed."""
    out = bytearray(data)
    out[4:6] = version.to_bytes(2, "little")
    head = mf.PREFIX.size + mf.CHECKSUM.size
    signed = data[7] & mf.FLAG_SIGNED
    end = len(out) - (mf.TRAILER.size if signed else 0)
    out[mf.PREFIX.size : head] = mf.CHECKSUM.pack(
        xxhash.xxh3_64_intdigest(bytes(out[: mf.PREFIX.size] + out[head:end]))
    )
    return bytes(out)


def test_unsigned_objects_are_version_1_exactly_as_before_signing():
    assert _small() == PRE_SIGNING_CHUNK
    assert mf.encode(_segment()) == PRE_SIGNING_SEGMENT
    # And with zstd: version 1, no flags, four-number frame entries, no key id:
    # all an older reader accepts.
    blob = _encode()
    _magic, version, flags, hlen, _sum, zero = codec.PREFIX.unpack_from(blob)
    assert (version, flags, zero) == (1, 0, 0)
    header = json.loads(blob[codec.PREFIX_LEN : codec.PREFIX_LEN + hlen])
    assert "kid" not in header and all(len(f) == 4 for f in header["frames"])
    assert codec.parse_header(blob).version == 1 and not codec.parse_header(blob).signed


def test_signed_objects_are_version_2():
    keys = FleetKeys([SECRET])
    _magic, version, flags, *_ = codec.PREFIX.unpack_from(_small(keys))
    assert (version, flags) == (2, codec.FLAG_SIGNED)
    h = codec.parse_header(_small(keys), keys)
    assert h.version == 2 and h.kid == keys.signing_kid
    signed = mf.encode(_segment(), keys)
    assert mf.PREFIX.unpack_from(signed)[1:4:2] == (2, mf.FLAG_SIGNED)


@pytest.mark.parametrize("reader", ["no secret", "the secret", "another secret"])
@pytest.mark.parametrize("written", ["v1", "v2 signed", "v2 unsigned", "v3", "v0", "v1 flagged"])
def test_which_manifest_versions_each_reader_reads(written, reader):
    keys = {"no secret": None, "the secret": FleetKeys([SECRET]), "another secret": FleetKeys([OTHER])}
    unsigned, signed = mf.encode(_segment()), mf.encode(_segment(), FleetKeys([SECRET]))
    data = {
        "v1": unsigned,
        "v2 signed": signed,
        "v2 unsigned": _manifest_with_version(unsigned, 2),
        "v3": _manifest_with_version(signed, 3),
        "v0": _manifest_with_version(unsigned, 0),
        "v1 flagged": _manifest_with_version(signed, 1),
    }[written]
    k = keys[reader]
    readable = {
        "no secret": {"v1", "v2 signed", "v2 unsigned"},
        "the secret": {"v2 signed"},
        "another secret": set(),
    }[reader]
    if written in readable:
        obj = mf.decode(data, keys=k)
        assert obj.added.tolist() == [1, 5, 9] and obj.removed.tolist() == [3]
        return
    with pytest.raises(CorruptManifest) as e:
        mf.decode(data, keys=k)
    if written == "v3":
        assert isinstance(e.value, UnsupportedManifestVersion)
        assert "manifest format version 3; this s3kv reads 1, 2" in str(e.value)
        return
    assert not isinstance(e.value, UnsupportedManifestVersion)
    if written in ("v1", "v2 unsigned", "v2 signed"):  # sound, but not signed with the reader's keys
        assert isinstance(e.value, UnsignedManifest)
    else:
        assert not isinstance(e.value, UnsignedManifest)


# -- blosc2 frames: version 3 ------------------------------------------------------------


def test_blosc2_objects_roundtrip_at_zstd_s_ratio_and_are_version_3():
    layers = _layers(size=1 << 16)
    blob = _encode("blosc2", layers)
    header = codec.parse_header(blob)
    assert (header.version, header.codec, header.shuffle) == (3, "blosc2", 2)
    for i, f in enumerate(header.frames):
        out = np.empty(f.raw_length, np.uint8)
        got = codec.decode_frame(header, i, blob[f.offset : f.end], out=out)
        assert got.base is out or got is out  # decoded in place, one pass
        assert (out == layers[i]).all()
    assert len(blob) <= 1.01 * len(_encode("zstd", layers))  # shuffled + zstd: the same ratio, or better
    keys = FleetKeys([SECRET])
    signed = _encode_keys("blosc2", layers, keys)
    _magic, version, flags, *_ = codec.PREFIX.unpack_from(signed)
    assert (version, flags) == (3, codec.FLAG_SIGNED)
    h = codec.parse_header(signed, keys)
    f = h.frames[0]
    assert (codec.decode_frame(h, 0, signed[f.offset : f.end], keys=keys) == layers[0]).all()


def _encode_keys(codec_name, layers, keys):
    return codec.encode_chunk(
        namespace=NS,
        key=KEY,
        rank=0,
        tokens=64,
        layers=layers,
        dtype="bfloat16",
        itemsize=2,
        page_shape=[2, 2, 32, 128],
        codec=codec_name,
        keys=keys,
    )


def test_each_version_admits_only_its_codecs():
    """An older reader (versions 1 and 2) refuses a blosc2 object by its
    version, a miss rather than corruption; here a version that does not go
    with its codec is corrupt."""
    with pytest.raises(CorruptChunk, match="codec 'blosc2' in a version 1 object"):
        codec.parse_header(_with_version(_encode("blosc2"), 1))
    with pytest.raises(CorruptChunk, match="codec 'zstd' in a version 3 object"):
        codec.parse_header(_with_version(_encode("zstd"), 3))
    from s3kv.errors import UnsupportedFormat

    with pytest.raises(UnsupportedFormat):
        codec.parse_header(_with_version(_encode("blosc2"), 4))


def _refit(blob: bytes, index: int, stored: bytes) -> tuple[codec.ChunkHeader, bytes]:
    """The header, and frame ``index`` replaced by ``stored`` with a checksum
    that passes: what a forger with write access (and no secret) can make."""
    header = codec.parse_header(blob)
    f = header.frames[index]
    frames = list(header.frames)
    frames[index] = codec.Frame(f.offset, len(stored), f.raw_length, xxhash.xxh3_64_intdigest(stored), None)
    return codec.ChunkHeader(**{**header.__dict__, "frames": tuple(frames)}), stored


def test_a_blosc2_frame_that_lies_about_its_sizes_is_corrupt_before_it_is_decoded():
    import blosc2

    layers = _layers(size=1 << 14)
    blob = _encode("blosc2", layers)
    raw = layers[0]
    out = np.zeros(raw.size, np.uint8)
    bigger = blosc2.compress2(np.concatenate([raw, raw]), typesize=2, codec=blosc2.Codec.ZSTD)
    header, stored = _refit(blob, 0, bigger)  # would write twice the page
    with pytest.raises(CorruptChunk, match="blosc2 chunk of"):
        codec.decode_frame(header, 0, stored, out=out)
    assert not out.any()  # nothing written
    header, stored = _refit(blob, 0, b"\x05" * 64)  # not blosc2 at all
    with pytest.raises(CorruptChunk, match="blosc2"):
        codec.decode_frame(header, 0, stored, out=out)
    good = codec.parse_header(blob).frames[0]
    header, stored = _refit(blob, 0, blob[good.offset : good.end - 10])  # cut short
    with pytest.raises(CorruptChunk, match="blosc2 chunk of"):
        codec.decode_frame(header, 0, stored, out=out)
