"""The NVMe tier's bytes: one file per chunk shard under ``disk_path``.

``{disk_path}/{namespace}/{kk}/{key}.r{shard}`` (the shard's name, as
:func:`s3kv.keys.chunk_path` builds it for S3 too) holds the shard in the
chunk object format, encoded with ``disk_codec`` (by default ``none``: a
disk is read faster than a frame decodes). A chunk promoted from S3 is
written as fetched when the two codecs agree, else re-encoded from its
pages; a file of codec ``none`` is read straight into the KV pages where
the page cache holds it (a read that neither waits for the disk nor starts
I/O: :mod:`~s3kv.tiering.tiers.nvme.residency`), else frame
by frame into a buffer of the read's own, checked there, then copied into
the pages (:meth:`DiskTier.read`).
Files are written to a ``*.partial`` name that carries the writer's pid
namespace and pid, optionally fsync'd, then renamed: a crash never leaves a
half file under a real name, and a later process removes a dead writer's
partials (by pid in its own pid namespace, by age for writers in other
containers). Every read is checked
(identity, layout, per-layer checksums), from a regular file of at most a
chunk's size, never through a symlink; a file that fails is deleted.

The scheduler side rebuilds its index of the directory with :func:`scan` at
start-up, so a restarted replica hits its own disk without S3. The scan trusts
nothing it finds: symlinks, special files, oddly named or unreadable entries
are skipped and counted, never followed and never fatal.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from s3kv import codec as codec_mod
from s3kv.chunk_reader import as_corrupt
from s3kv.errors import CorruptChunk
from s3kv.frame_sinks import FrameInto, SinkFailed
from s3kv.keys import chunk_path, is_namespace_id, is_shard_name, parse_chunk_name
from s3kv.stores.local import PARTIAL_SUFFIX, atomic_write, is_stale_partial, map_os_error
from s3kv.tiering.chunks import ChunkCodec, ChunkData
from s3kv.tiering.placement import Tier
from s3kv.tiering.tiers.nvme.residency import DIRECT_OFF, DirectReads, probe_direct

if TYPE_CHECKING:
    from s3kv.tiering.codec_choice import TierChoice

log = logging.getLogger("s3kv.disk")

LOCK_NAME = ".s3kv.lock"
PROBE_NAME = ".s3kv-probe"


def shard_path(root: Path, namespace: str, key: bytes, shard: int) -> Path:
    """The file of one shard of a chunk under ``root``."""
    return root / chunk_path(namespace, key, shard)


class DiskTier:
    """The directory's chunk files, read and written synchronously (the
    NVMe tier's handler, :class:`~s3kv.tiering.tiers.nvme.handler.NvmeHandler`,
    calls these on threads of its own)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        chunk_codec: ChunkCodec,
        *,
        fsync: bool = False,
        choice: TierChoice | None = None,
        direct: DirectReads | None = None,
    ) -> None:
        self.root = Path(root)
        self.codec = chunk_codec
        self.fsync = fsync
        self.choice = choice
        """``disk_codec: auto``'s choice: files are written in the codec it picks."""
        self.direct = DIRECT_OFF if direct is None else direct
        """Whether a read tries the page cache first under the load's lock,
        without waiting for the device (:func:`preadv_cached`), and whether
        it asks first that the page cache holds the whole file (decided by
        :func:`~s3kv.tiering.tiers.nvme.residency.probe_direct` in
        ``root``); off once the file system said it cannot."""
        if direct is None:
            self.probe_reads()
        self.steady: Callable[[], bool] = _always
        """Whether the disk answers in time now (the handler's view: no read
        or write overdue, no failure since its last success): a read under
        the load's lock is tried only then."""

    def probe_reads(self) -> None:
        """Decide :attr:`direct` by probing ``root`` (a write, an fsync and a
        read: disk I/O, which may stall with the disk; the tier's handler
        runs it on the disk's threads, never on vLLM's). Reads go aside
        until it is done."""
        direct = probe_direct(self.root) if NOWAIT_READS else DIRECT_OFF
        log.info(
            "s3kv: NVMe tier %s: reads from the page cache under the load's lock: %s", self.root, direct.why
        )
        self.direct = direct

    def store_codec(self) -> ChunkCodec:
        """The codec a chunk is written in now."""
        return self.choice.chunk_codec(self.codec) if self.choice is not None else self.codec

    def path(self, key: bytes) -> Path:
        return shard_path(self.root, self.codec.namespace, key, self.codec.rank)

    def _where(self, key: bytes) -> str:
        """``str(self.path(key))``, without pathlib's cost (once a read)."""
        return os.path.join(self.root, chunk_path(self.codec.namespace, key, self.codec.rank))

    def write(self, key: bytes, chunk: ChunkData) -> int:
        blob = chunk.blob_for(chunk.picked.get(Tier.DISK) or self.store_codec())
        path = self.path(key)
        try:
            atomic_write(path, blob, fsync=self.fsync)
        except OSError as e:
            raise map_os_error(e, str(path)) from e
        return len(blob)

    def _open(self, path: str) -> tuple[int, int, bool]:
        """(descriptor, size, whether reads leave its access time alone) of
        a shard's file at ``path``, read only from a regular file at the shard's own
        name: never through a symlink, never blocking on a FIFO.
        CorruptChunk for anything else (a symlink, FIFO or directory there
        is left alone, as the scan leaves it)."""
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            try:
                fd = os.open(path, flags | O_NOATIME)
                noatime = bool(O_NOATIME)
            except PermissionError:  # O_NOATIME: not the file's owner
                fd = os.open(path, flags)
                noatime = False
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CorruptChunk(f"{path}: a symlink where a chunk file belongs (not followed)") from None
            if e.errno == errno.ENXIO:  # a socket
                raise CorruptChunk(f"{path}: not a regular file") from None
            raise map_os_error(e, path) from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptChunk(f"{path}: not a regular file (mode {stat.filemode(st.st_mode)})")
        except BaseException as e:
            os.close(fd)
            if isinstance(e, OSError):
                raise map_os_error(e, path) from e
            raise
        return fd, st.st_size, noatime

    def read(self, key: bytes, sink: FrameInto) -> int:
        """Check and decode the file; one that fails (a newer format's
        included: this s3kv cannot use it) is deleted, so that a bad copy
        costs one failed load.

        A file of codec ``none`` goes to the sink a chunk at a time
        (:meth:`FrameInto.read_chunk_into`, :class:`FileFrames`): what the
        page cache holds in one ``preadv`` that never waits for the device
        (``RWF_NOWAIT``; only while the disk answers in time and, where such
        a read starts I/O, the page cache holds the whole file:
        :meth:`FileFrames.cached`), straight into the frames' destinations (the pages
        on the host, a device's staging buffer), each frame's checksum (or
        MAC) computed there; the rest frame by frame with ``preadv`` into a
        buffer of the read's own (the frame's staging buffer where the
        target has one, else this thread's reused buffer, copied into the
        pages once checked). A read that hangs thus holds no lock the load
        needs, and whatever it reads after its load went on reaches no page
        (:meth:`Gate.read_chunk_into`). Other codecs read the file whole,
        then decode."""
        where = self._where(key)
        fd, size, noatime = self._open(where)  # a symlink or special file there is left alone
        try:
            try:
                if size > self.codec.max_object:  # deleted unread
                    raise CorruptChunk(f"{where}: {size} bytes, more than a chunk's {self.codec.max_object}")
                head = os.pread(fd, min(size, self.codec.max_header + PREFIX_READ), 0)
                header = self.codec.parse_header(head, where)
                self.codec.check(header, key.hex(), where)
                if header.object_length != size:
                    raise CorruptChunk(f"{where}: {size} bytes, its header says {header.object_length}")
                if header.codec != "none":
                    blob = _read_at_most(fd, size)  # from the start: only preads came before
                    try:
                        self.codec.reader.read_frames(header, blob, 0, range(len(header.frames)), sink, where)
                    except SinkFailed as e:  # the sink's own failure, as a read straight in passes it
                        raise e.__cause__ from None  # type: ignore[misc]
                    return size
                for i, f in enumerate(header.frames):
                    if f.length != f.raw_length:
                        raise CorruptChunk(f"{where}: frame {i} stores {f.length} bytes for {f.raw_length}")
                # Without O_NOATIME a read may update the file's access time,
                # and wait for the file system's journal: then nothing is
                # read from the page cache under the load's lock.
                sink.read_chunk_into(
                    FileFrames(self, fd, header, where, cached=noatime and self.direct.nowait)
                )
            except OSError as e:
                raise map_os_error(e, where) from e
            finally:
                os.close(fd)
        except CorruptChunk:
            self.delete(key)
            raise
        return size

    def delete(self, key: bytes) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(key))

    def bytes_used(self) -> int:
        return directory_bytes(self.root)


