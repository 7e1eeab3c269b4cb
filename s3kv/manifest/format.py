"""The bytes of one manifest object (segment, snapshot or access record;
their names and stamps are :mod:`s3kv.manifest.protocol`'s).

Each object: a 32-byte prefix (magic ``S3KM``, version, kind, flags, counts,
xxh3 of the rest), a JSON header, then little-endian uint64 arrays, sorted;
signed (flag 1, with the fleet secret), a 24-byte trailer: the key id and a
keyed-BLAKE3 MAC of everything before it. Versions as for chunk objects
(:mod:`s3kv.codec`): an unsigned object is version 1, exactly what s3kv
wrote before signing existed (older readers keep reading it); a signed one
is version 2 (older readers refuse it by its version); a higher version is
refused as :class:`~s3kv.errors.UnsupportedManifestVersion`.

A segment may name *bad* chunk objects (``meta["bad"]``: object names and
the ETags read), corrupt ones a replica could not delete: its removals drop
them from every replica's manifest, replicas then never publish them from a
412, and ``s3kv gc`` deletes them. A snapshot's header carries the bad
records of the segments it covers, in the same format
(:mod:`s3kv.manifest.bad`).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from s3kv.errors import CorruptManifest, UnsignedManifest, UnsupportedManifestVersion
from s3kv.manifest.arrays import EMPTY, as_sorted_unique

if TYPE_CHECKING:
    from s3kv.auth import FleetKeys

MAGIC = b"S3KM"
UNSIGNED_VERSION = 1
SIGNED_VERSION = 2
READ_VERSIONS = (UNSIGNED_VERSION, SIGNED_VERSION)
FLAG_SIGNED = 1
PREFIX = struct.Struct("<4sHBBIQQ")  # magic, version, kind, flags, header len, n_add, n_del
CHECKSUM = struct.Struct("<Q")
TRAILER = struct.Struct("<8s16s")  # key id, MAC
KINDS = {"segment": 1, "snapshot": 2, "access": 3, "epoch": 4}
_KIND_NAMES = {v: k for k, v in KINDS.items()}
MIN_BYTES = PREFIX.size + CHECKSUM.size
"""No manifest object is shorter: a smaller one is garbage without a GET."""


@dataclass
class ManifestObject:
    kind: str
    added: np.ndarray = field(default_factory=lambda: EMPTY)
    """Sorted, unique uint64 fingerprints (a snapshot: all of them)."""
    removed: np.ndarray = field(default_factory=lambda: EMPTY)
    meta: dict[str, Any] = field(default_factory=dict)


def encode(obj: ManifestObject, keys: FleetKeys | None = None) -> bytes:
    """The object's bytes; with ``keys``, signed with the fleet's signing key."""
    return frame(obj.kind, obj.meta, as_sorted_unique(obj.added), as_sorted_unique(obj.removed), keys)


def frame(
    kind: str, meta: dict[str, Any], added: np.ndarray, removed: np.ndarray, keys: FleetKeys | None = None
) -> bytes:
    """Prefix, checksum, header, arrays (as given) and, with ``keys``, the
    MAC trailer: every manifest object's framing (an epoch's arrays are its
    members' one after another, so not sorted as a whole)."""
    added_b = np.asarray(added, dtype="<u8").tobytes()
    removed_b = np.asarray(removed, dtype="<u8").tobytes()
    header = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
    body = header + added_b + removed_b
    version, flags = (SIGNED_VERSION, FLAG_SIGNED) if keys is not None else (UNSIGNED_VERSION, 0)
    prefix = PREFIX.pack(
        MAGIC, version, KINDS[kind], flags, len(header), len(added_b) // 8, len(removed_b) // 8
    )
    data = prefix + CHECKSUM.pack(xxhash.xxh3_64_intdigest(prefix + body)) + body
    if keys is not None:
        data += TRAILER.pack(keys.signing_kid, keys.sign("manifest", data))
    return data


def _check_prefix(data: bytes, name: str) -> tuple[int, int, int, int, int, int]:
    """(version, kind, flags, header length, n_add, n_del) of a sound prefix."""
    if len(data) < PREFIX.size:
        raise CorruptManifest(f"{name}: {len(data)} bytes, shorter than its prefix")
    magic, version, kind, flags, hlen, n_add, n_del = PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CorruptManifest(f"{name}: bad magic {bytes(magic)!r}")
    if version not in READ_VERSIONS:
        error = UnsupportedManifestVersion if version > SIGNED_VERSION else CorruptManifest
        raise error(
            f"{name}: manifest format version {version}; this s3kv reads {', '.join(map(str, READ_VERSIONS))}"
        )
    if kind not in _KIND_NAMES or flags & ~FLAG_SIGNED or (flags and version < SIGNED_VERSION):
        raise CorruptManifest(f"{name}: unknown kind {kind} or flags {flags}")
    return version, kind, flags, hlen, n_add, n_del


