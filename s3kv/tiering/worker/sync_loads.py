"""A step's synchronous loads: chunks that the connector copies into the KV
cache out of a tier that holds pages (CPU slots), layer by layer while the
forward runs, and what the worker reports of them once the copies are over."""

from __future__ import annotations

import logging
from typing import Protocol

from s3kv.stats import Counters
from s3kv.tiering.plan import LoadChunk, LoadTiming, TierReport

log = logging.getLogger("s3kv.worker")


class Copies(Protocol):
    """The connector's copies of a step's synchronous loads, waited for."""

    error: BaseException | None
    """Why the copies failed (then none of the chunks counts as loaded)."""

    @property
    def nbytes(self) -> int:
        """Bytes copied."""
        ...

    def elapsed_s(self) -> float | None:
        """How long the copies took, where known."""
        ...


class SyncLoads:
    """This step's synchronous loads on rank ``rank``: their requests and the
    chunks being copied (the worker side fills :attr:`reqs` and
    :attr:`chunks` as it starts them), reported by :meth:`over`."""

    def __init__(self, rank: int, counters: Counters) -> None:
        self.rank = rank
        self.counters = counters
        self.reqs: list[str] = []
        self.chunks: list[LoadChunk] = []

    def start(self, reqs: list[str] | None = None) -> None:
        """A step's loads start (``reqs``: requests whose loads are already decided)."""
        self.reqs = list(reqs) if reqs is not None else []
        self.chunks = []

    def over(self, report: TierReport, errors: set[int], copies: Copies | None) -> None:
        """The step's copies are over (``copies``: None where none started):
        each request's synchronous load counts in ``report``; a failed copy
        adds its chunks' blocks to ``errors`` (recomputed); copies that
        succeeded are counted and timed (rank 0 times the requests and the
        chunks for the cost model, as if copied one after another) and
        count for the tier they came from."""
        reqs, self.reqs = self.reqs, []
        chunks, self.chunks = self.chunks, []
        for req_id in reqs:
            report.sync_loaded[req_id] = report.sync_loaded.get(req_id, 0) + 1
        if copies is None:
            return
        if copies.error is not None:
            log.error("s3kv: copying from the CPU tier failed: %s", copies.error)
            for c in chunks:
                errors.update(c.write_ids)
            return
        self.counters.add("load_chunks_cpu", len(chunks))
        self.counters.add("load_bytes_cpu", copies.nbytes)
        elapsed = copies.elapsed_s()
        if elapsed is not None:  # the chunks were copied together, layer by layer
            for _ in chunks:
                self.counters.observe("load_seconds_cpu", elapsed)
            if self.rank == 0:  # one observation per request, not per rank
                for _ in reqs:
                    self.counters.observe("request_load_seconds", elapsed)
                if chunks:  # all were in at the end: as if copied one after another
                    n = len(chunks)
                    tier = chunks[0].sources[0].tier
                    report.load_timings.append(LoadTiming("", tier, n, elapsed / n, elapsed))
        ok = report.tier_ok
        for c in chunks:
            ok[c.sources[0].tier] = ok.get(c.sources[0].tier, 0) + 1
