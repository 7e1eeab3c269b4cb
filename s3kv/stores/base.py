"""The object store interface every backend implements.

In the spirit of arrow-rs ``object_store``: backends implement the minimum
(``put``, ``get``, ``head``, ``list``, ``delete_many``); helpers such as
``exists`` and ``delete`` are written once here. Preconditions are values
(:class:`PutMode`), errors are the names in :mod:`s3kv.errors`, and a missing
object raises :class:`~s3kv.errors.NotFound` (a ``FileNotFoundError``).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

from s3kv.errors import NotFound, RangeNotSatisfiable


class PutMode(enum.Enum):
    OVERWRITE = "overwrite"
    """Replace whatever is there."""
    CREATE = "create"
    """Write only if absent; raise AlreadyExists otherwise (S3: If-None-Match: *)."""


@dataclass(frozen=True)
class Update:
    """Replace the object only if its ETag is still ``etag`` (S3: If-Match);
    raise Precondition otherwise, NotFound if it is gone. For leases."""

    etag: str


HEAD_BYTES = 64 << 10
"""The first ranged GET of an object whose header says its own length (a
chunk's, a manifest object's): most headers fit in it, a longer one takes
a second GET."""


@dataclass(frozen=True)
class ByteRange:
    """Bytes ``[start, end)`` of an object; ``end=None`` reads to the end."""

    start: int
    end: int | None = None

    def __post_init__(self) -> None:
        if self.start < 0 or (self.end is not None and self.end <= self.start):
            raise ValueError(f"invalid byte range [{self.start}, {self.end})")

    def http(self) -> str:
        return f"bytes={self.start}-" + ("" if self.end is None else str(self.end - 1))


@dataclass(frozen=True)
class GetResult:
    """What a read returned: the bytes, the object's ETag, and the whole
    object's size (from a ranged read's Content-Range), where known."""

    data: bytes
    etag: str | None = None
    size: int | None = None


@dataclass(frozen=True)
class ObjectMeta:
    key: str
    size: int
    last_modified: float
    """Seconds since the epoch."""
    etag: str | None = None


@dataclass(frozen=True)
class Upload:
    """An incomplete multipart upload."""

    key: str
    upload_id: str
    initiated: float
    """Seconds since the epoch."""


class ObjectStore(ABC):
    """An async key -> bytes store with create-only puts and ranged reads.

    Keys are '/'-separated relative paths without empty, '.' or '..' segments.
    ``list`` yields objects in lexicographic key order, which ``start_after``
    relies on, except on a :attr:`directory` store.
    """

    directory: bool = False
    """An S3 Express One Zone directory bucket, or a store that behaves like
    one: ``list`` yields in no order, takes no ``start_after`` (ValueError)
    and only prefixes that end with '/' (or none). ``list_dirs`` is sorted
    all the same. Callers that need an order sort; the manifest files its
    segments under minute prefixes on such a store
    (:mod:`s3kv.manifest.listing`)."""

    @abstractmethod
    async def put(
        self, key: str, data: bytes | memoryview, *, mode: PutMode | Update = PutMode.OVERWRITE
    ) -> str | None:
        """Store ``data`` under ``key``; CREATE raises AlreadyExists if present,
        :class:`Update` raises Precondition unless the ETag still matches.
        Returns the new object's ETag where the backend has one."""

    @abstractmethod
    async def get(self, key: str, range: ByteRange | None = None) -> bytes:
        """The object's bytes (or the part in ``range``; a range running past
        the end is cut short, one starting past it raises RangeNotSatisfiable,
        a ValueError)."""

    async def get_object(self, key: str, range: ByteRange | None = None) -> GetResult:
        """:meth:`get`, with the object's ETag and whole size where the
        backend tells them (its default tells neither)."""
        return GetResult(await self.get(key, range))

    async def get_buffer(self, key: str, range: ByteRange | None = None) -> GetResult:
        """:meth:`get_object`, whose ``data`` may be any bytes-like object
        (``len``, slices, ``+`` and the buffer protocol, not ``bytes``'s
        methods): a backend that holds the body in its own memory hands it
        over without copying it into a ``bytes``. For chunk frames."""
        return await self.get_object(key, range)

    @abstractmethod
    async def head(self, key: str) -> ObjectMeta:
        """Size and time of the object; NotFound if absent."""

    @abstractmethod
    def list(self, prefix: str = "", *, start_after: str | None = None) -> AsyncIterator[ObjectMeta]:
        """Objects whose key starts with ``prefix`` and sorts after ``start_after``."""

    @abstractmethod
    async def delete_many(self, keys: Iterable[str]) -> None:
        """Delete the keys; absent keys are not an error."""

    async def delete_if(self, key: str, etag: str) -> None:
        """Delete ``key`` only if its ETag is still ``etag`` (S3: If-Match);
        Precondition otherwise, NotFound if it is absent (S3 answers 404 to an
        If-Match delete of a missing key). Backends without conditional
        deletes (no ETags) refuse with NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} has no conditional delete")

    async def list_dirs(self, prefix: str = "") -> tuple[list[ObjectMeta], list[str]]:
        """One level of the tree under ``prefix`` (which ends with '/' or is
        empty): the objects directly in it, and its sub-prefixes (each ending
        with '/', named once however many objects lie under it). Both lists
        are whole (not paged) and in lexicographic order; a sub-prefix is
        there only while some object lies under it (a folder emptied by
        deletes is not). S3 answers this with a delimiter listing."""
        objects: list[ObjectMeta] = []
        dirs: set[str] = set()
        async for meta in self.list(prefix):
            rest = meta.key[len(prefix) :]
            if "/" in rest:
                dirs.add(prefix + rest.split("/", 1)[0] + "/")
            else:
                objects.append(meta)
        return sorted(objects, key=lambda m: m.key), sorted(dirs)

    async def list_uploads(self, prefix: str = "") -> list[Upload]:
        """Incomplete multipart uploads under ``prefix`` (none for backends
        that have no multipart uploads)."""
        return []

    async def abort_upload(self, upload: Upload) -> None:  # noqa: B027
        """Abort an incomplete multipart upload (absent: not an error)."""

    async def open(self) -> None:  # noqa: B027 (optional hook)
        """Set up connections ahead of the first request (optional)."""

    async def close(self) -> None:  # noqa: B027 (optional hook)
        """Release connections; the store is unusable afterwards."""

    # Helpers, written once for every backend.
    async def exists(self, key: str) -> bool:
        try:
            await self.head(key)
        except NotFound:
            return False
        return True

    async def delete(self, key: str) -> None:
        await self.delete_many([key])

    async def list_keys(self, prefix: str = "", *, start_after: str | None = None) -> list[str]:
        return [m.key async for m in self.list(prefix, start_after=start_after)]

    async def __aenter__(self) -> ObjectStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def check_key(key: str) -> str:
    """Reject keys that would escape a directory or alias another key."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"invalid object key {key!r}")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts) or "\x00" in key:
        raise ValueError(f"invalid object key {key!r}: empty, '.' or '..' segment")
    return key


def slice_range(data: bytes, range: ByteRange | None, key: str) -> bytes:
    """Apply a ByteRange to a whole object's bytes (memory and local stores)."""
    if range is None:
        return data
    if range.start >= len(data) and not (range.start == 0 and len(data) == 0):
        raise RangeNotSatisfiable(f"range start {range.start} is past the end of {key} ({len(data)} bytes)")
    return data[range.start : range.end]


def check_directory_listing(bucket: str, prefix: str, start_after: str | None) -> None:
    """Refuse a listing that a directory bucket cannot answer as asked: it
    ignores StartAfter, and takes only prefixes that end with '/'."""
    if start_after:
        raise ValueError(
            f"bucket {bucket!r} is a directory bucket (S3 Express One Zone): it lists without StartAfter "
            f"(asked to list {prefix!r} after {start_after!r})"
        )
    if prefix and not prefix.endswith("/"):
        raise ValueError(
            f"bucket {bucket!r} is a directory bucket (S3 Express One Zone): it lists only prefixes that "
            f"end with '/', not {prefix!r}"
        )
