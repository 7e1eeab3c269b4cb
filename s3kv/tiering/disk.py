"""The NVMe tier's bytes: one file per chunk shard under ``disk_path``.

``{disk_path}/{namespace}/{kk}/{key}.r{rank}`` holds exactly the bytes of the
S3 object of that shard (so a chunk from S3 is promoted by writing what was
fetched, and a new chunk is encoded once for both). Files are written to a
``*.partial`` name that carries the writer's pid namespace and pid,
optionally fsync'd, then renamed: a crash never leaves a half file under a
real name, and a later process removes a dead writer's partials (by pid in
its own pid namespace, by age for writers in other containers). Every read is checked (identity,
layout, per-layer checksums); a file that fails is deleted.

The scheduler side rebuilds its index of the directory with :func:`scan` at
start-up, so a restarted replica hits its own disk without S3.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from s3kv.errors import CorruptChunk
from s3kv.keys import KEY_BYTES
from s3kv.stores.local import PARTIAL_SUFFIX, atomic_write, is_stale_partial, map_os_error
from s3kv.tiering.chunks import ChunkCodec, ChunkData, FrameSink
from s3kv.tiering.placement import Tier
from s3kv.tiering.tier import TierStorage

log = logging.getLogger("s3kv.disk")

LOCK_NAME = ".s3kv.lock"


def shard_path(root: Path, namespace: str, key: bytes, rank: int) -> Path:
    hexkey = key.hex()
    return root / namespace / hexkey[:2] / f"{hexkey}.r{rank}"


class DiskTier(TierStorage):
    tier = Tier.DISK

    def __init__(self, root: str | os.PathLike[str], chunk_codec: ChunkCodec, *, fsync: bool = False) -> None:
        self.root = Path(root)
        self.codec = chunk_codec
        self.fsync = fsync

    def path(self, key: bytes) -> Path:
        return shard_path(self.root, self.codec.namespace, key, self.codec.rank)

    def write(self, key: bytes, chunk: ChunkData, slot: int | None = None) -> int:
        blob = chunk.blob
        path = self.path(key)
        try:
            atomic_write(path, blob, fsync=self.fsync)
        except OSError as e:
            raise map_os_error(e, str(path)) from e
        return len(blob)

    def read_blob(self, key: bytes) -> bytes:
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise map_os_error(e, str(path)) from e

    def read(self, key: bytes, sink: FrameSink, slot: int | None = None) -> int:
        blob = self.read_blob(key)
        try:
            self.codec.decode(key, blob, sink, str(self.path(key)))
        except CorruptChunk:
            self.delete(key)
            raise
        return len(blob)

    def delete(self, key: bytes, slot: int | None = None) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(key))

    def bytes_used(self) -> int:
        return directory_bytes(self.root)


def directory_bytes(root: Path) -> int:
    """Bytes of every file under ``root`` (partials included: they take space too)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(dirpath, name)).st_size
    return total


@dataclass
class ScanResult:
    chunks: list[tuple[bytes, int, float]] = field(default_factory=list)
    """(key, bytes of all its rank files, newest mtime) of complete chunks of the
    namespace, oldest first."""
    other: list[tuple[str, int, float]] = field(default_factory=list)
    """(path relative to the root, bytes, mtime) of every other chunk file:
    other namespaces, chunks missing a rank. They count against the capacity
    and are evicted first-come by age."""
    removed_partials: int = 0


def scan(root: Path, namespace: str, world_size: int) -> ScanResult:
    """What the directory holds, for the scheduler's index; removes the
    partial files of writers that are gone."""
    result = ScanResult()
    ranks: dict[bytes, dict[int, tuple[str, int, float]]] = defaultdict(dict)
    if not root.is_dir():
        return result
    for ns_entry in os.scandir(root):
        if not ns_entry.is_dir(follow_symlinks=False) or len(ns_entry.name) != 32:
            continue
        for shard in os.scandir(ns_entry.path):
            if not shard.is_dir(follow_symlinks=False):
                continue
            for f in os.scandir(shard.path):
                if f.name.endswith(PARTIAL_SUFFIX):
                    try:
                        mtime_s = f.stat(follow_symlinks=False).st_mtime
                    except FileNotFoundError:
                        continue
                    if is_stale_partial(f.name, mtime_s):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(f.path)
                            result.removed_partials += 1
                    continue
                hexkey, dot, rank = f.name.partition(".r")
                if not dot or len(hexkey) != 2 * KEY_BYTES or not rank.isdigit():
                    continue
                try:
                    st = f.stat(follow_symlinks=False)
                    key = bytes.fromhex(hexkey)
                except (FileNotFoundError, ValueError):
                    continue
                rel = os.path.relpath(f.path, root)
                entry = (rel, st.st_size, st.st_mtime)
                if ns_entry.name == namespace and int(rank) < world_size:
                    ranks[key][int(rank)] = entry
                else:
                    result.other.append(entry)
    for key, by_rank in ranks.items():
        if len(by_rank) == world_size:
            result.chunks.append(
                (key, sum(e[1] for e in by_rank.values()), max(e[2] for e in by_rank.values()))
            )
        else:
            result.other.extend(by_rank.values())
    result.chunks.sort(key=lambda c: c[2])
    result.other.sort(key=lambda c: c[2])
    return result


def delete_chunk(root: Path, namespace: str, key: bytes, world_size: int) -> None:
    """Remove every rank's file of a chunk (the scheduler evicts whole chunks)."""
    for rank in range(world_size):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(shard_path(root, namespace, key, rank))


def delete_file(root: Path, rel: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(root / rel)


def check_writable(root: Path) -> None:
    """Create ``root`` and prove a file can be published in it. Raises OSError."""
    root.mkdir(parents=True, exist_ok=True)
    probe = root / ".s3kv-probe"
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
