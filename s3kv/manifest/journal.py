"""The last stores of a replica that vLLM kills: a local journal that the
process which outlives the engine publishes.

vLLM's default stop (``--shutdown-timeout 0``) sends the engine-core process
SIGTERM and kills its whole process tree at once: no s3kv code runs in it
after the signal, so the chunk objects it completed since its rank's last
segment (up to ``manifest_publish_s`` of them) would be invisible to the
fleet. The process that started the engine (``vllm serve``'s API server, or
the program that made an ``LLM``) is not in that tree and exits normally
after it, so:

- in that *front-end* process, s3kv's vLLM plugin makes a journal directory
  and names it in ``S3KV_JOURNAL_DIR``, which the engine's processes
  inherit (:func:`start_front_end`);
- each rank notes in its journal every chunk PUT as it starts, and each
  fingerprint of an object it created as the PUT returns (17 bytes a
  record, no fsync: the page cache outlives the process), and how many of
  those it has published after each segment (:class:`RankJournal`);
- when the front end exits, it publishes what the journals hold beyond what
  was published, as segments of the rank's writer id with ``j`` appended,
  within the rank's ``shutdown_flush_s`` (:func:`recover`, run in a fresh
  interpreter). A PUT that started but whose answer never came may have
  created its object all the same (S3 committed it as the process died):
  each such object is read (its header, checked like a 412's: identity,
  length and, with the fleet secret, MAC) and published if it is sound.

A replica that stops cleanly (the drain stop, ``LLM`` shut down) publishes
everything itself and removes its journal, so the front end has nothing to
do; what it could not publish within ``shutdown_flush_s`` (a slow S3) stays
in the journal, behind the count of what its segments name. A SIGKILL of the whole replica (its front end too, a node lost) leaves
the journal unread: ``s3kv gc``'s compaction publishes those objects.

This module imports only the standard library until :func:`recover` runs:
the plugin imports it in every vLLM process.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import struct
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from s3kv.config import DEFAULTS, KNOWN_KEYS

if TYPE_CHECKING:
    from s3kv.auth import FleetKeys
    from s3kv.config import S3KVConfig

log = logging.getLogger("s3kv.manifest")

ENV_VAR = "S3KV_JOURNAL_DIR"
_RECORD = struct.Struct("<c16s")
"""b"I" + a chunk key: its PUT is starting; b"S" + a fingerprint (8 bytes,
then 8 zero bytes): the PUT created the object; b"N" + a chunk key: the PUT
was answered without creating it (a 412: the object in the way is
another's to publish, and may be one the fleet was told is bad)."""
_started = False


def start_front_end() -> Path | None:
    """In the process that starts vLLM's engine (not one of its children):
    make a journal directory for the engine's ranks and publish what they
    leave in it when this process exits. Idempotent; None elsewhere."""
    global _started
    import multiprocessing

    if _started or multiprocessing.parent_process() is not None:
        return None
    _started = True
    directory = Path(tempfile.mkdtemp(prefix="s3kv-journal-"))
    os.environ[ENV_VAR] = str(directory)
    atexit.register(_recover_at_exit, directory)
    return directory


def _recover_at_exit(directory: Path) -> None:
    """At this process's exit: publish what the journals hold, in a fresh
    interpreter (an exiting one refuses new executor work, which asyncio's
    DNS lookups need), within the ranks' ``shutdown_flush_s``."""
    import subprocess
    import sys

    budget = 0.0
    for info_path in directory.glob("*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            fps, unanswered, _ = _unpublished(directory, info_path.stem)
            if fps or unanswered:
                info = json.loads(info_path.read_text())
                budget = max(
                    budget, float(info["config"].get("shutdown_flush_s") or DEFAULTS.shutdown_flush_s)
                )
    if budget:
        try:
            subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import sys; from s3kv.manifest.journal import main; main(sys.argv[1])",
                    str(directory),
                ],
                timeout=budget + 10,  # the interpreter's start, then the publish's own bound
                check=False,
            )
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("s3kv: could not publish the engine's last stores at exit: %r", e)
    shutil.rmtree(directory, ignore_errors=True)


