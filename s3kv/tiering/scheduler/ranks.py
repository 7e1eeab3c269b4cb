"""Reports counted over TP ranks: a chunk's write, a slot's release or a
load is over only once every rank has said so."""

from __future__ import annotations

from collections.abc import Hashable

from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import TierReport


class RankCount:
    """Per-key counts of ranks' reports, until every one of ``world_size`` reported."""

    def __init__(self, world_size: int = 1) -> None:
        self.world_size = world_size
        self._seen: dict[Hashable, int] = {}
        """Ranks that reported so far (a slot release, a synchronous load)."""
        self._outcomes: dict[Hashable, tuple[int, int]] = {}
        """(ranks that wrote, ranks that failed) of each pending write."""

    def count(self, what: Hashable, n: int) -> bool:
        """Add ``n`` ranks' reports of ``what``; True once every rank reported."""
        total = self._seen.get(what, 0) + n
        if total >= self.world_size:
            self._seen.pop(what, None)
            return True
        self._seen[what] = total
        return False

    def outcome(self, what: Hashable, ok: int, failed: int) -> bool | None:
        """Add ranks' outcomes of the write ``what``: None while some rank has
        not reported, then whether every rank succeeded."""
        good, bad = self._outcomes.get(what, (0, 0))
        good, bad = good + ok, bad + failed
        if good + bad < self.world_size:
            self._outcomes[what] = (good, bad)
            return None
        self._outcomes.pop(what, None)
        return bad == 0

    def writes(self, report: TierReport) -> dict[Tier, list[tuple[bytes, bool]]]:
        """The writes in ``report`` that every rank has now reported, by tier:
        (key, whether every rank succeeded), written ones first."""
        out: dict[Tier, list[tuple[bytes, bool]]] = {}
        for counts, ok in ((report.written, True), (report.failed, False)):
            for (tier, key), n in counts.items():
                outcome = self.outcome((tier, key), n if ok else 0, 0 if ok else n)
                if outcome is not None:
                    out.setdefault(tier, []).append((key, outcome))
        return out
