"""The NVMe tier's worker side: the directory's chunk files, on threads of their own."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from s3kv.config import DEFAULTS
from s3kv.errors import StorageFull
from s3kv.frame_sinks import FrameInto
from s3kv.stats import Counters
from s3kv.tiering.chunks import ChunkCodec, ChunkData
from s3kv.tiering.loop import background_thread, unbind_thread
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import Place
from s3kv.tiering.tiers.handler import Began, TierHandler, error_kind
from s3kv.tiering.tiers.nvme.files import DiskTier, directory_bytes
from s3kv.tiering.tiers.nvme.report import NvmeReport
from s3kv.tiering.tiers.report import RankReport

log = logging.getLogger("s3kv.transfer")

DISK_THREADS = 2
"""Threads for NVMe reads, and as many again for writes: a slow or hung
disk ties up these, never the ones that decode S3 loads or encode stores,
and writes queued behind slow writes never hold up a read."""


def _log_probe_failure(probe: concurrent.futures.Future[None]) -> None:
    if not probe.cancelled() and probe.exception() is not None:  # reads stay aside
        log.warning("s3kv: NVMe tier: probing page-cache reads failed: %r", probe.exception())


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

    def __init__(
        self,
        files: DiskTier,
        *,
        timeout_s: float = DEFAULTS.disk_timeout_s,
        write_queue_s: float = DEFAULTS.load_timeout_s,
        report: RankReport | None = None,
        counters: Counters | None = None,
        probe_reads: bool = False,
    ) -> None:
        """``probe_reads``: decide how ``files`` reads from the page cache
        (:meth:`DiskTier.probe_reads`) on the disk's own threads: a handler is
        made on vLLM's thread, which a stalled disk must never hold."""
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
        self._failed = False
        """A transfer failed for the disk's sake since the last that went
        well (the breaker's view, which pauses the tier until a probe
        succeeds): no read under a load's lock meanwhile."""
        files.steady = self.steady
        self.probe: concurrent.futures.Future[None] | None = None
        """The probe of page-cache reads under way or done (None: not asked for)."""
        if probe_reads:
            self.probe = self._threads[True].submit(files.probe_reads)
            self.probe.add_done_callback(_log_probe_failure)

    def steady(self) -> bool:
        """Is the disk answering in time: no failure since the last success,
        and no read or write under way on its threads for longer than
        ``timeout_s``? Called on the disk's threads before a read from the
        page cache under a load's lock (:attr:`DiskTier.steady`), so that a
        disk that stalls gets no such read at all."""
        if self._failed:
            return False
        now = self.clock()
        limit = self.timeout_s
        for jobs in self._running.values():
            for job in list(jobs):
                at = job.at
                if at is not None and now - at > limit:
                    return False
        return True

    def failing(self, *, loads: bool = True) -> None:
        self._failed = True
        super().failing(loads=loads)

    def store_codec(self) -> ChunkCodec:
        return self.files.store_codec()

    async def run(self, fn: Callable[..., Any], *args: Any, write: bool = False) -> Any:
        """``fn(*args)`` on the disk's read (or write) threads."""
        return await asyncio.get_running_loop().run_in_executor(
            self._threads[write], functools.partial(fn, *args)
        )

    def _op(self, fn: Callable[..., Any], *args: Any, write: bool = False) -> tuple[Any, Began]:
        """(``fn(*args)`` on the disk's threads, to await; when a thread took it up)."""
        began = Began(self._running[write], self.clock)
        return self.run(began.wrap(fn, *args), write=write), began

    async def read(
        self,
        place: Place,
        key: bytes,
        sink: FrameInto,
        *,
        deadline: float | None = None,
        keep_blob: bool = False,
    ) -> tuple[int, bytes | None]:
        read, began = self._op(self.files.read, key, sink)
        t = self.timeout_s
        n = await self.guard(read, t, load=True, began=began, queue_s=t, deadline=deadline)
        self._failed = False
        return n, None

    async def write(self, place: Place, chunk: ChunkData, start: float | None = None) -> int | None:
        write, began = self._op(self.files.write, chunk.key, chunk, write=True)
        try:
            # Write-through is background work: it may wait for a thread as
            # long as a load may take, then it is dropped (a disk failure
            # only if the threads are stuck).
            n = await self.guard(write, self.timeout_s, load=False, began=began, queue_s=self.write_queue_s)
            self._failed = False
        except StorageFull as e:
            self.counters.add("store_dropped_disk_full")
            log.warning("s3kv: NVMe tier full, chunk not stored there: %s", e)
            with self.report.section(self.tier, NvmeReport) as r:
                r.full = True
            return None
        self.counters.add("store_chunks_disk")
        self.counters.add("store_bytes_disk", n)
        if start is not None:
            self.counters.observe("store_seconds_disk", time.perf_counter() - start)
        with self.report.section(self.tier, NvmeReport) as r:
            r.sizes[chunk.key] = n
        return n

    def read_failed(self, key: bytes, e: Exception, *, last: bool) -> bool:
        """A read that failed for the disk's sake (an error, too slow, no
        thread free) goes on to the next source unless this was the last."""
        if super().read_failed(key, e, last=last):
            return True
        if last:
            return False
        kind = error_kind(e)
        self.counters.add(f"load_errors_{kind}")  # the tier failed us: try the next source
        log.warning("s3kv: %s read of chunk %s failed (%s): %s", self.label, key.hex(), kind, e)
        return True

    async def delete(self, place: Place, key: bytes) -> None:
        await self.run(self.files.delete, key, write=True)

    async def bytes_used(self) -> int:
        return await self.run(directory_bytes, self.files.root)

    def close(self) -> None:
        for threads in self._threads.values():
            threads.shutdown(wait=False, cancel_futures=True)
