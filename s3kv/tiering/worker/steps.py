"""Rank 0's timing of the forwards, for the scheduler side's cost model
(:mod:`s3kv.tiering.scheduler.cost`): each step that computes is timed from
before its forward to its end, on the device where there is one, so its
time is known only once the device has run it."""

from __future__ import annotations

from typing import Protocol

from s3kv.tiering.plan import StepTiming, StepTokens

KEPT = 64
"""Forwards timed whose time is not told yet, at most (a device that never tells)."""


class Stopwatch(Protocol):
    """One forward's time: started when made, stopped after the step."""

    def stop(self) -> None: ...

    def seconds(self) -> float | None:
        """The time from its start to its stop, or None while the device has not told it."""


class StepTimer:
    """The forwards timed, in order, until their times are known. With
    ``stages`` pipeline stages the first stage's forward is timed, and
    stands for the pipeline's as ``stages`` times it (vLLM's split balances
    the stages' layers)."""

    def __init__(self, stages: int = 1) -> None:
        self.stages = stages
        self._running: tuple[Stopwatch, StepTokens] | None = None
        """The forward being timed, and what it computes."""
        self._timed: list[tuple[Stopwatch, StepTokens]] = []
        """Forwards timed whose time the device has not told yet."""

    def begin(self, watch: Stopwatch | None, step: StepTokens | None) -> None:
        """A step's forward starts: time it with ``watch`` (None, or no
        ``step``: this one is not timed)."""
        self._running = (watch, step) if watch is not None and step is not None else None

    def end(self) -> list[StepTiming]:
        """The step is over: the timings of the forwards whose time is known
        now, in order (a device finishes its forwards in turn)."""
        if self._running is not None:
            self._running[0].stop()
            self._timed.append(self._running)
            self._running = None
            del self._timed[:-KEPT]
        out = []
        while self._timed:
            watch, step = self._timed[0]
            seconds = watch.seconds()
            if seconds is None:
                break
            self._timed.pop(0)
            out.append(StepTiming(step.tokens, step.context, seconds * self.stages))
        return out
