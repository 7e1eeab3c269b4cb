"""Bounded reads of what the ops commands find in a bucket: an object's
head (through the end of a header that says its own length), an object no
larger than a bound (refused unread past it), manifest objects read as the
replicas read them (an epoch object by :mod:`s3kv.manifest.epochs`' decoder,
every other kind by :mod:`s3kv.manifest.format`'s), and namespace descriptors."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from s3kv.auth import FleetKeys
from s3kv.config import DEFAULTS
from s3kv.descriptor import MAX_BYTES as DESCRIPTOR_MAX_BYTES
from s3kv.descriptor import Described, parse_descriptor
from s3kv.errors import NotFound, RangeNotSatisfiable, S3KVError, TooLarge
from s3kv.manifest import epochs
from s3kv.manifest import format as mf
from s3kv.manifest.protocol import EPOCHS, parse_epoch
from s3kv.stores.base import HEAD_BYTES, ByteRange, ObjectMeta, ObjectStore


async def read_head_bytes(store: ObjectStore, key: str, length_of: Callable[[bytes], int]) -> bytes:
    """The first bytes of an object, up to the end of its header:
    ``length_of(first bytes)`` says where that is (one ranged GET, two for
    a header longer than 64 KiB)."""
    data = await store.get(key, ByteRange(0, HEAD_BYTES))
    need = length_of(data)
    if need > len(data):
        data += await store.get(key, ByteRange(len(data), need))
    return data


async def read_at_most(
    store: ObjectStore,
    meta: ObjectMeta,
    most: int,
    error: type[S3KVError] = TooLarge,
    what: str = "manifest object",
) -> bytes:
    """Listed object ``meta``'s bytes, refused (``error``) unread if it was
    listed larger than ``most``, and never more than ``most`` + 1 bytes of
    it read, whatever it became since it was listed."""
    if meta.size > most:
        raise error(f"{what} is {meta.size} bytes, more than {most}")
    try:
        data = await store.get(meta.key, ByteRange(0, most + 1))
    except RangeNotSatisfiable:  # empty
        return b""
    if len(data) > most:
        raise error(f"{what} is more than {most} bytes")
    return data


def epoch_base(name: str) -> str | None:
    """The manifest prefix of epoch object ``name`` (ending ``manifest/``), or
    None if ``name`` is no epoch object's."""
    cut = name.rfind("/manifest/" + EPOCHS)
    base = name[: cut + len("/manifest/")]
    return base if cut >= 0 and parse_epoch(base, name) is not None else None


def check_manifest(
    name: str, data: bytes, keys: FleetKeys | None = None, *, directory: bool | None = None
) -> None:
    """Check manifest object ``name`` as replicas read it: an epoch object
    whole, its members included (:func:`s3kv.manifest.epochs.decode`: its
    header names this epoch, every member a segment of the bucket's layout,
    ``directory``, None: either), any other kind by its framing and arrays.
    Raises what decoding it raised (CorruptManifest, UnsignedManifest with
    ``keys``, UnsupportedManifestVersion)."""
    base = epoch_base(name)
    if base is not None:
        epochs.decode(base, name, data, keys=keys, directory=directory)
    else:
        mf.decode(data, name=name, keys=keys)


async def read_manifest(
    store: ObjectStore,
    meta: ObjectMeta,
    keys: FleetKeys | None = None,
    max_bytes: int = DEFAULTS.manifest_max_bytes,
) -> mf.ManifestObject:
    """A listed manifest object, decoded (with ``keys``: only a signed one),
    read as replicas read it: TooLarge, unread past ``max_bytes`` (their
    ``manifest_max_bytes``), if it is larger."""
    return mf.decode(await read_at_most(store, meta, max_bytes), name=meta.key, keys=keys)


async def read_manifest_head(
    store: ObjectStore,
    meta: ObjectMeta,
    keys: FleetKeys | None = None,
    max_bytes: int = DEFAULTS.manifest_max_bytes,
) -> tuple[str, int, int, dict[str, Any]]:
    """A manifest object's kind, counts and header, with one or two ranged
    GETs; with ``keys``, read whole (as :func:`read_manifest`), so that its
    MAC is checked before the caller acts on what the header says."""
    if keys is not None or meta.size > max_bytes:  # the latter refused unread
        obj = await read_manifest(store, meta, keys, max_bytes)
        return obj.kind, len(obj.added), len(obj.removed), obj.meta

    def head_length(first: bytes) -> int:
        need = mf.head_length(first)
        if need > max_bytes:
            raise TooLarge(f"manifest object's header is {need} bytes, more than {max_bytes}")
        return need

    return mf.decode_head(await read_head_bytes(store, meta.key, head_length), name=meta.key)


async def read_descriptor(
    store: ObjectStore, key: str, ns: str
) -> tuple[dict[str, Any] | None, Described | None]:
    """Namespace ``ns``'s descriptor ``key``, as it reads (None unless a JSON
    object) and what it says (:func:`~s3kv.descriptor.parse_descriptor`), never reading
    more than :data:`~s3kv.DESCRIPTOR_MAX_BYTES` of it. Gone: (None, None)."""
    try:
        data = await store.get(key, ByteRange(0, DESCRIPTOR_MAX_BYTES + 1))
    except (NotFound, RangeNotSatisfiable):
        return None, None
    try:
        d = json.loads(data)
    except (ValueError, RecursionError):
        d = None
    return (d if isinstance(d, dict) else None), parse_descriptor(ns, data)
