"""A lease on a bucket prefix, so that two ``s3kv gc`` runs take turns.

The lease is one object, ``{prefix}/gc.lock``, holding who took it and until
when. It is taken with a create-only PUT (``If-None-Match: *``), renewed
and released with conditional requests on its ETag (``If-Match``), so of two
processes racing for it exactly one wins, and a holder that lost its lease
(it stalled past the expiry and another took over) finds out at its next
renewal instead of overwriting the new holder's. A crashed holder's lease
expires after ``ttl_s``; the next gc takes it over, again with If-Match on
the stale lease's ETag.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass

from s3kv.errors import AlreadyExists, NotFound, Precondition, S3KVError
from s3kv.ops.inventory import LOCK_NAME
from s3kv.stores.base import ObjectStore, PutMode, Update

log = logging.getLogger("s3kv.ops")


class LockBusy(S3KVError):
    """Another process holds the lease and did not let go in time."""


class LockLost(S3KVError):
    """Our lease expired and another process took it over."""


def lock_key(prefix: str) -> str:
    return f"{prefix}/{LOCK_NAME}" if prefix else LOCK_NAME


@dataclass
class Lease:
    store: ObjectStore
    key: str
    ttl_s: float = 120.0
    owner: str = ""
    etag: str | None = None
    expires: float = 0.0

    def __post_init__(self) -> None:
        if not self.owner:
            self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    def _body(self, started: float) -> tuple[bytes, float]:
        """The lease's content, and when it would expire (counted from before
        the request is sent; set only once the write succeeded)."""
        expires = time.time() + self.ttl_s
        return json.dumps({"owner": self.owner, "started": started, "expires": expires}).encode(), expires

    async def _read(self) -> tuple[dict, str | None] | None:
        try:
            meta = await self.store.head(self.key)
            body = json.loads(await self.store.get(self.key))
        except NotFound:
            return None
        except ValueError:
            body = {}
        return body if isinstance(body, dict) else {}, meta.etag

    async def try_acquire(self) -> str | None:
        """Take the lease; on failure, who holds it (owner and how long for)."""
        now = time.time()
        body, expires = self._body(now)
        try:
            self.etag = await self.store.put(self.key, body, mode=PutMode.CREATE)
            self.expires = expires
            return None
        except AlreadyExists:
            pass
        held = await self._read()
        if held is None:
            return "a lease that was just released"  # try again
        other, etag = held
        until = float(other.get("expires", 0) or 0)
        if until > now or etag is None:
            return f"{other.get('owner', '?')} (lease ends in {max(0.0, until - now):.0f} s)"
        body, expires = self._body(now)
        try:  # stale: take it over, unless someone else just did
            self.etag = await self.store.put(self.key, body, mode=Update(etag))
            self.expires = expires
        except (Precondition, NotFound):
            return "another process taking over a stale lease"
        log.warning("s3kv: took over the stale gc lease of %s", other.get("owner", "?"))
        return None

    async def acquire(self, wait_s: float, poll_s: float = 2.0) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            holder = await self.try_acquire()
            if holder is None:
                return
            if time.monotonic() >= deadline:
                raise LockBusy(f"another s3kv gc holds {self.key}: {holder}")
            log.info("s3kv: waiting for the gc lease held by %s", holder)
            await asyncio.sleep(min(poll_s, max(0.05, deadline - time.monotonic())))

    async def renew(self) -> None:
        if self.etag is None:
            raise LockLost(f"{self.key}: not held")
        body, expires = self._body(time.time())
        try:
            self.etag = await self.store.put(self.key, body, mode=Update(self.etag))
            self.expires = expires
        except (Precondition, NotFound) as e:
            self.etag = None
            raise LockLost(f"{self.key}: the lease was taken over ({e})") from e

    def check(self) -> None:
        """Raise LockLost when the lease may have run out (no renewal in time)."""
        if self.etag is None or time.time() > self.expires - self.ttl_s / 4:
            raise LockLost(f"{self.key}: the lease ran out before it was renewed")

    async def release(self) -> None:
        if self.etag is None:
            return
        etag, self.etag = self.etag, None
        with contextlib.suppress(NotFound, Precondition):
            await self.store.delete_if(self.key, etag)

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 4)
            try:
                await self.renew()
            except LockLost:
                log.error("s3kv: lost the gc lease %s", self.key)
                return
            except Exception as e:  # a failed renewal is retried; check() stops work in time
                log.warning("s3kv: renewing the gc lease failed (%s)", e)


@contextlib.asynccontextmanager
async def held(store: ObjectStore, prefix: str, *, wait_s: float, ttl_s: float = 120.0):
    """Hold the gc lease of ``prefix`` for the body, renewing it in the background."""
    lease = Lease(store, lock_key(prefix), ttl_s)
    await lease.acquire(wait_s)
    keeper = asyncio.create_task(lease._keep_alive())
    try:
        yield lease
    finally:
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper
        await lease.release()
