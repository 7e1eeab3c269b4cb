"""The one chunk reader: every chunk object s3kv reads is checked here.

:class:`ChunkReader` turns an object's bytes into page bytes per layer, or
refuses them with :class:`~s3kv.errors.CorruptChunk`, in this order: the
header read (:meth:`ChunkReader.read_header`: the one way s3kv reads a chunk
header from a store) and parsed within a bound on its length (with the
fleet's keys, only a signed header whose MAC verifies), its identity
(namespace, chunk key, rank) checked, what its frames say they hold bounded
before anything is allocated, the object's length checked, then each frame
checked (its checksum, or its MAC with the keys) and decoded into a sink. A
reader that knows the engine's pages (or, in the ops commands, the size of
those a namespace's descriptor names) wants every frame to decode to
exactly one layer's pages; one that does not refuses a frame that claims
more than :data:`~s3kv.codec.MAX_FRAME_RAW` bytes, undecoded.

Who reads through it: the engine (:class:`~s3kv.tiering.chunks.ChunkCodec`),
the ops commands (:mod:`s3kv.ops.chunks`), the journal's recovery
(:func:`read_chunk_head`, :func:`check_chunk_head`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from s3kv import blosc2_format, codec
from s3kv.auth import FleetKeys
from s3kv.descriptor import ChunkPages
from s3kv.errors import CorruptChunk, Precondition, RangeNotSatisfiable, Unsigned
from s3kv.frame_sinks import FrameInto, FrameSink, SinkFailed, scatter, scratch_buffer
from s3kv.keys import parse_object_key
from s3kv.stores.base import HEAD_BYTES, ByteRange, GetResult, ObjectStore


@dataclass(frozen=True)
class PageFormat:
    """What a writer records about the pages it stores, and a reader expects."""

    dtype: str
    itemsize: int
    page_shape: tuple[int, ...]
    tokens: int
    layer_bytes: int
    """Bytes of one layer's pages of a chunk: what every frame must decode to."""


def zstd_bound(raw_bytes: int) -> int:
    """The most zstd may store for ``raw_bytes`` (its ZSTD_COMPRESSBOUND, and a margin)."""
    return raw_bytes + (raw_bytes >> 7) + (64 << 10)


def as_corrupt(e: BaseException, where: str | None) -> CorruptChunk:
    """Any failure to make sense of an object's bytes is corruption: a bad
    size, shuffle value or header, a zstd error. Not a MemoryError, which
    callers let pass: what a decode allocates is bounded by the reader's own
    layout before a header is believed, so running out of memory is the
    host's state, and calling it corrupt would delete a good shared object."""
    if isinstance(e, CorruptChunk):
        return e
    return CorruptChunk(_at(where, f"{type(e).__name__}: {e}"))


@contextlib.contextmanager
def checking_bytes(where: str | None) -> Iterator[None]:
    """Around code that only looks at an object's bytes (parsing, checksums,
    MACs, decompression): whatever it raises means the bytes are bad."""
    try:
        yield
    except (CorruptChunk, MemoryError):
        raise
    except Exception as e:
        raise as_corrupt(e, where) from e


def _at(where: str | None, message: str) -> str:
    return f"{where}: {message}" if where else message


RangeGet = Callable[[int, int], Awaitable[GetResult]]
"""A ranged GET of one object's bytes ``[start, end)``, the caller's own: how
it reads, and what it requires of a second read (the first's version)."""


def ranged_get(store: ObjectStore, name: str) -> RangeGet:
    """Plain ranged GETs of the object ``name``."""
    return lambda start, end: store.get_object(name, ByteRange(start, end))


class BufferGet:
    """Ranged GETs of the object ``name`` into the store's buffers
    (:meth:`~s3kv.stores.base.ObjectStore.get_buffer`), for the engine's
    loads: :attr:`etag` keeps what the read from the object's first byte
    saw, for the caller to read after :meth:`ChunkReader.read_header`,
    whether it parsed or failed (a corrupt object is deleted only if it is
    still the version read)."""

    def __init__(self, store: ObjectStore, name: str) -> None:
        self.store = store
        self.name = name
        self.etag: str | None = None

    async def __call__(self, start: int, end: int) -> GetResult:
        got = await self.store.get_buffer(self.name, ByteRange(start, end))
        if start == 0:
            self.etag = got.etag
        return got


@dataclass(frozen=True)
class HeaderRead:
    """A chunk object's header as :meth:`ChunkReader.read_header` read it."""

    header: codec.ChunkHeader
    data: bytes
    """The object's first bytes: the header and whatever else the first GET brought."""
    etag: str | None
    size: int | None
    """The whole object's size, where the store said."""


