"""A worker rank that refuses every transfer: its fleet key is not the
scheduler side's.

Each process reads the fleet secret on its own (a Ray worker does not
inherit the environment unless told to): a rank without the scheduler
side's key would write unsigned objects into a signed namespace and refuse
every signed one, and one with another key would write what the fleet
refuses. Such a rank refuses every transfer instead: loads fail (vLLM
recomputes), stores are dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import LoadPlan, StoreChunk, TierReport

log = logging.getLogger("s3kv.worker")


def _kid(k: bytes | None) -> str:
    return k.hex() if k is not None else "none"


class Refusal:
    """What a refusing rank answers to the plans, in the report it sends."""

    def __init__(self, own_kid: bytes | None, scheduler_kid: bytes | None) -> None:
        self.reason = f"fleet key id {_kid(own_kid)} here, {_kid(scheduler_kid)} on the scheduler side"
        self._finished: set[str] = set()
        """Asynchronous loads refused, to report as finished (failed)."""

    @classmethod
    def check(cls, own_kid: bytes | None, scheduler_kid: bytes | None, rank: int) -> Refusal | None:
        """A refusal, said once, if this rank's key id is not the scheduler side's."""
        if own_kid == scheduler_kid:
            return None
        log.error(
            "s3kv: rank %d's fleet secret (key id %s) is not the scheduler side's (key id %s): this "
            "rank refuses every load and store, so the replica serves without the KV cache. Give "
            "every vLLM process the same S3KV_AUTH_KEY or auth_key_file (under Ray, list "
            "S3KV_AUTH_KEY in VLLM_RAY_EXTRA_ENV_VARS_TO_COPY) and restart.",
            rank,
            _kid(own_kid),
            _kid(scheduler_kid),
        )
        return cls(own_kid, scheduler_kid)

    def loads(
        self, loads: Sequence[LoadPlan], prefetch: Sequence[LoadPlan], report: TierReport
    ) -> tuple[set[int], list[str]]:
        """Refused loads fail as a failed load does: their blocks are
        recomputed, their promotions (and the prefetches') freed, and each
        is over: an asynchronous one at the next :meth:`take_finished`, a
        synchronous one at the end of the step. (The blocks in error, the
        requests of the synchronous ones.)"""
        errors: set[int] = set()
        sync: list[str] = []
        for plan in loads:
            report.load_failed.add(plan.req_id)
            if plan.sync:
                sync.append(plan.req_id)
            else:
                self._finished.add(plan.req_id)
            for c in plan.chunks:
                errors.update(c.write_ids)
                for place in c.promote:
                    _write_failed(report, place.tier, c.key)
        for plan in prefetch:
            for c in plan.chunks:
                for place in c.promote:
                    _write_failed(report, place.tier, c.key)
        return errors, sync

    def stores(self, stores: Sequence[StoreChunk], report: TierReport) -> None:
        """Refused stores are dropped, uncopied: every tier they were meant
        for hears of a failed write, and their CPU slots are free again."""
        for s in stores:
            for place in s.targets:
                _write_failed(report, place.tier, s.key)
            if s.pinned:  # the write-through would have read the slot
                report.released[s.key] = report.released.get(s.key, 0) + 1

    def take_finished(self) -> set[str]:
        """The asynchronous loads refused since the last call."""
        finished, self._finished = self._finished, set()
        return finished


def _write_failed(report: TierReport, tier: Tier, key: bytes) -> None:
    report.failed[(tier, key)] = report.failed.get((tier, key), 0) + 1
