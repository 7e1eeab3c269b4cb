"""Model identity for namespaces: what makes two replicas' weights the same.

For a model in a local directory (or a single weights file) the identity is
a digest of its content, every byte of every weight file and of its small
configuration files, not its path: replicas that mount the same weights at
different paths share a cache, and two fine-tunes that differ anywhere (a
merged LoRA, the last layers trained) never do. Hashing is xxh3_128 over
the whole file; each file's digest is cached by (device, inode, size,
mtime_ns, ctime_ns) in a small file under the user's cache directory, so a
restart does not read 16 GB again, and a changed file is hashed again (a
tool may set mtime back after a rewrite; nothing can set ctime).

For a hub model the identity is the resolved snapshot commit (the sha the
local hub cache holds for the revision), never a mutable name such as
"main". An operator who knows the weights' digest (a model registry's) can
give it as ``model_digest`` and skip the hashing.

Resolving an identity may take seconds to minutes (a first start reads
every weight file), so the connector runs :func:`resolve_identity` off
vLLM's scheduling loop; until it is done the replica offers no hits and
stores nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import tempfile
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from s3kv.errors import IdentityError

log = logging.getLogger("s3kv.identity")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".h5", ".msgpack")
CONFIG_SUFFIXES = (".json", ".py", ".yaml", ".yml", ".model", ".tiktoken")
"""Small files beside the weights that may change KV (configs, quantization
configs, custom modelling code); hashed whole too, cheaply."""
READ_BYTES = 8 << 20
CACHE_ENTRIES = 4096
_SHA_RE = re.compile(r"^[0-9a-f]{40}$")


# -- the per-file digest cache ------------------------------------------------------


def default_cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "s3kv" / "file-digests.json"


def stat_key(st: os.stat_result) -> str:
    """What names one version of a file: a changed file gets another key.
    ctime is in it because mtime can be set back (``touch -d``, ``rsync -t``,
    ``cp -p``) and ctime cannot; keys of older caches, without it, simply miss."""
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


class DigestCache:
    """File digests by :func:`stat_key`, kept in one small JSON file. Every
    failure to read or write it only costs a re-hash: it is never fatal."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path if path is not None else default_cache_path()
        self._entries: dict[str, str] = {}
        self._new: dict[str, str] = {}
        self._lock = threading.Lock()
        self._entries = self._read()

    def _read(self) -> dict[str, str]:
        try:
            raw = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        entries = raw.get("xxh3_128") if isinstance(raw, dict) else None
        if not isinstance(entries, dict):
            return {}
        return {k: v for k, v in entries.items() if isinstance(k, str) and isinstance(v, str)}

    def get(self, st: os.stat_result) -> str | None:
        with self._lock:
            return self._entries.get(stat_key(st))

    def put(self, st: os.stat_result, digest: str) -> None:
        with self._lock:
            self._entries[stat_key(st)] = digest
            self._new[stat_key(st)] = digest

    def save(self) -> None:
        """Merge the new entries into the file (other processes may have
        written theirs since), keeping the newest ``CACHE_ENTRIES``."""
        with self._lock:
            new, self._new = self._new, {}
        if not new:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                merged = {**self._read(), **new}
                if len(merged) > CACHE_ENTRIES:
                    merged = dict(list(merged.items())[-CACHE_ENTRIES:])
                fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".file-digests.")
                try:
                    with os.fdopen(fd, "w") as f:
                        json.dump({"xxh3_128": merged}, f)
                    os.replace(tmp, self.path)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)
        except OSError as e:
            log.warning(
                "s3kv: could not save weight digests to %s (%s); they are hashed again next time",
                self.path,
                e,
            )


# -- hashing ------------------------------------------------------------------------


