"""The scheduler's in-memory knowledge of which chunks the store holds.

``get_num_new_matched_tokens`` runs in vLLM's scheduling loop and must not
touch the network, so it asks this index. The index is a hint, the store is
the truth: a key whose object turns out missing or corrupt is dropped when a
worker reports it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable

from s3kv.keys import namespace_prefix, parse_object_key
from s3kv.stores.base import ObjectStore

log = logging.getLogger("s3kv.index")


class ChunkIndex:
    """A set of chunk keys (16-byte digests). Safe for one writer thread and
    concurrent readers (CPython's set operations are atomic)."""

    def __init__(self) -> None:
        self._keys: set[bytes] = set()

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: bytes) -> None:
        self._keys.add(key)

    def update(self, keys: Iterable[bytes]) -> None:
        self._keys.update(keys)

    def discard(self, key: bytes) -> None:
        self._keys.discard(key)


async def load_listing(
    index: ChunkIndex, store: ObjectStore, prefix: str, namespace: str, world_size: int
) -> int:
    """Add every chunk of ``namespace`` whose ``world_size`` rank shards are
    all in the store. Returns how many keys were added."""
    ranks: dict[bytes, set[int]] = defaultdict(set)
    added = 0
    async for meta in store.list(namespace_prefix(prefix, namespace)):
        parsed = parse_object_key(meta.key)
        if parsed is None or parsed[0] != namespace or parsed[2] >= world_size:
            continue
        _, key, rank = parsed
        seen = ranks[key]
        seen.add(rank)
        if len(seen) == world_size:
            index.add(key)
            del ranks[key]
            added += 1
    return added
