"""The transfer engine's loads: each chunk of a job read from its sources
in turn, through a :class:`~s3kv.tiering.worker.gate.Gate` per attempt into
the job's :class:`~s3kv.tiering.worker.gate.PageSink`, and promoted into the
nearer tiers it names; what happened goes to the engine's report and
counters."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from s3kv.errors import GaveUp, NotFound
from s3kv.frame_sinks import FrameSink, PageTarget
from s3kv.tiering.chunks import ChunkCodec, ChunkData
from s3kv.tiering.loop import JobLoop
from s3kv.tiering.meter import Attempt
from s3kv.tiering.plan import LoadChunk, Place
from s3kv.tiering.tiers.handler import PageTierHandler, TierHandler, error_kind
from s3kv.tiering.worker.gate import Gate, PageSink

if TYPE_CHECKING:
    from s3kv.tiering.worker.transfer import TransferEngine

log = logging.getLogger("s3kv.transfer")


class _NoPages:
    """The pages of a prefetch: none, its layers go to the promotions only."""

    def write(self, chunk: LoadChunk, layer: int, data: np.ndarray) -> None:
        pass

    def target(self, chunk: LoadChunk, layer: int) -> PageTarget | None:
        return None


@dataclass
class _Promotion:
    """A loaded chunk's copy into a tier that is written from the object."""

    handler: TierHandler
    place: Place
    key: bytes
    blob: bytes

    def save(self, codec: ChunkCodec) -> Coroutine[Any, Any, int | None]:
        return self.handler.save(self.place, ChunkData(self.key, codec, blob=self.blob))


NO_PAGES: PageSink = _NoPages()


class Loads:
    """The loads of ``engine`` (its handlers, settings, clock, meter, report
    and counters), run as jobs on its ``loop``."""

    def __init__(self, engine: TransferEngine, loop: JobLoop) -> None:
        self._e = engine
        self._loop = loop

    async def job(self, job_id: str | None, chunks: list[LoadChunk], pages: PageSink) -> None:
        clock = self._e.clock
        start = clock()
        # A request's copies into tiers written from the object (NVMe) start
        # once its last chunk is in: their decoding, encoding and writes would
        # take the cores its other chunks' reads and decodes need. A
        # prefetch (no job, no pages) writes each copy at once: that is its point.
        later: list[_Promotion] | None = [] if job_id is not None else None
        try:
            attempts = await asyncio.gather(*(self._one(c, pages, later) for c in chunks))
        except BaseException:  # cancelled (the engine is closing): the copies never start
            for promotion in later or ():
                self._e.report.failed(promotion.place.tier, promotion.key, started=False)
            raise
        failed = [c for c, a in zip(chunks, attempts) if a is None]
        if not failed and self._e.s.timing:  # one observation per request, not per rank
            took = clock() - start
            if job_id is not None:
                self._e.counters.observe("request_load_seconds", took)
            done = [a for a in attempts if a is not None]
            for timing in self._e.meter.timings(job_id or "", done, took):  # ranks load alike
                self._e.report.timed(timing)
        if job_id is not None:
            self._e.report.finished(job_id, failed)
        for promotion in later or ():
            self._loop.track(promotion.save(self._e.codec))  # type: ignore[arg-type]

    async def _one(
        self,
        chunk: LoadChunk,
        pages: PageSink,
        later: list[_Promotion] | None = None,
    ) -> Attempt | None:
        """Load one chunk: the attempt at the tier it came from, or None if it
        failed. Its copies into tiers written from the object go to ``later``
        (the job starts them), or start now."""
        key = chunk.key
        promote = [(self._e.handlers.get(p.tier), p) for p in chunk.promote]
        fills = [(h, p) for h, p in promote if isinstance(h, PageTierHandler)]  # filled as layers load
        copies = [(h, p) for h, p in promote if not isinstance(h, PageTierHandler)]  # written from the object
        sinks: list[FrameSink] = [h.open_fill(p, key) for h, p in fills]
        try:
            deadline = self._e.clock() + self._e.s.load_timeout_s
            source, nbytes, blob, attempt = await self._from_sources(
                chunk, pages, sinks, bool(copies), deadline
            )
        except Exception as e:  # every failure becomes a recompute, never an engine error
            kind = error_kind(e)
            if kind not in ("missing", "corrupt", "denied"):  # those were counted per tier
                self._e.counters.add(f"load_errors_{kind}")
                log.warning("s3kv: load of chunk %s failed (%s): %s", key.hex(), kind, e)
            for h, p in promote:  # the promotions are off
                # A fill may have written some layers; one from the object never began.
                self._e.report.failed(p.tier, key, started=(h, p) in fills)
            return None
        tier = source.tier.value
        self._e.report.tier_ok(source.tier)
        self._e.counters.add(f"load_chunks_{tier}")
        self._e.counters.add(f"load_bytes_{tier}", nbytes)
        self._e.counters.observe(f"load_seconds_{tier}", attempt.ended - attempt.started)
        for h, p in fills:
            h.close_fill(p, key)
            self._e.report.written(p.tier, key)
            self._e.counters.add(f"promote_chunks_{p.tier.value}")
        for h, p in copies:
            if not self._e.s.writes:  # the rank that writes this shard promotes it
                self._e.report.written(p.tier, key)
            elif blob is None or h is None:
                self._e.report.failed(p.tier, key)
            elif later is not None:
                later.append(_Promotion(h, p, key, blob))
            else:
                self._loop.track(_Promotion(h, p, key, blob).save(self._e.codec))  # type: ignore[arg-type]
        return attempt

    async def _from_sources(
        self,
        chunk: LoadChunk,
        pages: PageSink,
        fills: list[FrameSink],
        keep_blob: bool,
        deadline: float,
    ) -> tuple[TierHandler, int, bytes | None, Attempt]:
        """(handler it came from, bytes read, the object if asked to keep it,
        the attempt there: timed by itself, not from the load's start).
        A tier that lacks the chunk (absent, corrupt, a 403 on the object) is
        reported and the next source tried; so is one whose handler falls
        through on its own trouble (a disk that errs, is too slow or has no
        thread free). Other errors end the load, and so does the deadline
        (GaveUp: no tier's fault)."""
        last: Exception | None = None
        for i, place in enumerate(chunk.sources):
            tier = place.tier
            if deadline - self._e.clock() <= 0:  # an earlier source took the time: this one is not to blame
                raise GaveUp(f"{tier.value}: given up, no time left before the load's deadline")
            h = self._e.handlers.get(tier)
            # Each attempt writes the KV cache through a gate of its own: once
            # it is over (done, failed, timed out, given up) no late write of
            # a decoding thread reaches blocks that are vLLM's again, or that
            # the next source is writing.
            gate = Gate(pages, chunk, fills)
            try:
                if h is None:
                    raise NotFound(f"no {tier.value} tier here")
                choice = self._e.codec_choices.get(tier)
                with (
                    self._e.meter.attempt(tier) as attempt,
                    choice.transfer() if choice is not None else contextlib.nullcontext([0, 0]) as moved,
                ):
                    nbytes, blob = await h.read(
                        place, chunk.key, gate, deadline=deadline, keep_blob=keep_blob
                    )
                    moved[:] = [nbytes, self._e.chunk_raw_bytes]
                return h, nbytes, blob, attempt
            except Exception as e:
                last = e
                if h is None:
                    self._e.counters.add("load_errors_missing")
                    self._e.report.missing(tier, chunk.key)
                elif not h.read_failed(chunk.key, e, last=i == len(chunk.sources) - 1):
                    raise
            finally:
                gate.close()
        raise last if last is not None else NotFound(chunk.key.hex())
