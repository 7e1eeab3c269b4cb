"""The namespace descriptor, ``{prefix}/{namespace}/namespace.json``: what a
replica leaves beside a namespace's chunks (:func:`encode`), so that
operators can tell namespaces apart (``s3kv ls``) and the ops commands know
what the namespace's chunks are (:func:`parse_descriptor`): how many shard
objects each part is cut into, and how many page bytes each holds, the bound
on what checking one may cost.

Its bytes are untrusted, as every object's: the ops commands act only on a
descriptor that is small and whose fields hash to its namespace's id (the
id *is* that hash, :meth:`~s3kv.keys.Namespace.from_fields`), so that
whoever can write to the bucket cannot make gc take a TP=2 namespace for a
TP=1 one, or its layers for others. ``chunk_tokens`` is no namespace field
(replicas of one namespace may store chunks of other sizes): it says only
which chunks the ops commands decode.

A model with several KV cache groups (:mod:`s3kv.kvgroups`) has a
``kv_groups`` field, one entry per group (its kind, window, block and page
size, layer names): each chunk is then one part object per group, each of
``num_layers`` frames (the most layers a group has). A descriptor whose
groups are not what s3kv writes, or have more layers than ``num_layers``,
does not describe its chunks' pages.

A namespace whose parts are cut by KV head, or stored once (:mod:`s3kv.shards`),
has a ``kv_shards`` field (its mode, shards and heads per shard), and no
``tp_size`` where replicas of every TP size share it; its
``page_size_bytes`` is one shard's page. Without the field each part is one object per rank, of
the namespace's ``tp_size``. A ``kv_shards`` that is not what s3kv writes
says neither how many objects a part has nor what their pages are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from s3kv.codec import MAX_FRAME_RAW
from s3kv.keys import Namespace
from s3kv.kvgroups import KVGroup
from s3kv.shards import HEADS, MAX_SHARDS, REPLICATED, Slicing, ranks

MAX_TP = 1 << 16
MAX_PP = 1 << 8
"""The largest TP size a descriptor is taken to say."""

NAME = "namespace.json"
MAX_BYTES = 64 << 10
"""The largest descriptor read; a replica's is a few KiB."""
MAX_LAYERS = 4096
MAX_GROUPS = 256
MAX_WINDOW = 1 << 32


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
class DescribedGroup:
    """One KV cache group of a namespace, as its descriptor names it."""

    kind: str
    """``full``, ``sliding_window`` or ``chunked_local`` (:data:`s3kv.kvgroups.KINDS`)."""
    window: int
    """Its window or attention chunk, in tokens (0: full attention)."""
    layers: tuple[str, ...]
    """Its layers' names, in frame order."""


@dataclass(frozen=True)
class Described:
    """What the ops commands take from a namespace's descriptor."""

    tp_size: int | None
    """Ranks that each store a shard of every chunk; None: not said."""
    pages: ChunkPages | None
    """The pages of each object (each part, with several KV cache groups) of
    the namespace's chunks of ``chunk_tokens`` tokens; None: not said."""
    groups: tuple[DescribedGroup, ...] | None = None
    """The KV cache groups, each a part object of every chunk; None: one
    full-attention group (no ``kv_groups`` field), or groups not read."""
    groups_unread: bool = False
    """It has a ``kv_groups`` field that is not groups s3kv writes."""
    slicing: Slicing | None = None
    """How each part is cut into shard objects: its ``kv_shards`` field,
    else one shard per rank of its ``tp_size``; None: neither read."""
    shards_unread: bool = False
    """It has a ``kv_shards`` field that is not what s3kv writes."""
    pp_size: int | None = 1
    """Pipeline stages, each with shards of its own (its ``pp_size``
    field, 1 without it); None: a ``pp_size`` that is not one."""

    @property
    def shards(self) -> int | None:
        """Shard objects of each part (``.r0`` to ``.r{shards-1}``, every
        pipeline stage's): a part is whole once every one is stored; None:
        not said."""
        if self.slicing is None or self.pp_size is None:
            return None
        return self.slicing.shards * self.pp_size


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
    tp_size, pages = _count(fields.get("tp_size"), MAX_TP), _pages(fields, d.get("chunk_tokens"))
    slicing = _slicing(fields, tp_size)
    pp_size = _count(fields.get("pp_size", 1), MAX_PP)
    shards_unread = "kv_shards" in fields and slicing is None
    if shards_unread:
        pages = None  # a page of what? its objects are not said
    if "kv_groups" not in fields:
        return Described(tp_size, pages, slicing=slicing, shards_unread=shards_unread, pp_size=pp_size)
    groups = _groups(fields)
    if groups is None or pages is None or any(len(g.layers) > pages.num_layers for g in groups):
        pages = None  # parts of groups it does not say, or frames fewer than a group's layers
    return Described(
        tp_size,
        pages,
        groups,
        groups_unread=groups is None,
        slicing=slicing,
        shards_unread=shards_unread,
        pp_size=pp_size,
    )


