"""The S3 store with a native data plane: object GETs, HEADs and single-part
PUTs go through obstore (arrow-rs ``object_store``, Rust: requests are signed,
sent and parsed off the GIL); listings, deletes, conditional deletes and
multipart uploads stay on aiobotocore (:class:`~s3kv.stores.s3.S3Store`,
which this subclasses), where they are rare and where obstore lacks the
conditions s3kv needs (a conditional delete, a create-only multipart
complete).

Why obstore: chunk GETs and PUTs are most of a replica's S3 work, and they
share the CPU with the forward and the codec threads; obstore keeps them
off the GIL at the least client CPU per byte of the clients
``benchmarks/s3_clients.py`` compares (its goal keeps the choice checked).

What it keeps of the aiobotocore store, so that callers cannot tell:

- **Credentials**: botocore's chain, the very one aiobotocore uses
  (environment, profiles, web identity / IRSA, container and instance
  roles, SSO), handed to obstore as a credential provider that botocore
  refreshes; refused or unrenewable credentials are the tier's
  (``PermissionDenied(credentials=True)``).
- **Retries**: ``s3_max_attempts`` attempts with exponential backoff and
  jitter on 5xx (SlowDown's 503 included), dropped connections and timeouts
  (object_store's retry policy).
- **Timeouts**: ``s3_connect_timeout_s`` for the connect;
  ``s3_read_timeout_s`` bounds each attempt of a request as a whole (object
  store has no per-read timeout).
- **Addressing and endpoints**: ``addressing_style`` and ``endpoint_url``
  as for aiobotocore (``auto``: path style with an endpoint).
- **Errors**: mapped onto :mod:`s3kv.errors` here (:func:`map_error`), by
  the HTTP status and the S3 error code in the response.
- **Request counts**: ``on_request`` is told once per call (obstore's
  retries are not seen).
- **Connections**: ``max_connections`` slots shared by both clients
  (:meth:`S3Store._in_flight`); reqwest's own setting caps only the idle
  pool, and it opens a connection for every request beyond it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import threading
from collections.abc import Callable
from typing import Any

from s3kv.errors import (
    AlreadyExists,
    ConfigError,
    NotFound,
    PermissionDenied,
    Precondition,
    RangeNotSatisfiable,
    S3KVError,
    Throttled,
    Transient,
)
from s3kv.stores.base import ByteRange, GetResult, ObjectMeta, PutMode, Update, check_key
from s3kv.stores.s3 import S3Options, S3Store
from s3kv.stores.s3_errors import CREDENTIALS_CODES, DENIED_CODES, NO_CREDENTIALS, THROTTLED_CODES

_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([^<]{1,100})</Code>")
CREDENTIAL_TTL = dt.timedelta(minutes=5)
"""How long obstore keeps credentials before asking botocore again (botocore
renews temporary ones itself ahead of their expiry)."""


def _status_and_code(message: str) -> tuple[int, str]:
    status = _STATUS.search(message)
    code = _CODE.search(message)
    n = int(status.group(1)) if status else 0
    return n, code.group(1) if code else (str(n) if n else "")


def map_error(
    e: BaseException, what: str, *, if_match: bool = False, credentials_failed: bool = False
) -> Exception:
    """The one place where obstore's errors become s3kv errors."""
    from obstore import exceptions as ox

    message = str(e)
    status, code = _status_and_code(message)
    if credentials_failed:
        return PermissionDenied(f"{what}: the AWS credentials could not be renewed", credentials=True)
    if code == "NoSuchBucket":
        return NotFound(what, "no such bucket")
    if isinstance(e, ox.AlreadyExistsError):
        return Precondition(what) if if_match else AlreadyExists(what)
    if isinstance(e, FileNotFoundError) or status == 404:
        return NotFound(what)
    if isinstance(e, ox.PreconditionError) or status == 412:
        return Precondition(what) if if_match else AlreadyExists(what)
    if code in CREDENTIALS_CODES or isinstance(e, ox.UnauthenticatedError) or status == 401:
        return PermissionDenied(f"{what}: {code or 'unauthenticated'} (HTTP {status})", credentials=True)
    if code in DENIED_CODES or status == 403 or isinstance(e, ox.PermissionDeniedError):
        return PermissionDenied(f"{what}: {code or 'AccessDenied'}")
    if code == "InvalidRange" or status == 416:
        return RangeNotSatisfiable(f"{what}: range not satisfiable")
    if code in THROTTLED_CODES or status in (429, 503):
        return Throttled(f"{what}: {code} (HTTP {status})")
    if status:
        return Transient(f"{what}: {code} (HTTP {status})")
    if isinstance(e, (ox.BaseError, OSError, TimeoutError)):
        first = message.split("\n", 1)[0][:300]
        return Transient(f"{what}: {type(e).__name__}: {first}")
    return e if isinstance(e, Exception) else S3KVError(message)


