"""Checking one chunk object in a bucket by its name, as ``s3kv verify``,
``inspect --check`` and gc (its orphans, the objects replicas reported bad)
do: at a bounded cost, whatever the object holds or claims.

:func:`check_object` never reads an object whole: its header first (one
ranged GET, two for a long one), judged before anything else is read, then
its frames in ranges of about :data:`RANGE_BYTES`, each decoded as it
arrives. So a junk object of any size costs one small GET, and memory holds
one range and one decoded frame. What is decoded is bounded by the pages
the namespace's descriptor names, as the engine's reader bounds its loads
(:func:`~s3kv.chunk_reader.check_bounds`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from s3kv import codec
from s3kv.auth import FleetKeys
from s3kv.chunk_reader import ChunkReader, check_bounds, ops_reader
from s3kv.descriptor import ChunkPages
from s3kv.errors import CorruptChunk, Precondition, RangeNotSatisfiable, Unsigned
from s3kv.stores.base import HEAD_BYTES, ByteRange, ObjectStore
from s3kv.tiering.chunks import plan_ranges

RANGE_BYTES = 8 << 20
"""Bytes of frames read at once (a frame larger than this is read alone)."""


@dataclass
class _Read:
    """One check's reads of an object: the ETag of the first, which every
    later one must match, and the object's size where the store said."""

    name: str
    etag: str | None = None
    size: int | None = None

    async def get(self, store: ObjectStore, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``: CorruptChunk if the object ends before,
        Precondition if it is another version than the first read's."""
        try:
            got = await store.get_object(self.name, ByteRange(start, end))
        except RangeNotSatisfiable:
            raise CorruptChunk(f"object ends before byte {start}, its header says it goes on") from None
        if start == 0:
            self.etag, self.size = got.etag, got.size
        elif got.etag is not None and self.etag is not None and got.etag != self.etag:
            raise Precondition(self.name)
        if len(got.data) != end - start and (start, end) != (0, HEAD_BYTES):
            raise CorruptChunk(f"truncated: bytes {start}-{end} gave {len(got.data)}")
        return got.data


async def check_object(
    store: ObjectStore,
    name: str,
    pages: ChunkPages | None = None,
    keys: FleetKeys | None = None,
    *,
    sound_first: bool = True,
    range_bytes: int = RANGE_BYTES,
) -> codec.ChunkHeader:
    """Check the object ``name`` as :func:`~s3kv.chunk_reader.check_chunk`
    checks its bytes, ``pages`` being what the namespace's descriptor names
    (None: none says), reading it a range at a time. Raises as that does
    (a CorruptChunk carrying the ETag read), and what the store raises
    (NotFound, PermissionDenied, Transient); Precondition if the object
    changed between two of its reads. Not ``sound_first``: with ``keys``, a
    header they refuse is Unsigned, its frames unread (where the verdict,
    not its kind, matters: replicas refuse both alike)."""
    r = _Read(name)
    try:
        return await _check(store, r, pages, keys, sound_first, range_bytes)
    except CorruptChunk as e:
        e.etag = r.etag
        raise


async def _check(
    store: ObjectStore,
    r: _Read,
    pages: ChunkPages | None,
    keys: FleetKeys | None,
    sound_first: bool,
    range_bytes: int,
) -> codec.ChunkHeader:
    reader = ops_reader(pages)
    try:
        data = await r.get(store, 0, HEAD_BYTES)
    except CorruptChunk:
        raise CorruptChunk("empty object") from None
    need = reader.header_length(data)
    if need > len(data):
        data += await r.get(store, len(data), need)
    header = reader.parse_header(data)
    check_bounds(r.name, header, pages)
    size = r.size if r.size is not None else (await store.head(r.name)).size
    if size != header.object_length or len(data) > size:
        raise CorruptChunk(f"object is {size} bytes, its header says {header.object_length}")
    signed, unsigned = _signed(data, keys)
    if unsigned is not None and not sound_first:
        raise Unsigned(unsigned)
    macs_failed: list[str] = []

    def decode(buf: bytes, base: int, indexes: list[int]) -> None:
        reader.decode_frames(header, buf, base, indexes, lambda _i, _page: None, scratch=True)
        if signed is not None and keys is not None and not macs_failed:
            mv = memoryview(buf)
            for i in indexes:
                f = header.frames[i]
                try:
                    codec.check_frame_mac(signed, i, mv[f.offset - base : f.end - base], keys)
                except CorruptChunk as e:
                    macs_failed.append(str(e))
                    break

    await asyncio.to_thread(decode, data, 0, [i for i, f in enumerate(header.frames) if f.end <= len(data)])
    for start, end, indexes in plan_ranges(header.frames, len(data), range_bytes):
        await asyncio.to_thread(decode, await r.get(store, start, end), start, indexes)
    # Sound: with the fleet's keys, it must be signed too.
    if unsigned is not None or macs_failed:
        raise Unsigned(unsigned or macs_failed[0])
    return header


def _signed(head: bytes, keys: FleetKeys | None) -> tuple[codec.ChunkHeader | None, str | None]:
    """With ``keys``: the header as they read it, or why they refuse it."""
    if keys is None:
        return None, None
    try:
        return ChunkReader(keys).parse_header(head), None
    except CorruptChunk as e:
        return None, str(e)
