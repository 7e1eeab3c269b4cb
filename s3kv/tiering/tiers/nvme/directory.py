"""The NVMe tier's directory on the scheduler side: opening it (checks,
lock, the start-up scan that rebuilds the index) and deleting evicted
files on a thread of its own."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path

from s3kv.stats import Counters
from s3kv.tiering.placement import TierIndex
from s3kv.tiering.tiers.nvme import files as disk
from s3kv.units import format_size

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
    path: str, namespace: str, shards: int, capacity_bytes: int | None
) -> tuple[DiskSetup | None, list[Hashable]]:
    """Check the directory, rebuild its index from what it holds (chunks of
    ``namespace`` with a file of each of its ``shards``, oldest
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
    found = disk.scan(root, namespace, shards)
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

    def __init__(self, root: Path, namespace: str, shards: int) -> None:
        self.root = root
        self.namespace = namespace
        self.shards = shards
        """Files of each chunk: an evicted chunk's are all deleted."""
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="s3kv-disk-gc")
        self._done: queue.SimpleQueue[Hashable] = queue.SimpleQueue()

    def delete(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            self._executor.submit(self._delete, key)

    def _delete(self, key: Hashable) -> None:
        try:
            if isinstance(key, bytes):
                disk.delete_chunk(self.root, self.namespace, key, self.shards)
            else:
                disk.delete_file(self.root, str(key))
        except OSError as e:
            _setup_log.warning("s3kv: could not delete %s from the NVMe tier: %s", key, e)
        finally:
            self._done.put(key)

    def take_done(self) -> list[Hashable]:
        if self._done.empty():
            return []
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


class Directory:
    """The NVMe tier's directory as the scheduler side holds it: opened for
    a namespace (:func:`open_disk`; what does not fit is deleted at once),
    then its evicted files are deleted by a :class:`DiskCleaner`; closing
    lets both go."""

    def __init__(self, path: str, capacity_bytes: int | None, shards: int, counters: Counters) -> None:
        self.path = path
        self.capacity_bytes = capacity_bytes
        self.shards = shards
        """Shard files of each chunk (:attr:`ManagerEnv.shards <s3kv.tiering.tiers.spec.ManagerEnv.shards>`)."""
        self.counters = counters
        self.setup: DiskSetup | None = None
        self.cleaner: DiskCleaner | None = None

    def open(self, namespace: str) -> TierIndex | None:
        """The index of what the directory holds for ``namespace``, or None:
        the directory is unusable and the tier is off."""
        setup, evicted = open_disk(self.path, namespace, self.shards, self.capacity_bytes)
        if setup is None:
            return None
        if setup.skipped:
            self.counters.add("disk_scan_skipped", setup.skipped)
        self.setup = setup
        self.cleaner = DiskCleaner(setup.root, namespace, self.shards)
        self.cleaner.delete(evicted)
        return setup.index

    def close(self) -> None:
        """Finish the queued deletes for a while, and let go of the lock."""
        if self.cleaner is not None:
            self.cleaner.close()
        if self.setup is not None:
            release_lock(self.setup.lock_fd)
