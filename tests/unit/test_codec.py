"""The chunk object format: encoding, shuffling, the header's prefix and its
versions (reading whole objects: test_chunk_reader.py), and the manifest
object's versions."""

import json

import numpy as np
import pytest
import xxhash

from s3kv import blosc2_format, codec
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


def test_shuffle_roundtrip():
    data = np.arange(1000, dtype=np.uint16).view(np.uint8)
    assert (codec.unshuffle(codec.shuffle(data, 2), 2) == data).all()


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


def test_blosc2_lets_go_of_the_gil_and_works_on_the_calling_thread_only():
    """s3kv decodes frames on several codec threads at once: blosc2 must not
    hold the GIL meanwhile (python-blosc2's default), nor start threads of its own."""
    import blosc2

    assert blosc2.set_releasegil(True) is True  # what s3kv.codec set (this returns the previous value)
    assert blosc2.nthreads == 1


# -- blosc2 chunks s3kv never writes: refused from the header, before blosc2 sees them ---------


def _bf16(raw_length: int, seed: int = 0) -> np.ndarray:
    return _layers(1, raw_length, seed)[0]


def _b2_header(stored: bytes) -> blosc2_format.Blosc2Header:
    return blosc2_format.Blosc2Header._make(blosc2_format.BLOSC2_HEADER.unpack_from(stored))


def blosc2_variant(raw_length: int = 4096, itemsize: int = 2, **fields) -> bytes:
    """A zstd-compressed blosc2 chunk of bf16-like bytes shuffled by
    ``itemsize``, as s3kv writes it, its header's ``fields`` changed (the
    blocks left as they are)."""
    good = codec.blosc2_compress(_bf16(raw_length), itemsize, 1)
    h = _b2_header(good)
    assert h.blosc2_flags == 0 and h.flags & 0xE2 == 0x80  # compressed by zstd, not copied
    return blosc2_format.BLOSC2_HEADER.pack(*h._replace(**fields)) + good[blosc2_format.BLOSC2_HEADER.size :]


def plugin_frame(codec_id: int, raw_length: int = 4096, itemsize: int = 2) -> bytes:
    """A chunk whose codec is ``codec_id``, named in the user-defined codec
    slot (compressor format 6): how a chunk names a plugin codec."""
    return blosc2_variant(raw_length, itemsize, flags=0x05 | 6 << 5, codec=codec_id)


def special_frame(
    kind: int, raw_length: int = 4096, itemsize: int = 2, *, flags: int = 0x85, tail: bytes | None = None
) -> bytes:
    """A chunk of special value ``kind`` (1 zeros, 2 NaNs, 3 a repeated value,
    4 uninitialized) of ``raw_length`` bytes: its header, and ``tail`` (by
    default nothing, the repeated value for kind 3)."""
    if tail is None:
        tail = b"\x7f" * itemsize if kind == 3 else b""
    h = blosc2_format.Blosc2Header(
        version=5,
        versionlz=1,
        flags=flags,
        typesize=itemsize,
        nbytes=raw_length,
        blocksize=raw_length,
        cbytes=32 + len(tail),
        filters=b"\x01" + bytes(5),
        codec=5,
        codec_meta=0,
        filters_meta=bytes(6),
        flags2=0,
        blosc2_flags=kind << 4,
    )
    return blosc2_format.BLOSC2_HEADER.pack(*h) + tail


def watch_python(tmp_path, monkeypatch):
    """PATH set to a folder whose only programs, ``python`` and ``python3``,
    note each run in the file returned: how c-blosc2 looks for a plugin it
    lacks (``python -c "import blosc2_<name>; ..."``, through popen) shows there."""
    bin_dir, runs = tmp_path / "bin", tmp_path / "python-runs"
    bin_dir.mkdir()
    for name in ("python", "python3"):
        (bin_dir / name).write_text(f'#!/bin/sh\necho "$0 $*" >> {runs}\n')
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    return runs


HOSTILE = {
    # name: (the frame, for an object of 4096-byte frames shuffled by 2; what the refusal says)
    **{f"plugin codec {c}": (lambda c=c: plugin_frame(c), "compressor format 6") for c in range(36, 41)},
    **{f"registered codec {c}": (lambda c=c: plugin_frame(c), "compressor format 6") for c in (32, 33, 160)},
    "blosclz": (lambda: blosc2_variant(flags=0x05, codec=0), "compressor format 0"),
    "lz4": (lambda: blosc2_variant(flags=0x25, codec=1), "compressor format 1"),
    "zlib": (lambda: blosc2_variant(flags=0x65, codec=4), "compressor format 3"),
    "zstd naming another codec id": (lambda: blosc2_variant(codec=36), "codec id 36"),
    "codec meta": (lambda: blosc2_variant(codec_meta=3), r"codec id 5 \(meta 3\)"),
    **{
        f"special {name}": (lambda k=k: special_frame(k), rf"blosc2 flags {k << 4:#04x} \(a chunk of {name}")
        for k, name in (
            (2, "NaNs"),
            (3, "a repeated value"),
            (4, "uninitialized bytes"),
            (5, "special value 5"),
        )
    },
    "zeros, copied": (
        lambda: special_frame(1, flags=0x87, tail=bytes(4096)),
        r"blosc2 flags 0x10 \(a chunk of zeros",
    ),
    "zeros, with blocks": (
        lambda: blosc2_variant(blosc2_flags=0x10),
        r"blosc2 flags 0x10 \(a chunk of zeros",
    ),
    "zeros, lazy": (lambda: special_frame(1)[:31] + b"\x18", "a lazy chunk, a chunk of zeros"),
    "lazy chunk": (lambda: blosc2_variant(blosc2_flags=0x08), r"\(a lazy chunk\)"),
    "dictionary": (lambda: blosc2_variant(blosc2_flags=0x01), r"\(a dictionary\)"),
    "big-endian": (lambda: blosc2_variant(blosc2_flags=0x02), "big-endian"),
    "instrumented": (lambda: blosc2_variant(blosc2_flags=0x80), "instrumented"),
    "variable-length blocks": (lambda: blosc2_variant(flags2=0x01), "flags2 0x01"),
    "typesize 4 in its header": (
        lambda: blosc2_variant(typesize=4),
        "typesize 4, the object's shuffle item size is 2",
    ),
    "shuffled by 1": (lambda: blosc2_variant(itemsize=1), "typesize 1, the object's"),
    "shuffled by 4": (lambda: blosc2_variant(itemsize=4), "typesize 4, the object's"),
    "bit shuffle": (lambda: blosc2_variant(filters=b"\x02" + bytes(5)), r"filters \[2, 0"),
    "shuffle last": (lambda: blosc2_variant(filters=bytes(5) + b"\x01"), r"filters \[0, 0, 0, 0, 0, 1\]"),
    "shuffle then delta": (lambda: blosc2_variant(filters=b"\x01\x03" + bytes(4)), r"filters \[1, 3"),
    "plugin filter": (lambda: blosc2_variant(filters=b"\x24" + bytes(5)), r"filters \[36"),
    "user filter": (lambda: blosc2_variant(filters=b"\x01\xa0" + bytes(4)), r"filters \[1, 160"),
    "filter meta": (lambda: blosc2_variant(filters_meta=b"\x04" + bytes(5)), r"metas \[4"),
    "delta flag": (lambda: blosc2_variant(flags=0x8D), "flags 0x8d"),
    "blosc1 header": (lambda: blosc2_variant(flags=0x81), "flags 0x81"),
    "format 6": (lambda: blosc2_variant(version=6), "chunk format 6.1"),
    "codec format 2": (lambda: blosc2_variant(versionlz=2), "chunk format 5.2"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_blosc2_chunk_s3kv_never_writes_is_corrupt_before_blosc2_sees_it(name, tmp_path, monkeypatch):
    """Each field of the header outside the one form s3kv writes, in a frame
    whose checksum passes (anyone who may write to the bucket makes one):
    corrupt, the page untouched, no process started."""
    make, says = HOSTILE[name]
    runs = watch_python(tmp_path, monkeypatch)
    header, stored = _refit(_encode("blosc2", _layers(size=4096)), 0, make())
    out = np.full(4096, 0xA5, np.uint8)
    with pytest.raises(CorruptChunk, match=f"frame 0: blosc2 .*{says}"):
        codec.decode_frame(header, 0, stored, out=out)
    assert (out == 0xA5).all() and not runs.exists()


def test_the_witness_sees_blosc2_run_python_for_a_plugin_codec(tmp_path, monkeypatch):
    """What the test above relies on: c-blosc2, handed a chunk naming a
    plugin codec it lacks, runs ``python`` to look for it (twice: python,
    then python3) and fails; and decodes an uninitialized chunk without
    writing a byte."""
    import blosc2

    runs = watch_python(tmp_path, monkeypatch)
    out = np.full(4096, 0xA5, np.uint8)
    with pytest.raises(ValueError, match="Error while decompressing"):
        blosc2.decompress2(plugin_frame(36), dst=out)
    assert runs.read_text().count("import blosc2_openhtj2k") == 2
    blosc2.decompress2(special_frame(4), dst=out)
    assert (out == 0xA5).all()


def _kinds(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Pages s3kv may store: random (copied, not compressed), zeros (blosc2's
    special chunk), bf16-like, and mixes of them."""
    half = np.zeros(n, np.uint8)
    half[: n // 2] = rng.integers(0, 256, n // 2, dtype=np.uint8)
    return {
        "random": rng.integers(0, 256, n, dtype=np.uint8),
        "zeros": np.zeros(n, np.uint8),
        "bf16": _layers(1, n + n % 2, int(rng.integers(100)))[0][:n],
        "half zeros": half,
        "one value": np.full(n, 0x3F, np.uint8),
    }


def test_every_blosc2_chunk_s3kv_writes_passes_the_check_and_decodes():
    """The allow-list admits what s3kv's own writer makes, of each kind of
    page, item size, level and size (under 32 bytes blosc2 copies with
    another compressor id; incompressible bytes are copied; zeros are a
    special chunk): every form blosc2 chose is seen, and decodes whole."""
    rng = np.random.default_rng(1)
    forms = set()
    for itemsize in (1, 2, 4, 8, 16):
        for n in (itemsize, 16, 32, 48, 4096, 65536 + itemsize, 1 << 20):
            n -= n % itemsize
            for kind, raw in _kinds(n, rng).items():
                for level in (1, 5, 9):
                    stored = codec.blosc2_compress(raw, itemsize, level)
                    blosc2_format.check_blosc2_header(0, stored, n, itemsize)
                    h = _b2_header(stored)
                    forms.add((h.flags, h.blosc2_flags))
                    out = np.full(n, 0xA5, np.uint8)
                    codec._blosc2_decode(0, stored, n, itemsize, out)
                    assert np.array_equal(out, raw), (itemsize, n, kind, level)
    # zstd; copied; copied without a compressor (< 32 bytes); unsplit; zeros
    assert {(0x85, 0), (0x87, 0), (0x07, 0), (0x95, 0), (0x85, 0x10)} <= forms, forms