PREFIX_READ = 64
"""Bytes read past the longest header in the first read (the prefix, the MAC)."""


IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


O_NOATIME = getattr(os, "O_NOATIME", 0)


def _kernel_at_least(major: int, minor: int) -> bool:
    try:
        release = os.uname().release.split(".")
        return (int(release[0]), int(release[1].split("-")[0])) >= (major, minor)
    except (AttributeError, ValueError, IndexError):
        return False


NOWAIT_READS = hasattr(os, "RWF_NOWAIT") and _kernel_at_least(5, 9)
"""Reads from the page cache that never wait for the device: Linux's
``preadv2(RWF_NOWAIT)``, which returns what the page cache holds (a short
read) or EAGAIN. Whether it also starts no I/O depends on the kernel (5.9
to the 2024 readahead change: none; since, readahead of what it lacks), so
a read under a gate's lock first checks that the page cache holds the
whole file (:mod:`~s3kv.tiering.tiers.nvme.residency`).
Earlier kernels and other platforms read every frame as one that may stall."""


def _always() -> bool:
    return True


class FileFrames:
    """The frames of a codec-``none`` file open at ``fd`` whose ``header``
    passed its checks (a :class:`~s3kv.frame_sinks.ChunkFrames`): their
    sizes are the engine's (the header's were checked against them), read
    from the page cache in one pass where ``cached``, else frame by frame."""

    def __init__(
        self, files: DiskTier, fd: int, header: codec_mod.ChunkHeader, where: str, *, cached: bool
    ) -> None:
        self.nbytes = [f.raw_length for f in header.frames]
        self._files = files
        self._fd = fd
        self._header = header
        self._where = where
        self._cached = cached

    def cached(self, buffers: Sequence[np.ndarray]) -> int:
        """The first pass, under the load's lock: nothing is read while the
        disk is not answering in time (:attr:`DiskTier.steady`), nor, where
        a ``RWF_NOWAIT`` read starts I/O for what it lacks, unless the
        page cache holds the whole file just before (one ``cachestat``).

        What remains: pages evicted between that check and the read (the
        microseconds of one system call, in which reclaim must pick exactly
        this file's pages). The read then submits readahead for them, which
        may sleep (the device's request tags when its queue is full, an
        extent block the file system must read). Taken as acceptable: a disk
        that stalls does so first for reads of its own, which leave the tier
        not :attr:`~DiskTier.steady` (overdue, or failed), and no pass runs
        from then on; the lock is held across a stall only where one begins
        within that window. Neither ``RWF_NOWAIT`` (the kernel's no-I/O flag
        is not user space's) nor a read through ``mmap`` (a fault reads the
        page in) can forbid the readahead, so the window is narrowed, not
        closed."""
        if not self._cached or not self._header.frames:
            return 0
        files = self._files
        direct = files.direct
        if not files.steady() or not direct.all_cached(self._fd, self._header.object_length):
            return 0  # everything goes aside, as after an EAGAIN
        got = preadv_cached(self._fd, buffers, self._header.frames[0].offset)
        if got is None:  # this file system (or kernel) cannot: not again
            files.direct = DIRECT_OFF
            self._cached = False
            return 0
        return got

    def read(self, frame: int, out: list[np.ndarray], start: int = 0) -> None:
        f = self._header.frames[frame]
        if preadv_all(self._fd, out, f.offset + start) != f.length - start:
            raise CorruptChunk(f"{self._where}: truncated in frame {frame}")

    def check(self, frame: int, parts: Sequence[np.ndarray]) -> None:
        try:  # checking_bytes(), at no context manager's cost a frame
            codec_mod.check_frame_parts(self._header, frame, parts, self._files.codec.keys)
        except (CorruptChunk, MemoryError):
            raise
        except Exception as e:
            raise as_corrupt(e, self._where) from e


