"""The chunk object format.

One object holds one rank's shard of one chunk: every layer's KV pages for
``chunk_tokens`` tokens. Layout::

    prefix  24 bytes   magic "S3KV", format version u16, flags u16,
                       header length u32, xxh3_64 of the header u64, zero u32
    header  JSON       namespace, key, rank, tokens, codec, shuffle item size,
                       dtype, page shape, and per layer one frame entry
                       [offset, stored length, raw length, xxh3_64 of the stored
                       bytes(, MAC of the stored bytes)]; signed: the key id
    MAC     16 bytes   only when signed (flag 1): keyed BLAKE3 of prefix + header
    frames             one per layer, in layer order

Per-layer frames let a reader fetch a few layers per ranged GET and decode
them as they arrive. This module writes objects and holds the steps of
reading one (:func:`header_length`, :func:`parse_header`,
:func:`decode_frame`); :class:`s3kv.chunk_reader.ChunkReader` puts them
together with the identity and size checks, and every read of a chunk
object goes through it. Every byte that reaches a KV cache passed a checksum
(and, with a fleet secret, a MAC): anything else (truncation, flipped bits,
another namespace or key, a frame that would decode to another size than
its page) raises :class:`CorruptChunk` and returns nothing.

Versions: an unsigned object is version 1, byte for byte the layout s3kv
wrote before objects could be signed, so that older readers go on reading
what newer writers store without a secret. A signed object (flag 1, MACs)
is version 2: older readers refuse it by its version. A reader without the
secret reads version 2 by its checksums (the MAC is not checked); with the
secret, only version 2 objects whose MACs verify are read. A version 2
object without the flag (only the builds between the two wrote them) reads
as unsigned. A higher version raises :class:`UnsupportedFormat`: a newer
s3kv's object, unusable here but not damaged.

Codecs: ``zstd`` frames are s3kv's byte shuffle (numpy, plane by plane)
then zstd (:mod:`s3kv.zstd_format`); ``none`` frames are the page bytes.
Both are versions 1 and 2. ``blosc2`` frames are one blosc2 chunk each
(python-blosc2: SIMD shuffle and zstd in one C pass, decoded straight into
the destination buffer), only of the form s3kv writes
(:mod:`s3kv.blosc2_format`, which writes them, and checks a frame before
blosc2 sees it); such an object is version 3 (signed or not, by the flag),
so that s3kv builds from before it refuse it by its version (a miss to
them, never "corrupt", which a replica may delete) instead of misreading it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import xxhash

from s3kv import blosc2_format, zstd_format
from s3kv.errors import CorruptChunk, UnsupportedFormat

if TYPE_CHECKING:
    from s3kv.auth import FleetKeys

MAGIC = b"S3KV"
UNSIGNED_VERSION = 1
SIGNED_VERSION = 2
BLOSC2_VERSION = 3
READ_VERSIONS = (UNSIGNED_VERSION, SIGNED_VERSION, BLOSC2_VERSION)
FLAG_SIGNED = 1
PREFIX = struct.Struct("<4sHHIQI")
PREFIX_LEN = PREFIX.size  # 24
TAG_BYTES = 16
MAX_HEADER_LEN = 1 << 20
MAX_FRAME_RAW = 256 << 20
"""The most a frame may decode to where no engine says what its pages are
(``s3kv verify``): a frame that claims more is corrupt, not decompressed."""
CODECS = ("zstd", "none", "blosc2")
VERSION_CODECS = {
    UNSIGNED_VERSION: ("zstd", "none"),
    SIGNED_VERSION: ("zstd", "none"),
    BLOSC2_VERSION: ("blosc2",),
}
"""The codecs each version's objects may use."""
MAX_SHUFFLE = 16


