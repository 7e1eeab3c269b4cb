"""One chunk shard in its forms: page bytes per layer (the CPU tier, the KV
cache) and the encoded object (NVMe, S3). :class:`ChunkCodec` is this
engine's way of encoding them and of reading them back, through the one
:class:`~s3kv.chunk_reader.ChunkReader` set to its pages; :func:`load_chunk`
fetches an object from a store with parallel ranged reads and decodes frames
as they arrive. The CPU work (checksums, zstd, shuffling) runs in an executor
so several chunks decode at once."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TypeVar

import numpy as np

from s3kv import codec
from s3kv.auth import FleetKeys
from s3kv.chunk_reader import BufferGet, ChunkReader, HeaderRead, PageFormat
from s3kv.config import DEFAULTS
from s3kv.errors import (
    ConfigError,
    CorruptChunk,
    NotFound,
    PermissionDenied,
    RangeNotSatisfiable,
    Transient,
    UnsupportedFormat,
)
from s3kv.frame_sinks import FrameInto, FrameSink, SinkFailed
from s3kv.stores.base import ByteRange, ObjectStore

T = TypeVar("T")


@dataclass(frozen=True)
class ChunkId:
    """Which object a chunk shard is, and what its header must say."""

    object_key: str
    namespace: str
    key_hex: str
    rank: int


def plan_ranges(
    frames: Sequence[codec.Frame], have_until: int, range_bytes: int
) -> list[tuple[int, int, list[int]]]:
    """Group the frames not yet fetched into ranged GETs of about ``range_bytes``:
    (start, end, frame indexes), each group whole frames in layer order."""
    groups: list[tuple[int, int, list[int]]] = []
    current: list[int] = []
    start = end = 0
    for i, f in enumerate(frames):
        if f.end <= have_until:
            continue
        if current and f.end - start > range_bytes:
            groups.append((start, end, current))
            current = []
        if not current:
            start = f.offset
        current.append(i)
        end = f.end
    if current:
        groups.append((start, end, current))
    return groups


@dataclass(frozen=True)
class ChunkCodec:
    """How this engine's chunk shards are encoded, and what a decoded one
    must match: namespace, rank, layer count and page format. With ``keys``
    (the fleet secret) objects are signed, and only signed ones are read."""

    namespace: str
    rank: int
    num_layers: int
    fmt: PageFormat
    codec: str = DEFAULTS.codec
    level: int = DEFAULTS.zstd_level
    keys: FleetKeys | None = None

    @cached_property
    def reader(self) -> ChunkReader:
        """The one chunk reader, set to this engine's keys and pages."""
        return ChunkReader(self.keys, self.num_layers, self.fmt)

    @property
    def max_header(self) -> int:
        """The longest header one of this engine's chunks can have."""
        return self.reader.max_header

    @property
    def max_object(self) -> int:
        """The most bytes one of this engine's chunks can take."""
        bound = self.reader.max_object
        assert bound is not None  # a reader with pages
        return bound

    def encode(self, key: bytes, layers: Sequence[np.ndarray]) -> bytes:
        return codec.encode_chunk(
            namespace=self.namespace,
            key=key.hex(),
            rank=self.rank,
            tokens=self.fmt.tokens,
            layers=layers,
            dtype=self.fmt.dtype,
            itemsize=self.fmt.itemsize,
            page_shape=self.fmt.page_shape,
            codec=self.codec,
            level=self.level,
            keys=self.keys,
        )

    def parse_header(self, data: bytes | memoryview, where: str = "chunk") -> codec.ChunkHeader:
        return self.reader.parse_header(data, where)

    def check(self, header: codec.ChunkHeader, key_hex: str, where: str) -> None:
        """Raise CorruptChunk unless ``header`` is this engine's chunk
        ``key_hex``, with frames that decode to exactly this engine's pages:
        nothing a header says is allocated before it passed."""
        self.reader.check(header, self.namespace, key_hex, self.rank, where)

    def decode(
        self, key: bytes, blob: bytes | memoryview, sink: FrameSink, where: str, *, scratch: bool = False
    ) -> None:
        """Check a whole object and hand each decoded layer to ``sink`` (with
        ``scratch``, in a reused buffer: see :data:`FrameSink`)."""
        self.reader.decode(
            blob, sink, namespace=self.namespace, key=key.hex(), rank=self.rank, where=where, scratch=scratch
        )

    def decode_into(self, key: bytes, blob: bytes | memoryview, into: FrameInto, where: str) -> None:
        """Check a whole object and decode each layer straight where ``into``
        puts it (:meth:`~s3kv.chunk_reader.ChunkReader.read_frames`)."""
        reader = self.reader
        header = reader.checked(blob, namespace=self.namespace, key=key.hex(), rank=self.rank, where=where)
        reader.read_frames(header, blob, 0, range(len(header.frames)), into, where)