def decode(data: bytes, *, name: str = "manifest object", keys: FleetKeys | None = None) -> ManifestObject:
    """Check and decode a whole object. With ``keys``, only one signed with a
    fleet key passes (UnsignedManifest otherwise), its MAC checked first."""
    obj = unframe(data, name=name, keys=keys)
    if not (_sorted_unique(obj.added) and _sorted_unique(obj.removed)):
        raise CorruptManifest(f"{name}: fingerprints are not sorted and unique")
    return obj


def _sorted_unique(a: np.ndarray) -> bool:
    return len(a) < 2 or bool((a[1:] > a[:-1]).all())


def unframe(data: bytes, *, name: str = "manifest object", keys: FleetKeys | None = None) -> ManifestObject:
    """:func:`decode` less the check that the arrays are sorted and unique:
    the framing (size, checksum, MAC, header) checked, the arrays as written."""
    head = PREFIX.size + CHECKSUM.size
    if len(data) < head:
        raise CorruptManifest(f"{name}: {len(data)} bytes, shorter than its prefix")
    _version, kind, flags, hlen, n_add, n_del = _check_prefix(data, name)
    trailer = TRAILER.size if flags & FLAG_SIGNED else 0
    if keys is not None:
        if not trailer:
            raise UnsignedManifest(
                f"{name}: unsigned (the fleet secret is set: only signed objects are read)"
            )
        if len(data) < head + trailer:
            raise CorruptManifest(f"{name}: {len(data)} bytes, shorter than a signed object")
        kid, tag = TRAILER.unpack_from(data, len(data) - trailer)
        if not keys.knows(kid):
            raise UnsignedManifest(f"{name}: signed with key id {kid.hex()}, not one of the fleet's keys")
        if not keys.verify("manifest", kid, tag, memoryview(data)[: len(data) - trailer]):
            raise UnsignedManifest(f"{name}: MAC mismatch (not written with the fleet's secret)")
    expect = head + hlen + 8 * (n_add + n_del) + trailer
    if len(data) != expect:
        raise CorruptManifest(f"{name}: {len(data)} bytes, its prefix says {expect}")
    end = len(data) - trailer
    (checksum,) = CHECKSUM.unpack_from(data, PREFIX.size)
    if xxhash.xxh3_64_intdigest(data[: PREFIX.size] + data[head:end]) != checksum:
        raise CorruptManifest(f"{name}: checksum mismatch")
    try:
        meta = json.loads(data[head : head + hlen])
    except ValueError as e:
        raise CorruptManifest(f"{name}: malformed header: {e}") from e
    start = head + hlen
    added = np.frombuffer(data, dtype="<u8", count=n_add, offset=start).astype(np.uint64)
    removed = np.frombuffer(data, dtype="<u8", count=n_del, offset=start + 8 * n_add).astype(np.uint64)
    return ManifestObject(_KIND_NAMES[kind], added, removed, meta if isinstance(meta, dict) else {})


def is_signed(prefix: bytes) -> bool:
    """Whether an object's prefix says it is signed."""
    return len(prefix) >= PREFIX.size and bool(PREFIX.unpack_from(prefix)[3] & FLAG_SIGNED)


def head_length(prefix: bytes) -> int:
    """Bytes of prefix, checksum and JSON header, from the object's first 32 bytes."""
    if len(prefix) < PREFIX.size:
        raise CorruptManifest(f"{len(prefix)} bytes, shorter than a manifest prefix")
    magic, _version, _kind, _flags, hlen, _n_add, _n_del = PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise CorruptManifest(f"bad magic {bytes(magic)!r}")
    return PREFIX.size + CHECKSUM.size + hlen


def decode_head(data: bytes, *, name: str = "manifest object") -> tuple[str, int, int, dict[str, Any]]:
    """(kind, fingerprints added, removed, header) from the first
    :func:`head_length` bytes, without reading (or checking) the arrays."""
    if len(data) < head_length(data):
        raise CorruptManifest(f"{name}: truncated inside its header")
    _version, kind, _flags, hlen, n_add, n_del = _check_prefix(data, name)
    head = PREFIX.size + CHECKSUM.size
    try:
        meta = json.loads(data[head : head + hlen])
    except ValueError as e:
        raise CorruptManifest(f"{name}: malformed header: {e}") from e
    return _KIND_NAMES[kind], n_add, n_del, meta if isinstance(meta, dict) else {}
