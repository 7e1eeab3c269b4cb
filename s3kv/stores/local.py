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
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

from s3kv.errors import AlreadyExists, NotFound, PermissionDenied, StorageFull, Transient
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


def partial_path(path: Path) -> Path:
    """A temporary name beside ``path`` that names its writer's pid, so that a
    later process can tell a dead writer's leftovers from a live one's."""
    return path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:12]}{PARTIAL_SUFFIX}")


def is_stale_partial(path: Path, *, max_age_s: float = 3600.0) -> bool:
    """A ``*.partial`` whose writer is dead (or that is older than ``max_age_s``)."""
    name = path.name
    if not name.endswith(PARTIAL_SUFFIX):
        return False
    try:
        if time.time() - path.stat().st_mtime > max_age_s:
            return True
    except FileNotFoundError:
        return False
    pid_part = name[: -len(PARTIAL_SUFFIX)].rsplit(".", 1)[-1].split("-", 1)[0]
    if not pid_part.isdigit():
        return True
    try:
        os.kill(int(pid_part), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


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
                raise ValueError(f"range start {range.start} is past the end of {key} ({size} bytes)")
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