def hash_file(path: Path, buffer: bytearray | None = None) -> str:
    """xxh3_128 of every byte of ``path``."""
    h = xxhash.xxh3_128()
    buf = buffer if buffer is not None else bytearray(READ_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        with contextlib.suppress(AttributeError, OSError):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def file_digest(path: Path, cache: DigestCache | None, buffer: bytearray | None = None) -> str:
    """The file's content digest, from the cache when the file is unchanged."""
    st = path.stat()
    if cache is not None:
        hit = cache.get(st)
        if hit is not None:
            return hit
    digest = hash_file(path, buffer)
    if path.stat().st_mtime_ns != st.st_mtime_ns:
        raise IdentityError(f"{path} changed while it was being hashed")
    if cache is not None:
        cache.put(st, digest)
    return digest


def _model_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    out = []
    for p in sorted(path.iterdir(), key=lambda p: p.name):
        if p.name.startswith(".") or not p.is_file():  # is_file follows links into a hub cache's blobs
            continue
        if p.name.endswith(WEIGHT_SUFFIXES) or p.name.endswith(CONFIG_SUFFIXES):
            out.append(p)
    return out


def content_digest(path: Path, cache: DigestCache | None = None) -> str:
    """One digest of a model directory (or file): every weight file's and
    configuration file's name, size and full-content digest."""
    files = _model_files(path)
    if not any(p.name.endswith(WEIGHT_SUFFIXES) for p in files):
        raise IdentityError(f"{path} holds no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    h = xxhash.xxh3_128()
    buffer = bytearray(READ_BYTES)
    for p in files:
        try:
            digest = file_digest(p, cache, buffer)
            size = p.stat().st_size
        except OSError as e:
            raise IdentityError(f"cannot read {p}: {e.strerror or e}") from e
        h.update(f"{p.name}\0{size}\0{digest}\0".encode())
    if cache is not None:
        cache.save()
    return h.hexdigest()


# -- hub models ---------------------------------------------------------------------


def hub_cache_dirs(download_dir: str | None = None) -> list[Path]:
    """Where a hub model's snapshots may be: vLLM's download_dir, then the
    Hugging Face cache (HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub)."""
    dirs: list[Path] = []
    if download_dir:
        dirs.append(Path(download_dir))
    try:
        from huggingface_hub import constants

        dirs.append(Path(constants.HF_HUB_CACHE))
    except ImportError:
        hf_home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
        dirs.append(Path(os.environ.get("HF_HUB_CACHE") or os.path.join(hf_home, "hub")))
    return dirs


def hub_commit(repo_id: str, revision: str | None, cache_dirs: Iterable[Path]) -> str | None:
    """The commit sha a local hub cache resolves ``revision`` (default
    "main") of ``repo_id`` to, or None if no cache has it."""
    revision = revision or "main"
    folder = "models--" + repo_id.replace("/", "--")
    for base in cache_dirs:
        repo = base / folder
        if _SHA_RE.match(revision):
            if (repo / "snapshots" / revision).is_dir():
                return revision
            continue
        try:
            sha = (repo / "refs" / revision).read_text().strip()
        except OSError:
            continue
        if _SHA_RE.match(sha):
            return sha
    return None


# -- the identity -------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSource:
    """Where the engine's weights come from: what :func:`resolve_identity` names."""

    model: str
    """vLLM's model argument: a local directory or file, or a hub id."""
    revision: str | None = None
    digest: str | None = None
    """The operator's ``model_digest``: used instead of hashing."""
    download_dir: str | None = None


def resolve_identity(source: ModelSource, cache: DigestCache | None = None) -> dict[str, Any]:
    """The model's namespace fields. Blocking (reads the weights on a first
    start); raises IdentityError when the identity cannot be established."""
    path = Path(source.model)
    local = path.exists()
    if source.digest is not None:
        fields: dict[str, Any] = {"model_digest": source.digest}
        config = path / "config.json"
        if local and config.is_file():  # cheap, and a changed config splits
            fields["config"] = xxhash.xxh3_128_hexdigest(config.read_bytes())
        return fields
    if local:
        return {"model_content": content_digest(path, cache)}
    if re.match(r"^[\w.\-]+/[\w.\-]+$", source.model):
        sha = hub_commit(source.model, source.revision, hub_cache_dirs(source.download_dir))
        if sha is None:
            raise IdentityError(
                f"hub model {source.model} (revision {source.revision or 'main'}) is not in the local "
                "hub cache, so its snapshot commit is unknown; set model_digest to name its weights"
            )
        return {"hub_model": source.model, "commit": sha}
    raise IdentityError(
        f"model {source.model!r} is neither a local path nor a hub id whose snapshot is cached "
        "(weights streamed from object storage?); set model_digest to name its weights"
    )


def canonical_config(hf_config: Mapping[str, Any]) -> str:
    """The effective model config (hf_overrides and rope scaling applied) as
    canonical JSON, without the fields that name paths or caches."""
    cleaned = {k: v for k, v in hf_config.items() if not k.startswith("_") and k != "name_or_path"}
    return json.dumps(cleaned, sort_keys=True, default=str, separators=(",", ":"))
