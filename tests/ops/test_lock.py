"""The gc lease: one holder at a time, stale leases taken over, a holder
that lost its lease finds out. On the in-memory store and on real S3
(If-None-Match / If-Match on a loopback server)."""

from __future__ import annotations

import asyncio

import pytest

from s3kv.errors import Precondition
from s3kv.ops.lock import Lease, LockBusy, LockLost, held, lock_key
from s3kv.stores.base import PutMode, Update
from s3kv.stores.memory import MemoryStore
from s3kv.stores.s3 import S3Options, S3Store


@pytest.fixture(params=["memory", "s3"])
def store(request):
    if request.param == "memory":
        return MemoryStore()
    server = request.getfixturevalue("s3_server")
    return S3Store(server.new_bucket(), S3Options(region="us-east-1", endpoint_url=server.endpoint_url))


async def test_update_and_conditional_delete(store):
    etag = await store.put("k", b"one", mode=PutMode.CREATE)
    assert etag
    new = await store.put("k", b"two", mode=Update(etag))
    with pytest.raises(Precondition):
        await store.put("k", b"three", mode=Update(etag))  # stale ETag
    with pytest.raises(Precondition):
        await store.delete_if("k", etag)
    assert await store.get("k") == b"two"
    await store.delete_if("k", new)
    assert not await store.exists("k")


async def test_one_holder_at_a_time(store):
    key = lock_key("p")
    leases = [Lease(store, key, ttl_s=30) for _ in range(6)]
    got = await asyncio.gather(*(lease.try_acquire() for lease in leases))
    winners = [lease for lease, holder in zip(leases, got) if holder is None]
    assert len(winners) == 1
    loser = leases[[g is None for g in got].index(False)]
    with pytest.raises(LockBusy, match="another s3kv gc holds"):
        await loser.acquire(wait_s=0.2, poll_s=0.05)
    await winners[0].release()
    await loser.acquire(wait_s=1)
    assert loser.etag is not None
    await loser.release()
    assert not await store.exists(key)


async def test_stale_lease_is_taken_over_and_the_old_holder_finds_out(store):
    key = lock_key("p")
    old = Lease(store, key, ttl_s=1.5)
    await old.acquire(wait_s=0)
    new = Lease(store, key, ttl_s=30)
    assert await new.try_acquire() is not None  # still fresh
    await asyncio.sleep(1.8)
    with pytest.raises(LockLost):
        old.check()  # it did not renew in time: it must stop deleting
    await new.acquire(wait_s=0)  # takes the stale lease over
    with pytest.raises(LockLost):
        await old.renew()
    await old.release()  # must not remove the new holder's lease
    assert await store.exists(key)
    await new.renew()
    await new.release()
    assert not await store.exists(key)


async def test_held_renews_and_releases(store):
    async with held(store, "p", wait_s=0, ttl_s=1.2) as lease:
        await asyncio.sleep(2.0)  # longer than the ttl: renewals keep it
        lease.check()
        assert await Lease(store, lock_key("p"), ttl_s=1).try_acquire() is not None
    assert not await store.exists(lock_key("p"))