def _count(value: Any, most: int) -> int | None:
    """``value`` if it is an int in 1..``most`` (not a bool), else None."""
    return value if type(value) is int and 1 <= value <= most else None


def _slicing(fields: dict[str, Any], tp_size: int | None) -> Slicing | None:
    """The ``kv_shards`` field as s3kv writes it (:meth:`Slicing.field
    <s3kv.shards.Slicing.field>`): ``heads``, 1 to MAX_SHARDS shards of at
    least one head each, or ``replicated``, one shard of no heads; else
    None. Without the field, one shard per rank
    of ``tp_size`` (None where that is not said)."""
    if "kv_shards" not in fields:
        return ranks(tp_size) if tp_size is not None else None
    value = fields["kv_shards"]
    if not isinstance(value, dict) or set(value) != {"mode", "shards", "heads_per_shard"}:
        return None
    mode, q = value["mode"], value["heads_per_shard"]
    if mode == HEADS:
        shards = _count(value["shards"], MAX_SHARDS)
        q = _count(q, MAX_TP)
    elif mode == REPLICATED:
        shards = _count(value["shards"], 1)
        q = q if type(q) is int and q == 0 else None
    else:
        return None
    if shards is None or q is None:
        return None
    return Slicing(mode, shards, q)


def _pages(fields: dict[str, Any], chunk_tokens: Any) -> ChunkPages | None:
    layers = _count(fields.get("num_layers"), MAX_LAYERS)
    block = _count(fields.get("block_size"), MAX_FRAME_RAW)
    page = _count(fields.get("page_size_bytes"), MAX_FRAME_RAW)
    tokens = _count(chunk_tokens, MAX_FRAME_RAW)
    if layers is None or block is None or page is None or tokens is None or tokens % block:
        return None
    layer_bytes = tokens // block * page
    return ChunkPages(layers, tokens, layer_bytes) if layer_bytes <= MAX_FRAME_RAW else None


def _groups(fields: dict[str, Any]) -> tuple[DescribedGroup, ...] | None:
    """The groups of the ``kv_groups`` field, or None unless it lists 1 to
    MAX_GROUPS groups, each of a kind s3kv shares with a window that kind
    has, 1 to MAX_LAYERS layer names, and the namespace's block and page
    size (every part's frames are pages of one size)."""
    value = fields.get("kv_groups")
    block, page = fields.get("block_size"), fields.get("page_size_bytes")
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_GROUPS:
        return None
    out = []
    for g in value:
        if not isinstance(g, dict):
            return None
        kind, window, layers = g.get("kind"), g.get("window"), g.get("layers")
        if not isinstance(kind, str) or type(window) is not int or not 0 <= window <= MAX_WINDOW:
            return None
        if not isinstance(layers, list) or not 1 <= len(layers) <= MAX_LAYERS:
            return None
        if not all(isinstance(n, str) for n in layers):
            return None
        if any(
            type(g.get(f)) is not int or g.get(f) != v
            for f, v in (("block_size", block), ("page_size_bytes", page))
        ):
            return None
        try:
            KVGroup(kind, (), window)  # a kind s3kv shares, with a window that kind has
        except ValueError:
            return None
        out.append(DescribedGroup(kind, window, tuple(layers)))
    return tuple(out)