class ChunkData:
    """A chunk shard as page bytes per layer, as an encoded object, or both;
    the missing form is made once, on first use (thread-safe enough: at worst
    two threads both encode)."""

    def __init__(
        self,
        key: bytes,
        chunk_codec: ChunkCodec,
        *,
        layers: Sequence[np.ndarray] | None = None,
        blob: bytes | None = None,
    ) -> None:
        if layers is None and blob is None:
            raise ValueError("a chunk needs its layers or its encoded bytes")
        self.key = key
        self.codec = chunk_codec
        self._layers = list(layers) if layers is not None else None
        self._blob = blob
        self._encoded: dict[tuple[str, int], bytes] = {}
        """The chunk in other codecs than its own (:meth:`blob_for`)."""
        self._from_object = layers is None
        """Known first as an object (a promotion's): :attr:`blob` is in the
        codec its header names, which need not be ``chunk_codec``'s (an
        object stored before ``codec: auto`` switched, or after)."""
        self._blob_codec: str | None = None
        self.picked: dict[object, ChunkCodec] = {}
        """The codec each tier's writer picked for this chunk when the store
        encoded it (``codec: auto``), by tier: its write uses that one even
        if the choice changed since, so the chunk is not encoded twice."""

    @property
    def raw_bytes(self) -> int:
        if self._layers is not None:
            return sum(a.nbytes for a in self._layers)
        return self.codec.parse_header(self._blob).raw_bytes  # type: ignore[arg-type]

    @property
    def layers(self) -> list[np.ndarray]:
        if self._layers is None:
            out: list[np.ndarray] = [np.empty(0, np.uint8)] * self.codec.num_layers
            self.codec.decode(self.key, self._blob, out.__setitem__, "chunk")  # type: ignore[arg-type]
            self._layers = out
        return self._layers

    @property
    def blob(self) -> bytes:
        if self._blob is None:
            self._blob = self.codec.encode(self.key, self._layers)  # type: ignore[arg-type]
        return self._blob

    def _is_stored_as(self, chunk_codec: ChunkCodec) -> bool:
        """Is :attr:`blob` already ``chunk_codec``'s encoding? For a chunk
        encoded here, if that is its own codec. For one known first as an
        object (a promotion), if the object's header names ``chunk_codec``'s
        codec, whatever codec the chunk was built with and whether its layers
        were decoded since (one engine's codecs differ only in that field and
        the level, which readers do not need)."""
        if not self._from_object:
            return chunk_codec == self.codec
        if dataclasses.replace(chunk_codec, codec=self.codec.codec, level=self.codec.level) != self.codec:
            return False
        if self._blob_codec is None:
            self._blob_codec = self.codec.parse_header(self._blob).codec  # type: ignore[arg-type]
        return self._blob_codec == chunk_codec.codec

    def blob_for(self, chunk_codec: ChunkCodec) -> bytes:
        """The chunk as ``chunk_codec`` encodes it: :attr:`blob` where that is
        already in ``chunk_codec``'s codec (:meth:`_is_stored_as`), else
        encoded from the layers (decoded from the blob first if need be),
        once per codec."""
        if self._is_stored_as(chunk_codec):
            return self.blob
        which = (chunk_codec.codec, chunk_codec.level)
        blob = self._encoded.get(which)
        if blob is None:
            blob = self._encoded[which] = chunk_codec.encode(self.key, self.layers)
        return blob


@dataclass
class _Reading:
    """One read of a chunk object: what a CorruptChunk must carry."""

    where: str
    etag: str | None = None


_STORE_ERRORS = (NotFound, Transient, PermissionDenied, ConfigError)
"""What stores raise that a read passes on as it is."""


async def _read(where: str, body: Callable[[_Reading], Awaitable[T]]) -> T:
    """Run one read of the chunk object ``where``, and say what its failure
    means: the one place this is decided, for every read of a chunk object.

    CorruptChunk only for the object's bytes (what the :class:`ChunkReader`
    guards: header, MAC, checksums, sizes, frames, truncation) and a 416, with
    the ETag read so that a delete is conditional. A MemoryError is the
    host's, not the object's (every allocation a read makes is bounded by the
    reader's layout): Transient, so memory pressure never deletes an object.
    A too new format version is NotFound: this s3kv cannot use the object,
    but another can, so it is never deleted. Store errors pass as they are;
    anything else (a library's surprise: a connection dropped mid-body, an
    executor shut down) is Transient, never corrupt, so that a network fault
    never costs a good object. Its message names the object and the error's
    type, not its text, which may hold an endpoint or a signed URL."""
    r = _Reading(where)
    try:
        return await body(r)
    except SinkFailed as e:  # the engine's side, not the object's: no corruption
        raise e.__cause__ from None  # type: ignore[misc]
    except UnsupportedFormat as e:
        raise NotFound(where, str(e)) from e
    except CorruptChunk as e:
        e.etag = r.etag
        raise
    except MemoryError as e:
        raise Transient(
            f"{where}: out of memory while reading it (MemoryError), not a fault of the object"
        ) from e
    except RangeNotSatisfiable as e:
        corrupt = CorruptChunk(f"{where}: shorter than its header says ({e})")
        corrupt.etag = r.etag
        raise corrupt from e
    except _STORE_ERRORS:
        raise
    except Exception as e:
        raise Transient(f"{where}: reading it failed ({type(e).__name__}), not a fault of the object") from e


