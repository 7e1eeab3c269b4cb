"""A store in a local directory: one file per object.

Writes go to a ``*.partial`` temporary beside the target and are published
by ``os.link`` (CREATE: fails if the name exists) or ``os.replace``
(OVERWRITE), so a reader never sees a half-written object under a real name,
even after a crash. Blocking file I/O runs in threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import hashlib
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

from s3kv.errors import AlreadyExists, NotFound, PermissionDenied, RangeNotSatisfiable, StorageFull, Transient
from s3kv.stores.base import ByteRange, ObjectMeta, ObjectStore, PutMode, Update, check_key

PARTIAL_SUFFIX = ".partial"


def map_os_error(e: OSError, key: str) -> Exception:
    """The one place where file-system errors become s3kv errors."""
    if isinstance(e, FileNotFoundError):
        return NotFound(key)
    if isinstance(e, FileExistsError):
        return AlreadyExists(key)
    if isinstance(e, PermissionError):
        return PermissionDenied(f"{key}: {e}")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFull(f"{key}: {e}")
    return Transient(f"{key}: {e}")


OWN_PARTIAL_MAX_AGE_S = 3600.0
"""A partial of a writer in this pid namespace is stale once its pid is dead,
or past this age whatever the pid says (pids are reused)."""

FOREIGN_PARTIAL_MAX_AGE_S = 900.0
"""A partial of a writer in another pid namespace or on another host (another
container sharing the directory), or with an old-style name that does not say
which, is stale past this age: its pid means nothing here. A chunk file is
written in well under a minute."""

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_PID_NAMESPACE = Path("/proc/self/ns/pid")
_MAX_PID = 2**31 - 1


@functools.cache
def writer_namespace() -> str:
    """12 hex characters naming the pid namespace this process runs in: the
    boot id of its host and the namespace's inode, or the host name where
    /proc does not say. Two writers whose pids mean the same thing have equal
    values; a writer in another container or on another host a different one."""
    parts = []
    with contextlib.suppress(OSError):
        parts.append(_BOOT_ID.read_text().strip())
    with contextlib.suppress(OSError):
        st = os.stat(_PID_NAMESPACE)
        parts.append(f"pidns:{st.st_dev}:{st.st_ino}")
    if len(parts) < 2:
        parts.append(f"host:{socket.gethostname()}")
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=6).hexdigest()


def partial_path(path: Path) -> Path:
    """A temporary name beside ``path``: ``.{name}.{writer}-{pid}-{nonce}.partial``,
    naming its writer's pid namespace and pid, so that a later process can
    tell a dead writer's leftovers from a live one's."""
    tag = f"{writer_namespace()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    return path.with_name(f".{path.name}.{tag}{PARTIAL_SUFFIX}")


def partial_writer(name: str) -> tuple[str | None, int] | None:
    """(writer namespace, pid) that a partial's file name names; the namespace
    is None in an old-style name (``.{name}.{pid}-{nonce}.partial``, written
    before names carried it). None when the name names no writer."""
    if not name.endswith(PARTIAL_SUFFIX):
        return None
    fields = name[: -len(PARTIAL_SUFFIX)].rsplit(".", 1)[-1].split("-")
    if len(fields) == 3:
        writer, pid, _nonce = fields
        if len(writer) != 12 or not _is_lower_hex(writer):
            return None
    elif len(fields) == 2:
        writer, (pid, _nonce) = None, fields
    else:
        return None
    if not (pid.isascii() and pid.isdigit()) or not 0 < int(pid) <= _MAX_PID:
        return None
    return writer, int(pid)


def is_stale_partial(
    name: str,
    mtime_s: float,
    *,
    now_s: float | None = None,
    max_age_s: float = OWN_PARTIAL_MAX_AGE_S,
    foreign_max_age_s: float = FOREIGN_PARTIAL_MAX_AGE_S,
) -> bool:
    """Whether the ``*.partial`` file ``name``, last modified at ``mtime_s``,
    is a leftover to remove. A partial of this pid namespace is stale once its
    writer's pid is dead here or it is older than ``max_age_s``; any other one
    (another container, another host, an old-style name) only by age, past
    ``foreign_max_age_s``; a name that names no writer at once. An mtime as
    far in the future counts as old: no live writer set it."""
    if not name.endswith(PARTIAL_SUFFIX):
        return False
    writer = partial_writer(name)
    if writer is None:
        return True
    age_s = abs((time.time() if now_s is None else now_s) - mtime_s)
    namespace, pid = writer
    if namespace != writer_namespace():
        return age_s > min(foreign_max_age_s, max_age_s)
    return age_s > max_age_s or not _pid_alive(pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive under another user
        return True
    return True


def _is_lower_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(
    path: Path, data: bytes | memoryview, *, fsync: bool = False, exclusive: bool = False
) -> None:
    """Write ``data`` to a temporary beside ``path`` and publish it by
    ``os.link`` (``exclusive``: FileExistsError if the name exists) or
    ``os.replace``. A crash at any point leaves no partial file under
    ``path``. Raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        if exclusive:
            os.link(tmp, path)
        else:
            os.replace(tmp, path)
        if fsync:
            fsync_dir(path.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


class LocalStore(ObjectStore):
    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _put_sync(self, key: str, data: bytes | memoryview, mode: PutMode) -> None:
        path = self._path(key)
        if path.name.endswith(PARTIAL_SUFFIX):
            raise ValueError(f"invalid object key {key!r}: {PARTIAL_SUFFIX} is reserved")
        atomic_write(path, data, fsync=self.fsync, exclusive=mode is PutMode.CREATE)

    async def put(
        self, key: str, data: bytes | memoryview, *, mode: PutMode | Update = PutMode.OVERWRITE
    ) -> str | None:
        if isinstance(mode, Update):
            raise NotImplementedError("LocalStore has no conditional updates")
        try:
            await asyncio.to_thread(self._put_sync, key, data, mode)
        except OSError as e:
            raise map_os_error(e, key) from e
        return None

    def _get_sync(self, key: str, range: ByteRange | None) -> bytes:
        with open(self._path(key), "rb") as f:
            if range is None:
                return f.read()
            size = os.fstat(f.fileno()).st_size
            if range.start >= size and size:
                raise RangeNotSatisfiable(
                    f"range start {range.start} is past the end of {key} ({size} bytes)"
                )
            f.seek(range.start)
            return f.read(-1 if range.end is None else range.end - range.start)

    async def get(self, key: str, range: ByteRange | None = None) -> bytes:
        try:
            return await asyncio.to_thread(self._get_sync, key, range)
        except IsADirectoryError as e:
            raise NotFound(key) from e
        except OSError as e:
            raise map_os_error(e, key) from e

    async def head(self, key: str) -> ObjectMeta:
        try:
            st = await asyncio.to_thread(os.stat, self._path(key))
        except OSError as e:
            raise map_os_error(e, key) from e
        if not os.path.isfile(self._path(key)):
            raise NotFound(key)
        return ObjectMeta(key, st.st_size, st.st_mtime)

    def _list_sync(self, prefix: str, start_after: str | None) -> list[ObjectMeta]:
        # Walk only the deepest directory the prefix names, then sort whole keys:
        # per-directory order is not the lexicographic order of full keys.
        base_dir = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = self.root / base_dir if base_dir else self.root
        found: list[ObjectMeta] = []
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                if name.endswith(PARTIAL_SUFFIX):
                    continue
                full = os.path.join(dirpath, name)
                key = os.path.relpath(full, self.root).replace(os.sep, "/")
                if not key.startswith(prefix) or (start_after is not None and key <= start_after):
                    continue
                try:
                    st = os.stat(full)
                except FileNotFoundError:
                    continue
                found.append(ObjectMeta(key, st.st_size, st.st_mtime))
        found.sort(key=lambda m: m.key)
        return found

    async def list(self, prefix: str = "", *, start_after: str | None = None) -> AsyncIterator[ObjectMeta]:
        for meta in await asyncio.to_thread(self._list_sync, prefix, start_after):
            yield meta

    def _delete_sync(self, keys: list[str]) -> None:
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(key))

    async def delete_many(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        try:
            await asyncio.to_thread(self._delete_sync, keys)
        except OSError as e:
            raise map_os_error(e, ",".join(keys[:3])) from e
