"""A dict-backed store: the reference the other backends are tested against."""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator, Iterable

from s3kv.errors import AlreadyExists, NotFound, Precondition
from s3kv.stores.base import (
    ByteRange,
    GetResult,
    ObjectMeta,
    ObjectStore,
    PutMode,
    Update,
    check_key,
    slice_range,
)


class MemoryStore(ObjectStore):
    def __init__(self) -> None:
        self._objects: dict[str, tuple[bytes, float]] = {}

    @staticmethod
    def _etag(data: bytes) -> str:
        return '"' + hashlib.md5(data, usedforsecurity=False).hexdigest() + '"'

    async def put(
        self, key: str, data: bytes | memoryview, *, mode: PutMode | Update = PutMode.OVERWRITE
    ) -> str | None:
        check_key(key)
        if mode is PutMode.CREATE and key in self._objects:
            raise AlreadyExists(key)
        if isinstance(mode, Update):
            self._check_etag(key, mode.etag)
        data = bytes(data)
        self._objects[key] = (data, time.time())
        return self._etag(data)

    def _check_etag(self, key: str, etag: str) -> None:
        entry = self._objects.get(key)
        if entry is None:
            raise NotFound(key)
        if self._etag(entry[0]).strip('"') != etag.strip('"'):
            raise Precondition(key)

    async def delete_if(self, key: str, etag: str) -> None:
        self._check_etag(check_key(key), etag)
        del self._objects[key]

    async def get(self, key: str, range: ByteRange | None = None) -> bytes:
        try:
            data, _ = self._objects[check_key(key)]
        except KeyError:
            raise NotFound(key) from None
        return slice_range(data, range, key)

    async def get_object(self, key: str, range: ByteRange | None = None) -> GetResult:
        part = await self.get(key, range)  # through get(): what a subclass makes of it too
        entry = self._objects.get(key)
        if entry is None:
            return GetResult(part)
        return GetResult(part, self._etag(entry[0]), len(entry[0]))

    async def head(self, key: str) -> ObjectMeta:
        try:
            data, mtime = self._objects[check_key(key)]
        except KeyError:
            raise NotFound(key) from None
        return ObjectMeta(key, len(data), mtime, self._etag(data))

    async def list(self, prefix: str = "", *, start_after: str | None = None) -> AsyncIterator[ObjectMeta]:
        for key in sorted(self._objects):
            if key.startswith(prefix) and (start_after is None or key > start_after):
                entry = self._objects.get(key)
                if entry is not None:
                    yield ObjectMeta(key, len(entry[0]), entry[1], self._etag(entry[0]))

    async def delete_many(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._objects.pop(check_key(key), None)