async def _read_header(
    store: ObjectStore, chunk: ChunkId, chunk_codec: ChunkCodec, prefetch: int, r: _Reading
) -> HeaderRead:
    where = chunk.object_key
    get = BufferGet(store, where)
    try:
        head = await chunk_codec.reader.read_header(get, prefetch, where)
    finally:
        r.etag = get.etag  # what the first GET saw, for a failure's CorruptChunk
    chunk_codec.check(head.header, chunk.key_hex, where)
    length = head.header.object_length
    if len(head.data) > length or (head.size is not None and head.size != length):
        raise CorruptChunk(
            f"{where}: object is {head.size if head.size is not None else len(head.data)} bytes, "
            f"its header says {length}"
        )
    return head


async def read_header(
    store: ObjectStore, chunk: ChunkId, *, chunk_codec: ChunkCodec, prefetch: int
) -> HeaderRead:
    """Read and check ``chunk``'s header (the first GET asks for ``prefetch``
    bytes). Raises as :func:`load_chunk` does."""
    return await _read(chunk.object_key, lambda r: _read_header(store, chunk, chunk_codec, prefetch, r))


async def load_chunk(
    store: ObjectStore,
    chunk: ChunkId,
    into: FrameInto,
    *,
    chunk_codec: ChunkCodec,
    range_bytes: int,
    executor: concurrent.futures.Executor | None = None,
    keep_blob: bool = False,
) -> tuple[int, bytes | None]:
    """Fetch, check and decode every frame of ``chunk`` straight where
    ``into`` puts it, as soon as its range arrives. Returns the bytes fetched and, with
    ``keep_blob``, the whole object (to promote it to another tier).

    Raises NotFound (also for an object of a newer format version);
    CorruptChunk for anything wrong with the object's bytes (identity, layer
    count, sizes, checksum or MAC, truncation, a 416), with the ETag read;
    Transient, PermissionDenied (see :func:`_read`); what ``into`` raises
    passes as it is. ``into`` sees only
    verified bytes, but may have seen some layers before a later one fails.
    Nothing is allocated from what a header says before
    :meth:`ChunkCodec.check` passed it."""

    async def body(r: _Reading) -> tuple[int, bytes | None]:
        head = await _read_header(store, chunk, chunk_codec, range_bytes, r)
        return await _fetch_frames(
            store, chunk_codec, head.header, head.data, into, r.where, range_bytes, executor, keep_blob
        )

    return await _read(chunk.object_key, body)


async def _fetch_frames(
    store: ObjectStore,
    chunk_codec: ChunkCodec,
    header: codec.ChunkHeader,
    first: bytes,
    into: FrameInto,
    where: str,
    range_bytes: int,
    executor: concurrent.futures.Executor | None,
    keep_blob: bool,
) -> tuple[int, bytes | None]:
    """Check and decode the frames of ``first`` (the object's first bytes)
    and of the ranged GETs that fetch the rest, each range on the executor
    as it arrives. A chunk the first GET brought whole (one of
    ``range_bytes`` or less: the usual case) takes one hop to the executor
    for all of its frames, and its bytes are used where the store holds them."""
    loop = asyncio.get_running_loop()
    read_frames = chunk_codec.reader.read_frames  # on the executor's threads: the CPU work
    have = len(first)
    groups = plan_ranges(header.frames, have, range_bytes)
    if not groups:  # every frame is in ``first``, which is then the whole object
        if header.frames:
            await loop.run_in_executor(
                executor, read_frames, header, first, 0, range(len(header.frames)), into, where
            )
        return have, bytes(first) if keep_blob else None

    whole = bytearray(header.object_length) if keep_blob else None
    if whole is not None:
        whole[: len(first)] = first
    ready = [i for i, f in enumerate(header.frames) if f.end <= have]
    jobs = (
        [loop.run_in_executor(executor, read_frames, header, first, 0, ready, into, where)] if ready else []
    )

    async def fetch_and_decode(start: int, end: int, indexes: list[int]) -> int:
        buf = (await store.get_buffer(where, ByteRange(start, end))).data
        if len(buf) != end - start:
            raise CorruptChunk(f"{where}: truncated (range {start}-{end} gave {len(buf)} bytes)")
        if whole is not None:
            whole[start:end] = buf
        await loop.run_in_executor(executor, read_frames, header, buf, start, indexes, into, where)
        return len(buf)

    jobs += [fetch_and_decode(*g) for g in groups]
    results = await asyncio.gather(*jobs, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    fetched = have + sum(r for r in results if isinstance(r, int))
    return fetched, bytes(whole) if whole is not None else None
