"""Namespaces, chained chunk keys and the names of chunk objects.

A *namespace* is a hash of everything that makes KV bytes interchangeable
(format version, model identity, dtype, block size, page shapes, attention
layout, TP size). A *chunk key* chains: ``k_i = xxh3_128(k_{i-1} || tokens_i ||
extras_i)`` with ``k_{-1}`` the namespace, so a key names a whole prefix, not
just its last chunk. Keys depend only on their inputs (never on
``PYTHONHASHSEED`` or vLLM's hash settings): two processes on two machines get
the same key for the same prefix.

With vLLM's block hashes (:func:`hash_keys`, the *block scheme*), a chunk's
key is instead the first 16 bytes of the hash of the chunk's last block
(which names every token and extra key up to the chunk's end) XOR a mask
of the namespace (:func:`hash_key_mask`): no token is touched. vLLM's
hashes are the same in every process only where its algorithm and seed
are, so those are namespace fields under that scheme.

A chunk shard's name, ``{namespace}/{kk}/{key}.r{rank}`` (:func:`chunk_path`),
is the same in S3 (under the bucket's prefix) and on NVMe (under
``disk_path``); this module alone builds and parses it.
"""

from __future__ import annotations

import array
import functools
import struct
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

FORMAT_VERSION = 1
"""Bump when the meaning of stored bytes changes; it is part of every namespace."""

KEY_BYTES = 16


def canonical_bytes(obj: Any) -> bytes:
    """A stable, unambiguous byte encoding of nested None/bool/int/float/str/
    bytes/tuple/list/dict values (dict keys sorted by their encoding).

    Used for vLLM's extra keys (LoRA, multimodal hashes, cache_salt, prompt
    embedding hashes) and for namespace fields. Raises TypeError on anything
    else rather than falling back to ``repr``.
    """
    out = bytearray()
    _encode(obj, out)
    return bytes(out)


def _encode(obj: Any, out: bytearray) -> None:
    if obj is None:
        out += b"N"
    elif obj is True:
        out += b"T"
    elif obj is False:
        out += b"F"
    elif isinstance(obj, int):
        digits = str(obj).encode()
        out += b"i" + struct.pack("<I", len(digits)) + digits
    elif isinstance(obj, float):
        out += b"f" + struct.pack("<d", obj)
    elif isinstance(obj, str):
        data = obj.encode("utf-8")
        out += b"s" + struct.pack("<I", len(data)) + data
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        data = bytes(obj)
        out += b"b" + struct.pack("<I", len(data)) + data
    elif isinstance(obj, (tuple, list)):
        out += b"l" + struct.pack("<I", len(obj))
        for item in obj:
            _encode(item, out)
    elif isinstance(obj, Mapping):
        items = sorted((canonical_bytes(k), canonical_bytes(v)) for k, v in obj.items())
        out += b"d" + struct.pack("<I", len(items))
        for k, v in items:
            out += k + v
    else:
        raise TypeError(f"cannot encode {type(obj).__name__} canonically: {obj!r}")


@dataclass(frozen=True)
class Namespace:
    """The compatibility class of stored KV: only equal namespaces share keys."""

    id: str
    """32 hex characters (xxh3_128 of the canonical fields)."""
    fields: Mapping[str, Any]
    """What went into the hash, kept for listings (``s3kv ls``)."""

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> Namespace:
        full = {"format_version": FORMAT_VERSION, **fields}
        return cls(id=xxhash.xxh3_128_hexdigest(canonical_bytes(full)), fields=full)

    @property
    def root_key(self) -> bytes:
        return bytes.fromhex(self.id)


_UINT32 = next(code for code in "IL" if array.array(code).itemsize == 4)
_BIG_ENDIAN = sys.byteorder == "big"


