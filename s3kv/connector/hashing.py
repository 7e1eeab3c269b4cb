"""How this engine keys chunks, decided once at start-up: from vLLM's block
hashes (the *block scheme*) where every replica computes the same ones, else
from the tokens (the *token scheme*, the namespace as it always was).

vLLM hashes each request's blocks when the request arrives (off the
scheduling loop), chained over the whole prefix with its extra keys (LoRA,
multimodal, cache_salt, prompt embeddings). With a cryptographic algorithm
(``sha256``, ``sha256_cbor``) its chain starts from a seed that is fixed, or
``PYTHONHASHSEED`` where that is set: equal in every process that shares
the algorithm and the seed. Those, the hash block size and ``chunk_tokens``
become namespace fields under the block scheme, so replicas that hash
differently never share a namespace: a chunk's key is its last block's hash,
which does not say where the chunk starts (under the token scheme the chunk
size is in the key chain itself). The seed is there as a digest, which does
not make it secret: CPython's PYTHONHASHSEED is an integer below 2**32, so
anyone who reads the namespace descriptor can find it by trying them all. A non-cryptographic algorithm (``xxhash``) seeds
each process at random unless ``PYTHONHASHSEED`` is set, and is not
collision resistant: those engines key by tokens.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from s3kv.tiering.scheduler.keychain import HashScheme

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("s3kv")

HASH_BYTES = {"sha256": 32, "sha256_cbor": 32}
"""vLLM's cryptographic prefix-caching algorithms and their digest sizes."""
SCHEME = "vllm-block-hashes"


@dataclass(frozen=True)
class VllmHashing:
    """The block scheme and what makes vLLM's hashes equal across replicas."""

    scheme: HashScheme
    algo: str
    seed: str
    """The seed vLLM derives its first parent hash from (not logged: it may be PYTHONHASHSEED)."""
    chunk_tokens: int
    """Tokens a chunk: the same last block ends a chunk of 256 tokens and one of 512."""

    def fields(self) -> dict[str, Any]:
        """The namespace field: replicas that hash differently, or cut chunks
        differently, never share keys."""
        return {
            "scheme": SCHEME,
            "hash_algo": self.algo,
            "none_hash_seed": hashlib.sha256(self.seed.encode()).hexdigest()[:32],
            "hash_block_size": self.scheme.hash_block_size,
            "chunk_tokens": self.chunk_tokens,
        }


def choose(
    vllm_config: VllmConfig, kv_cache_config: Any, chunk_tokens: int, setting: str
) -> tuple[VllmHashing | None, str]:
    """(the block scheme, or None for the token scheme; why, for the log).

    Block hashes key chunks when ``setting`` is ``auto``, vLLM hashes
    requests' blocks (prefix caching on, or a KV connector configured: vLLM
    0.32 hashes for either), its algorithm is cryptographic and
    ``chunk_tokens`` is a multiple of the hash block size (with several KV
    cache groups that may be smaller than any group's block size)."""
    if setting == "tokens":
        return None, "chunk_keys is tokens"
    cache = vllm_config.cache_config
    if not (cache.enable_prefix_caching or vllm_config.kv_transfer_config is not None):
        return None, "vLLM does not hash blocks (prefix caching off)"
    algo = str(cache.prefix_caching_hash_algo)
    if algo not in HASH_BYTES:
        return None, f"prefix_caching_hash_algo {algo} is not cryptographic (each process seeds it at random)"
    hash_block_size = getattr(kv_cache_config, "hash_block_size", None)
    if not hash_block_size:
        return None, "vLLM did not say its hash block size"
    if chunk_tokens % int(hash_block_size):
        return None, f"chunk_tokens {chunk_tokens} is not a multiple of the hash block size {hash_block_size}"
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed

    # vLLM's engine core resolves its seed after the connector is built; for
    # a cryptographic algorithm that is deterministic (PYTHONHASHSEED or a
    # fixed default), and RequestReader checks vLLM's own value once.
    seed = resolve_none_hash_seed(get_hash_fn_by_name(algo))
    scheme = HashScheme(int(hash_block_size), HASH_BYTES[algo])
    return VllmHashing(scheme, algo, seed, chunk_tokens), f"{algo} block hashes of {hash_block_size} tokens"


def seed_in_use() -> str:
    """The seed vLLM's block hashes started from in this process (its default before it decides)."""
    from vllm.v1.core.kv_cache_utils import get_none_hash_seed

    return get_none_hash_seed()
