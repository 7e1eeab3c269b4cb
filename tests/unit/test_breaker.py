"""The per-tier circuit breaker on its own, with a fake clock."""

from s3kv.tiering.breaker import Breaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def breaker(**kw):
    clock, trips = Clock(), []
    b = Breaker((5.0, 60.0), clock=clock, on_trip=lambda: trips.append(clock.now), **kw)
    return b, clock, trips


def test_a_trip_is_counted_on_opening_not_on_every_failure_while_open():
    b, clock, trips = breaker()
    b.failure()  # closed -> open, for 5 s
    assert trips == [0.0] and not b.closed and not b.usable()
    clock.now = 1.0
    b.failure()  # news of transfers that started before it opened
    b.report(0, 3)
    assert trips == [0.0]
    clock.now = 5.5  # nor did they lengthen the backoff
    assert b.usable() and b.allow("probe")
    b.failure()  # the probe failed: half-open -> open, for 10 s
    assert trips == [0.0, 5.5]
    clock.now = 15.0
    assert not b.allow("next")
    clock.now = 15.6
    assert b.allow("next")
    b.success()
    assert b.closed
    b.failure()  # closed -> open again, with the short backoff
    assert trips == [0.0, 5.5, 15.6]
    clock.now = 20.7
    assert b.usable()


def test_a_released_probe_slot_goes_to_the_next_owner():
    b, clock, trips = breaker()
    b.failure()
    clock.now = 6.0
    assert b.allow("a")  # the probe
    assert not b.allow("b") and not b.usable()
    b.release("b")  # not the probe: nothing changes
    assert not b.allow("b")
    b.release("a")  # "a" will not use the tier after all
    assert b.usable() and b.allow("b", take=False) and b.usable()  # asking takes nothing
    assert b.allow("b") and not b.allow("a")
    b.success()
    assert b.closed and b.allow("a") and trips == [0.0]


def test_a_probe_that_never_answers_trips_the_breaker_once():
    b, clock, trips = breaker(probe_timeout_s=30.0)
    b.failure()
    clock.now = 6.0
    assert b.allow("probe")
    clock.now = 36.5  # no word: as good as a failure, opening it for 10 s
    assert not b.usable() and not b.allow("other")
    assert trips == [0.0, 36.5]
    clock.now = 46.6
    assert b.allow("other")


def test_release_on_a_closed_breaker_is_harmless():
    b, _, trips = breaker()
    b.release("anyone")
    assert b.closed and b.allow("x") and trips == []
