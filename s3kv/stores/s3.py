"""The S3 store, over aiobotocore.

Retries are botocore's ("standard" mode: throttling, 5xx, connection errors,
with exponential backoff and jitter, up to ``max_attempts``). Every botocore
error is mapped to an :mod:`s3kv.errors` name by
:func:`s3kv.stores.s3_errors.map_error`. CREATE puts send ``If-None-Match:
*``, so two replicas racing on one chunk store it once; the loser gets
AlreadyExists.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import botocore.exceptions as bexc
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session

from s3kv.config import DEFAULTS, S3KVConfig
from s3kv.errors import ConfigError, NotFound
from s3kv.stores.base import (
    ByteRange,
    GetResult,
    ObjectMeta,
    ObjectStore,
    PutMode,
    Update,
    Upload,
    check_directory_listing,
    check_key,
)
from s3kv.stores.s3_errors import NO_CREDENTIALS, map_error


@dataclass(frozen=True)
class S3Options:
    """Connection settings, cut from the config by :meth:`from_config`; a
    plain value so tests can build one (the defaults are the config's)."""

    region: str | None = DEFAULTS.region
    endpoint_url: str | None = DEFAULTS.endpoint_url
    addressing_style: str = DEFAULTS.addressing_style
    max_attempts: int = DEFAULTS.s3_max_attempts
    """Attempts per request, retried by botocore's "standard" mode: throttling
    (SlowDown, 503), 500/502/504, and connection or read errors."""
    connect_timeout_s: float = DEFAULTS.s3_connect_timeout_s
    read_timeout_s: float = DEFAULTS.s3_read_timeout_s
    max_connections: int = DEFAULTS.max_connections
    """Requests of the store in flight at once (:meth:`S3Store._in_flight`),
    and so connections in use."""
    directory: bool = False
    """An S3 Express One Zone directory bucket (:attr:`ObjectStore.directory`)."""
    multipart_threshold: int = 32 << 20
    part_size: int = 8 << 20
    part_concurrency: int = 8

    @property
    def virtual_hosted(self) -> bool:
        """Virtual-host addressing? (``auto``: path style with an endpoint.)"""
        if self.addressing_style == "auto":
            return not self.endpoint_url
        return self.addressing_style == "virtual"

    @classmethod
    def from_config(cls, config: S3KVConfig) -> S3Options:
        """The store's settings in ``config`` (the multipart ones are not keys)."""
        return cls(
            region=config.region,
            endpoint_url=config.endpoint_url,
            addressing_style=config.addressing_style,
            max_attempts=config.s3_max_attempts,
            connect_timeout_s=config.s3_connect_timeout_s,
            read_timeout_s=config.s3_read_timeout_s,
            max_connections=config.max_connections,
            directory=config.directory_bucket,
        )


def _meta(obj: dict[str, Any]) -> ObjectMeta:
    return ObjectMeta(obj["Key"], int(obj["Size"]), obj["LastModified"].timestamp(), obj.get("ETag"))


REQUEST_KINDS = {
    "GetObject": "get",
    "PutObject": "put",
    "CreateMultipartUpload": "put",
    "UploadPart": "put",
    "CompleteMultipartUpload": "put",
    "AbortMultipartUpload": "put",
    "ListObjectsV2": "list",
    "ListObjects": "list",
    "ListMultipartUploads": "list",
    "HeadObject": "head",
    "HeadBucket": "head",
    "DeleteObject": "delete",
    "DeleteObjects": "delete",
}
"""S3 operations by what they cost (S3 prices GET, PUT/LIST, and HEAD apart)."""


class S3Store(ObjectStore):
    """Objects in ``bucket`` (keys are used as given; prefixes are the caller's).

    ``on_request(kind)`` is called for every HTTP request sent, retries
    included, with ``kind`` one of get, put, list, head, delete, other.
    Every request waits for one of ``max_connections`` slots
    (:meth:`_in_flight`)."""

    def __init__(
        self, bucket: str, options: S3Options | None = None, on_request: Callable[[str], None] | None = None
    ) -> None:
        self.bucket = bucket
        self.options = options or S3Options()
        self.directory = self.options.directory
        self.on_request = on_request
        self._client: Any = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._client_lock: asyncio.Lock | None = None
        self._slots: asyncio.Semaphore | None = None

    def _in_flight(self) -> asyncio.Semaphore:
        """The slot a request holds until its response is read: at most
        ``max_connections`` requests of this store (of either client, as
        :class:`~s3kv.stores.native.NativeS3Store` has two) are in flight at
        once, and so at most that many connections in use. aiohttp's pool
        caps its own connections, but obstore's (reqwest's) only the idle
        ones, and opens one per request beyond them."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.options.max_connections)
        return self._slots

    async def _pages(self, client: Any, operation: str, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        """The pages of a paginated listing, each fetched in a slot of its
        own (none is held while the caller works on a page)."""
        pages = client.get_paginator(operation).paginate(**kwargs).__aiter__()
        while True:
            async with self._in_flight():
                try:
                    page = await pages.__anext__()
                except StopAsyncIteration:
                    return
            yield page

    async def _get_client(self) -> Any:
        if self._client is not None:
            return self._client
        if self._client_lock is None:
            self._client_lock = asyncio.Lock()
        async with self._client_lock:
            if self._client is None:
                o = self.options
                config = AioConfig(
                    region_name=o.region,
                    max_pool_connections=o.max_connections,
                    connect_timeout=o.connect_timeout_s,
                    read_timeout=o.read_timeout_s,
                    retries={
                        "mode": "standard",
                        "total_max_attempts": o.max_attempts,
                    },  # botocore's max_attempts counts retries
                    s3={"addressing_style": "virtual" if o.virtual_hosted else "path"},
                    tcp_keepalive=True,
                )
                stack = contextlib.AsyncExitStack()
                client = await stack.enter_async_context(
                    get_session().create_client("s3", endpoint_url=o.endpoint_url, config=config)
                )
                if self.on_request is not None:
                    client.meta.events.register("before-send.s3", self._count_request)
                self._client = client
                self._stack = stack
        return self._client

    def _count_request(self, event_name: str = "", **kwargs: Any) -> None:
        if self.on_request is not None:
            self.on_request(REQUEST_KINDS.get(event_name.rsplit(".", 1)[-1], "other"))

    async def open(self) -> None:
        await self._get_client()

    async def close(self) -> None:
        if self._stack is not None:
            stack, self._stack, self._client = self._stack, None, None
            await stack.aclose()

    async def check_access(self) -> None:
        """Fail unless credentials exist and the bucket is there and ours to read.

        Raises ConfigError (no credentials), NotFound (no bucket),
        PermissionDenied, or Transient (endpoint unreachable).
        """
        session = get_session()
        try:
            credentials = await session.get_credentials()
        except Exception as e:  # a provider in the chain is misconfigured
            raise ConfigError(f"AWS credentials could not be loaded: {e}") from e
        if credentials is None:
            raise ConfigError(NO_CREDENTIALS)
        client = await self._get_client()
        try:
            async with self._in_flight():
                await client.head_bucket(Bucket=self.bucket)
        except Exception as e:
            mapped = map_error(e, f"bucket {self.bucket}")
            if isinstance(mapped, NotFound):
                raise NotFound(self.bucket, "no such bucket") from e
            raise mapped from e

    async def put(
        self, key: str, data: bytes | memoryview, *, mode: PutMode | Update = PutMode.OVERWRITE
    ) -> str | None:
        check_key(key)
        client = await self._get_client()
        update = isinstance(mode, Update)
        extra = {"IfMatch": mode.etag} if update else {"IfNoneMatch": "*"} if mode is PutMode.CREATE else {}
        if len(data) >= self.options.multipart_threshold:
            return await self._put_multipart(client, key, memoryview(data), extra)
        try:
            async with self._in_flight():
                resp = await client.put_object(Bucket=self.bucket, Key=key, Body=bytes(data), **extra)
        except Exception as e:
            raise map_error(e, key, if_match=update) from e
        return resp.get("ETag")

    async def delete_if(self, key: str, etag: str) -> None:
        check_key(key)
        client = await self._get_client()
        try:
            async with self._in_flight():
                await client.delete_object(Bucket=self.bucket, Key=key, IfMatch=etag)
        except Exception as e:
            raise map_error(e, key, if_match=True) from e

    async def list_dirs(self, prefix: str = "") -> tuple[list[ObjectMeta], list[str]]:
        if self.directory:
            check_directory_listing(self.bucket, prefix, None)
        client = await self._get_client()
        objects: list[ObjectMeta] = []
        dirs: list[str] = []
        try:
            async for page in self._pages(
                client, "list_objects_v2", Bucket=self.bucket, Prefix=prefix, Delimiter="/"
            ):
                objects.extend(_meta(obj) for obj in page.get("Contents", ()))
                dirs.extend(p["Prefix"] for p in page.get("CommonPrefixes", ()))
        except Exception as e:
            raise map_error(e, f"list {prefix!r}") from e
        if self.directory:  # a directory bucket's listing comes in no order
            objects.sort(key=lambda m: m.key)
            dirs.sort()
        return objects, dirs

    async def list_uploads(self, prefix: str = "") -> list[Upload]:
        client = await self._get_client()
        out: list[Upload] = []
        try:
            async for page in self._pages(
                client, "list_multipart_uploads", Bucket=self.bucket, Prefix=prefix
            ):
                out.extend(
                    Upload(u["Key"], u["UploadId"], u["Initiated"].timestamp())
                    for u in page.get("Uploads", ())
                )
        except Exception as e:
            raise map_error(e, f"list uploads {prefix!r}") from e
        return out

    async def abort_upload(self, upload: Upload) -> None:
        client = await self._get_client()
        try:
            async with self._in_flight():
                await client.abort_multipart_upload(
                    Bucket=self.bucket, Key=upload.key, UploadId=upload.upload_id
                )
        except Exception as e:
            mapped = map_error(e, upload.key)
            if not isinstance(mapped, NotFound):
                raise mapped from e

    async def _put_multipart(
        self, client: Any, key: str, data: memoryview, extra: dict[str, str]
    ) -> str | None:
        try:
            async with self._in_flight():
                upload = await client.create_multipart_upload(Bucket=self.bucket, Key=key)
        except Exception as e:
            raise map_error(e, key) from e
        upload_id = upload["UploadId"]
        size = self.options.part_size
        sem = asyncio.Semaphore(self.options.part_concurrency)

        async def one(number: int, start: int) -> dict[str, Any]:
            async with sem, self._in_flight():
                resp = await client.upload_part(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=bytes(data[start : start + size]),
                )
                return {"PartNumber": number, "ETag": resp["ETag"]}

        try:
            parts = await asyncio.gather(
                *(one(i + 1, start) for i, start in enumerate(range(0, len(data), size)))
            )
            async with self._in_flight():
                resp = await client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": list(parts)},
                    **extra,
                )
        except BaseException as e:
            with contextlib.suppress(Exception):
                async with self._in_flight():
                    await client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            if isinstance(e, Exception):
                raise map_error(e, key, if_match="IfMatch" in extra) from e
            raise
        return resp.get("ETag")

    async def get(self, key: str, range: ByteRange | None = None) -> bytes:
        return (await self.get_object(key, range)).data

    async def get_object(self, key: str, range: ByteRange | None = None) -> GetResult:
        check_key(key)
        client = await self._get_client()
        kwargs = {"Range": range.http()} if range is not None else {}
        try:
            async with self._in_flight():
                resp = await client.get_object(Bucket=self.bucket, Key=key, **kwargs)
                async with resp["Body"] as body:
                    data = await body.read()
        except Exception as e:
            raise map_error(e, key) from e
        total = str(resp.get("ContentRange") or "").rpartition("/")[2]
        size = int(total) if total.isascii() and total.isdigit() else (len(data) if range is None else None)
        return GetResult(data, resp.get("ETag"), size)

    async def head(self, key: str) -> ObjectMeta:
        check_key(key)
        client = await self._get_client()
        try:
            async with self._in_flight():
                resp = await client.head_object(Bucket=self.bucket, Key=key)
        except Exception as e:
            raise map_error(e, key) from e
        return ObjectMeta(key, int(resp["ContentLength"]), resp["LastModified"].timestamp(), resp.get("ETag"))

    async def list(self, prefix: str = "", *, start_after: str | None = None) -> AsyncIterator[ObjectMeta]:
        if self.directory:
            check_directory_listing(self.bucket, prefix, start_after)
        client = await self._get_client()
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
        if start_after:
            kwargs["StartAfter"] = start_after
        try:
            async for page in self._pages(client, "list_objects_v2", **kwargs):
                for obj in page.get("Contents", ()):
                    yield _meta(obj)
        except Exception as e:
            raise map_error(e, f"list {prefix!r}") from e

    async def delete_many(self, keys: Iterable[str]) -> None:
        client = await self._get_client()
        batch: list[str] = []

        async def flush() -> None:
            try:
                async with self._in_flight():
                    resp = await client.delete_objects(
                        Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                    )
            except Exception as e:
                raise map_error(e, f"delete {batch[0]}...") from e
            errors = [err for err in resp.get("Errors", ()) if err.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                raise map_error(
                    bexc.ClientError({"Error": first, "ResponseMetadata": {}}, "DeleteObjects"),
                    first.get("Key", "?"),
                )

        for key in keys:
            batch.append(check_key(key))
            if len(batch) == 1000:
                await flush()
                batch = []
        if batch:
            await flush()
