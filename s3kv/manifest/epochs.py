"""Epoch objects (protocol "epochs"): one object per epoch of every segment
the fleet published in it, so a replica reads one object per interval
instead of every replica's segments.

An epoch object ``ep/{e_ms}/{e}`` (:func:`~s3kv.manifest.protocol.epoch_name`)
holds its *members*: each segment it covers, as (name, fingerprints added,
removed, header), in name order, in :mod:`s3kv.manifest.format`'s framing
(kind "epoch": one checksum, one fleet-key MAC over the whole). The header
says which epoch it is (``e``, ``e_ms``: checked against the object's name,
so an epoch copied under another name is refused), who wrote it and when
(``writer``, ``ts``), and the members' names (relative to the manifest
prefix), array lengths and headers. The arrays are the members' added
fingerprints one member after another, then their removals likewise: each
member's own arrays sorted and unique, as a segment's are.

Pure: no I/O. :class:`~s3kv.manifest.sync.ManifestSync` lists, reads,
writes and applies them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from s3kv.errors import CorruptManifest
from s3kv.manifest import format as mf
from s3kv.manifest.arrays import EMPTY, as_sorted_unique
from s3kv.manifest.protocol import parse_epoch, parse_name
from s3kv.manifest.ranks import rank_fields

if TYPE_CHECKING:
    from s3kv.auth import FleetKeys

Member = tuple[str, mf.ManifestObject]
"""A segment an epoch covers: (its full name, its object), as
:func:`~s3kv.manifest.replay.changes` takes segments."""


@dataclass
class Epoch:
    e: int
    e_ms: int
    writer: str
    """The replica that aggregated it."""
    ts: int
    """Its writer's clock (ms) when it wrote it."""
    members: list[Member] = field(default_factory=list)
    """In name order."""


def encode(base: str, epoch: Epoch, keys: FleetKeys | None = None) -> bytes:
    """The epoch object's bytes (signed with ``keys``)."""
    members = sorted(epoch.members, key=lambda m: m[0])
    listed: list[list[Any]] = []
    added: list[np.ndarray] = []
    removed: list[np.ndarray] = []
    for name, obj in members:
        if not name.startswith(base):
            raise ValueError(f"{name} is not under the manifest prefix {base}")
        a, r = as_sorted_unique(obj.added), as_sorted_unique(obj.removed)
        listed.append([name[len(base) :], len(a), len(r), obj.meta])
        added.append(a)
        removed.append(r)
    meta = {"e": epoch.e, "e_ms": epoch.e_ms, "writer": epoch.writer, "ts": epoch.ts, "members": listed}
    return mf.frame(
        "epoch",
        meta,
        np.concatenate(added) if added else EMPTY,
        np.concatenate(removed) if removed else EMPTY,
        keys,
    )


def _int(meta: dict[str, Any], key: str, name: str) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CorruptManifest(f"{name}: header field {key!r} is {value!r}, not a count")
    return value


def decode(
    base: str,
    name: str,
    data: bytes,
    *,
    keys: FleetKeys | None = None,
    directory: bool | None = None,
) -> Epoch:
    """Check and decode epoch object ``name`` (full name) under the manifest
    prefix ``base``. Raises CorruptManifest (or UnsignedManifest, with
    ``keys``) for anything that is not an epoch s3kv wrote under that name:
    another kind, a header naming another epoch or chain, members that are
    no segment names of this bucket's layout under ``base`` or not in name
    order, array lengths that do not add up, a member's arrays unsorted."""
    where = parse_epoch(base, name)
    if where is None:
        raise CorruptManifest(f"{name}: not an epoch object's name")
    obj = mf.unframe(data, name=name, keys=keys)
    if obj.kind != "epoch":
        raise CorruptManifest(f"{name}: a {obj.kind}, not an epoch")
    meta = obj.meta
    e, e_ms = _int(meta, "e", name), _int(meta, "e_ms", name)
    if (e, e_ms) != where:
        raise CorruptManifest(f"{name}: its header says epoch {e} of {e_ms} ms (copied from another name?)")
    writer, ts = meta.get("writer"), _int(meta, "ts", name)
    listed = meta.get("members")
    if not isinstance(writer, str) or not isinstance(listed, list):
        raise CorruptManifest(f"{name}: header without its writer or members")
    members: list[Member] = []
    at_add = at_del = 0
    previous = ""
    for entry in listed:
        if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)):
            raise CorruptManifest(f"{name}: malformed member {entry!r}")
        rel, n_add, n_del, member_meta = entry
        full = base + rel
        parsed = parse_name(base, full, directory=directory)
        if parsed is None or parsed.kind != "segment":
            raise CorruptManifest(f"{name}: member {rel!r} is no segment's name")
        if full <= previous:
            raise CorruptManifest(f"{name}: members not in name order at {rel!r}")
        previous = full
        if (
            not isinstance(n_add, int)
            or not isinstance(n_del, int)
            or isinstance(n_add, bool)
            or isinstance(n_del, bool)
            or n_add < 0
            or n_del < 0
            or not isinstance(member_meta, dict)
        ):
            raise CorruptManifest(f"{name}: member {rel!r} has malformed counts or header")
        added = obj.added[at_add : at_add + n_add]
        removed = obj.removed[at_del : at_del + n_del]
        at_add += n_add
        at_del += n_del
        if len(added) != n_add or len(removed) != n_del:
            raise CorruptManifest(f"{name}: member {rel!r} runs past the arrays")
        if not (_sorted_unique(added) and _sorted_unique(removed)):
            raise CorruptManifest(f"{name}: member {rel!r}: fingerprints are not sorted and unique")
        rank_fields(member_meta)  # nonsense there is garbage, as in a segment
        members.append((full, mf.ManifestObject("segment", added, removed, member_meta)))
    if at_add != len(obj.added) or at_del != len(obj.removed):
        raise CorruptManifest(f"{name}: members account for {at_add}+{at_del} fingerprints of {len(obj.added)}+{len(obj.removed)}")
    return Epoch(e, e_ms, writer, ts, members)


def _sorted_unique(a: np.ndarray) -> bool:
    return len(a) < 2 or bool((a[1:] > a[:-1]).all())
