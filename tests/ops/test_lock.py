"""The gc lease: one holder at a time, stale leases taken over, a holder
that lost its lease finds out, and no wall clock trusted (holders an hour
ahead or behind never overlap; staleness and a holder's own deadline are
counted on monotonic clocks). On the in-memory store and on real S3
(If-None-Match / If-Match on a loopback server).

Tests wait on the condition itself (:func:`until`), never for a fixed time
that a busy machine may outlast, and the lease's timeouts (ttls, renewals,
polls) run on a :class:`ManualClock` the test moves, so no real request
races a real ttl."""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import time
import uuid
from collections.abc import Awaitable, Callable

import pytest

from s3kv.errors import LockBusy, LockLost, Precondition
from s3kv.ops.lock import RENEW_FRACTION, Lease, held, lock_key
from s3kv.stores.base import PutMode, Update
from s3kv.stores.memory import MemoryStore
from s3kv.stores.s3 import S3Options, S3Store

BOUND_S = 60.0
"""How long a test waits for what it waits for before it fails."""


async def until(condition: Callable[[], bool | Awaitable[bool]], what: str, *, poll_s: float = 0.05) -> None:
    """Wait until ``condition()`` holds, at most :data:`BOUND_S`."""
    deadline = time.monotonic() + BOUND_S
    while True:
        ok = condition()
        if inspect.isawaitable(ok):
            ok = await ok
        if ok:
            return
        assert time.monotonic() < deadline, f"{what}: not within {BOUND_S:.0f} s"
        await asyncio.sleep(poll_s)


def lost(lease: Lease) -> bool:
    """Whether the holder's check() says stop."""
    try:
        lease.check()
    except LockLost:
        return True
    return False


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
    clock = ManualClock()
    leases = [Lease(store, key, ttl_s=30, monotonic=clock, sleep=clock.sleep) for _ in range(6)]
    got = await asyncio.gather(*(lease.try_acquire() for lease in leases))
    winners = [lease for lease, holder in zip(leases, got) if holder is None]
    assert len(winners) == 1
    loser = leases[[g is None for g in got].index(False)]
    waiting = asyncio.ensure_future(loser.acquire(wait_s=0.2, poll_s=0.05))
    await drive(clock, lambda: 1, waiting)  # its polls, on the clock
    with pytest.raises(LockBusy, match="another s3kv gc holds"):
        await waiting
    await winners[0].release()
    await loser.acquire(wait_s=1)
    assert loser.etag is not None
    await loser.release()
    assert not await store.exists(key)


async def test_stale_lease_is_taken_over_and_the_old_holder_finds_out(store):
    key, clock = lock_key("p"), ManualClock()
    old = Lease(store, key, ttl_s=1.5, monotonic=clock)
    await old.acquire(wait_s=0)
    new = Lease(store, key, ttl_s=30, monotonic=clock, sleep=clock.sleep)
    assert await new.try_acquire() is not None  # still fresh
    clock.advance(1.0)
    assert not lost(old)
    clock.advance(0.2)  # 1.2 s > 3/4 of its 1.5 s ttl
    with pytest.raises(LockLost):
        old.check()  # it did not renew in time: it must stop deleting
    acquiring = asyncio.create_task(new.acquire(wait_s=BOUND_S, poll_s=0.05))
    while not acquiring.done():  # polls on its clock; takes the lease over once unchanged for its ttl
        await until(lambda: clock.sleeping or acquiring.done(), "the contender polling")
        clock.advance(0.05)
    await acquiring
    assert clock() >= 1.5
    with pytest.raises(LockLost):
        await old.renew()
    await old.release()  # must not remove the new holder's lease
    assert await store.exists(key)
    await new.renew()
    await new.release()
    assert not await store.exists(key)


async def renewal(lease: Lease, clock: ManualClock, etags: set) -> None:
    """Move ``clock`` on to the next renewal of ``lease`` (held by :func:`held`
    on that clock), wait for the renewal, and check the holder may go on."""
    await until(lambda: clock.sleeping, "the keeper waiting for its next renewal")
    clock.advance(lease.ttl_s * RENEW_FRACTION)
    await until(lambda: lease.etag not in etags, "a renewal")
    lease.check()
    etags.add(lease.etag)


