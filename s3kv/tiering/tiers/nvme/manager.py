"""The NVMe tier's scheduler side: the directory's byte-bounded index."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable

from s3kv.config import S3KVConfig
from s3kv.tiering.breaker import BACKOFF_S, PROBE_TIMEOUT_S
from s3kv.tiering.placement import Tier, TierIndex
from s3kv.tiering.plan import Place, TierReport
from s3kv.tiering.tiers.manager import IndexedTierManager, probe_timeout_s
from s3kv.tiering.tiers.nvme.directory import Directory
from s3kv.tiering.tiers.nvme.report import NvmeReport


def disk_estimate(object_bytes: int) -> int:
    """Bytes to reserve for one shard's file of a chunk before its size is
    known: the raw pages plus zstd's worst-case growth and the header."""
    return object_bytes + object_bytes // 64 + (16 << 10)


class NvmeTierManager(IndexedTierManager):
    """The NVMe directory's byte-bounded index. A chunk is reserved at its
    estimate (every shard's file) and takes its real size once written;
    evicted and failed entries become file deletes, run off the scheduling
    thread by its :class:`Directory`'s cleaner (without one, as in tests,
    they wait for :meth:`take_evictions`), and a key is not written again
    while its old files are being deleted."""

    tier = Tier.DISK

    def __init__(
        self,
        index: TierIndex,
        *,
        shards: int = 1,
        object_bytes: int = 0,
        backoff_s: tuple[float, float] = BACKOFF_S,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        directory: Directory | None = None,
    ) -> None:
        super().__init__(index)
        self.directory = directory
        """The directory to open for the namespace (:meth:`activate`), and whose cleaner deletes files."""
        self.breaker = self._breaker(backoff_s, probe_timeout_s, clock)
        self.reserve_bytes = shards * disk_estimate(object_bytes)
        """A chunk's files before their sizes are known: ``shards`` files of ``object_bytes`` raw bytes."""
        self._sizes: dict[bytes, int] = {}
        """Bytes the ranks reported written so far, per pending key."""
        self._failures: dict[bytes, tuple[int, int]] = {}
        """Ranks that reported a pending key's write failed so far, and how
        many of those never began it (:attr:`TierReport.unstarted`)."""
        self._deleting: set[Hashable] = set()
        self._evictions: list[Hashable] = []

    @classmethod
    def from_config(
        cls, index: TierIndex, config: S3KVConfig, *, shards: int, object_bytes: int
    ) -> NvmeTierManager:
        return cls(index, shards=shards, object_bytes=object_bytes, probe_timeout_s=probe_timeout_s(config))

    # -- life --------------------------------------------------------------------
    def activate(self, namespace: str) -> bool:
        if self.directory is None:
            return True
        index = self.directory.open(namespace)
        if index is None:
            return False
        self.index = index
        return True

    def describe(self) -> str:
        setup = self.directory.setup if self.directory is not None else None
        return str(setup.root) if setup is not None else "on"

    def close(self) -> None:
        if self.directory is not None:
            self.directory.close()

    def _reserve(self, key: bytes) -> bool:
        if key in self._deleting:
            return False
        got = self.index.reserve(key, self.reserve_bytes)
        if got is None:
            return False
        self._evict(got[1])
        return True

    def _evict(self, evicted: Iterable[tuple[Hashable, object]]) -> None:
        for key, _ in evicted:
            self.counters.add("evict_chunks_disk")
            self._forget_files(key)
            if isinstance(key, bytes):
                self.events.removed(self.tier, key)

    def _forget_files(self, key: Hashable) -> None:
        self._deleting.add(key)
        cleaner = self.directory.cleaner if self.directory is not None else None
        if cleaner is not None:
            cleaner.delete((key,))
        else:
            self._evictions.append(key)

    def _settle(self) -> None:
        """Keys whose old files the cleaner deleted may be written again."""
        cleaner = self.directory.cleaner if self.directory is not None else None
        if cleaner is not None:
            self.on_deleted(cleaner.take_done())

    def prepare_store(self, key: bytes, owner: Hashable) -> Place | None:
        self._settle()
        if self.index.has(key) or key in self._deleting or not self.allows(owner, take=False):
            return None
        if not (self._reserve(key) and self.allows(owner)):
            return None
        return Place(self.tier)

    def prepare_promotion(self, key: bytes) -> Place | None:
        self._settle()
        assert self.breaker is not None
        return Place(self.tier) if self.breaker.closed and self._reserve(key) else None

    def complete_store(self, key: bytes, ok: bool) -> None:
        super().complete_store(key, ok)
        size = self._sizes.pop(key, None)
        failed, unstarted = self._failures.pop(key, (0, 0))
        if ok:
            self._evict(self.index.commit(key, size))
        elif self.index.abort(key) is not None and not (size is None and failed and unstarted == failed):
            self._forget_files(key)  # ranks that did write (or may have) leave files

    def forget(self, key: bytes) -> None:
        if self.index.has(key):
            self.index.remove(key)
            self._forget_files(key)  # the other shards' files of it
        super().forget(key)

    def on_report(
        self, report: TierReport, decided: Iterable[tuple[bytes, bool]], missing: Iterable[bytes]
    ) -> None:
        own = report.section(self.tier, NvmeReport)
        if own is not None and own.sizes:
            sizes = self._sizes
            for (tier, key), _n in report.written.items():
                if tier is self.tier:
                    sizes[key] = sizes.get(key, 0) + own.sizes.get(key, 0)
        for (tier, key), n in report.failed.items():
            if tier is self.tier:
                failed, unstarted = self._failures.get(key, (0, 0))
                self._failures[key] = (failed + n, unstarted + report.unstarted.get((tier, key), 0))
        super().on_report(report, decided, missing)

    def end_report(self, report: TierReport) -> None:
        own = report.section(self.tier, NvmeReport)
        if own is not None and own.full:
            # The disk filled up below disk_bytes (other files grew): take what
            # s3kv holds now as the capacity, so later stores evict instead.
            self._evict(self.index.shrink(max(self.index.used, self.reserve_bytes)))
        super().end_report(report)

    # -- file deletes ------------------------------------------------------------
    def take_evictions(self) -> list[Hashable]:
        """Entries whose files to delete (chunk keys, or paths of other
        files), where no cleaner deletes them."""
        out, self._evictions = self._evictions, []
        return out

    def on_deleted(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            self._deleting.discard(key)

    def gauges(self) -> dict[str, int]:
        return {
            **super().gauges(),
            "tier_used_bytes_disk": self.index.used,
            "tier_capacity_bytes_disk": self.index.capacity,
        }