class Frame(NamedTuple):
    """One layer's entry in the frame table (a tuple: a header has one per
    layer, and a load parses a header per chunk)."""

    offset: int
    length: int
    raw_length: int
    checksum: int
    tag: bytes | None = None
    """The frame's MAC, in a signed object."""

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class ChunkHeader:
    namespace: str
    key: str
    """Hex of the chunk key."""
    rank: int
    tokens: int
    codec: str
    shuffle: int
    """Item size the frames were byte-shuffled with; 1 means not shuffled."""
    dtype: str
    page_shape: tuple[int, ...]
    """Shape of one layer's stored page array (informational)."""
    frames: tuple[Frame, ...]
    header_length: int
    """Bytes of prefix + header (+ MAC): where frames may start."""
    kid: bytes | None = None
    """The id of the fleet key that signed it; None: unsigned."""
    version: int = UNSIGNED_VERSION

    @property
    def signed(self) -> bool:
        return self.kid is not None

    @cached_property
    def object_length(self) -> int:
        """Bytes of the whole object (asked more than once per load: worked out once)."""
        return max((f.end for f in self.frames), default=self.header_length)

    @property
    def raw_bytes(self) -> int:
        return sum(f.raw_length for f in self.frames)

    @property
    def stored_bytes(self) -> int:
        return sum(f.length for f in self.frames)

    def check_identity(self, namespace: str, key: str, rank: int) -> None:
        """Raise CorruptChunk unless this header is the object that was asked for."""
        if self.namespace != namespace:
            raise CorruptChunk(f"object is of namespace {self.namespace}, expected {namespace}")
        if self.key != key:
            raise CorruptChunk(f"object holds chunk {self.key}, expected {key}")
        if self.rank != rank:
            raise CorruptChunk(f"object holds rank {self.rank}, expected rank {rank}")


def _frame_tag(keys: FleetKeys, stored: bytes | memoryview) -> bytes:
    return keys.sign("chunk", b"frame", stored)


