"""The NVMe tier: a local directory of chunk files (scheduler side: the byte-bounded index; worker side: the files)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from s3kv.chunk_reader import FrameSink
from s3kv.config import DEFAULTS, S3KVConfig
from s3kv.errors import StorageFull
from s3kv.stats import Counters
from s3kv.tiering.breaker import BACKOFF_S, PROBE_TIMEOUT_S
from s3kv.tiering.chunks import ChunkData
from s3kv.tiering.loop import background_thread, unbind_thread
from s3kv.tiering.placement import Tier, TierIndex
from s3kv.tiering.plan import Place, TierReport
from s3kv.tiering.tiers.base import (
    Began,
    IndexedTierManager,
    RankReport,
    TierHandler,
    WorkerEnv,
    probe_timeout_s,
)
from s3kv.tiering.tiers.nvme import files as disk
from s3kv.tiering.tiers.nvme.files import DiskTier, directory_bytes
from s3kv.units import format_size

# -- scheduler side ---------------------------------------------------------------


_setup_log = logging.getLogger("s3kv.tiers")

DEFAULT_DISK_FRACTION = 0.8
"""Without disk_bytes, the NVMe tier may take this share of the free space."""


@dataclass
class DiskSetup:
    index: TierIndex
    root: Path
    lock_fd: int | None
    found_chunks: int
    found_bytes: int
    skipped: int = 0
    """Entries the start-up scan left alone (see :attr:`disk.ScanResult.skipped`)."""


def open_disk(
    path: str, namespace: str, world_size: int, capacity_bytes: int | None
) -> tuple[DiskSetup | None, list[Hashable]]:
    """Check the directory, rebuild its index from what it holds (oldest
    first, so they are evicted first) and return what must be deleted to fit
    the capacity. An unusable directory (not writable, not readable) turns the
    tier off with a warning: the cache is an optimisation, the engine still
    serves. What the directory holds never fails start-up."""
    root = Path(path)
    try:
        disk.check_writable(root)
    except OSError as e:
        _setup_log.warning("s3kv: disk_path %s is not writable (%s); the NVMe tier is off", root, e)
        return None, []
    try:
        lock_fd = disk.try_lock(root)
    except OSError as e:
        lock_fd = None
        _setup_log.warning(
            "s3kv: cannot open the lock file %s (%s); if another engine uses disk_path, each accounts "
            "its own writes against disk_bytes",
            root / disk.LOCK_NAME,
            e,
        )
    else:
        if lock_fd is None:
            _setup_log.warning(
                "s3kv: another engine uses disk_path %s; each accounts its own writes against disk_bytes, "
                "so give each engine its own directory",
                root,
            )
    started = time.monotonic()
    found = disk.scan(root, namespace, world_size)
    if found.root_error is not None:
        _setup_log.warning(
            "s3kv: disk_path %s cannot be listed (%s); the NVMe tier is off", root, found.root_error
        )
        release_lock(lock_fd)
        return None, []
    entries: list[tuple[float, Hashable, int]] = [(m, rel, size) for rel, size, m in found.other]
    entries += [(m, key, size) for key, size, m in found.chunks]
    if capacity_bytes is None:  # what s3kv holds there counts as free for it
        held = sum(size for _m, _k, size in entries)
        capacity_bytes = int(disk.free_bytes(root) * DEFAULT_DISK_FRACTION) + held
        _setup_log.info("s3kv: disk_bytes not set; the NVMe tier may use %s", format_size(capacity_bytes))
    index = TierIndex("disk", capacity_bytes)
    evicted: list[Hashable] = []
    for _mtime, key, size in sorted(entries, key=lambda e: e[0]):
        out = index.insert_ready(key, size)
        if out is None:  # larger than the whole tier
            evicted.append(key)
            continue
        evicted += [k for k, _ in out]
    _setup_log.info(
        "s3kv: NVMe tier %s: %d chunks of this model (%s) and %d other files found in %.2f s; "
        "%d stale partial files removed; %d entries skipped%s; capacity %s",
        root,
        len(found.chunks),
        format_size(sum(c[1] for c in found.chunks)),
        len(found.other),
        time.monotonic() - started,
        found.removed_partials,
        found.skipped,
        _format_reasons(found.skipped_reasons),
        format_size(capacity_bytes),
    )
    setup = DiskSetup(
        index, root, lock_fd, len(found.chunks), sum(c[1] for c in found.chunks), skipped=found.skipped
    )
    return setup, evicted


def _format_reasons(reasons: dict[str, int]) -> str:
    """`` (2 symlink, 1 unreadable)`` for the log line; empty without reasons."""
    if not reasons:
        return ""
    return " (" + ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items())) + ")"


class DiskCleaner:
    """Deletes evicted NVMe entries in a thread of its own, in order; the
    scheduler collects what is done with :meth:`take_done` (so it never plans
    a write of a key whose old files are still being removed)."""

    def __init__(self, root: Path, namespace: str, world_size: int) -> None:
        self.root = root
        self.namespace = namespace
        self.world_size = world_size
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="s3kv-disk-gc")
        self._done: queue.SimpleQueue[Hashable] = queue.SimpleQueue()

    def delete(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            self._executor.submit(self._delete, key)

    def _delete(self, key: Hashable) -> None:
        try:
            if isinstance(key, bytes):
                disk.delete_chunk(self.root, self.namespace, key, self.world_size)
            else:
                disk.delete_file(self.root, str(key))
        except OSError as e:
            _setup_log.warning("s3kv: could not delete %s from the NVMe tier: %s", key, e)
        finally:
            self._done.put(key)

    def take_done(self) -> list[Hashable]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def close(self, timeout_s: float = 5.0) -> None:
        """Finish queued deletions for up to ``timeout_s`` (the rest is left
        for the next start-up's capacity check)."""
        waiter = threading.Thread(target=self._executor.shutdown, daemon=True)
        waiter.start()
        waiter.join(timeout_s)


def release_lock(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


def disk_estimate(shard_bytes: int) -> int:
    """Bytes to reserve for one rank's file of a chunk before its size is
    known: the raw pages plus zstd's worst-case growth and the header."""
    return shard_bytes + shard_bytes // 64 + (16 << 10)


class NvmeTierManager(IndexedTierManager):
    """The NVMe directory's byte-bounded index. A chunk is reserved at its
    estimate (every rank's file) and takes its real size once written;
    evicted and failed entries become file deletes, handed to the caller
    (:meth:`take_evictions`) to run off the scheduling thread, and a key is
    not written again while its old files are being deleted."""

    tier = Tier.DISK

    def __init__(
        self,
        index: TierIndex,
        *,
        world_size: int = 1,
        shard_bytes: int = 0,
        backoff_s: tuple[float, float] = BACKOFF_S,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(index)
        self.breaker = self._breaker(backoff_s, probe_timeout_s, clock)
        self.reserve_bytes = world_size * disk_estimate(shard_bytes)
        self._sizes: dict[bytes, int] = {}
        """Bytes the ranks reported written so far, per pending key."""
        self._failures: dict[bytes, tuple[int, int]] = {}
        """Ranks that reported a pending key's write failed so far, and how
        many of those never began it (:attr:`TierReport.unstarted`)."""
        self._deleting: set[Hashable] = set()
        self._evictions: list[Hashable] = []

    @classmethod
    def from_config(
        cls, index: TierIndex, config: S3KVConfig, *, world_size: int, shard_bytes: int
    ) -> NvmeTierManager:
        return cls(
            index, world_size=world_size, shard_bytes=shard_bytes, probe_timeout_s=probe_timeout_s(config)
        )

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
        self._evictions.append(key)

    def prepare_store(self, key: bytes, owner: Hashable) -> Place | None:
        if self.index.has(key) or key in self._deleting or not self.allows(owner, take=False):
            return None
        if not (self._reserve(key) and self.allows(owner)):
            return None
        return Place(self.tier)

    def prepare_promotion(self, key: bytes) -> Place | None:
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
            self._forget_files(key)  # the other ranks' files of it
        super().forget(key)

    def on_report(
        self, report: TierReport, decided: Iterable[tuple[bytes, bool]], missing: Iterable[bytes]
    ) -> None:
        if report.disk_sizes:
            sizes = self._sizes
            for (tier, key), _n in report.written.items():
                if tier is self.tier:
                    sizes[key] = sizes.get(key, 0) + report.disk_sizes.get(key, 0)
        for (tier, key), n in report.failed.items():
            if tier is self.tier:
                failed, unstarted = self._failures.get(key, (0, 0))
                self._failures[key] = (failed + n, unstarted + report.unstarted.get((tier, key), 0))
        super().on_report(report, decided, missing)

    def end_report(self, report: TierReport) -> None:
        if report.disk_full:
            # The disk filled up below disk_bytes (other files grew): take what
            # s3kv holds now as the capacity, so later stores evict instead.
            self._evict(self.index.shrink(max(self.index.used, self.reserve_bytes)))
        super().end_report(report)

    # -- file deletes ------------------------------------------------------------
    def take_evictions(self) -> list[Hashable]:
        """Entries whose files to delete (chunk keys, or paths of other files)."""
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


# -- worker side -------------------------------------------------------------------

log = logging.getLogger("s3kv.transfer")

DISK_THREADS = 2
"""Threads for NVMe reads, and as many again for writes: a slow or hung
disk ties up these, never the ones that decode S3 loads or encode stores,
and writes queued behind slow writes never hold up a read."""


class NvmeHandler(TierHandler):
    """The directory's files (:class:`~s3kv.tiering.tiers.nvme.files.DiskTier`), on
    threads of their own. A read or write slower than ``timeout_s`` from
    when a thread starts it fails for the disk's sake; a read that waits
    that long for a thread gives up (the next source serves it), blaming the
    disk only if its threads are stuck (busy is not failing); a write may
    wait ``write_queue_s`` for a thread. A read that fails for the disk's
    sake goes on to the next source; a file that fails its checks is
    deleted by the read."""

    tier = Tier.DISK
    label = "NVMe"
    falls_through = True

    def __init__(
        self,
        files: DiskTier,
        *,
        timeout_s: float = DEFAULTS.disk_timeout_s,
        write_queue_s: float = DEFAULTS.load_timeout_s,
        report: RankReport | None = None,
        counters: Counters | None = None,
    ) -> None:
        super().__init__(report, counters)
        self.files = files
        self.timeout_s = timeout_s
        self.write_queue_s = write_queue_s
        # Writes (write-through, and the copies loads promote) are background
        # work: at a lower priority, they never take a core from a forward.
        self._threads = {
            write: concurrent.futures.ThreadPoolExecutor(
                DISK_THREADS,
                thread_name_prefix=f"s3kv-disk-{name}",
                initializer=background_thread if write else unbind_thread,
            )
            for write, name in ((False, "read"), (True, "write"))
        }
        self._running: dict[bool, set[Began]] = {False: set(), True: set()}
        """Reads (False) and writes (True) under way on the disk's threads."""

    async def run(self, fn: Callable[..., Any], *args: Any, write: bool = False) -> Any:
        """``fn(*args)`` on the disk's read (or write) threads."""
        return await asyncio.get_running_loop().run_in_executor(
            self._threads[write], functools.partial(fn, *args)
        )

    def _op(self, fn: Callable[..., Any], *args: Any, write: bool = False) -> tuple[Any, Began]:
        """(``fn(*args)`` on the disk's threads, to await; when a thread took it up)."""
        began = Began(self._running[write], self.clock)
        return self.run(began.wrap(fn, *args), write=write), began

    @classmethod
    def for_worker(cls, env: WorkerEnv) -> NvmeHandler | None:
        if env.settings.disk_path is None:
            return None
        files_codec = dataclasses.replace(env.codec, codec=env.settings.disk_codec)
        return cls(
            DiskTier(Path(env.settings.disk_path), files_codec, fsync=env.settings.disk_fsync),
            timeout_s=env.settings.disk_timeout_s,
            write_queue_s=env.settings.load_timeout_s,
            report=env.report,
            counters=env.counters,
        )

    async def read(
        self,
        place: Place,
        key: bytes,
        sink: FrameSink,
        *,
        deadline: float | None = None,
        keep_blob: bool = False,
    ) -> tuple[int, bytes | None]:
        read, began = self._op(self.files.read, key, sink)
        t = self.timeout_s
        return await self.guard(read, t, load=True, began=began, queue_s=t, deadline=deadline), None

    async def write(self, place: Place, chunk: ChunkData, start: float | None = None) -> int | None:
        write, began = self._op(self.files.write, chunk.key, chunk, write=True)
        try:
            # Write-through is background work: it may wait for a thread as
            # long as a load may take, then it is dropped (a disk failure
            # only if the threads are stuck).
            n = await self.guard(write, self.timeout_s, load=False, began=began, queue_s=self.write_queue_s)
        except StorageFull as e:
            self.counters.add("store_dropped_disk_full")
            log.warning("s3kv: NVMe tier full, chunk not stored there: %s", e)
            with self.report.edit() as r:
                r.disk_full = True
            return None
        self.counters.add("store_chunks_disk")
        self.counters.add("store_bytes_disk", n)
        if start is not None:
            self.counters.observe("store_seconds_disk", time.perf_counter() - start)
        with self.report.edit() as r:
            r.disk_sizes[chunk.key] = n
        return n

    async def delete(self, place: Place, key: bytes) -> None:
        await self.run(self.files.delete, key, write=True)

    async def bytes_used(self) -> int:
        return await self.run(directory_bytes, self.files.root)

    def close(self) -> None:
        for threads in self._threads.values():
            threads.shutdown(wait=False, cancel_futures=True)
