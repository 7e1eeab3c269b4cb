"""Model identity for namespaces: what makes two replicas' weights the same.

For a model in a local directory the identity is a fingerprint of its
content (config.json and sampled windows of every weight file), not its
path: replicas that mount the same weights at different paths share a cache,
and two fine-tunes with identical configs and file sizes never do. For a
hub name it is the name and revision.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import xxhash

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_WINDOWS = 8
_WINDOW_BYTES = 64 << 10


def file_fingerprint(path: Path, h: xxhash.xxh3_128) -> None:
    """Feed the size and ``_WINDOWS`` evenly spread windows of ``path`` to ``h``."""
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        if size <= _WINDOWS * _WINDOW_BYTES:
            h.update(f.read())
            return
        for i in range(_WINDOWS):
            f.seek((size - _WINDOW_BYTES) * i // (_WINDOWS - 1))
            h.update(f.read(_WINDOW_BYTES))


def model_identity(model: str, revision: str | None = None) -> dict[str, Any]:
    path = Path(model)
    if path.is_dir():
        h = xxhash.xxh3_128()
        config = path / "config.json"
        if config.is_file():
            h.update(config.read_bytes())
        weights = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
        for p in weights:
            file_fingerprint(p, h)
        return {"model_content": h.hexdigest()}
    return {"model": model, "revision": revision or "main"}