@dataclass(frozen=True)
class ChunkReader:
    """How chunk objects are read, and what a decoded one must match.

    ``where`` (every method's last argument) names the object in the
    messages of what the reader finds itself; None where the caller names
    it (``s3kv verify`` reports the object beside the reason)."""

    keys: FleetKeys | None = None
    """The fleet's keys: only objects signed with one of them are read, and
    their frames are checked by MAC instead of checksum."""
    num_layers: int | None = None
    fmt: PageFormat | ChunkPages | None = None
    """The engine's pages (with ``num_layers``), or the ops commands' from a
    namespace's descriptor (their size, not their shape): each frame must
    decode to exactly one layer's. None: any pages, each frame at most
    MAX_FRAME_RAW."""

    def __post_init__(self) -> None:
        if (self.num_layers is None) != (self.fmt is None):
            raise ValueError("a reader knows both the layer count and the page format, or neither")

    @property
    def max_header(self) -> int:
        """The longest header read: one of the engine's chunks; MAX_HEADER_LEN without its pages."""
        return codec.MAX_HEADER_LEN if self.num_layers is None else 4096 + 160 * self.num_layers

    @property
    def max_object(self) -> int | None:
        """The most bytes one of the engine's chunks can take; None without its pages."""
        if self.num_layers is None or self.fmt is None:
            return None
        return (
            codec.PREFIX_LEN
            + self.max_header
            + codec.TAG_BYTES
            + self.num_layers * zstd_bound(self.fmt.layer_bytes)
        )

    def header_length(self, prefix: bytes | memoryview, where: str | None = None) -> int:
        """Bytes of prefix + header (+ MAC), from an object's first PREFIX_LEN bytes."""
        with checking_bytes(where):
            return codec.header_length(prefix, self.max_header)

    def parse_header(self, data: bytes | memoryview, where: str | None = None) -> codec.ChunkHeader:
        """The header at the start of ``data`` (at least :meth:`header_length` bytes)."""
        with checking_bytes(where):
            return codec.parse_header(data, self.keys, max_header_len=self.max_header)

    async def read_header(self, get: RangeGet, first: int, where: str | None = None) -> HeaderRead:
        """The header of the object ``get`` reads, parsed: its first ``first``
        bytes (one ranged GET), then the rest of a longer header (a second),
        refused unread past :attr:`max_header` (the caller checks its identity:
        :meth:`check`). The one way s3kv reads a chunk header from a store."""
        got = await get(0, max(first, codec.PREFIX_LEN))
        data = got.data
        need = self.header_length(data, where)
        if need > len(data):
            data += (await get(len(data), need)).data
        return HeaderRead(self.parse_header(data, where), data, got.etag, got.size)

    def check(
        self, header: codec.ChunkHeader, namespace: str, key: str, rank: int, where: str | None = None
    ) -> None:
        """Raise CorruptChunk unless ``header`` is chunk ``key`` (hex) of
        ``namespace`` and ``rank``, with frames this reader decodes: nothing
        a header says is allocated before it passed."""
        with checking_bytes(where):
            self._check(header, namespace, key, rank, where)

    def _check(
        self, header: codec.ChunkHeader, namespace: str, key: str, rank: int, where: str | None
    ) -> None:
        try:
            header.check_identity(namespace, key, rank)
        except CorruptChunk as e:
            raise CorruptChunk(_at(where, str(e))) from None
        if self.num_layers is None or self.fmt is None:
            for i, f in enumerate(header.frames):
                if f.raw_length > codec.MAX_FRAME_RAW:
                    raise CorruptChunk(
                        _at(
                            where,
                            f"frame {i}: says it decodes to {f.raw_length} bytes, "
                            f"more than {codec.MAX_FRAME_RAW}",
                        )
                    )
            return
        if len(header.frames) != self.num_layers:
            raise CorruptChunk(_at(where, f"{len(header.frames)} layers, this model has {self.num_layers}"))
        fmt = self.fmt
        if not isinstance(fmt, PageFormat):
            if header.tokens != fmt.tokens:
                raise CorruptChunk(
                    _at(where, f"{header.tokens} tokens, this namespace's chunks hold {fmt.tokens}")
                )
        elif header.dtype != fmt.dtype or header.page_shape != fmt.page_shape or header.tokens != fmt.tokens:
            raise CorruptChunk(
                _at(
                    where,
                    f"pages are {header.dtype}{list(header.page_shape)} x {header.tokens} tokens, "
                    f"this engine's are {fmt.dtype}{list(fmt.page_shape)} x {fmt.tokens}",
                )
            )
        elif header.shuffle not in (1, fmt.itemsize):
            raise CorruptChunk(
                _at(where, f"shuffle item size {header.shuffle}, the pages' items are {fmt.itemsize}")
            )
        bound = {
            "zstd": zstd_bound(fmt.layer_bytes),
            "blosc2": fmt.layer_bytes + blosc2_format.BLOSC2_OVERHEAD,
        }.get(header.codec, fmt.layer_bytes)
        for i, f in enumerate(header.frames):
            if f.raw_length != fmt.layer_bytes or not 0 < f.length <= bound:
                raise CorruptChunk(
                    _at(
                        where,
                        f"frame {i} holds {f.raw_length} bytes in {f.length}; a layer's pages "
                        f"are {fmt.layer_bytes} bytes",
                    )
                )

    def decode_frames(
        self,
        header: codec.ChunkHeader,
        buf: bytes | memoryview,
        base: int,
        indexes: Iterable[int],
        sink: FrameSink,
        where: str | None = None,
        *,
        scratch: bool = False,
    ) -> None:
        """Check and decode frames ``indexes`` of a header that passed
        :meth:`check`, from ``buf`` (the object's bytes from offset
        ``base``), handing each to ``sink`` in turn (with ``scratch``, in
        this thread's reused buffer: see :data:`FrameSink`). What ``sink``
        raises passes as it is: it is the caller's, not the object's."""
        for i, stored in self._frames(header, buf, base, indexes, where):
            if scratch and self.fmt is not None:
                out = scratch_buffer(header.frames[i].raw_length)
                self._decode_into(header, i, stored, [out], where)
                sink(i, out)
                continue
            with checking_bytes(where):
                data = codec.decode_frame(header, i, stored, keys=self.keys)
            sink(i, data)

    def read_frames(
        self,
        header: codec.ChunkHeader,
        buf: bytes | memoryview,
        base: int,
        indexes: Iterable[int],
        into: FrameInto,
        where: str | None = None,
    ) -> None:
        """:meth:`decode_frames` for the worker's loads: each frame is
        checked and decoded straight where ``into`` puts it
        (:meth:`FrameInto.read_into`), from ``buf`` as the store holds it
        (a view, never a copy). What ``into`` raises, other than the frame's
        own check, is raised as :class:`SinkFailed`. One call per chunk (or
        per ranged GET): the per-frame work is a slice, a check and a decode."""
        frames = header.frames
        for i, stored in self._frames(header, buf, base, indexes, where):
            failed: list[BaseException] = []

            def read(
                out: list[np.ndarray], i: int = i, stored: memoryview = stored, failed: list = failed
            ) -> None:
                try:
                    self._decode_into(header, i, stored, out, where)
                except BaseException as e:
                    failed.append(e)
                    raise

            try:
                into.read_into(i, frames[i].raw_length, read)
            except Exception as e:
                if failed and e is failed[0]:
                    raise
                raise SinkFailed() from e

    def _frames(
        self,
        header: codec.ChunkHeader,
        buf: bytes | memoryview,
        base: int,
        indexes: Iterable[int],
        where: str | None,
    ) -> Iterator[tuple[int, memoryview]]:
        """(index, stored bytes) of frames ``indexes``; CorruptChunk where ``buf`` ends first."""
        mv = memoryview(buf)
        size = mv.nbytes
        frames = header.frames
        for i in indexes:
            f = frames[i]
            if f.end - base > size:
                raise CorruptChunk(_at(where, f"truncated in frame {i}"))
            yield i, mv[f.offset - base : f.end - base]

    def _decode_into(
        self,
        header: codec.ChunkHeader,
        i: int,
        stored: memoryview,
        out: list[np.ndarray],
        where: str | None,
    ) -> None:
        """Check frame ``i`` and decode it into ``out`` (see :data:`FrameRead`):
        in one pass where ``out`` is one buffer, else through this thread's
        scratch buffer; a frame of codec none is copied from ``stored``
        once checked. Nothing is written before the stored
        bytes passed."""
        f = header.frames[i]
        try:
            if len(out) == 1:
                codec.decode_frame(header, i, stored, out=out[0], keys=self.keys)
                return
            if header.codec == "none" and f.length == f.raw_length:  # never shuffled (parse_header)
                codec.check_frame(header, i, stored, self.keys)
                data = np.frombuffer(stored, dtype=np.uint8)
            else:
                data = codec.decode_frame(header, i, stored, out=scratch_buffer(f.raw_length), keys=self.keys)
        except (CorruptChunk, MemoryError):
            raise
        except Exception as e:  # what checking_bytes says, without a context manager per frame
            raise as_corrupt(e, where) from e
        scatter(data, out)

    def decode(
        self,
        data: bytes | memoryview,
        sink: FrameSink,
        *,
        namespace: str,
        key: str,
        rank: int,
        where: str | None = None,
        scratch: bool = False,
    ) -> codec.ChunkHeader:
        """Check a whole object, chunk ``key`` (hex) of ``namespace`` and
        ``rank``, and hand each decoded layer to ``sink``; returns its header."""
        header = self.checked(data, namespace=namespace, key=key, rank=rank, where=where)
        self.decode_frames(header, data, 0, range(len(header.frames)), sink, where, scratch=scratch)
        return header

    def checked(
        self, data: bytes | memoryview, *, namespace: str, key: str, rank: int, where: str | None = None
    ) -> codec.ChunkHeader:
        """The header of a whole object, checked as :meth:`decode` does before its frames."""
        header = self.parse_header(data, where)
        self.check(header, namespace, key, rank, where)
        if len(data) != header.object_length:
            raise CorruptChunk(
                _at(where, f"object is {len(data)} bytes, its header says {header.object_length}")
            )
        return header

    def check_macs(self, data: bytes | memoryview, where: str | None = None) -> codec.ChunkHeader:
        """With the keys: raise CorruptChunk unless a whole object, sound by
        its checksums, carries valid MACs (header and every frame); nothing
        is decompressed."""
        if self.keys is None:
            raise ValueError("a reader without keys checks no MACs")
        header = self.parse_header(data, where)
        mv = memoryview(data)
        with checking_bytes(where):
            for i, f in enumerate(header.frames):
                codec.check_frame_mac(header, i, mv[f.offset : f.end], self.keys)
        return header


