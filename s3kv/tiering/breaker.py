"""A circuit breaker per remote tier (S3, NVMe), kept by the scheduler side.

Closed, the tier is used. A failure that says the tier itself is in trouble
(S3 not answering, throttling, a timeout; a disk read that errs or is too
slow) opens it: no lookup offers the tier's hits and no store is planned to
it, so no request waits for its timeout, for a backoff that doubles while it
stays down (``backoff_s``). When the backoff has passed, the breaker lets one
*probe* through, the next request (or store) that wants the tier, and only
it: its success closes the breaker and resets the backoff, its failure (or
no answer within ``probe_timeout_s``) opens it again. Only the tier's own
results move its breaker: hits served by other tiers say nothing about it.
A probe that ends up not using the tier (its hit was trimmed, it finished,
its write was dropped) gives its slot back (:meth:`release`), so that the
next user probes instead of everyone waiting for the probe to time out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

BACKOFF_S = (5.0, 60.0)
"""The first backoff, and the longest it doubles to."""
PROBE_TIMEOUT_S = 60.0
"""A probe that has not answered in this long counts as failed."""


class Breaker:
    def __init__(
        self,
        backoff_s: tuple[float, float] = BACKOFF_S,
        *,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        on_trip: Callable[[], None] | None = None,
    ) -> None:
        self._on_trip = on_trip
        self._backoff_s = backoff_s
        self._next_backoff_s = backoff_s[0]
        self._probe_timeout_s = probe_timeout_s
        self._clock = clock
        self._open_until: float | None = None
        """None: closed. Else: open until then, and half-open after."""
        self._probe: Hashable | None = None
        self._probe_at = 0.0

    @property
    def closed(self) -> bool:
        return self._open_until is None

    def _expire_probe(self) -> None:
        if self._probe is not None and self._clock() - self._probe_at > self._probe_timeout_s:
            self._probe = None
            self.failure()  # the probe never answered: as good as a failure

    def usable(self) -> bool:
        """Could a new user have the tier now (closed, or half-open with no
        probe out)? Takes nothing."""
        if self._open_until is None:
            return True
        self._expire_probe()
        return self._open_until is not None and self._clock() >= self._open_until and self._probe is None

    def allow(self, owner: Hashable, *, take: bool = True) -> bool:
        """May ``owner`` (a request, a store) use the tier? Half-open, the
        first owner to ask (with ``take``) becomes the probe and keeps the
        tier until its result is known; everyone else is refused. Without
        ``take`` it only asks, and takes nothing."""
        if self._open_until is None:
            return True
        self._expire_probe()
        if self._probe is not None:
            return self._probe == owner
        if self._clock() < self._open_until:
            return False
        if take:
            self._probe, self._probe_at = owner, self._clock()
        return True

    def release(self, owner: Hashable) -> None:
        """``owner`` will not use the tier after all: if it is the probe, the
        next owner to ask may probe instead."""
        if self._probe is not None and self._probe == owner:
            self._probe = None

    def success(self) -> None:
        self._open_until = None
        self._probe = None
        self._next_backoff_s = self._backoff_s[0]

    def failure(self) -> None:
        """A transfer on the tier failed for the tier's sake. Closed or
        half-open, the breaker opens (a trip) for the next backoff. Already
        open, the failure is news of transfers that started before it opened:
        it neither trips it again nor lengthens the backoff."""
        now = self._clock()
        if self._open_until is not None and now < self._open_until:
            return
        self._open_until = now + self._next_backoff_s
        self._next_backoff_s = min(self._next_backoff_s * 2, self._backoff_s[1])
        self._probe = None
        if self._on_trip is not None:
            self._on_trip()

    def report(self, ok: int, failed: int) -> None:
        """Results of transfers on the tier: any failure opens (or reopens)
        it; otherwise a success closes it."""
        if failed:
            self.failure()
        elif ok:
            self.success()