_NOWAIT_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def preadv_cached(fd: int, buffers: Sequence[np.ndarray], offset: int) -> int | None:
    """Fill ``buffers`` from ``fd`` at ``offset`` with what the page cache
    holds, never waiting for the device (``preadv2(RWF_NOWAIT)``, at most
    IOV_MAX buffers a call): the bytes read, from none (EAGAIN) to all;
    None where the file system or kernel cannot read so."""
    total = 0
    for at in range(0, len(buffers), IOV_MAX):
        batch = buffers[at : at + IOV_MAX]
        try:
            n = os.preadv(fd, batch, offset + total, os.RWF_NOWAIT)  # type: ignore[arg-type]
        except BlockingIOError:  # EAGAIN: not (all) in the page cache
            return total
        except NotImplementedError:  # a Python built without preadv2
            return None if total == 0 else total
        except OSError as e:
            if e.errno in _NOWAIT_UNSUPPORTED:
                return None if total == 0 else total
            raise
        total += n
        if n < sum(b.nbytes for b in batch):
            break
    return total


def preadv_all(fd: int, buffers: list[np.ndarray], offset: int) -> int:
    """Fill ``buffers`` from ``fd`` at ``offset`` with preadv (at most
    IOV_MAX at a time, short reads continued); the bytes read, fewer only
    at the file's end."""
    total = 0
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        n = os.preadv(fd, views[:IOV_MAX], offset + total)
        if n == 0:
            break
        total += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if n:
            views[0] = views[0][n:]
    return total


