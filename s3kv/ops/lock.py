"""A lease on a bucket prefix, so that two ``s3kv gc`` runs take turns.

The lease is one object, ``{prefix}/gc.lock``, holding who took it, its ttl
and (for people) until when by the holder's clock. It is taken with a
create-only PUT (``If-None-Match: *``), renewed and released with
conditional requests on its ETag (``If-Match``), so of two processes racing
for it exactly one wins, and a holder that lost its lease (it stalled and
another took over) finds out at its next renewal instead of overwriting the
new holder's.

No wall clock decides anything, as gc hosts' clocks may disagree by hours:

- A contender treats a lease as stale only once its ETag stayed unchanged
  for the holder's ttl on the contender's own monotonic clock, counted from
  the first read that returned that ETag. A holder renews every ttl/4, and
  every renewal changes the ETag (each body carries a fresh nonce).
- The holder stops (``check()`` raises :class:`~s3kv.errors.LockLost`) once 3/4 of the
  ttl passed on its monotonic clock since its last successful write, timed
  from before that request was sent. A write lands after it was sent and a
  contender sees it later still, so the holder always stops first.
- The expiry written in the body is only reported, capped at the object's
  LastModified (the server's clock) + ttl.

A crashed holder's lease is taken over (with If-Match on its ETag) after a
contender has watched it unchanged for the ttl, so ``--wait`` must be longer
than the ttl for a gc to take over a lease left behind by a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from s3kv.errors import AlreadyExists, LockBusy, LockLost, NotFound, Precondition, S3KVError
from s3kv.ops.inventory import LOCK_NAME
from s3kv.stores.base import ObjectMeta, ObjectStore, PutMode, Update

log = logging.getLogger("s3kv.ops")

DEFAULT_TTL_S = 120.0
RENEW_FRACTION = 0.25
"""A holder renews every ttl/4 ..."""
STOP_FRACTION = 0.75
"""... and stops working once 3/4 of the ttl passed without a successful renewal."""


def lock_key(prefix: str) -> str:
    return f"{prefix}/{LOCK_NAME}" if prefix else LOCK_NAME


def _number(value: object) -> float | None:
    """A finite float from a lease body's field, or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


