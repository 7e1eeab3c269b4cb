"""What the ops commands show of a namespace's descriptor: its KV cache
groups and its shards in a line (``s3kv ls``), as rows (``--json``), and
the whole descriptor (``s3kv inspect`` of a namespace).

A namespace of a model with several KV cache groups stores each chunk as
one part object per group (:mod:`s3kv.kvgroups`), so its chunk keys are
part keys: about ``groups`` of them a chunk (fewer where a windowed group's
part of a chunk no hit reaches was not stored). Only what
:func:`~s3kv.descriptor.parse_descriptor` read from a descriptor of the
namespace is shown as its groups: the descriptor's bytes are untrusted.

A namespace that replicas of every TP size share (:mod:`s3kv.shards`) has
no TP size: each chunk key is its shard objects, cut by KV head or stored
once, whoever wrote them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from s3kv.descriptor import MAX_BYTES, Described, DescribedGroup, parse_descriptor
from s3kv.errors import CorruptChunk
from s3kv.keys import is_namespace_id
from s3kv.ops.reads import read_at_most
from s3kv.shards import REPLICATED
from s3kv.stores.base import ObjectStore


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _kind(g: DescribedGroup) -> str:
    return f"{g.kind} {g.window}" if g.window else g.kind


def summary(groups: Sequence[DescribedGroup]) -> str:
    """The groups in a line: ``6 groups (5x sliding_window 1024 + 1x full,
    1 layer each)``: how many of each kind and window, in the groups' order,
    and how many layers each has."""
    kinds: dict[str, int] = {}
    for g in groups:
        kinds[_kind(g)] = kinds.get(_kind(g), 0) + 1
    counts = sorted({len(g.layers) for g in groups})
    if len(groups) == 1:
        return f"1 group ({_kind(groups[0])}, {_plural(counts[0], 'layer')})"
    each = _plural(counts[0], "layer") if len(counts) == 1 else f"{counts[0]}-{counts[-1]} layers"
    return f"{len(groups)} groups ({' + '.join(f'{n}x {k}' for k, n in kinds.items())}, {each} each)"


def sharding(described: Described | None, tp_size: Any) -> str:
    """How a namespace's chunk keys are cut into objects, in a few words:
    ``tp2`` (an object a rank of TP ``tp_size``, the descriptor's field as
    it reads), or for a namespace cut into shards ``tp any, 8 shards by
    head`` (replicas of every TP size share it), ``tp8, 1 shard
    (replicated)``; `` x pp2`` after it with pipeline stages, each with
    shards of its own."""
    d = described
    if d is not None and d.shards_unread:
        return "kv_shards unread"
    stages = f" x pp{d.pp_size}" if d is not None and d.pp_size != 1 else ""  # each stage its shards
    if d is None or d.slicing is None or d.slicing.per_rank:
        return f"tp{tp_size}{stages}"
    how = "(replicated)" if d.slicing.mode == REPLICATED else "by head"
    tp = "tp any" if d.tp_size is None else f"tp{d.tp_size}"
    return f"{tp}, {_plural(d.slicing.shards, 'shard')} {how}{stages}"


def short_names(names: Sequence[str], shown: int = 3) -> str:
    """The first ``shown`` names, and how many more there are."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f", ... (+{more})" if more > 0 else "")


def group_rows(groups: Sequence[DescribedGroup], names: bool = False) -> list[dict[str, Any]]:
    """One dict per group: its kind, window and layer count (``names``: and its layers' names)."""
    rows = []
    for i, g in enumerate(groups):
        row: dict[str, Any] = {"group": i, "kind": g.kind, "window": g.window, "layers": len(g.layers)}
        if names:
            row["layer_names"] = list(g.layers)
        rows.append(row)
    return rows


async def inspect_descriptor(store: ObjectStore, name: str) -> dict[str, Any]:
    """What the descriptor object ``name`` says, read no further than a
    descriptor may be (CorruptChunk past that): its namespace (its
    directory's, or for a file elsewhere the one it names), model, chunk
    size, and what the ops commands take from it (TP size, the shard objects
    of each part, the pages of each object, the KV cache groups); its problems where it is not what a
    replica of that namespace writes. NotFound if there is no such object."""
    meta = await store.head(name)
    data = await read_at_most(store, meta, MAX_BYTES, CorruptChunk, "descriptor")
    out: dict[str, Any] = {"object": name, "type": "namespace descriptor", "bytes": len(data)}
    try:
        d = json.loads(data)
    except (ValueError, RecursionError):
        d = None
    if not isinstance(d, dict):
        return {**out, "problems": ["not a JSON object: not a descriptor s3kv writes"]}
    directory = name.rsplit("/", 2)[-2] if name.count("/") >= 1 else ""
    ns = directory if is_namespace_id(directory) else d.get("namespace")
    described = parse_descriptor(ns, data) if isinstance(ns, str) else None
    out.update(namespace=ns, model=d.get("model"), chunk_tokens=d.get("chunk_tokens"))
    problems, notes = [], []
    if described is None:
        problems.append(
            f"not namespace {ns}'s descriptor (it names another, or its fields do not hash to that id): "
            "the ops commands do not act on it"
        )
    else:
        out.update(_described(described))
        if described.shards_unread:
            problems.append(
                "its kv_shards is not a slicing s3kv writes (or is beside a tp_size): "
                "its chunks' shards and pages are not said"
            )
        if described.groups_unread:
            problems.append(
                "its kv_groups are not KV cache groups s3kv writes: its chunks' pages are not said"
            )
        elif described.pages is None and not described.shards_unread:
            notes.append("it does not say its chunks' pages: verify and gc check them without")
    out["fields"] = d.get("fields")
    out["problems"] = problems
    if notes:
        out["notes"] = notes
    return out


def _described(described: Described) -> dict[str, Any]:
    p = described.pages
    return {
        "tp_size": described.tp_size,
        "shards": described.shards,
        "shard_mode": described.slicing.mode if described.slicing is not None else None,
        "frames": p.num_layers if p is not None else None,
        "frame_bytes": p.layer_bytes if p is not None else None,
        "kv_groups": group_rows(described.groups, names=True) if described.groups is not None else None,
    }
