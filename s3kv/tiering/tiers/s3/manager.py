"""The S3 tier's scheduler side: the bucket as this replica knows it (the
fleet's manifest, the breaker and the stores in flight)."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from itertools import compress

import numpy as np

from s3kv.config import S3KVConfig
from s3kv.keys import object_key
from s3kv.manifest.keyset import Manifest
from s3kv.manifest.publish import replica_segments
from s3kv.tiering.breaker import BACKOFF_S, PROBE_TIMEOUT_S
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import Place, TierReport
from s3kv.tiering.tiers.manager import TierManager, probe_timeout_s
from s3kv.tiering.tiers.s3.report import S3Report

VERIFIED_SIZE = 1 << 16
"""Keys remembered present in the manifest (~100 bytes each)."""
BAD_KEY_RETRY_S = 10.0
"""After a store found an object reported bad in the way, how long before
the key is stored again (the object stays until ``s3kv gc`` deletes it)."""


class S3TierManager(TierManager):
    """The bucket as this replica knows it: the fleet's manifest, the breaker,
    and the stores in flight (a key is not stored again before
    ``store_retry_s``, or ``BAD_KEY_RETRY_S`` while a bad object is in the way)."""

    tier = Tier.S3

    def __init__(
        self,
        manifest: Manifest,
        *,
        store_retry_s: float = 120.0,
        backoff_s: tuple[float, float] = BACKOFF_S,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        url: str = "s3",
        prefix: str = "",
        publishes_all: bool = False,
    ) -> None:
        super().__init__()
        self.publishes_all = publishes_all
        """Whether this replica's segment names every chunk it stored (its
        ranks hold theirs for it: protocol "epochs"), or only those a store
        found already there (a 412: the ranks publish what they create)."""
        self.url = url
        """The bucket and prefix, for the start-up log line."""
        self.prefix = prefix
        self.namespace = ""
        """The model's namespace (:meth:`activate`): where its objects are named."""
        self.breaker = self._breaker(backoff_s, probe_timeout_s, clock)
        self.manifest = manifest
        self.store_retry_s = store_retry_s
        self._clock = clock
        self.down = False
        """S3 did not answer at start-up (:func:`check_bucket`): paused until
        the manifest loads from it (:meth:`resume`). The one place this is kept."""
        self._verified: set[bytes] = set()
        """Keys seen in the manifest at ``_verified_epoch`` (a set, not a dict:
        its inserts are cheaper, and a new prefix's lookup pays one a key)."""
        self._verified_epoch = -1
        self._storing: dict[bytes, float] = {}
        """Keys planned for a store and not yet reported, or whose store found
        an object reported bad in the way (a 412): with when, so that they
        are not stored again before ``store_retry_s``."""
        self._existing: set[bytes] = set()
        """Stores that found the object there already (a 412), until decided."""

    @classmethod
    def from_config(cls, manifest: Manifest, config: S3KVConfig) -> S3TierManager:
        return cls(
            manifest,
            probe_timeout_s=probe_timeout_s(config),
            url=f"s3://{config.bucket}/{config.prefix}",
            prefix=config.prefix,
            publishes_all=replica_segments(config),
        )

    @property
    def paused(self) -> bool:
        """Not to be used by a new request now (down, or the breaker open)."""
        assert self.breaker is not None
        return self.down or not self.breaker.usable()

    def activate(self, namespace: str) -> bool:
        self.namespace = namespace
        return True

    def resume(self) -> None:
        self.down = False

    def describe(self) -> str:
        return self.url

    def prepare_promotion(self, key: bytes) -> Place | None:
        """None: the farthest tier, never promoted into."""
        return None

    def allows(self, owner: Hashable, *, take: bool = True) -> bool:
        return not self.down and super().allows(owner, take=take)

    # -- loads -----------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes], fps: np.ndarray, start: int, end: int) -> list[bool]:
        """Keys seen present since the manifest's last removal are known; the
        rest are looked up in one vectorised pass (each a binary search
        through the whole manifest, cache misses in a large one)."""
        epoch = self.manifest.epoch
        if epoch != self._verified_epoch:
            self._verified.clear()
            self._verified_epoch = epoch
        verified = self._verified
        asked = keys[start:end]
        if not verified.isdisjoint(asked):
            todo = [i for i in range(start, end) if keys[i] not in verified]
            if not todo:
                return [True] * (end - start)
        else:  # a new prefix: all of them, without a list of indices and a copy
            found = self.manifest.present_fps(fps[start:end]).tolist()
            verified.update(compress(asked, found))
            if len(verified) > VERIFIED_SIZE:
                verified.clear()
            return found
        found = self.manifest.present_fps(fps[todo]).tolist()
        out = [True] * (end - start)
        for i, has in zip(todo, found):
            if has:
                verified.add(keys[i])
            else:
                out[i - start] = False
        if len(verified) > VERIFIED_SIZE:
            verified.clear()
        return out

    def fallback(self, key: bytes) -> Place | None:
        assert self.breaker is not None
        ok = key in self.manifest and not self.down and self.breaker.closed
        return Place(self.tier) if ok else None

    def prefetches(self, key: bytes) -> bool:
        """Far and slow: a waiting request's chunks are fetched nearer, while the breaker is closed."""
        assert self.breaker is not None
        return self.breaker.closed

    def record_use(self, keys: Sequence[bytes]) -> None:
        self.manifest.touch(keys)  # access records, for gc

    # -- stores ----------------------------------------------------------------
    def prepare_store(self, key: bytes, owner: Hashable) -> Place | None:
        now = self._clock()
        if (
            key in self.manifest
            or now - self._storing.get(key, -self.store_retry_s) < self.store_retry_s
            or not self.allows(owner)  # last: half-open, this store is the probe
        ):
            return None
        self._storing[key] = now
        return Place(self.tier)

    def complete_store(self, key: bytes, ok: bool) -> None:
        super().complete_store(key, ok)
        existing = key in self._existing
        self._existing.discard(key)
        # An object some replica reported bad is never published from a 412
        # (it may be that very object). One this replica wrote goes in its
        # own segment (protocol "epochs": the ranks hold it until that
        # segment names it), or is published by the ranks that wrote it the
        # moment their PUTs returned (manifest.publish) and here only joins
        # this replica's index.
        bad = self.manifest.is_bad(key)
        if bad and (existing or not ok):
            # The bad object is in the way (a 412, or a store that found one
            # it could not verify) until gc removes it: the next store waits
            # BAD_KEY_RETRY_S instead of trying every step (one PUT per key
            # that often is cheap; gc may run any time).
            self._storing[key] = self._clock() - self.store_retry_s + BAD_KEY_RETRY_S
        else:
            self._storing.pop(key, None)
        if ok and not (existing and bad):
            self.manifest.add(key, publish=existing or self.publishes_all)

    def forget(self, key: bytes) -> None:
        if key in self.manifest:
            self.manifest.discard(key)
            self.counters.add("manifest_dropped")
        super().forget(key)

    def on_report(
        self, report: TierReport, decided: Iterable[tuple[bytes, bool]], missing: Iterable[bytes]
    ) -> None:
        own = report.section(self.tier, S3Report)
        if own is not None:
            for (key, rank), etag in own.bad.items():  # corrupt objects left in S3: tell the fleet
                self.manifest.quarantine(key, object_key(self.prefix, self.namespace, key, rank), etag)
            self._existing.update(own.existing)
        super().on_report(report, decided, missing)