@dataclass
class Lease:
    """One process's handle on the lease object ``key``.

    ``wall`` only stamps the body and the messages; ``monotonic`` decides,
    and ``sleep`` waits on it (the polls of :meth:`acquire`, the renewals of
    :func:`held`): all injectable, so tests can skew the clocks or drive a
    fake one instead of racing real time.
    """

    store: ObjectStore
    key: str
    ttl_s: float = DEFAULT_TTL_S
    owner: str = ""
    wall: Callable[[], float] = field(default=time.time, repr=False)
    monotonic: Callable[[], float] = field(default=time.monotonic, repr=False)
    sleep: Callable[[float], Awaitable[object]] = field(default=asyncio.sleep, repr=False)
    etag: str | None = None
    """The ETag of our last successful write; None while not held."""
    renewed_at: float | None = None
    """Our monotonic clock just before that write was sent."""
    _started: float = field(default=0.0, repr=False)
    _seen: tuple[str, float] | None = field(default=None, repr=False)
    """(ETag, monotonic time of the first read that returned it) of another's lease."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.ttl_s) and self.ttl_s > 0):
            raise ValueError(f"ttl_s must be a positive number of seconds, got {self.ttl_s!r}")
        if not self.owner:
            self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    def _body(self) -> tuple[bytes, float]:
        """The lease's content, and when we started holding it."""
        now = self.wall()
        started = self._started or now
        body = {
            "owner": self.owner,
            "started": started,
            "expires": now + self.ttl_s,  # for people; readers cap it (see _describe)
            "ttl_s": self.ttl_s,
            "nonce": uuid.uuid4().hex,  # a new ETag for every write, even with a stuck clock
        }
        return json.dumps(body).encode(), started

    async def _write(self, mode: PutMode | Update) -> None:
        """Write the lease; on success we hold it until ``renewed_at`` + 3/4 ttl."""
        sent_at = self.monotonic()  # before the request: the write lands later
        body, started = self._body()
        etag = await self.store.put(self.key, body, mode=mode)
        if etag is None:
            raise S3KVError(f"{self.key}: the store returned no ETag; a lease needs one")
        self.etag, self.renewed_at, self._started, self._seen = etag, sent_at, started, None

    async def _read(self) -> tuple[dict, ObjectMeta] | None:
        try:
            meta = await self.store.head(self.key)
            body = json.loads(await self.store.get(self.key))
        except NotFound:
            return None
        except ValueError:
            body = {}
        return (body if isinstance(body, dict) else {}), meta

    def _their_ttl(self, body: dict) -> float:
        """The holder's ttl (its check() stops it by 3/4 of it); ours for a
        body that does not say (an older s3kv, or garbage)."""
        ttl = _number(body.get("ttl_s"))
        return ttl if ttl is not None and ttl > 0 else self.ttl_s

    def _describe(self, body: dict, meta: ObjectMeta, ttl: float, unchanged_s: float) -> str:
        owner = str(body.get("owner", "?"))[:200]  # the bucket's text: bounded
        # The holder's claimed expiry is its own clock's; the server's
        # LastModified + ttl caps it (a holder's clock an hour fast does not
        # make its lease look an hour longer).
        cap = meta.last_modified + ttl
        claimed = _number(body.get("expires"))
        ends = cap if claimed is None else min(claimed, cap)
        return (
            f"{owner} (lease ends in {max(0.0, ends - self.wall()):.0f} s unless renewed; "
            f"taken over if unchanged for {max(0.0, ttl - unchanged_s):.0f} s more)"
        )

    async def try_acquire(self) -> str | None:
        """Take the lease; on failure, who holds it (owner and how long for).

        Call it again (same Lease) to keep watching: a lease whose ETag
        stayed the same for its ttl across these calls is taken over.
        """
        try:
            await self._write(PutMode.CREATE)
            return None
        except AlreadyExists:
            pass
        held = await self._read()
        seen_at = self.monotonic()  # after the read: never before the write it returned
        if held is None:
            self._seen = None
            return "a lease that was just released"  # try again
        other, meta = held
        if meta.etag is None:
            raise S3KVError(f"{self.key}: the store returned no ETag; a lease needs one")
        if self._seen is None or self._seen[0] != meta.etag:
            self._seen = (meta.etag, seen_at)  # new, or renewed since we last looked
        ttl = self._their_ttl(other)
        unchanged_s = seen_at - self._seen[1]
        if unchanged_s < ttl:
            return self._describe(other, meta, ttl, unchanged_s)
        try:  # stale: take it over, unless its holder renewed or someone else took it
            await self._write(Update(meta.etag))
        except (Precondition, NotFound):
            self._seen = None
            return "another process taking over a stale lease"
        owner = str(other.get("owner", "?"))[:200]
        log.warning("s3kv: took over the gc lease of %s (unchanged for %.0f s)", owner, unchanged_s)
        return None

    async def acquire(self, wait_s: float, poll_s: float = 2.0) -> None:
        deadline = self.monotonic() + wait_s
        while True:
            holder = await self.try_acquire()
            if holder is None:
                return
            left = deadline - self.monotonic()
            if left <= 0:
                raise LockBusy(
                    f"another s3kv gc holds {self.key}: {holder}; a lease whose holder stopped "
                    "renewing it is taken over once it stayed unchanged for its ttl, so wait longer "
                    "than that (--wait)"
                )
            log.info("s3kv: waiting for the gc lease held by %s", holder)
            await self.sleep(min(poll_s, max(0.05, left)))

    async def renew(self) -> None:
        if self.etag is None:
            raise LockLost(f"{self.key}: not held")
        try:
            await self._write(Update(self.etag))
        except (Precondition, NotFound) as e:
            self.etag = self.renewed_at = None
            raise LockLost(f"{self.key}: the lease was taken over ({e})") from e

    def check(self) -> None:
        """Raise LockLost when a contender could take over soon: 3/4 of the
        ttl passed on our monotonic clock since our last successful write."""
        if (
            self.etag is None
            or self.renewed_at is None
            or self.monotonic() - self.renewed_at > self.ttl_s * STOP_FRACTION
        ):
            raise LockLost(f"{self.key}: the lease ran out before it was renewed")

    async def release(self) -> None:
        if self.etag is None:
            return
        etag, self.etag, self.renewed_at, self._started = self.etag, None, None, 0.0
        with contextlib.suppress(NotFound, Precondition):
            await self.store.delete_if(self.key, etag)

    async def _within(self, task: asyncio.Future, seconds: float) -> bool:
        """Wait for ``task`` at most ``seconds`` by :attr:`sleep`; whether it
        is done (it is left running if not)."""
        timer = asyncio.ensure_future(self.sleep(seconds))
        try:
            await asyncio.wait({task, timer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()
        return task.done()

    async def _keep_alive(self, stop: asyncio.Event) -> None:
        """Renew every ttl/4 until ``stop`` is set (never inside a renewal)."""
        stopped = asyncio.ensure_future(stop.wait())
        try:
            while not await self._within(stopped, self.ttl_s * RENEW_FRACTION):
                try:
                    await self.renew()
                except LockLost:
                    log.error("s3kv: lost the gc lease %s", self.key)
                    return
                except Exception as e:  # a failed renewal is retried; check() stops work in time
                    log.warning("s3kv: renewing the gc lease failed (%s)", e)
        finally:
            stopped.cancel()


@contextlib.asynccontextmanager
async def held(
    store: ObjectStore,
    prefix: str,
    *,
    wait_s: float,
    ttl_s: float = DEFAULT_TTL_S,
    poll_s: float = 2.0,
    wall: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
):
    """Hold the gc lease of ``prefix`` for the body, renewing it in the
    background. On the way out a renewal in flight is let finish (for up
    to ttl/4 by ``sleep``), so that the release deletes the version it
    wrote. ``wall``, ``monotonic`` and ``sleep`` are the :class:`Lease`'s."""
    lease = Lease(store, lock_key(prefix), ttl_s, wall=wall, monotonic=monotonic, sleep=sleep)
    await lease.acquire(wait_s, poll_s)
    stop = asyncio.Event()
    keeper = asyncio.create_task(lease._keep_alive(stop))
    try:
        yield lease
    finally:
        stop.set()
        if not await lease._within(keeper, ttl_s * RENEW_FRACTION):
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
        await lease.release()
