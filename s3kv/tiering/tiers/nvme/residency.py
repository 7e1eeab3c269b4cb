"""Whether a file's pages are all in the page cache, asked without starting
I/O, and the start-up probe that decides, per NVMe tier, whether its reads
from the page cache need that question asked first.

A read under a load's gate lock (:meth:`Gate.read_chunk_into`'s first pass)
must never wait on the device: :meth:`Gate.close` runs on the engine's loop
and waits for that lock. ``preadv2(RWF_NOWAIT)`` promises only not to
*wait* for I/O: on kernels that read ahead for a ``RWF_NOWAIT`` read (the
2024 change "allow read-ahead with IOCB_NOWAIT set"; this machine's 6.18
does) a read of evicted pages returns EAGAIN and yet submits readahead
first, and submitting may sleep (the block layer's tags of a device that
hangs, the file system's metadata reads). :func:`probe_direct` tells the
two kinds of kernel apart in the tier's own directory; where reads start
I/O, a read goes under the lock only after :class:`Residency` said the
page cache holds its whole file.

Weighed: ``cachestat`` (Linux 6.5+, through ctypes: no binding in the
standard library or a kept package for it) counts the cached pages of a
range in one call that never touches the device; ``mincore`` over a
read-only ``mmap`` of the file (also ctypes: Python's :mod:`mmap` has no
mincore) does the same on older kernels, mapping and unmapping the file
each time. Neither starts I/O, nor takes a page's lock."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from s3kv.stores.local import partial_path

log = logging.getLogger("s3kv.disk")

PAGE = mmap.PAGESIZE

ResidentPages = Callable[[int, int], "int | None"]
"""``(fd, size)``: how many pages of the file's first ``size`` bytes the
page cache holds, asked without starting I/O; None where this check cannot
be made here (the kernel or the platform lacks it)."""


def pages_of(size: int) -> int:
    return -(-size // PAGE)


_CACHESTAT_NR = {"x86_64": 451, "amd64": 451, "aarch64": 451, "arm64": 451}
"""``cachestat``'s syscall number: 451 in x86_64's table and in the generic
one (aarch64's, ``asm-generic/unistd.h``); other machines are not asked."""


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [
        ("nr_cache", ctypes.c_uint64),
        ("nr_dirty", ctypes.c_uint64),
        ("nr_writeback", ctypes.c_uint64),
        ("nr_evicted", ctypes.c_uint64),
        ("nr_recently_evicted", ctypes.c_uint64),
    ]


def _libc() -> ctypes.CDLL | None:
    """The C library, its functions called holding the GIL (``PyDLL``): each
    call is a system call that returns at once, and letting the GIL go
    around it costs a wait to take it back from a busy thread (measured,
    cachestat of a 2 MiB file beside a thread running Python: 1.7 µs a
    call holding it, 8.9 µs with ``CDLL``)."""
    try:
        return ctypes.PyDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


def _cachestat_fn() -> ResidentPages | None:
    """``cachestat(2)`` as a :data:`ResidentPages`, or None where this
    platform has no such call to make."""
    nr = _CACHESTAT_NR.get(platform.machine().lower())
    if _LIBC is None or nr is None or not hasattr(_LIBC, "syscall"):
        return None
    syscall = _LIBC.syscall
    syscall.restype = ctypes.c_long
    number = ctypes.c_long(nr)
    zero = ctypes.c_uint(0)

    def cachestat(fd: int, size: int) -> int | None:
        rng = _CachestatRange(0, size)
        out = _Cachestat()
        if syscall(number, ctypes.c_uint(fd), ctypes.byref(rng), ctypes.byref(out), zero) != 0:
            e = ctypes.get_errno()
            if e in (errno.ENOSYS, errno.EPERM):  # an older kernel, or a seccomp filter
                return None
            raise OSError(e, os.strerror(e))
        return int(out.nr_cache)

    return cachestat


def _mincore_fn() -> ResidentPages | None:
    """``mincore(2)`` over a read-only shared ``mmap`` of the file, as a
    :data:`ResidentPages` (a page counts once it is up to date)."""
    if _LIBC is None or not all(hasattr(_LIBC, f) for f in ("mmap", "munmap", "mincore")):
        return None
    c_mmap, c_munmap, c_mincore = _LIBC.mmap, _LIBC.munmap, _LIBC.mincore
    c_mmap.restype = ctypes.c_void_p
    c_mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    c_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    c_mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    failed = ctypes.c_void_p(-1).value

    def mincore(fd: int, size: int) -> int | None:
        if size <= 0:
            return 0
        addr = c_mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == failed:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        try:
            vec = ctypes.create_string_buffer(pages_of(size))
            if c_mincore(addr, size, vec) != 0:
                e = ctypes.get_errno()
                if e in (errno.ENOSYS, errno.EPERM):
                    return None
                raise OSError(e, os.strerror(e))
            raw = vec.raw
            return len(raw) - raw.count(0)
        finally:
            c_munmap(addr, size)

    return mincore


def resident_pages_fn(fd: int) -> ResidentPages | None:
    """The cheapest residency check that works on ``fd`` here: cachestat,
    else mincore; None if neither does."""
    size = os.fstat(fd).st_size
    for make in (_cachestat_fn, _mincore_fn):
        fn = make()
        if fn is None:
            continue
        try:
            if fn(fd, size) is not None:
                return fn
        except OSError:
            continue
    return None


@dataclass(frozen=True)
class DirectReads:
    """How a tier reads from the page cache under a load's gate lock.

    ``nowait``: a ``RWF_NOWAIT`` read may run there at all (off: every
    frame is read aside, as where the file system refuses the flag).
    ``resident``: the check that a file's pages are all cached, asked just
    before each such read (:meth:`all_cached`), which reads only a file the
    page cache holds whole: ``RWF_NOWAIT`` may start readahead (it does on
    this machine's kernel, 6.18), and where it does not, a read that meets a
    readahead marker may; None only in tests, where no check is made."""

    nowait: bool
    resident: ResidentPages | None = None
    why: str = ""

    def all_cached(self, fd: int, size: int) -> bool:
        """May a ``RWF_NOWAIT`` read of this file (of ``size`` bytes) run
        under the lock: True without a check, else only when every page of
        the file is cached. The whole file, not only the range read: a read
        that meets a readahead marker starts readahead of the pages after
        it, and finds none to read only when all of them are there up to
        the file's end."""
        if self.resident is None:
            return True
        try:
            n = self.resident(fd, size)
        except OSError:
            return False
        return n is not None and n >= pages_of(size)


DIRECT_OFF = DirectReads(False, why="off")

PROBE_BYTES = 64 * PAGE
"""The probe file's size: room for the kernel's readahead to show."""


def probe_direct(
    root: Path,
    *,
    preadv: Callable[..., int] = os.preadv,
    resident: ResidentPages | None | bool = True,
) -> DirectReads:
    """Decide, in ``root`` (the tier's directory), how reads from the page
    cache run under a gate's lock: write a probe file, fsync it, drop its
    pages (``POSIX_FADV_DONTNEED``), read one page with ``RWF_NOWAIT``
    (``preadv``), then count its cached pages (``resident``; True: the
    cheapest check that works here; the ``why`` says whether that read
    started I/O). Every read under the lock asks the check first, either
    way. Without a residency check, or where the flag is refused or the
    probe cannot be made, reads go aside (:data:`DIRECT_OFF`)."""
    if not hasattr(os, "RWF_NOWAIT"):
        return DIRECT_OFF
    path = partial_path(root / ".s3kv-probe")  # a crash leaves a partial the scan removes
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as e:
        log.info("s3kv: %s: no probe of page-cache reads (%s); every NVMe read goes aside", root, e)
        return DIRECT_OFF
    try:
        os.write(fd, b"\xa5" * PROBE_BYTES)
        os.fsync(fd)
        check = resident_pages_fn(fd) if resident is True else resident
        if not callable(check):
            return DIRECT_OFF
        os.posix_fadvise(fd, 0, PROBE_BYTES, os.POSIX_FADV_DONTNEED)
        before = check(fd, PROBE_BYTES)
        if before is None:
            return DIRECT_OFF
        try:
            got = preadv(fd, [bytearray(PAGE)], 0, os.RWF_NOWAIT)
        except BlockingIOError:
            got = 0
        except (NotImplementedError, OSError) as e:
            if isinstance(e, NotImplementedError) or e.errno in (
                errno.EOPNOTSUPP,
                errno.ENOSYS,
                errno.EINVAL,
            ):
                return DIRECT_OFF  # tmpfs: the flag is refused
            raise
        if before:
            return DirectReads(True, check, "the probe's pages stayed cached")
        if got:
            return DirectReads(True, check, "NOWAIT read evicted pages")
        after = check(fd, PROBE_BYTES)
        if after is None:
            return DIRECT_OFF
        # Checked either way: where this read started no I/O, a read that
        # meets a readahead marker on a cached page may still start
        # readahead of the pages after it (not verified on older kernels);
        # the check costs ~5 µs a chunk.
        return DirectReads(True, check, "NOWAIT starts readahead" if after else "no readahead seen")
    except OSError as e:
        log.info("s3kv: %s: probe of page-cache reads failed (%s); every NVMe read goes aside", root, e)
        return DIRECT_OFF
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