def recorded_config(config: S3KVConfig, keys: FleetKeys | None) -> dict[str, Any]:
    """The connector config as a rank's journal records it for the front
    end's replay: every key, but ``auth_key_file`` only when ``keys`` were
    read from it. A value that was never read as a file may be the fleet
    secret itself, pasted there by mistake (with ``S3KV_AUTH_KEY`` set, the
    file is not read at all), and no file s3kv writes holds one. The replay
    runs in the front end, whose environment the engine inherited, so keys
    from ``S3KV_AUTH_KEY`` load there as they did in the rank."""
    recorded = {k: getattr(config, k) for k in KNOWN_KEYS}
    recorded["auth_key_file"] = keys.key_file if keys is not None else None
    return recorded


class RankJournal:
    """One rank publisher's journal: ``{writer}.json`` (how to publish: the
    connector config as :func:`recorded_config` gives it, the manifest base,
    rank and ranks among the ranks that publish, the shards whose objects
    it writes; no secrets),
    ``{writer}.fps`` (the fingerprints stored, appended) and ``{writer}.done``
    (how many of them are published, and the last stamp used)."""

    def __init__(self, directory: Path, writer: str, info: dict[str, Any]) -> None:
        self._lock = threading.Lock()
        self._paths = [directory / f"{writer}.{ext}" for ext in ("json", "fps", "done")]
        info_path, fps_path, self._done_path = self._paths
        _write_atomic(info_path, json.dumps({**info, "writer": writer}, default=str).encode())
        self._fps = open(fps_path, "ab", buffering=0)  # noqa: SIM115 (open for the publisher's life)
        self.appended = 0

    def storing(self, key: bytes) -> None:
        """A PUT of ``key``'s object starts."""
        with self._lock:
            self._fps.write(_RECORD.pack(b"I", key))

    def settled(self, key: bytes) -> None:
        """The PUT of ``key``'s object was answered and created nothing."""
        with self._lock:
            self._fps.write(_RECORD.pack(b"N", key))

    def stored(self, fp: int) -> None:
        """The PUT created the object of the key whose fingerprint is ``fp``."""
        with self._lock:
            self._fps.write(_RECORD.pack(b"S", fp.to_bytes(8, "little")))
            self.appended += 1

    def published(self, count: int, last_ts_ms: int) -> None:
        """The first ``count`` fingerprints appended are in published segments."""
        _write_atomic(self._done_path, f"{count} {last_ts_ms}".encode())

    def close(self, *, all_published: bool) -> None:
        """Done with it: removed when nothing is left for the front end."""
        with self._lock:
            self._fps.close()
        if all_published:
            for path in self._paths:
                with contextlib.suppress(OSError):
                    path.unlink()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _unpublished(directory: Path, writer: str) -> tuple[list[int], list[bytes], int]:
    """What a rank stored beyond what it published (fingerprints), the keys
    whose last PUT started and never returned, and the last stamp it used."""
    data = (directory / f"{writer}.fps").read_bytes()
    stored: list[int] = []
    started: dict[int, bytes] = {}
    for kind, body in _RECORD.iter_unpack(data[: len(data) - len(data) % _RECORD.size]):
        if kind == b"S":
            stored.append(int.from_bytes(body[:8], "little"))
        elif kind == b"I":
            started[int.from_bytes(body[:8], "big")] = body  # a key's fingerprint: its first 8 bytes
        elif kind == b"N":
            started.pop(int.from_bytes(body[:8], "big"), None)
    done, last_ts = 0, 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        done_text = (directory / f"{writer}.done").read_text().split()
        done, last_ts = int(done_text[0]), int(done_text[1])
    returned = set(stored)
    return stored[done:], [k for fp, k in started.items() if fp not in returned], last_ts


