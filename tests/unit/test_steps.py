"""Rank 0's step timer (:mod:`s3kv.tiering.worker.steps`): forwards timed on
a device whose times come later, reported in order once known."""

from s3kv.tiering.plan import StepTiming, StepTokens
from s3kv.tiering.worker.steps import KEPT, StepTimer


class Watch:
    """A forward's stopwatch whose time the test tells (as a device does, later)."""

    def __init__(self):
        self.stopped, self.time = False, None

    def stop(self):
        self.stopped = True

    def seconds(self):
        return self.time


def test_forwards_are_reported_in_order_once_their_times_are_known():
    timer = StepTimer()
    first, second = Watch(), Watch()
    timer.begin(first, StepTokens(256, 256))
    assert timer.end() == [] and first.stopped  # stopped, its time not told yet
    timer.begin(second, StepTokens(1, 300))
    second.time = 0.01
    assert timer.end() == []  # the second waits for the first
    first.time = 0.5
    assert timer.end() == [StepTiming(256, 256, 0.5), StepTiming(1, 300, 0.01)]
    assert timer.end() == []


def test_a_step_without_a_watch_or_tokens_is_not_timed_and_untold_times_are_bounded():
    timer = StepTimer()
    watch = Watch()
    timer.begin(watch, None)
    timer.begin(None, StepTokens(1, 1))
    assert timer.end() == [] and not watch.stopped
    watches = [Watch() for _ in range(KEPT + 5)]
    for i, w in enumerate(watches):  # a device that never tells
        timer.begin(w, StepTokens(i, i))
        timer.end()
    for w in watches:
        w.time = 1.0
    assert [t.tokens for t in timer.end()] == list(range(5, KEPT + 5))  # the oldest were let go


def test_a_pipelines_first_stage_stands_for_every_stage():
    timer = StepTimer(stages=2)
    watch = Watch()
    timer.begin(watch, StepTokens(512, 512))
    watch.time = 0.25
    assert timer.end() == [StepTiming(512, 512, 0.5)]
