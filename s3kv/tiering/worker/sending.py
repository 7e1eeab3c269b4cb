"""Held requests whose copies are done: the worker's "finished sending".
vLLM keeps a finished request's blocks while the worker copies out of them
(the request is held), and accepts it as finished sending only once vLLM
itself has passed it to the worker as finished, in the same step or after."""

from __future__ import annotations

from collections.abc import Iterable


class RecentSet:
    """A set that keeps only its ``size`` most recent members."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: dict[str, None] = {}

    def update(self, items: Iterable[str]) -> None:
        for item in items:
            self._items.pop(item, None)
            self._items[item] = None
        while len(self._items) > self.size:
            del self._items[next(iter(self._items))]

    def __contains__(self, item: str) -> bool:
        return item in self._items

    def discard(self, item: str) -> None:
        self._items.pop(item, None)


class FinishedSending:
    """The held requests whose copies are done, until vLLM has passed them
    as finished (the most recent ``remembered`` of those it passed are kept)."""

    def __init__(self, remembered: int = 4096) -> None:
        self._sent: set[str] = set()
        """Held requests whose copies are done, to report as finished sending."""
        self._finished = RecentSet(remembered)

    def copied(self, req_ids: Iterable[str]) -> None:
        """The copies out of these held requests' blocks are done (or none was made)."""
        self._sent.update(req_ids)

    def take(self, finished_req_ids: Iterable[str] | None) -> set[str]:
        """The requests to report as finished sending now: copied, and
        passed as finished by vLLM (``finished_req_ids``: this step's)."""
        self._finished.update(finished_req_ids or ())
        sent = {r for r in self._sent if r in self._finished}
        self._sent -= sent
        for req_id in sent:
            self._finished.discard(req_id)
        return sent