async def test_held_renews_and_releases(store):
    ttl, clock = 3.0, ManualClock()
    async with held(store, "p", wait_s=0, ttl_s=ttl, monotonic=clock, sleep=clock.sleep) as lease:
        start, etags = clock(), {lease.etag}
        while not (len(etags) >= 3 and clock() - start > ttl):
            await renewal(lease, clock, etags)  # renewals keep it
        lease.check()
        assert await Lease(store, lock_key("p"), ttl_s=1).try_acquire() is not None
    assert not await store.exists(lock_key("p"))
    await until(lambda: not clock.sleeping, "the keeper stopping with the lease")


# -- Clocks: the lease must not trust wall clocks --------------------------------
HOUR = 3600.0


class ManualClock:
    """A clock that moves only when told to; who sleeps on it (:meth:`sleep`)
    wakes once it is moved past the sleep's end."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t
        self._sleepers: list[tuple[float, asyncio.Future]] = []

    def __call__(self) -> float:
        return self.t

    @property
    def sleeping(self) -> int:
        """How many sleep on the clock now."""
        return len(self._sleepers)

    def advance(self, s: float) -> None:
        self.t += s
        for entry in [e for e in self._sleepers if e[0] <= self.t]:
            self._sleepers.remove(entry)
            if not entry[1].done():
                entry[1].set_result(None)

    def next_wake(self) -> float:
        """When the earliest sleep on the clock ends."""
        return min(end for end, _ in self._sleepers)

    async def sleep(self, s: float) -> None:
        entry = (self.t + s, asyncio.get_running_loop().create_future())
        self._sleepers.append(entry)
        self.advance(0)  # a sleep that is already over ends at once
        try:
            await entry[1]
        finally:
            if entry in self._sleepers:
                self._sleepers.remove(entry)


def skewed(offset_s: float):
    return lambda: time.time() + offset_s


class SlowPuts:
    """The store, with every PUT taking ``delay_s`` on ``clock`` (a slow renewal)."""

    def __init__(self, store, clock: ManualClock, delay_s: float) -> None:
        self._store, self._clock, self._delay_s = store, clock, delay_s

    def __getattr__(self, name):
        return getattr(self._store, name)

    async def put(self, key, data, *, mode=PutMode.OVERWRITE):
        self._clock.advance(self._delay_s)
        return await self._store.put(key, data, mode=mode)


@pytest.mark.parametrize("skew", [HOUR, -HOUR], ids=["holder-an-hour-ahead", "holder-an-hour-behind"])
async def test_skewed_clocks_never_overlap_while_the_holder_renews(store, skew):
    ttl, clock = 10.0, ManualClock()
    origin = 1e6 * (1 + uuid.uuid4().int % 97)  # the contender's monotonic clock: an origin of its own
    contender = Lease(store, lock_key("p"), ttl_s=ttl, wall=skewed(-skew), monotonic=lambda: clock() + origin)
    async with held(
        store, "p", wait_s=0, ttl_s=ttl, wall=skewed(skew), monotonic=clock, sleep=clock.sleep
    ) as first:
        etags, start = {first.etag}, contender.monotonic()
        # Watch until the holder renewed five times and 1.5 ttls passed on the contender's clock.
        while True:
            holder = await contender.try_acquire()
            assert holder is not None, "the contender took a lease that was being renewed"
            if len(etags) >= 6 and contender.monotonic() - start >= 1.5 * ttl:
                break
            await renewal(first, clock, etags)  # and the holder never had to stop
        assert contender.etag is None
    await contender.acquire(wait_s=5, poll_s=0.05)  # released: the contender gets it at once
    await contender.release()


@pytest.mark.parametrize("skew", [HOUR, -HOUR], ids=["holder-an-hour-ahead", "holder-an-hour-behind"])
async def test_skewed_clocks_a_crashed_holder_is_taken_over_after_its_ttl_unchanged(store, skew):
    ttl = 1.0
    crashed = Lease(store, lock_key("p"), ttl_s=ttl, wall=skewed(skew))
    await crashed.acquire(wait_s=0)  # and then it stops: no renewals, no release
    clock = ManualClock(1e6 * (1 + uuid.uuid4().int % 97))  # a monotonic clock with an origin of its own
    contender = Lease(store, lock_key("p"), ttl_s=30, wall=skewed(-skew), monotonic=clock)
    first_look = clock()
    while not await _taken(contender):  # taking over a lease nobody renews
        assert clock() - first_look < BOUND_S, "not taken over"
        clock.advance(0.1)
    # Every call before the one that took it over found the lease held, and
    # that one returned only after a ttl of unchanged ETag on the contender's clock.
    assert contender.monotonic() - first_look >= ttl
    with pytest.raises(LockLost):
        await crashed.renew()  # had it been alive, it would find out
    await contender.release()
    assert not await store.exists(lock_key("p"))


async def _taken(contender: Lease) -> bool:
    return await contender.try_acquire() is None


async def drive(clock: ManualClock, sleepers: Callable[[], int], done: asyncio.Future) -> None:
    """Until ``done``: each time ``sleepers()`` sleep on ``clock`` (all of
    its users, none of them in the middle of a request), move it on to the
    end of the earliest sleep."""
    while not done.done():
        await until(lambda: clock.sleeping >= sleepers() or done.done(), "every user asleep on the clock")
        if clock.sleeping and not done.done():
            clock.advance(clock.next_wake() - clock())


async def test_two_held_gc_runs_with_skewed_clocks_take_turns(store):
    """Two ``held()`` contexts, one wall clock an hour ahead and one an hour
    behind: the second enters only after the first left."""
    events: list[tuple[str, float]] = []
    first_in = asyncio.Event()
    clock = ManualClock()

    async def gc_run(name: str, skew: float, renewals: int) -> None:
        async with held(
            store,
            "p",
            wait_s=60,
            ttl_s=6.0,
            poll_s=0.2,
            wall=skewed(skew),
            monotonic=clock,
            sleep=clock.sleep,
        ) as lease:
            events.append((f"{name} in", clock()))
            first_in.set()
            etags = {lease.etag}

            def worked() -> bool:  # through a few renewals
                lease.check()
                etags.add(lease.etag)
                return len(etags) > renewals

            await until(worked, f"{renewals} renewals")
            events.append((f"{name} out", clock()))

    one = asyncio.create_task(gc_run("behind", -HOUR, renewals=4))
    await first_in.wait()
    two = asyncio.create_task(gc_run("ahead", HOUR, renewals=1))
    both = asyncio.gather(one, two)
    try:
        # While "behind" holds the lease, its keeper and "ahead"'s polls sleep on the clock; after, one.
        await drive(clock, lambda: 2 if events[-1][0] == "behind in" else 1, both)
        await both
    finally:
        both.cancel()
    assert [e for e, _ in events] == ["behind in", "behind out", "ahead in", "ahead out"]


async def test_takeover_counts_on_the_contenders_monotonic_clock(store):
    key = lock_key("p")
    first = Lease(store, key, ttl_s=10, wall=skewed(-24 * HOUR))  # its body says: expired a day ago
    await first.acquire(wait_s=0)
    clock = ManualClock(500.0)
    contender = Lease(store, key, ttl_s=600, wall=skewed(24 * HOUR), monotonic=clock)
    assert await contender.try_acquire() is not None  # first look: ETag noted
    clock.advance(9.9)
    assert await contender.try_acquire() is not None  # unchanged for 9.9 s of the holder's 10
    await first.renew()  # a new ETag: the count starts again
    clock.advance(5)
    assert await contender.try_acquire() is not None
    clock.advance(9.9)
    assert await contender.try_acquire() is not None
    first.check()
    clock.advance(0.2)  # 10.1 s unchanged on the contender's clock
    assert await contender.try_acquire() is None
    assert contender.etag is not None
    with pytest.raises(LockLost):
        await first.renew()


async def test_a_frozen_contender_clock_never_takes_over(store):
    """Real time passing is not enough: only the contender's own monotonic
    clock counts (here it stands still while the lease goes unrenewed)."""
    key = lock_key("p")
    first = Lease(store, key, ttl_s=0.2, wall=skewed(-HOUR))
    await first.acquire(wait_s=0)
    contender = Lease(store, key, ttl_s=0.2, monotonic=ManualClock(7.0))
    assert await contender.try_acquire() is not None
    start, looks = time.monotonic(), 0

    async def watched_five_ttls() -> bool:
        nonlocal looks
        assert await contender.try_acquire() is not None
        looks += 1
        return looks >= 5 and time.monotonic() - start >= 1.0  # five ttls of real time, and five looks

    await until(watched_five_ttls, "five looks over five ttls", poll_s=0.1)


async def test_the_holder_stops_by_its_monotonic_clock_not_its_wall_clock(store):
    mono, wall = ManualClock(0.0), ManualClock(1.7e9)
    lease = Lease(store, lock_key("p"), ttl_s=8, wall=wall, monotonic=mono)
    await lease.acquire(wait_s=0)
    wall.advance(-HOUR)  # the wall clock steps back an hour: no help
    mono.advance(5.9)
    lease.check()  # 5.9 s < 3/4 of the ttl
    mono.advance(0.2)
    with pytest.raises(LockLost):
        lease.check()
    wall.advance(2 * HOUR)
    await lease.renew()
    lease.check()  # a renewal restores it
    before = lease.etag
    await lease.renew()  # the wall clock stood still, yet contenders must see a renewal
    assert lease.etag != before
    mono.advance(6.1)
    with pytest.raises(LockLost):
        lease.check()
    await lease.release()


async def test_a_renewal_counts_from_before_its_request_was_sent(store):
    mono = ManualClock(0.0)
    lease = Lease(SlowPuts(store, mono, delay_s=4.0), lock_key("p"), ttl_s=8, monotonic=mono)
    await lease.acquire(wait_s=0)  # the PUT took 4 s
    lease.check()
    mono.advance(1.9)
    lease.check()  # 5.9 s since the request was sent
    mono.advance(0.2)
    with pytest.raises(LockLost):
        lease.check()  # 6.1 s since it was sent, though only 2.1 s since it returned
    await lease.release()


async def test_a_holders_claimed_expiry_is_capped_at_last_modified_plus_ttl(store):
    key = lock_key("p")
    ahead = Lease(store, key, ttl_s=30, wall=skewed(HOUR))  # claims its lease ends in an hour and 30 s
    await ahead.acquire(wait_s=0)
    written = (await store.head(key)).last_modified  # the server's clock, whole seconds
    # the contender's clock reads the moment the lease was written: its
    # LastModified + 30 s is 30 s away, however long the test took since
    holder = await Lease(store, key, ttl_s=30, wall=lambda: written).try_acquire()
    assert holder is not None and ahead.owner in holder
    ends_in = int(re.search(r"lease ends in (\d+) s", holder).group(1))
    assert ends_in == 30, holder  # not the hour and 30 s it claimed


@pytest.mark.parametrize(
    "body", [b"not json", b"[1, 2]", json.dumps({"owner": "old", "expires": 0}).encode()]
)
async def test_a_lease_body_without_a_ttl_uses_the_contenders(store, body):
    """Garbage, or a lease written by an older s3kv: the contender waits its
    own ttl of unchanged ETag, whatever the body claims."""
    key = lock_key("p")
    await store.put(key, body, mode=PutMode.CREATE)
    clock = ManualClock(0.0)
    contender = Lease(store, key, ttl_s=5, monotonic=clock)
    assert await contender.try_acquire() is not None
    clock.advance(4.9)
    assert await contender.try_acquire() is not None
    clock.advance(0.2)
    assert await contender.try_acquire() is None
    await contender.release()
    assert not await store.exists(key)