class _BotocoreCredentials:
    """obstore's credential provider: botocore's chain, renewed by botocore.
    A failure is remembered, so that the error it causes is the credentials'."""

    def __init__(self, region: str | None) -> None:
        import botocore.session

        session = botocore.session.Session()
        try:
            self._credentials = session.get_credentials()
        except Exception as e:  # a provider in the chain is misconfigured
            raise ConfigError(f"AWS credentials could not be loaded: {e}") from e
        if self._credentials is None:
            raise ConfigError(NO_CREDENTIALS)
        self.region = region or session.get_config_variable("region") or "us-east-1"
        self.failed = False

    def __call__(self) -> dict[str, Any]:
        try:
            frozen = self._credentials.get_frozen_credentials()
        except Exception:
            self.failed = True
            raise
        self.failed = False
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": dt.datetime.now(dt.timezone.utc) + CREDENTIAL_TTL,
        }


class NativeS3Store(S3Store):
    """:class:`S3Store` whose object reads and writes go through obstore."""

    def __init__(
        self, bucket: str, options: S3Options | None = None, on_request: Callable[[str], None] | None = None
    ) -> None:
        super().__init__(bucket, options, on_request)
        self._native: Any = None
        self._credentials: _BotocoreCredentials | None = None
        self._native_lock = threading.Lock()

    def _obstore(self) -> Any:
        if self._native is not None:
            return self._native
        with self._native_lock:
            if self._native is None:
                from obstore.store import S3Store as ObstoreS3

                o = self.options
                credentials = _BotocoreCredentials(o.region)
                config: dict[str, Any] = {"region": credentials.region}
                if o.endpoint_url:
                    config["endpoint"] = o.endpoint_url
                elif o.directory:
                    # S3 Express One Zone: object_store signs with the session
                    # credentials of a CreateSession it caches and renews per
                    # client (not per request). It sends CreateSession to AWS
                    # whatever the endpoint, so a compatible server named by
                    # endpoint_url is spoken to as a general-purpose one.
                    config["s3_express"] = True
                self._native = ObstoreS3(
                    self.bucket,
                    config=config,
                    virtual_hosted_style_request=o.virtual_hosted,
                    credential_provider=credentials,
                    client_options={
                        "allow_http": bool(o.endpoint_url and o.endpoint_url.startswith("http://")),
                        "connect_timeout": dt.timedelta(seconds=o.connect_timeout_s),
                        "timeout": dt.timedelta(seconds=o.read_timeout_s),
                        "pool_max_idle_per_host": str(o.max_connections),
                    },
                    retry_config={
                        "max_retries": max(0, o.max_attempts - 1),
                        "backoff": {
                            "init_backoff": dt.timedelta(milliseconds=100),
                            "max_backoff": dt.timedelta(seconds=20),
                            "base": 2,
                        },
                        "retry_timeout": dt.timedelta(seconds=max(60.0, o.read_timeout_s * o.max_attempts)),
                    },
                )
                self._credentials = credentials
        return self._native

    async def _store(self) -> Any:
        """The obstore client, built off the event loop the first time
        (botocore's chain may ask an instance's metadata endpoint)."""
        if self._native is not None:
            return self._native
        return await asyncio.to_thread(self._obstore)

    def _map(self, e: BaseException, what: str, *, if_match: bool = False) -> Exception:
        failed = self._credentials is not None and self._credentials.failed
        return map_error(e, what, if_match=if_match, credentials_failed=failed)

    def _count(self, kind: str) -> None:
        if self.on_request is not None:
            self.on_request(kind)

    async def open(self) -> None:
        await super().open()
        await self._store()

    async def put(
        self, key: str, data: bytes | memoryview, *, mode: PutMode | Update = PutMode.OVERWRITE
    ) -> str | None:
        if len(data) >= self.options.multipart_threshold:
            return await super().put(key, data, mode=mode)  # a create-only or If-Match complete
        import obstore

        check_key(key)
        store = await self._store()
        update = isinstance(mode, Update)
        native_mode: Any = {"e_tag": mode.etag} if update else mode.value
        self._count("put")
        try:
            async with self._in_flight():
                result = await obstore.put_async(store, key, data, mode=native_mode, use_multipart=False)
        except Exception as e:
            raise self._map(e, key, if_match=update) from e
        return result.get("e_tag")

    async def get(self, key: str, range: ByteRange | None = None) -> bytes:
        return (await self.get_object(key, range)).data

    async def get_object(self, key: str, range: ByteRange | None = None) -> GetResult:
        got = await self.get_buffer(key, range)
        return GetResult(bytes(got.data), got.etag, got.size)

    async def get_buffer(self, key: str, range: ByteRange | None = None) -> GetResult:
        import obstore

        check_key(key)
        store = await self._store()
        options: dict[str, Any] = {}
        if range is not None:
            options["range"] = {"offset": range.start} if range.end is None else (range.start, range.end)
        self._count("get")
        try:
            async with self._in_flight():
                result = await obstore.get_async(store, key, options=options)
                data = await result.bytes_async()
        except Exception as e:
            raise self._map(e, key) from e
        meta = result.meta
        # obstore's Bytes: the response body as Rust received it, shared
        # through the buffer protocol (no copy into a Python bytes); it
        # compares, slices and concatenates as bytes do.
        return GetResult(data, meta.get("e_tag"), int(meta["size"]))

    async def head(self, key: str) -> ObjectMeta:
        import obstore

        check_key(key)
        store = await self._store()
        self._count("head")
        try:
            async with self._in_flight():
                meta = await obstore.head_async(store, key)
        except Exception as e:
            raise self._map(e, key) from e
        return ObjectMeta(key, int(meta["size"]), meta["last_modified"].timestamp(), meta.get("e_tag"))
