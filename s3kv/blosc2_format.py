"""s3kv's ``blosc2`` frames: the one form of blosc2 chunk s3kv writes, the
check that admits only it, and the decode that runs only after it.

A ``blosc2`` frame (:func:`blosc2_compress`) is one blosc2 chunk:
``blosc2.compress2(raw, typesize=itemsize, clevel=1..9, codec=ZSTD,
filters=[SHUFFLE])``. Its 32-byte header (c-blosc2's README_CHUNK_FORMAT.rst)
can say much more than s3kv ever writes, and some of it is dangerous to hand
to blosc2: a codec or filter id of a plugin makes c-blosc2 look for the
plugin's library (``popen`` of ``python -c "import blosc2_<name>; ..."``)
and load it, to run it on the frame's bytes; a special chunk of
uninitialized values, or a lazy chunk, decodes without writing every byte
of its destination (which then keeps what the pages held: another
request's KV). :func:`check_blosc2_header` reads the header's bytes itself,
before blosc2 sees the frame, and admits only the forms blosc2 makes of
s3kv's input (compressed, copied where it would not compress, a header only
for all zeros). Anything else is corrupt.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import blosc2
import numpy as np

from s3kv.errors import CorruptChunk

# One frame per call on s3kv's codec threads: blosc2 works on the calling
# thread only, and lets go of the GIL meanwhile (python-blosc2 holds it by
# default, which would serialise the codec threads and stall the engine's
# own Python). Both are process-wide settings of blosc2.
blosc2.set_nthreads(1)
blosc2.set_releasegil(True)
BLOSC2_OVERHEAD = blosc2.MAX_OVERHEAD
"""The most a blosc2 chunk adds to what it holds (incompressible bytes are copied)."""


class Blosc2Header(NamedTuple):
    """A blosc2 chunk's 32-byte header (c-blosc2's README_CHUNK_FORMAT.rst)."""

    version: int
    versionlz: int
    """The codec's format version."""
    flags: int
    typesize: int
    nbytes: int
    blocksize: int
    cbytes: int
    filters: bytes
    """The filter pipeline's six filter ids."""
    codec: int
    codec_meta: int
    filters_meta: bytes
    flags2: int
    blosc2_flags: int


BLOSC2_HEADER = struct.Struct("<BBBBiii6sBB6sBB")
_B2_VERSION = (5, 1)
"""Chunk format 5 (blosc2's stable one), codec format 1: what blosc2 writes."""
_B2_EXTENDED = 0x05
"""flags: the byte- and bit-shuffle bits both set mark the 32-byte header."""
_B2_MEMCPYED = 0x02
"""flags: the bytes follow the header as they are (what would not compress)."""
_B2_UNSPLIT = 0x10
"""flags: blocks are not split into one stream per byte (blosc2 decides)."""
_B2_COMPRESSOR = 0xE0
_B2_ZSTD = 4 << 5
"""flags' top three bits: the compressor format, zstd; 0 (blosclz) where
memcpyed, which decodes without a codec (an input under 32 bytes)."""
_B2_FILTERS = bytes([blosc2.Filter.SHUFFLE.value, 0, 0, 0, 0, 0])
"""A byte shuffle by the typesize (meta 0), then nothing."""
_B2_SPECIAL_ZERO = 0x10
"""blosc2 flags: the whole chunk is zeros (a header only), what blosc2 writes
for all-zero input; decoded by memset, every byte written."""
_B2_FLAG_NAMES = (
    (0x01, "a dictionary"),
    (0x02, "big-endian data"),
    (0x04, "a codec byte before the chunk"),
    (0x08, "a lazy chunk"),
    (0x80, "an instrumented codec"),
)
_B2_SPECIALS = {1: "zeros", 2: "NaNs", 3: "a repeated value", 4: "uninitialized bytes"}


