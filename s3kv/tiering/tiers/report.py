"""One rank's :class:`~s3kv.tiering.plan.TierReport` in the making: filled
by the transfer engine and the tier handlers from the engine's loop and
threads, taken once per step."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import LoadChunk, LoadTiming, S, TierReport


class RankReport:
    """This rank's :class:`TierReport` since the last :meth:`take`, filled
    from the engine's loop and threads (one rank counts 1 per key), and the
    loads that finished meanwhile."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._report = TierReport()
        self._loads: dict[str, list[LoadChunk]] = {}

    @contextlib.contextmanager
    def edit(self) -> Iterator[TierReport]:
        with self._lock:
            yield self._report

    @contextlib.contextmanager
    def section(self, tier: Tier, kind: type[S]) -> Iterator[S]:
        """``tier``'s own section of the report (made empty on first use)."""
        with self._lock:
            section = self._report.sections.get(tier)
            if not isinstance(section, kind):
                section = self._report.sections[tier] = kind()
            yield section

    def take(self) -> tuple[TierReport, dict[str, list[LoadChunk]]]:
        """(The report, job id -> the chunks that failed) since the last take."""
        with self._lock:
            report, self._report = self._report, TierReport()
            loads, self._loads = self._loads, {}
        return report, loads

    def finished(self, job_id: str, failed: list[LoadChunk]) -> None:
        """Load job ``job_id`` (a request's) is over; ``failed``: its chunks that did not load."""
        with self._lock:
            if failed:
                self._report.load_failed.add(job_id)
            self._loads[job_id] = failed

    def written(self, tier: Tier, key: bytes) -> None:
        with self._lock:
            self._report.written[(tier, key)] = 1

    def failed(self, tier: Tier, key: bytes, *, started: bool = True) -> None:
        """This rank's write of ``key`` to ``tier`` failed or was dropped;
        ``started=False``: it never began (a promotion whose load failed)."""
        with self._lock:
            self._report.failed[(tier, key)] = 1
            if not started:
                self._report.unstarted[(tier, key)] = 1

    def missing(self, tier: Tier, key: bytes) -> None:
        with self._lock:
            self._report.missing.add((tier, key))

    def released(self, key: bytes) -> None:
        with self._lock:
            self._report.released[key] = self._report.released.get(key, 0) + 1

    def tier_ok(self, tier: Tier) -> None:
        with self._lock:
            self._report.tier_ok[tier] = self._report.tier_ok.get(tier, 0) + 1

    def tier_failed(self, tier: Tier) -> None:
        with self._lock:
            self._report.tier_failed[tier] = self._report.tier_failed.get(tier, 0) + 1

    def timed(self, timing: LoadTiming) -> None:
        with self._lock:
            self._report.load_timings.append(timing)
