"""Chunk keys of requests, by the engine's scheme, decided once at start-up:
from vLLM's block hashes (no token touched), or from the tokens, remembered
by prefix so that a prefix this engine keyed once (a shared system prompt,
a chat's next turn) is not hashed again."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from s3kv.keys import Namespace, chain_keys, hash_key_mask, hash_keys
from s3kv.manifest.keyset import fingerprints

ExtrasFn = Callable[[int, int], Any]
"""extras(start_token, end_token) -> the extra keys of that chunk, or None."""
PrefixIds = Callable[[int], Hashable | None]
"""prefix_ids(chunk) -> an id, local to this engine, of every token and extra
key up to the end of that chunk (vLLM's block hash of its last block), or
None. Equal ids mean equal chunk keys, so a prefix this engine has keyed
once is not hashed again."""
MEMO_SIZE = 1 << 16
"""Chunk keys remembered by prefix id (~200 bytes each)."""


@dataclass(frozen=True)
class HashScheme:
    """Chunk keys from vLLM's block hashes (the *block scheme*): one engine's
    choice, made at start-up."""

    hash_block_size: int
    """Tokens per block hash (a divisor of ``chunk_tokens``)."""
    hash_bytes: int = 32
    """Bytes of each block hash (sha256)."""


@dataclass(frozen=True)
class BlockHashes:
    """A request's own under the block scheme: vLLM's block hashes (its live
    list, grown as tokens are appended) and its LoRA adapter's content digest."""

    hashes: Sequence[bytes]
    adapter: str | None = None


class Keyed(Protocol):
    """What a request's chain is made from, and where it is kept."""

    token_ids: Sequence[int]
    extras: ExtrasFn | None
    prefix_ids: PrefixIds | None
    block_hashes: BlockHashes | None
    """Under the block scheme, what its keys are made from (its tokens are not)."""
    keys: list[bytes]
    fps: np.ndarray
    """Fingerprints of ``keys``, for the manifest's vectorised lookup."""


class ChainKeys:
    """The chain keys of requests' chunks: under the block scheme
    (``scheme``) derived from vLLM's block hashes, else hashed from the
    tokens once per prefix per engine."""

    def __init__(self, namespace: Namespace, chunk_tokens: int, scheme: HashScheme | None = None) -> None:
        if scheme is not None and chunk_tokens % scheme.hash_block_size:
            raise ValueError("chunk_tokens must be a multiple of the hash block size")
        self.namespace = namespace
        self.chunk_tokens = chunk_tokens
        self.scheme = scheme
        self._masks: dict[str | None, bytes] = {}
        """Each adapter's key mask (None: requests without one)."""
        self._memo: dict[Hashable, tuple[list[bytes], np.ndarray]] = {}
        """Prefix id of chunk c -> a chain whose first c + 1 keys (and
        fingerprints) are that prefix's."""

    def clear(self) -> None:
        """Forget every prefix (the next request of each is hashed)."""
        self._memo.clear()

    def extend(self, req: Keyed, n_chunks: int) -> list[bytes]:
        """``req.keys`` (and ``req.fps``) grown to at least ``n_chunks`` keys;
        under the block scheme, to as many of them as its block hashes
        cover (none without them: such a request is not keyed the other way)."""
        have = len(req.keys)
        if self.scheme is not None:
            if have < n_chunks and req.block_hashes is not None:
                self._from_hashes(req, req.block_hashes, have, n_chunks)
            return req.keys
        if have < n_chunks and req.prefix_ids is not None:
            # A prefix keyed before: no hashing. The memo points into the
            # chains of earlier requests (lists that only grow); the longest
            # known prefix is found by bisection.
            memo, ids = self._memo, req.prefix_ids
            lo, hi, found = have - 1, n_chunks, None
            while hi - lo > 1:
                mid = (lo + hi) // 2
                pid = ids(mid)
                entry = memo.get(pid) if pid is not None else None
                if entry is None:
                    hi = mid
                else:
                    lo, found = mid, entry
            if found is not None:
                chain, fps = found
                req.keys += chain[have : lo + 1]
                req.fps = fps[: lo + 1]
                have = lo + 1
        if have < n_chunks:
            ct = self.chunk_tokens
            extras = None
            if req.extras is not None:
                extras = [req.extras(i * ct, (i + 1) * ct) for i in range(have, n_chunks)]
            # A first lookup packs the live list itself: a slice would copy
            # every token first (~19 us for 8k tokens here).
            tokens = req.token_ids if have == 0 else req.token_ids[have * ct : n_chunks * ct]
            new = chain_keys(
                self.namespace,
                tokens,
                ct,
                extras,
                parent=req.keys[-1] if req.keys else None,
                start_chunk=have,
                max_chunks=n_chunks - have,
            )
            req.keys += new
            req.fps = np.concatenate([req.fps, fingerprints(new)])
            if req.prefix_ids is not None:
                for c in range(have, n_chunks):
                    pid = req.prefix_ids(c)
                    if pid is not None:
                        self._memo[pid] = (req.keys, req.fps)
                if len(self._memo) > MEMO_SIZE:  # start over rather than keep an LRU order per chunk
                    self._memo.clear()
        return req.keys

    def _from_hashes(self, req: Keyed, src: BlockHashes, have: int, n_chunks: int) -> None:
        """Keys of chunks [have, n_chunks) from the hashes of their last blocks."""
        assert self.scheme is not None
        per = self.chunk_tokens // self.scheme.hash_block_size
        n_chunks = min(n_chunks, len(src.hashes) // per)
        if n_chunks <= have:
            return
        mask = self._masks.get(src.adapter)
        if mask is None:
            if len(self._masks) > 4096:  # adapters come and go: a bound
                self._masks.clear()
            mask = self._masks[src.adapter] = hash_key_mask(self.namespace, src.adapter)
        keys, fps = hash_keys(
            src.hashes[(have + 1) * per - 1 : n_chunks * per : per], mask, self.scheme.hash_bytes
        )
        req.keys += keys
        req.fps = np.concatenate([req.fps, fps]) if have else fps