def _read_at_most(fd: int, limit: int) -> bytes:
    """Up to ``limit`` bytes from ``fd``, to its end."""
    parts: list[bytes] = []
    left = limit
    while left > 0:
        part = os.read(fd, min(left, 1 << 24))
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def directory_bytes(root: Path) -> int:
    """Bytes of every file under ``root`` (partials included: they take space
    too). Symlinks are not followed; what cannot be read counts as nothing."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


# Why scan left an entry alone (the keys of ScanResult.skipped_reasons).
SKIP_SYMLINK = "symlink"
SKIP_SPECIAL = "special file"
"""A FIFO, socket or device where a chunk file belongs."""
SKIP_STRAY_FILE = "stray file"
"""A file where only directories belong (the top level, a namespace)."""
SKIP_UNKNOWN_DIR = "unknown directory"
"""A directory not named as a namespace (32 hex) or shard (2 hex) directory
is, or one inside a shard directory."""
SKIP_NOT_CHUNK = "not a chunk file"
"""A file in a shard directory not named ``{key}.r{shard}`` for that directory."""
SKIP_UNREADABLE = "unreadable"
"""A directory that cannot be listed or an entry that cannot be stat'ed."""
SKIP_VANISHED = "vanished"
"""Listed, then gone before it was looked at."""
SKIP_PARTIAL_KEPT = "stale partial not removable"
"""A stale partial that could not be deleted (another user's directory)."""


@dataclass
class ScanResult:
    chunks: list[tuple[bytes, int, float]] = field(default_factory=list)
    """(key, bytes of all its shard files, newest mtime) of complete chunks of
    the namespace (a file of every shard), oldest first."""
    other: list[tuple[str, int, float]] = field(default_factory=list)
    """(path relative to the root, bytes, mtime) of every other chunk file:
    other namespaces, chunks missing a shard, shards a chunk of the namespace
    does not have. They count against the capacity
    and are evicted first-come by age."""
    removed_partials: int = 0
    skipped: int = 0
    """Entries that are neither chunk files nor s3kv's own (symlinks, special
    or oddly named files, unknown directories, what could not be read): left
    alone, not indexed and not counted against the capacity."""
    skipped_reasons: dict[str, int] = field(default_factory=dict)
    """``skipped`` by reason (the ``SKIP_*`` values)."""
    root_error: str | None = None
    """Why the directory itself could not be listed (then nothing was found)."""

    def skip(self, reason: str) -> None:
        self.skipped += 1
        self.skipped_reasons[reason] = self.skipped_reasons.get(reason, 0) + 1


