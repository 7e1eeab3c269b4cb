"""Checking one chunk object in a bucket by its name, as ``s3kv verify``,
``inspect --check`` and gc (its orphans, the objects replicas reported bad)
do: at a bounded cost, whatever the object holds or claims.

:func:`check_object` never reads an object whole: its header first (one
ranged GET, two for a long one), judged before anything else is read, then
its frames in ranges of about :data:`RANGE_BYTES`, each decoded as it
arrives. So a junk object of any size costs one small GET, and memory holds
one range and one decoded frame. What is decoded is bounded by the pages
the namespace's descriptor names, as the engine's reader bounds its loads
(:func:`check_bounds`); :func:`check_chunk` judges an object's bytes
alike.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from s3kv import codec
from s3kv.auth import FleetKeys
from s3kv.chunk_reader import ChunkReader, named_chunk
from s3kv.descriptor import ChunkPages
from s3kv.errors import CorruptChunk, Precondition, RangeNotSatisfiable, Unchecked, Unsigned
from s3kv.stores.base import HEAD_BYTES, ByteRange, GetResult, ObjectStore
from s3kv.tiering.chunks import plan_ranges

RANGE_BYTES = 8 << 20
"""Bytes of frames read at once (a frame larger than this is read alone)."""

MAX_UNDESCRIBED_RAW = 1 << 30
"""The most page bytes of one chunk object the ops commands decode where no
descriptor of its namespace bounds them (a replica's chunk object holds one
shard of every layer of ``chunk_tokens`` tokens: tens of MiB for most models)."""


def ops_reader(pages: ChunkPages | None, keys: FleetKeys | None = None) -> ChunkReader:
    """The reader the ops commands judge a namespace's chunk objects with:
    set to the pages its descriptor names, else to any pages."""
    return ChunkReader(keys) if pages is None else ChunkReader(keys, pages.num_layers, pages)


def check_bounds(name: str, header: codec.ChunkHeader, pages: ChunkPages | None) -> None:
    """Raise unless decoding the frames of ``header``, read from the object
    ``name``, costs no more than a chunk of its namespace may (as the
    engine's reader bounds it): CorruptChunk for a header of another object,
    or of other pages than ``pages`` (the namespace's descriptor's: its layer
    count, each frame one layer's pages); Unchecked for a chunk of another
    size than ``pages`` names (pages not known, so not decoded), or, without
    ``pages``, one claiming more than MAX_UNDESCRIBED_RAW bytes."""
    ns, key, rank = named_chunk(name)
    header.check_identity(ns, key, rank)
    if pages is not None and len(header.frames) == pages.num_layers and header.tokens != pages.tokens:
        raise Unchecked(
            f"a chunk of {header.tokens} tokens; its namespace's descriptor names the pages of "
            f"chunks of {pages.tokens}: not decoded"
        )
    ops_reader(pages).check(header, ns, key, rank)
    if pages is None and header.raw_bytes > MAX_UNDESCRIBED_RAW:
        raise Unchecked(
            f"its frames claim {header.raw_bytes} bytes of pages, more than the {MAX_UNDESCRIBED_RAW} "
            "decoded without its namespace's descriptor: not decoded"
        )


def _discard(_i: int, _page: np.ndarray) -> None:
    pass


def check_chunk(
    name: str, data: bytes, keys: FleetKeys | None = None, pages: ChunkPages | None = None
) -> codec.ChunkHeader:
    """Raise CorruptChunk unless ``data`` is a sound chunk object named
    ``name``: its header, identity and length, and every frame checked and
    decoded as a replica would, within :func:`check_bounds` (so that a bomb
    costs nothing: Unchecked for what it does not decode). Then, with
    ``keys``, Unsigned unless a fleet key signed it (header and every
    frame). UnsupportedFormat for a newer format. Returns the header. The
    ops commands read an object in a bucket with :func:`check_object`."""
    reader = ops_reader(pages)
    # Sound first: a damaged object is corrupt, whoever wrote it.
    header = reader.parse_header(data)
    check_bounds(name, header, pages)
    if len(data) != header.object_length:
        raise CorruptChunk(f"object is {len(data)} bytes, its header says {header.object_length}")
    reader.decode_frames(header, data, 0, range(len(header.frames)), _discard, scratch=True)
    if keys is not None:
        try:
            ChunkReader(keys).check_macs(data)
        except CorruptChunk as e:
            raise Unsigned(str(e)) from None
    return header


@dataclass
class _Read:
    """One check's reads of an object: the ETag of the first, which every
    later one must match, and the object's size where the store said."""

    store: ObjectStore
    name: str
    etag: str | None = None
    size: int | None = None

    async def get(self, start: int, end: int) -> GetResult:
        """Bytes ``[start, end)``: CorruptChunk if the object ends before (is
        empty, at the first read), Precondition if it is another version than
        the first read's."""
        try:
            got = await self.store.get_object(self.name, ByteRange(start, end))
        except RangeNotSatisfiable:
            if start == 0:
                raise CorruptChunk("empty object") from None
            raise CorruptChunk(f"object ends before byte {start}, its header says it goes on") from None
        if start == 0:
            self.etag, self.size = got.etag, got.size
        elif got.etag is not None and self.etag is not None and got.etag != self.etag:
            raise Precondition(self.name)
        if len(got.data) != end - start and (start, end) != (0, HEAD_BYTES):
            raise CorruptChunk(f"truncated: bytes {start}-{end} gave {len(got.data)}")
        return got


async def check_object(
    store: ObjectStore,
    name: str,
    pages: ChunkPages | None = None,
    keys: FleetKeys | None = None,
    *,
    sound_first: bool = True,
    range_bytes: int = RANGE_BYTES,
) -> codec.ChunkHeader:
    """Check the object ``name`` as :func:`check_chunk`
    checks its bytes, ``pages`` being what the namespace's descriptor names
    (None: none says), reading it a range at a time. Raises as that does
    (a CorruptChunk carrying the ETag read), and what the store raises
    (NotFound, PermissionDenied, Transient); Precondition if the object
    changed between two of its reads. Not ``sound_first``: with ``keys``, a
    header they refuse is Unsigned, its frames unread (where the verdict,
    not its kind, matters: replicas refuse both alike)."""
    r = _Read(store, name)
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
    head = await reader.read_header(r.get, HEAD_BYTES)
    header, data = head.header, head.data
    check_bounds(r.name, header, pages)
    size = r.size if r.size is not None else (await store.head(r.name)).size
    if size != header.object_length or len(data) > size:
        raise CorruptChunk(f"object is {size} bytes, its header says {header.object_length}")
    signed, unsigned = _signed(data, keys)
    if unsigned is not None and not sound_first:
        raise Unsigned(unsigned)
    macs_failed: list[str] = []

    def decode(buf: bytes, base: int, indexes: list[int]) -> None:
        reader.decode_frames(header, buf, base, indexes, _discard, scratch=True)
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
        await asyncio.to_thread(decode, (await r.get(start, end)).data, start, indexes)
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
