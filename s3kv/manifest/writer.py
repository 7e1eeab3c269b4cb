"""Writing segments under one writer id: the replicas' own (a
:class:`~s3kv.manifest.sync.ManifestSync`), their ranks' (a
:class:`~s3kv.manifest.publish.ShardPublisher`) and the front end's replay of
a rank's journal (:mod:`s3kv.manifest.journal`)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from s3kv.auth import FleetKeys
from s3kv.config import DEFAULTS
from s3kv.errors import AlreadyExists
from s3kv.manifest import format as mf
from s3kv.manifest.protocol import segment_name
from s3kv.stats import Counters
from s3kv.stores.base import ObjectStore, PutMode

log = logging.getLogger("s3kv.manifest")


class SegmentWriter:
    """Writes segments under one writer id: stamps from ``next_ts`` (the
    owner's hybrid clock), create-only PUTs, and publishing again under a
    fresh stamp when a PUT was so slow that readers' floors may have passed
    it."""

    def __init__(
        self,
        store: ObjectStore,
        base: str,
        writer: str,
        next_ts: Callable[[], int],
        *,
        keys: FleetKeys | None = None,
        skew_s: float = DEFAULTS.manifest_clock_skew_s,
        clock: Callable[[], float] = time.time,
        counters: Counters | None = None,
    ) -> None:
        self.store = store
        self.base = base
        self.writer = writer
        self.keys = keys
        self._next_ts = next_ts
        self._skew_s = skew_s
        self._clock = clock
        self.counters = counters or Counters()
        self._seq = 0

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    async def put(self, segment: mf.ManifestObject) -> list[tuple[str, int]]:
        """Write ``segment``; returns the (name, stamp) of each copy written.

        A PUT slower than half the skew margin may land behind other
        readers' floors (protocol "segments") or after the aggregators of
        the epochs that could still take it listed (protocol "epochs"): the
        same keys are published again under a fresh stamp, and again, until
        one PUT is fast enough. Never given up: a key published is a key the
        fleet sees (a PUT that fails raises, and the caller tries again)."""
        body = mf.encode(segment, self.keys)
        written: list[tuple[str, int]] = []
        while True:
            ts = self._next_ts()
            name = segment_name(self.base, ts, self.writer, self.next_seq(), directory=self.store.directory)
            with contextlib.suppress(AlreadyExists):  # names are ours alone: a retried PUT
                await self.store.put(name, body, mode=PutMode.CREATE)
            written.append((name, ts))
            self.counters.add("manifest_segments_published")
            if self._clock() * 1000 - ts <= self._skew_s * 500:
                return written
            log.warning(
                "s3kv: a manifest segment PUT took over %.0f s (%d so far); publishing it again",
                self._skew_s / 2,
                len(written),
            )