def encode_chunk(
    *,
    namespace: str,
    key: str,
    rank: int,
    tokens: int,
    layers: Sequence[memoryview | bytes | np.ndarray],
    dtype: str,
    itemsize: int,
    page_shape: Sequence[int],
    codec: str = "zstd",
    level: int = 1,
    keys: FleetKeys | None = None,
) -> bytes:
    """Encode one chunk shard: ``layers[i]`` are layer i's page bytes. With
    ``keys``, the object is signed with the fleet's signing key."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}")
    shuffle_size = itemsize if codec in ("zstd", "blosc2") else 1
    stored: list[bytes | memoryview] = []
    raw_lengths: list[int] = []
    for layer in layers:
        raw = (
            np.frombuffer(layer, dtype=np.uint8)
            if not isinstance(layer, np.ndarray)
            else layer.reshape(-1).view(np.uint8)
        )
        raw_lengths.append(raw.size)
        if codec == "zstd":
            stored.append(zstd_format.zstd_compress(raw, shuffle_size, level))
        elif codec == "blosc2":
            stored.append(blosc2_format.blosc2_compress(raw, shuffle_size, level))
        else:
            stored.append(memoryview(np.ascontiguousarray(raw)).cast("B"))
    tags = [_frame_tag(keys, blob).hex() for blob in stored] if keys is not None else None
    mac_len = TAG_BYTES if keys is not None else 0
    entries: list[list[int | str]] = []
    # Header length depends on the offsets it contains: compute with a
    # placeholder size, then fix the offsets (the JSON of ints is stable once
    # offsets only grow by the header length, so two passes suffice).
    header_len = 0
    for _ in range(3):
        offset = PREFIX_LEN + header_len + mac_len
        entries = []
        for i, (blob, raw_len) in enumerate(zip(stored, raw_lengths)):
            entry: list[int | str] = [offset, len(blob), raw_len, xxhash.xxh3_64_intdigest(blob)]
            if tags is not None:
                entry.append(tags[i])
            entries.append(entry)
            offset += len(blob)
        fields = {
            "ns": namespace,
            "key": key,
            "rank": rank,
            "tokens": tokens,
            "codec": codec,
            "shuffle": shuffle_size,
            "dtype": dtype,
            "page_shape": list(page_shape),
            "frames": entries,
        }
        if keys is not None:
            fields["kid"] = keys.signing_kid.hex()
        header = json.dumps(fields, separators=(",", ":")).encode()
        if len(header) == header_len:
            break
        header_len = len(header)
    else:  # pragma: no cover - offsets converge in two passes
        raise AssertionError("header length did not converge")
    version, flags = (SIGNED_VERSION, FLAG_SIGNED) if keys is not None else (UNSIGNED_VERSION, 0)
    if codec == "blosc2":
        version = BLOSC2_VERSION
    prefix = PREFIX.pack(MAGIC, version, flags, len(header), xxhash.xxh3_64_intdigest(header), 0)
    mac = [keys.sign("chunk", b"header", prefix, header)] if keys is not None else []
    return b"".join([prefix, header, *mac, *stored])


def header_length(prefix: bytes | memoryview, max_header_len: int = MAX_HEADER_LEN) -> int:
    """Total bytes of prefix + header (+ MAC), from the first PREFIX_LEN bytes.
    A header longer than ``max_header_len`` is refused before it is read."""
    if len(prefix) < PREFIX_LEN:
        raise CorruptChunk(f"object is {len(prefix)} bytes, shorter than the {PREFIX_LEN}-byte prefix")
    magic, version, flags, hlen, _hsum, zero = PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise CorruptChunk(f"bad magic {bytes(magic)!r}: not an s3kv chunk object")
    if version not in READ_VERSIONS:
        if version > max(READ_VERSIONS):
            raise UnsupportedFormat(version, READ_VERSIONS)
        raise CorruptChunk(f"chunk format version {version}: no s3kv writes it")
    if flags & ~FLAG_SIGNED or zero or (flags and version < SIGNED_VERSION):
        raise CorruptChunk(f"unknown flags {flags:#x}/{zero:#x} in the prefix")
    if hlen > max_header_len:
        raise CorruptChunk(f"header length {hlen} exceeds {max_header_len}")
    return PREFIX_LEN + hlen + (TAG_BYTES if flags & FLAG_SIGNED else 0)


def parse_header(
    data: bytes | memoryview, keys: FleetKeys | None = None, *, max_header_len: int = MAX_HEADER_LEN
) -> ChunkHeader:
    """Parse prefix and header from the start of an object. ``data`` must hold
    at least :func:`header_length` bytes; frames are not read. With ``keys``
    only an object signed with one of them passes (its MAC is checked before
    any field but the key id is used)."""
    total = header_length(data, max_header_len)
    if len(data) < total:
        raise CorruptChunk(f"object truncated inside its header ({len(data)} of {total} bytes)")
    _magic, version, flags, hlen, hsum, _zero = PREFIX.unpack_from(data)
    header = bytes(data[PREFIX_LEN : PREFIX_LEN + hlen])
    signed = bool(flags & FLAG_SIGNED)
    if keys is not None and not signed:
        raise CorruptChunk("unsigned object: with a fleet secret set, only objects signed with it are read")
    if xxhash.xxh3_64_intdigest(header) != hsum:
        raise CorruptChunk("header checksum mismatch")
    try:
        h = json.loads(header)
        kid = bytes.fromhex(h["kid"]) if signed else None
        if keys is not None:
            assert kid is not None
            if not keys.knows(kid):
                raise CorruptChunk(f"signed with key id {kid.hex()}, which is not one of the fleet's keys")
            if not keys.verify(
                "chunk", kid, data[PREFIX_LEN + hlen : total], b"header", data[:PREFIX_LEN], header
            ):
                raise CorruptChunk("header MAC mismatch: not written with the fleet's secret")
        frames = tuple(
            Frame(int(f[0]), int(f[1]), int(f[2]), int(f[3]), bytes.fromhex(f[4]) if signed else None)
            for f in h["frames"]
        )
        parsed = ChunkHeader(
            namespace=str(h["ns"]),
            key=str(h["key"]),
            rank=int(h["rank"]),
            tokens=int(h["tokens"]),
            codec=str(h["codec"]),
            shuffle=int(h["shuffle"]),
            dtype=str(h["dtype"]),
            page_shape=tuple(int(x) for x in h["page_shape"]),
            frames=frames,
            header_length=total,
            kid=kid,
            version=version,
        )
    except CorruptChunk:
        raise
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as e:
        raise CorruptChunk(f"malformed header: {type(e).__name__}: {e}") from e
    if parsed.codec not in VERSION_CODECS[version]:
        raise CorruptChunk(f"codec {parsed.codec!r} in a version {version} object")
    if not 1 <= parsed.shuffle <= MAX_SHUFFLE or (parsed.codec == "none" and parsed.shuffle != 1):
        raise CorruptChunk(f"bad shuffle item size {parsed.shuffle}")
    expect = total
    for f in frames:
        if f.offset != expect or f.length < 0 or f.raw_length < 0 or f.raw_length % parsed.shuffle:
            raise CorruptChunk("frame table is not contiguous, or a frame is not whole items")
        if signed and (f.tag is None or len(f.tag) != TAG_BYTES):
            raise CorruptChunk("a frame of a signed object has no MAC")
        expect = f.end
    return parsed


def check_frame_mac(header: ChunkHeader, index: int, stored: bytes | memoryview, keys: FleetKeys) -> None:
    """Raise CorruptChunk unless frame ``index`` of a header that passed
    ``keys`` carries a valid MAC of ``stored``."""
    check_frame_parts_mac(header, index, [stored], keys)


def check_frame_parts_mac(
    header: ChunkHeader, index: int, parts: Sequence[bytes | memoryview | np.ndarray], keys: FleetKeys
) -> None:
    """:func:`check_frame_mac` of a frame whose bytes are ``parts``, in order."""
    frame = header.frames[index]
    assert header.kid is not None and frame.tag is not None, "parse_header(keys) admits signed objects only"
    if not keys.verify("chunk", header.kid, frame.tag, b"frame", *parts):
        raise CorruptChunk(f"frame {index}: MAC mismatch")


def check_frame(
    header: ChunkHeader, index: int, stored: bytes | memoryview | np.ndarray, keys: FleetKeys | None = None
) -> None:
    """Check frame ``index``'s stored bytes: its length, then its MAC (with
    ``keys``, and a header that passed them) or its checksum."""
    check_frame_parts(header, index, [stored], keys)


def check_frame_parts(
    header: ChunkHeader,
    index: int,
    parts: Sequence[bytes | memoryview | np.ndarray],
    keys: FleetKeys | None = None,
) -> None:
    """:func:`check_frame` of a frame whose stored bytes are ``parts``, in
    order (a frame read straight into the pages it fills)."""
    frame = header.frames[index]
    n = 0
    for p in parts:
        n += p.nbytes if isinstance(p, (np.ndarray, memoryview)) else len(p)
    if n != frame.length:
        raise CorruptChunk(f"frame {index}: got {n} bytes, expected {frame.length}")
    if keys is not None:
        check_frame_parts_mac(header, index, parts, keys)
        return
    if len(parts) == 1:
        digest = xxhash.xxh3_64_intdigest(parts[0])
    else:
        h = xxhash.xxh3_64()
        for p in parts:
            h.update(p)
        digest = h.intdigest()
    if digest != frame.checksum:
        raise CorruptChunk(f"frame {index}: checksum mismatch")


def decode_frame(
    header: ChunkHeader,
    index: int,
    stored: bytes | memoryview,
    out: np.ndarray | None = None,
    keys: FleetKeys | None = None,
) -> np.ndarray:
    """Check and decode frame ``index`` from its stored bytes, into ``out`` if
    given. With ``keys`` (and a header that passed them), the frame's MAC is
    checked instead of its checksum. Nothing is decompressed into more than
    the frame's raw length, which the caller checked against its page."""
    frame = header.frames[index]
    check_frame(header, index, stored, keys)
    if out is not None and out.nbytes != frame.raw_length:
        raise CorruptChunk(f"frame {index}: holds {frame.raw_length} bytes, the page needs {out.nbytes}")
    if header.codec == "blosc2":
        # unshuffled in the same pass
        return blosc2_format.decode_blosc2(index, stored, frame.raw_length, header.shuffle, out)
    if header.codec == "none":
        if frame.length != frame.raw_length:
            raise CorruptChunk(f"frame {index}: {frame.length} stored bytes for {frame.raw_length} raw ones")
        raw = np.frombuffer(stored, dtype=np.uint8)
    else:
        raw = zstd_format.zstd_decompress(index, stored, frame.raw_length)
    if raw.size != frame.raw_length:
        raise CorruptChunk(f"frame {index}: decoded {raw.size} bytes, expected {frame.raw_length}")
    return zstd_format.unshuffle(raw, header.shuffle, out)