def _blosc2_refusal(h: Blosc2Header, typesize: int) -> str | None:
    """Why a blosc2 chunk of header ``h`` is not of the form s3kv writes with
    ``typesize``, or None: the allow-list, of the header's fields alone."""
    memcpyed = bool(h.flags & _B2_MEMCPYED)
    compressor = h.flags & _B2_COMPRESSOR
    if (h.version, h.versionlz) != _B2_VERSION:
        return f"chunk format {h.version}.{h.versionlz}, s3kv writes {_B2_VERSION[0]}.{_B2_VERSION[1]}"
    if h.flags & ~(_B2_MEMCPYED | _B2_UNSPLIT | _B2_COMPRESSOR) != _B2_EXTENDED:
        return f"flags {h.flags:#04x}: not the 32-byte header of a shuffled chunk (delta? blosc1?)"
    if compressor != _B2_ZSTD and not (memcpyed and compressor == 0):
        return f"compressor format {compressor >> 5} (codec id {h.codec}), s3kv writes zstd"
    if (h.codec, h.codec_meta) != (blosc2.Codec.ZSTD.value, 0):
        return f"codec id {h.codec} (meta {h.codec_meta}), s3kv writes zstd ({blosc2.Codec.ZSTD.value})"
    if h.filters != _B2_FILTERS or any(h.filters_meta):
        return f"filters {list(h.filters)} (metas {list(h.filters_meta)}), s3kv writes a byte shuffle only"
    if h.typesize != typesize:
        return f"typesize {h.typesize}, the object's shuffle item size is {typesize}"
    if h.flags2:
        return f"flags2 {h.flags2:#04x} (variable-length blocks?), s3kv writes none"
    if h.blosc2_flags == _B2_SPECIAL_ZERO and not memcpyed and h.cbytes == BLOSC2_HEADER.size:
        return None
    if h.blosc2_flags:
        what = [name for bit, name in _B2_FLAG_NAMES if h.blosc2_flags & bit]
        special = (h.blosc2_flags >> 4) & 0x07
        if special:
            what.append(f"a chunk of {_B2_SPECIALS.get(special, f'special value {special}')}")
        return f"blosc2 flags {h.blosc2_flags:#04x} ({', '.join(what)}): s3kv never writes them"
    if memcpyed and h.cbytes != h.nbytes + BLOSC2_HEADER.size:
        return f"a copied chunk of {h.nbytes} bytes in {h.cbytes}"
    return None


def check_blosc2_header(index: int, stored: bytes | memoryview, raw_length: int, typesize: int) -> None:
    """Raise CorruptChunk unless frame ``index`` is a blosc2 chunk of the
    form s3kv writes, of ``raw_length`` bytes shuffled by ``typesize``:
    zstd, a byte shuffle, no dictionary, lazy chunk or special value but
    all-zero input's. Nothing but the header's bytes is read."""
    if len(stored) < BLOSC2_HEADER.size:
        raise CorruptChunk(
            f"frame {index}: not a blosc2 chunk: {len(stored)} bytes, "
            f"shorter than its {BLOSC2_HEADER.size}-byte header"
        )
    h = Blosc2Header._make(BLOSC2_HEADER.unpack_from(stored))
    if h.nbytes != raw_length or h.cbytes != len(stored):
        raise CorruptChunk(
            f"frame {index}: blosc2 chunk of {h.nbytes} bytes in {h.cbytes}, the frame table says "
            f"{raw_length} in {len(stored)}"
        )
    why = _blosc2_refusal(h, typesize)
    if why is not None:
        raise CorruptChunk(f"frame {index}: blosc2 {why}")


BLOSC2_BLOCKSIZE = 256 << 10
"""The blocks s3kv's blosc2 frames are cut into (a smaller frame is one
block). blosc2's own choice for KV pages at level 1 is 64 KiB; 256 KiB
blocks decode faster (fewer zstd blocks, each with its tables to read) for
0.3% more stored bytes (benchmarks/ANALYSIS.md, issue 31). The block size
is a field of the chunk's header that every reader of blosc2 chunks
follows: frames of either size are read alike, by this s3kv and older ones."""


def blosc2_compress(raw: np.ndarray, itemsize: int, level: int) -> bytes:
    """One frame as a blosc2 chunk: shuffled by ``itemsize``, zstd at
    ``level`` (clamped to blosc2's 1..9), in blocks of
    :data:`BLOSC2_BLOCKSIZE`, on this thread only."""
    return blosc2.compress2(
        raw,
        typesize=itemsize,
        clevel=max(1, min(9, level)),
        codec=blosc2.Codec.ZSTD,
        filters=[blosc2.Filter.SHUFFLE],
        blocksize=BLOSC2_BLOCKSIZE,
    )


def decode_blosc2(
    index: int, stored: bytes | memoryview, raw_length: int, typesize: int, out: np.ndarray | None
) -> np.ndarray:
    """A blosc2 frame into ``out`` (or a new buffer), once its header is of
    the form s3kv writes and agrees with the frame table: every byte up to
    ``raw_length`` is written, and nothing past it."""
    check_blosc2_header(index, stored, raw_length, typesize)
    dst = np.empty(raw_length, dtype=np.uint8) if out is None else out.reshape(-1)
    try:
        blosc2.decompress2(stored, dst=dst)
    except Exception as e:
        raise CorruptChunk(f"frame {index}: blosc2: {e}") from e
    return dst