def recover(directory: Path) -> int:
    """Publish what the ranks' journals in ``directory`` hold beyond what
    they published, all at once, each within its rank's ``shutdown_flush_s``;
    then remove the directory. Returns the fingerprints published. Never
    raises."""
    import asyncio

    todo = []
    for info_path in sorted(directory.glob("*.json")):
        try:
            info = json.loads(info_path.read_text())
            fps, unanswered, last_ts = _unpublished(directory, info_path.stem)
        except (OSError, ValueError) as e:
            log.warning("s3kv: journal %s does not read (%r)", info_path, e)
            continue
        if fps or unanswered:
            todo.append((info, info_path.stem, fps, unanswered, last_ts))

    async def one(
        info: dict[str, Any], writer: str, fps: list[int], unanswered: list[bytes], last_ts: int
    ) -> int:
        try:
            return await _publish(info, writer, fps, unanswered, last_ts)
        except Exception as e:
            log.warning("s3kv: could not publish the last %d stores of %s at exit: %r", len(fps), writer, e)
            return 0

    async def all_of() -> list[int]:
        return await asyncio.gather(*(one(*t) for t in todo))

    total = sum(asyncio.run(all_of())) if todo else 0
    shutil.rmtree(directory, ignore_errors=True)
    return total


async def _publish(
    info: dict[str, Any], writer: str, fps: list[int], unanswered: list[bytes], last_ts: int
) -> int:
    import asyncio

    from s3kv.auth import load_keys
    from s3kv.chunk_reader import check_chunk_head, read_chunk_head
    from s3kv.config import parse_config
    from s3kv.errors import CorruptChunk, NotFound
    from s3kv.keys import fingerprint, object_key
    from s3kv.manifest import format as mf
    from s3kv.manifest.arrays import as_sorted_unique
    from s3kv.manifest.protocol import HybridClock
    from s3kv.manifest.writer import SegmentWriter
    from s3kv.stores.factory import make_store

    config = parse_config(info["config"])
    stamps = HybridClock(seen_ms=last_ts)  # after the rank's own last stamp
    meta: dict[str, Any] = {"writer": writer + "j", "recovered": True}
    if info.get("ranks", 1) > 1:
        meta.update(rank=info["rank"], ranks=info["ranks"])
    keys = load_keys(config.auth_key_file)
    store = make_store(config)

    shards = info.get("shards")
    if not (isinstance(shards, list) and shards and all(type(n) is int and n >= 0 for n in shards)):
        shards = [info["rank"]]  # a journal of a rank holding one shard, its own

    async def created(key: bytes) -> int | None:
        """The fingerprint of ``key`` if its unanswered PUTs left a sound
        object of every shard the rank writes."""
        for shard in shards:
            name = object_key(config.prefix, info["namespace"], key, shard)
            try:
                head = await read_chunk_head(store, name)
                if head is None:
                    return None
                check_chunk_head(name, head.data, head.size, keys)
            except (NotFound, CorruptChunk):
                return None
        return fingerprint(key)

    async def publish() -> None:
        found = await asyncio.gather(*(created(k) for k in unanswered))
        fps.extend(fp for fp in found if fp is not None)
        if fps:
            segment = mf.ManifestObject("segment", as_sorted_unique(fps), meta=meta)
            segments = SegmentWriter(
                store, info["base"], writer + "j", stamps.next, keys=keys, skew_s=config.manifest_clock_skew_s
            )
            await segments.put(segment)

    try:
        await asyncio.wait_for(publish(), config.shutdown_flush_s)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(store.close(), 1.0)
    log.info("s3kv: published %d chunks the engine had stored but not published (%s)", len(fps), writer)
    return len(fps)


def main(directory: str) -> None:
    """The fresh interpreter's part of :func:`_recover_at_exit`."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    recover(Path(directory))
