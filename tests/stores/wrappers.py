"""A store wrapper for tests of what real buckets hold: it composes over any
store (memory, S3) as arrow-rs's wrappers do, and

- raises :class:`~s3kv.errors.PermissionDenied` for the GETs of chosen keys
  (an object another tenant wrote, a KMS key this role may not use), or,
  for others, one that refuses the caller's own credentials (an expired
  token);
- raises :class:`~s3kv.errors.Transient` for the GETs of others (throttled
  for good);
- lists folder markers (zero-byte keys ending in '/') that a store which
  refuses such keys cannot hold, as S3 lists them;
- lists chosen objects with another size than they have (changed since);
- records every GET, with its range and how many bytes came back.

:class:`DirectoryBucketStore` lists any store as an S3 Express One Zone
directory bucket does; :class:`HeldPuts` holds chosen PUTs in flight (a slow
S3) until the test lets them go.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from s3kv.errors import PermissionDenied, Transient
from s3kv.stores.base import ByteRange, ObjectMeta, ObjectStore, PutMode, Update


@dataclass
class Get:
    key: str
    range: ByteRange | None
    returned: int
    """Bytes that came back (0 when it raised)."""


@dataclass
class WrappedStore(ObjectStore):
    inner: ObjectStore
    denied: set[str] = field(default_factory=set)
    refused: set[str] = field(default_factory=set)
    failing: set[str] = field(default_factory=set)
    markers: set[str] = field(default_factory=set)
    listed_sizes: dict[str, int] = field(default_factory=dict)
    gets: list[Get] = field(default_factory=list)

    def gets_of(self, key: str) -> list[Get]:
        return [g for g in self.gets if g.key == key]

    async def put(
        self, key: str, data: bytes | memoryview, *, mode: PutMode | Update = PutMode.OVERWRITE
    ) -> str | None:
        return await self.inner.put(key, data, mode=mode)

    async def get(self, key: str, range: ByteRange | None = None) -> bytes:
        if key in self.denied:
            self.gets.append(Get(key, range, 0))
            raise PermissionDenied(f"{key}: AccessDenied")
        if key in self.refused:
            self.gets.append(Get(key, range, 0))
            raise PermissionDenied(f"{key}: ExpiredToken (HTTP 400)", credentials=True)
        if key in self.failing:
            self.gets.append(Get(key, range, 0))
            raise Transient(f"{key}: SlowDown (HTTP 503)")
        data = await self.inner.get(key, range)
        self.gets.append(Get(key, range, len(data)))
        return data

    async def head(self, key: str) -> ObjectMeta:
        return await self.inner.head(key)

    async def list(self, prefix: str = "", *, start_after: str | None = None) -> AsyncIterator[ObjectMeta]:
        extra = [
            ObjectMeta(m, 0, 0.0)
            for m in sorted(self.markers)
            if m.startswith(prefix) and (start_after is None or m > start_after)
        ]
        extra_keys = [m.key for m in extra]
        async for meta in self.inner.list(prefix, start_after=start_after):
            while extra and extra[0].key < meta.key:
                yield extra.pop(0)
            if meta.key in self.listed_sizes:
                meta = ObjectMeta(meta.key, self.listed_sizes[meta.key], meta.last_modified, meta.etag)
            if meta.key not in extra_keys:
                yield meta
        for meta in extra:
            yield meta

    async def delete_many(self, keys: Iterable[str]) -> None:
        await self.inner.delete_many(keys)

    async def close(self) -> None:
        await self.inner.close()


@dataclass
class DirectoryBucketStore(WrappedStore):
    """``inner`` listed as a directory bucket (S3 Express One Zone) lists: in
    no order (shuffled, seeded), StartAfter ignored (and counted), a prefix
    that does not end with '/' refused as S3 refuses it (a 400 there)."""

    seed: int = 0
    start_after_ignored: int = 0
    listed: list[str] = field(default_factory=list)
    """Every prefix listed, in order."""
    shuffled: int = 0
    """Listings that came in another order than the inner store's."""

    directory = True

    async def list(self, prefix: str = "", *, start_after: str | None = None) -> AsyncIterator[ObjectMeta]:
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"InvalidArgument: prefix {prefix!r} does not end with '/' (a directory bucket)")
        if start_after is not None:
            self.start_after_ignored += 1
        self.listed.append(prefix)
        metas = [m async for m in self.inner.list(prefix)]
        order = metas[:]
        random.Random(self.seed + len(self.listed)).shuffle(order)
        self.shuffled += order != metas
        for meta in order:
            yield meta

    async def delete_if(self, key: str, etag: str) -> None:
        await self.inner.delete_if(key, etag)


@dataclass
class HeldPuts(WrappedStore):
    """The first ``times`` PUTs of keys containing ``hold`` stay in flight
    (a slow S3) until :meth:`release` (called on the store's event loop) or
    their cancellation: before they reach ``inner``, or with ``land_first``
    after it (S3 committed the object, its answer has not come yet)."""

    hold: str = ""
    times: int = 1
    land_first: bool = False
    held: int = 0
    """PUTs held so far."""
    in_flight: int = 0
    most_in_flight: int = 0
    """The most PUTs of keys containing ``hold`` under way at once."""
    _release: asyncio.Future[BaseException | None] | None = None

    def release(self, error: BaseException | None = None) -> None:
        """Let the held PUTs go on; with ``error``, they raise it instead."""
        if self._release is None:
            self._release = asyncio.get_running_loop().create_future()
        self._release.set_result(error)

    async def put(
        self, key: str, data: bytes | memoryview, *, mode: PutMode | Update = PutMode.OVERWRITE
    ) -> str | None:
        if self.hold not in key:
            return await self.inner.put(key, data, mode=mode)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.held >= self.times:
                return await self.inner.put(key, data, mode=mode)
            self.held += 1
            etag = await self.inner.put(key, data, mode=mode) if self.land_first else None
            if self._release is None:
                self._release = asyncio.get_running_loop().create_future()
            error = await asyncio.shield(self._release)
            if error is not None:
                raise error
            return etag if self.land_first else await self.inner.put(key, data, mode=mode)
        finally:
            self.in_flight -= 1