def tokens_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32, the form hashed into chunk keys."""
    if not isinstance(token_ids, np.ndarray):
        # array.array takes a list of ints ~4x faster than numpy does: this
        # runs on the first lookup of every request, in vLLM's scheduling loop.
        try:
            packed = array.array(_UINT32, token_ids)
        except (OverflowError, TypeError) as e:
            raise ValueError(f"token ids must fit in uint32: {e}") from None
        if sys.byteorder != "little":
            packed.byteswap()
        return packed.tobytes()
    if token_ids.size and (token_ids.min() < 0 or token_ids.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    return token_ids.astype("<u4", copy=False).tobytes()


def chain_keys(
    namespace: Namespace,
    token_ids: Sequence[int] | np.ndarray,
    chunk_tokens: int,
    extras: Sequence[Any] | None = None,
    *,
    parent: bytes | None = None,
    start_chunk: int = 0,
    max_chunks: int | None = None,
) -> list[bytes]:
    """Keys of the full chunks of ``token_ids`` (at most ``max_chunks``).

    ``extras[i]`` (optional) are the extra keys of chunk ``start_chunk + i``
    (anything :func:`canonical_bytes` accepts; ``None`` for none). To extend an
    earlier chain, pass its last key as ``parent`` and the token ids from the
    first new chunk on, with ``start_chunk`` set to that chunk's index.
    """
    if chunk_tokens <= 0:
        raise ValueError("chunk_tokens must be positive")
    if max_chunks is not None and len(token_ids) >= (max_chunks + 1) * chunk_tokens:
        token_ids = token_ids[: max_chunks * chunk_tokens]  # a tail of less than a chunk makes no key
    data = tokens_bytes(token_ids)
    step = 4 * chunk_tokens
    n_chunks = len(data) // step
    prev = namespace.root_key if parent is None else parent
    if parent is None and start_chunk != 0:
        raise ValueError("start_chunk > 0 needs the parent key")
    keys: list[bytes] = []
    for i in range(n_chunks):
        extra = extras[i] if extras is not None and i < len(extras) else None
        h = xxhash.xxh3_128()
        h.update(prev)
        h.update(data[i * step : (i + 1) * step])
        if extra is not None and extra != () and extra != []:
            h.update(canonical_bytes(extra))
        prev = h.digest()
        keys.append(prev)
    return keys


def hash_key_mask(namespace: Namespace, adapter: str | None = None) -> bytes:
    """The 16-byte mask that turns vLLM's block hashes into ``namespace``'s
    chunk keys (:func:`hash_keys`); ``adapter`` (a LoRA adapter's content
    digest) gives its requests their own keys: vLLM's hashes name an adapter
    by its name and path, which may point at other weights on another replica."""
    return xxhash.xxh3_128_digest(namespace.root_key + canonical_bytes(("block-hash-keys", adapter)))


@functools.lru_cache(maxsize=256)
def _hash_keys_layout(mask: bytes, n: int, hash_bytes: int) -> tuple[struct.Struct, np.ndarray]:
    """What :func:`hash_keys` needs for ``n`` hashes: the struct that cuts
    each key out of the masked hashes, and the mask laid over all of them
    as 64-bit words (zero past each key's 16 bytes)."""
    cut = struct.Struct(f"{KEY_BYTES}s{hash_bytes - KEY_BYTES}x" * n)
    words = np.frombuffer((mask + bytes(hash_bytes - KEY_BYTES)) * n, dtype=np.uint64)
    return cut, words


def hash_keys(hashes: Sequence[bytes], mask: bytes, hash_bytes: int) -> tuple[list[bytes], np.ndarray]:
    """Chunk keys (and their fingerprints, as :func:`fingerprint` reads them)
    from the hash of each chunk's last block: the hash's first 16 bytes XOR
    ``mask``, all chunks at once: one numpy XOR of the joined hashes' words
    (XOR is bytewise: the words' byte order does not matter), one struct
    unpack of the keys from its buffer, the fingerprints the first word of
    each read big-endian (fewer and cheaper calls than an XOR of two Python
    ints of the same bytes). Every hash is ``hash_bytes`` long (a multiple
    of 8, at least 16; ValueError otherwise)."""
    n = len(hashes)
    if not n:
        return [], np.empty(0, dtype=np.uint64)
    raw = b"".join(hashes)
    if hash_bytes < KEY_BYTES or hash_bytes % 8 or len(raw) != n * hash_bytes or len(mask) != KEY_BYTES:
        raise ValueError(f"block hashes must be {hash_bytes} bytes each, the mask {KEY_BYTES}")
    cut, words = _hash_keys_layout(mask, n, hash_bytes)
    masked = np.frombuffer(raw, dtype=np.uint64) ^ words
    first = masked[:: hash_bytes // 8]  # each key's first 8 bytes, in this machine's order
    fps = first.copy() if _BIG_ENDIAN else first.byteswap()
    return list(cut.unpack(masked)), fps


def fingerprint(key: bytes) -> int:
    """The 64-bit fingerprint of a chunk key (its first 8 bytes, big-endian)."""
    return int.from_bytes(key[:8], "big")


def chunk_path(namespace_id: str, key: bytes, rank: int) -> str:
    """``{namespace}/{kk}/{key}.r{rank}``: where one rank's shard of a chunk
    lives, the same below the bucket's prefix in S3 (:func:`object_key`) and
    below ``disk_path`` on NVMe. The two leading hash characters (the shard
    directory) spread load over S3's per-prefix request limits."""
    hexkey = key.hex()
    return f"{namespace_id}/{hexkey[:2]}/{hexkey}.r{rank}"


def object_key(prefix: str, namespace_id: str, key: bytes, rank: int) -> str:
    """``{prefix}/{namespace}/{kk}/{key}.r{rank}``: the S3 object of one rank's
    shard of a chunk (:func:`chunk_path` under the prefix)."""
    path = chunk_path(namespace_id, key, rank)
    return f"{prefix}/{path}" if prefix else path


def namespace_prefix(prefix: str, namespace_id: str) -> str:
    """The listing prefix of every object of a namespace (ends with '/')."""
    return f"{prefix}/{namespace_id}/" if prefix else f"{namespace_id}/"


_HEX_DIGITS = frozenset("0123456789abcdef")


def _is_hex(text: str, length: int) -> bool:
    """``text`` is ``length`` lower-case hex digits (as ``bytes.hex`` writes)."""
    return len(text) == length and _HEX_DIGITS.issuperset(text)


def is_namespace_id(name: str) -> bool:
    """Whether ``name`` can be a namespace id (the first part of a chunk path)."""
    return _is_hex(name, 32)


def is_shard_name(name: str) -> bool:
    """Whether ``name`` can be a shard directory (the second part of a chunk path)."""
    return _is_hex(name, 2)


def parse_chunk_name(name: str, shard: str) -> tuple[bytes, int] | None:
    """(chunk key, rank) of a file or object named exactly as :func:`chunk_path`
    names it in the shard directory ``shard``; None for any other name (an
    upper-case or short key, another shard's key, a rank with a sign, a
    leading zero or a non-ASCII digit)."""
    hexkey, dot, rank = name.partition(".r")
    if not dot or not _is_hex(hexkey, 2 * KEY_BYTES) or hexkey[:2] != shard:
        return None
    if not (rank.isascii() and rank.isdigit()) or rank != str(int(rank)):
        return None
    return bytes.fromhex(hexkey), int(rank)


def parse_object_key(obj_key: str) -> tuple[str, bytes, int] | None:
    """(namespace id, chunk key, rank) of a chunk object name (any prefix,
    then exactly :func:`chunk_path`); None if it is not one (manifest
    segments, descriptors, foreign objects)."""
    parts = obj_key.rsplit("/", 3)
    if len(parts) < 3:
        return None
    ns, shard, name = parts[-3], parts[-2], parts[-1]
    parsed = parse_chunk_name(name, shard) if is_namespace_id(ns) else None
    return None if parsed is None else (ns, *parsed)


def iter_chunk_ranges(n_tokens: int, chunk_tokens: int) -> Iterable[tuple[int, int]]:
    """(start, end) token ranges of the full chunks among ``n_tokens``."""
    for start in range(0, n_tokens - chunk_tokens + 1, chunk_tokens):
        yield start, start + chunk_tokens
