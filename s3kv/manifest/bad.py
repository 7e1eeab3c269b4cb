"""Bad records a replica knows: chunk objects some replica found corrupt
in S3 and could not delete (a segment's ``meta["bad"]``, :mod:`s3kv.manifest.format`).

A replica that knows one never publishes the chunk from a 412 (it may be
that very object in the way: publishing it would undo the quarantine fleet-wide,
and the replica would think the chunk stored and never store it again once
``s3kv gc`` removed it). A snapshot covers the segments before its horizon, so
it carries the records they held (its header's ``bad``, in the segments'
format): a replica that starts from it learns them as one that read the
segments would. Records of objects gc has since deleted do no harm (a 412 on
a chunk stored fresh is published by the replica that wrote it); the newest
:data:`BAD_KEPT` are kept.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from s3kv.keys import fingerprint, parse_object_key

BAD_KEPT = 4096
"""Bad records (and fingerprints) kept, the newest: a corrupt object no
replica may delete is rare; the bound keeps a fleet that reports many (a
bug, a hostile writer) from growing every snapshot's header without end."""


def entries(listed: Any) -> list[tuple[str, str | None]]:
    """The well-formed ``[name, etag]`` entries of a header's ``bad`` list
    (anything else in it is skipped: headers are read from the bucket)."""
    if not isinstance(listed, list):
        return []
    return [
        (e[0], e[1])
        for e in listed
        if isinstance(e, list)
        and len(e) == 2
        and isinstance(e[0], str)
        and (e[1] is None or isinstance(e[1], str))
    ]


class BadRecords:
    """The fingerprints of chunks reported bad (``fp in records``) and the
    records themselves (object name and the ETag read), to carry in snapshots."""

    def __init__(self, kept: int = BAD_KEPT) -> None:
        self.kept = kept
        self._fps: dict[int, None] = {}  # insertion-ordered: the oldest go first
        self._records: dict[str, str | None] = {}

    def __contains__(self, fp: object) -> bool:
        return fp in self._fps

    def __len__(self) -> int:
        return len(self._fps)

    def add(self, fp: int) -> None:
        self._fps.pop(fp, None)
        self._fps[fp] = None
        if len(self._fps) > self.kept:
            del self._fps[next(iter(self._fps))]

    def update(self, fps: Iterable[int]) -> None:
        for fp in fps:
            self.add(fp)

    def record(self, name: str, etag: str | None) -> None:
        """Object ``name`` (ETag ``etag`` as read) was reported bad: carried in snapshots."""
        self._records.pop(name, None)
        self._records[name] = etag
        if len(self._records) > self.kept:
            del self._records[next(iter(self._records))]

    def from_segment(self, fps: Iterable[int], meta: dict[str, Any]) -> None:
        """A segment reported ``fps`` bad (its removals, :func:`~s3kv.manifest.replay.bad_removals`)
        with the records of its header."""
        self.update(fps)
        for name, etag in entries(meta.get("bad")):
            self.record(name, etag)

    def from_snapshot(self, meta: dict[str, Any]) -> int:
        """The records a snapshot's header carries, each chunk's fingerprint
        read from its object's name (one that names no chunk object is
        skipped). Returns how many were learnt."""
        n = 0
        for name, etag in entries(meta.get("bad"))[-self.kept :]:
            parsed = parse_object_key(name)
            if parsed is None:
                continue
            self.add(fingerprint(parsed[1]))
            self.record(name, etag)
            n += 1
        return n

    def header(self) -> list[list[str | None]]:
        """The records, oldest first, as a snapshot's header carries them (``bad``)."""
        return [[name, etag] for name, etag in self._records.items()]