def decode_chunk(
    data: bytes | memoryview, *, namespace: str, key: str, rank: int, keys: FleetKeys | None = None
) -> tuple[codec.ChunkHeader, list[np.ndarray]]:
    """A whole object's header and its layers' page bytes, read by a
    :class:`ChunkReader` without an engine's pages (tools and tests)."""
    layers: dict[int, np.ndarray] = {}
    header = ChunkReader(keys).decode(data, layers.__setitem__, namespace=namespace, key=key, rank=rank)
    return header, [layers[i] for i in range(len(header.frames))]


# -- judging an object by its name (the ops commands, the journal) -----------------------


def named_chunk(name: str) -> tuple[str, str, int]:
    """(namespace, key hex, rank) that the object ``name`` must hold."""
    parsed = parse_object_key(name)
    if parsed is None:
        raise CorruptChunk("not a chunk object name")
    ns, key, rank = parsed
    return ns, key.hex(), rank


async def read_chunk_head(store: ObjectStore, name: str) -> GetResult | None:
    """A chunk object's first bytes, through the end of its header, as
    :meth:`ChunkReader.read_header` reads them (one ranged GET of
    ``HEAD_BYTES``; two for a longer header). None when it cannot be told
    from a head (empty, a 416; rewritten between the two GETs): the object
    is then judged whole. A head that does not parse comes back as read:
    :func:`check_chunk_head` says why."""
    reads: list[GetResult] = []

    async def get(start: int, end: int) -> GetResult:
        got = await store.get_object(name, ByteRange(start, end))
        if reads and got.etag != reads[0].etag:
            raise Precondition(name)
        reads.append(got)
        return got

    try:
        head = await ChunkReader().read_header(get, HEAD_BYTES)
    except (RangeNotSatisfiable, Precondition):
        return None
    except CorruptChunk:
        return GetResult(b"".join(g.data for g in reads), reads[0].etag, reads[0].size)
    return GetResult(head.data, head.etag, head.size)


def check_chunk_head(name: str, head: bytes, size: int | None, keys: FleetKeys | None = None) -> None:
    """Raise CorruptChunk unless ``head``, the start of the object ``name``
    (``size`` bytes in all, where known), is a sound header for that name,
    of that length, and (with ``keys``) signed by a fleet key (else
    Unsigned): what :func:`s3kv.ops.chunks.check_chunk` finds without reading the frames."""
    ns, key, rank = named_chunk(name)
    reader = ChunkReader()
    header = reader.parse_header(head)
    reader.check(header, ns, key, rank)
    if size is not None and size != header.object_length:
        raise CorruptChunk(f"object is {size} bytes, its header says {header.object_length}")
    if keys is not None:
        try:
            ChunkReader(keys).parse_header(head)
        except CorruptChunk as e:
            raise Unsigned(str(e)) from None
