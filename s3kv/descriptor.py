"""The namespace descriptor, ``{prefix}/{namespace}/namespace.json``: what a
replica leaves beside a namespace's chunks (:func:`encode`), so that
operators can tell namespaces apart (``s3kv ls``) and the ops commands know
what the namespace's chunks are (:func:`parse_descriptor`): how many ranks store a
shard of each, and how many page bytes each shard holds, the bound on what
checking one may cost.

Its bytes are untrusted, as every object's: the ops commands act only on a
descriptor that is small and whose fields hash to its namespace's id (the
id *is* that hash, :meth:`~s3kv.keys.Namespace.from_fields`), so that
whoever can write to the bucket cannot make gc take a TP=2 namespace for a
TP=1 one, or its layers for others. ``chunk_tokens`` is no namespace field
(replicas of one namespace may store chunks of other sizes): it says only
which chunks the ops commands decode.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from s3kv.codec import MAX_FRAME_RAW
from s3kv.keys import Namespace

NAME = "namespace.json"
MAX_BYTES = 64 << 10
"""The largest descriptor read; a replica's is a few KiB."""
MAX_LAYERS = 4096


def encode(namespace: Namespace, model: str | None, chunk_tokens: int) -> bytes:
    """The descriptor a replica writes for ``namespace``."""
    body = {
        "namespace": namespace.id,
        "model": model,
        "fields": dict(namespace.fields),
        "chunk_tokens": chunk_tokens,
    }
    return json.dumps(body, indent=1, default=str).encode()


@dataclass(frozen=True)
class ChunkPages:
    """What each rank's object of a chunk of ``tokens`` tokens holds: one
    frame per layer, each ``layer_bytes`` of pages once decoded."""

    num_layers: int
    tokens: int
    layer_bytes: int


@dataclass(frozen=True)
class Described:
    """What the ops commands take from a namespace's descriptor."""

    tp_size: int | None
    """Ranks that each store a shard of every chunk; None: not said."""
    pages: ChunkPages | None
    """The pages of the namespace's chunks of ``chunk_tokens`` tokens; None: not said."""


def parse_descriptor(namespace_id: str, data: bytes) -> Described | None:
    """What the descriptor ``data`` says of namespace ``namespace_id``, or
    None when it is not that namespace's descriptor: too large, not JSON,
    another namespace, or fields that do not hash to its id."""
    if len(data) > MAX_BYTES:
        return None
    try:
        d = json.loads(data)
    except (ValueError, RecursionError):
        return None
    fields = d.get("fields") if isinstance(d, dict) else None
    if not isinstance(fields, dict) or d.get("namespace") != namespace_id:
        return None
    try:
        if Namespace.from_fields(fields).id != namespace_id:
            return None
    except TypeError:  # a value the namespace hash does not encode: not a replica's
        return None
    return Described(_count(fields.get("tp_size"), 1 << 16), _pages(fields, d.get("chunk_tokens")))


def _count(value: Any, most: int) -> int | None:
    """``value`` if it is an int in 1..``most`` (not a bool), else None."""
    return value if type(value) is int and 1 <= value <= most else None


def _pages(fields: dict[str, Any], chunk_tokens: Any) -> ChunkPages | None:
    layers = _count(fields.get("num_layers"), MAX_LAYERS)
    block = _count(fields.get("block_size"), MAX_FRAME_RAW)
    page = _count(fields.get("page_size_bytes"), MAX_FRAME_RAW)
    tokens = _count(chunk_tokens, MAX_FRAME_RAW)
    if layers is None or block is None or page is None or tokens is None or tokens % block:
        return None
    layer_bytes = tokens // block * page
    return ChunkPages(layers, tokens, layer_bytes) if layer_bytes <= MAX_FRAME_RAW else None