def scan(root: Path, namespace: str, shards: int) -> ScanResult:
    """What the directory holds, for the scheduler's index (a chunk of
    ``namespace`` is whole with a file of each of its ``shards``, whichever
    rank wrote it); removes the
    partial files of writers that are gone. Never raises for what it finds:
    an entry it cannot use or read is skipped and counted, and symlinks are
    never followed (the root itself may be one)."""
    result = ScanResult()
    found: dict[bytes, dict[int, tuple[str, int, float]]] = defaultdict(dict)
    now_s = time.time()
    try:
        top = _list_dir(root)
    except FileNotFoundError:
        return result
    except OSError as e:
        result.root_error = f"{type(e).__name__}: {e}"
        return result
    for ns_entry in top:
        st = _lstat(ns_entry.path, result)
        if st is None:
            continue
        if not stat.S_ISDIR(st.st_mode):
            _top_level_file(ns_entry, st, now_s, result)
            continue
        if not is_namespace_id(ns_entry.name):
            result.skip(SKIP_UNKNOWN_DIR)
            continue
        for shard in _entries(ns_entry.path, result):
            st = _lstat(shard.path, result)
            if st is None:
                continue
            if not stat.S_ISDIR(st.st_mode):
                result.skip(_kind_reason(st.st_mode, SKIP_STRAY_FILE))
                continue
            if not is_shard_name(shard.name):
                result.skip(SKIP_UNKNOWN_DIR)
                continue
            for f in _entries(shard.path, result):
                st = _lstat(f.path, result)
                if st is None:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    result.skip(_kind_reason(st.st_mode, SKIP_SPECIAL))
                    continue
                if f.name.endswith(PARTIAL_SUFFIX):
                    _clean_partial(f.path, st, now_s, result)
                    continue
                parsed = parse_chunk_name(f.name, shard.name)
                if parsed is None:
                    result.skip(SKIP_NOT_CHUNK)
                    continue
                key, index = parsed  # the shard's index
                entry = (os.path.relpath(f.path, root), st.st_size, st.st_mtime)
                if ns_entry.name == namespace and index < shards:
                    found[key][index] = entry
                else:
                    result.other.append(entry)
    for key, by_shard in found.items():
        if len(by_shard) == shards:
            result.chunks.append(
                (key, sum(e[1] for e in by_shard.values()), max(e[2] for e in by_shard.values()))
            )
        else:
            result.other.extend(by_shard.values())
    result.chunks.sort(key=lambda c: c[2])
    result.other.sort(key=lambda c: c[2])
    return result


def _list_dir(path: str | os.PathLike[str]) -> list[os.DirEntry[str]]:
    with os.scandir(path) as it:
        return list(it)


def _entries(path: str, result: ScanResult) -> list[os.DirEntry[str]]:
    try:
        return _list_dir(path)
    except FileNotFoundError:
        result.skip(SKIP_VANISHED)
    except OSError:
        result.skip(SKIP_UNREADABLE)
    return []


def _lstat(path: str, result: ScanResult) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        result.skip(SKIP_VANISHED)
    except OSError:
        result.skip(SKIP_UNREADABLE)
    return None


def _kind_reason(mode: int, regular: str) -> str:
    """Why an entry of this mode is skipped where it is not wanted; ``regular``
    for a regular file."""
    if stat.S_ISLNK(mode):
        return SKIP_SYMLINK
    if stat.S_ISDIR(mode):
        return SKIP_UNKNOWN_DIR
    if stat.S_ISREG(mode):
        return regular
    return SKIP_SPECIAL


def _top_level_file(entry: os.DirEntry[str], st: os.stat_result, now_s: float, result: ScanResult) -> None:
    """s3kv's own files at the top level are left alone (the lock, a probe a
    crash left) or cleaned (the probe's partials); anything else is skipped."""
    name = entry.name
    if stat.S_ISREG(st.st_mode):
        if name in (LOCK_NAME, PROBE_NAME):
            return
        if name.startswith(f".{PROBE_NAME}.") and name.endswith(PARTIAL_SUFFIX):
            _clean_partial(entry.path, st, now_s, result)
            return
    result.skip(_kind_reason(st.st_mode, SKIP_STRAY_FILE))


def _clean_partial(path: str, st: os.stat_result, now_s: float, result: ScanResult) -> None:
    if not is_stale_partial(os.path.basename(path), st.st_mtime, now_s=now_s):
        return
    try:
        os.unlink(path)
    except FileNotFoundError:  # published or removed meanwhile
        return
    except OSError:
        result.skip(SKIP_PARTIAL_KEPT)
        return
    result.removed_partials += 1


def delete_chunk(root: Path, namespace: str, key: bytes, shards: int) -> None:
    """Remove every shard's file of a chunk (the scheduler evicts whole chunks)."""
    for shard in range(shards):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(shard_path(root, namespace, key, shard))


def delete_file(root: Path, rel: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(root / rel)


def check_writable(root: Path) -> None:
    """Create ``root`` and prove a file can be published in it. Raises OSError."""
    root.mkdir(parents=True, exist_ok=True)
    probe = root / PROBE_NAME
    atomic_write(probe, b"ok")
    os.unlink(probe)


def try_lock(root: Path) -> int | None:
    """Take the directory's advisory lock; the fd to keep, or None if another
    live engine holds it."""
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def free_bytes(root: Path) -> int:
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize
