"""s3kv's blosc2 frames (:mod:`s3kv.blosc2_format`): blosc2 set to work on
the calling thread without the GIL; every chunk s3kv writes admitted and
decoded whole; every other form refused from its header, before blosc2 sees
it (a plugin codec blosc2 would look for by running ``python``, special and
lazy chunks that leave bytes of the page unwritten)."""

import numpy as np
import pytest

from s3kv import blosc2_format, codec
from s3kv.errors import CorruptChunk
from tests.unit.test_codec import _encode, _layers, _refit


def test_blosc2_lets_go_of_the_gil_and_works_on_the_calling_thread_only():
    """s3kv decodes frames on several codec threads at once: blosc2 must not
    hold the GIL meanwhile (python-blosc2's default), nor start threads of its own."""
    import blosc2

    assert (
        blosc2.set_releasegil(True) is True
    )  # what s3kv.blosc2_format set (this returns the previous value)
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
    good = blosc2_format.blosc2_compress(_bf16(raw_length), itemsize, 1)
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
                    stored = blosc2_format.blosc2_compress(raw, itemsize, level)
                    blosc2_format.check_blosc2_header(0, stored, n, itemsize)
                    h = _b2_header(stored)
                    forms.add((h.flags, h.blosc2_flags))
                    out = np.full(n, 0xA5, np.uint8)
                    blosc2_format.decode_blosc2(0, stored, n, itemsize, out)
                    assert np.array_equal(out, raw), (itemsize, n, kind, level)
    # zstd; copied; copied without a compressor (< 32 bytes); unsplit; zeros
    assert {(0x85, 0), (0x87, 0), (0x07, 0), (0x95, 0), (0x85, 0x10)} <= forms, forms


def test_frames_are_written_in_blocks_of_256_kib_and_read_in_any_block_size():
    """The writer cuts a frame into BLOSC2_BLOCKSIZE blocks (a smaller frame
    is one block), which decode faster than blosc2's own 64 KiB choice; the
    block size is the chunk header's, so a frame in blosc2's own blocks (as
    s3kv wrote them before) passes the check and decodes as well."""
    import blosc2

    for n in (4096, 256 << 10, 1 << 20):
        raw = _bf16(n)
        stored = blosc2_format.blosc2_compress(raw, 2, 1)
        assert _b2_header(stored).blocksize == min(n, blosc2_format.BLOSC2_BLOCKSIZE)
        older = blosc2.compress2(
            raw, typesize=2, clevel=1, codec=blosc2.Codec.ZSTD, filters=[blosc2.Filter.SHUFFLE]
        )
        if n > 64 << 10:
            assert _b2_header(older).blocksize < _b2_header(stored).blocksize
        for frame in (stored, older):
            blosc2_format.check_blosc2_header(0, frame, n, 2)
            out = np.full(n, 0xA5, np.uint8)
            blosc2_format.decode_blosc2(0, frame, n, 2, out)
            assert np.array_equal(out, raw)
