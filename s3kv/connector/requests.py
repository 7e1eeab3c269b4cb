"""What s3kv reads of a vLLM request beside its tokens: under the block
scheme (:mod:`s3kv.connector.hashing`) vLLM's block hashes, which key its
chunks; else the extra keys of its blocks (LoRA, multimodal, cache_salt,
prompt embeddings) and vLLM's block hashes as prefix ids. Either way a LoRA
adapter is named by its content, and the request's own load policy is read.
A client's values are read once and quoted bounded."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from s3kv.config import LOAD_POLICIES
from s3kv.connector.hashing import VllmHashing, seed_in_use
from s3kv.identity import DigestCache, content_digest
from s3kv.stats import Counters
from s3kv.tiering.scheduler.keychain import BlockHashes, ExtrasFn, PrefixIds

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger("s3kv.scheduler")

POLICY_PARAM = "s3kv_load_policy"
"""The key of a request's ``kv_transfer_params`` that overrides ``load_policy`` for it."""
EXCERPT_CHARS = 40
"""How much of a request's bad parameter a warning quotes (a client may send megabytes)."""


def _excerpt(value: Any) -> str:
    """A bounded excerpt of a client's value, for a log line: its cost and
    length do not grow with the value."""
    if isinstance(value, str):
        more = f"... ({len(value)} characters)" if len(value) > EXCERPT_CHARS else ""
        return repr(value[:EXCERPT_CHARS]) + more
    if isinstance(value, (list, tuple, dict)):
        return f"a {type(value).__name__} of {len(value)} items"
    return repr(value)[:EXCERPT_CHARS]


def extras_fn(request: Request, adapter_digest: str | None) -> Any:
    """vLLM's own extra block-hash keys (LoRA, multimodal, cache_salt, prompt
    embeddings) for a token range, or None when the request has none. The
    LoRA key names the adapter by its content digest, not its name and path."""
    if not (
        request.lora_request or request.mm_features or request.cache_salt or request.prompt_embeds is not None
    ):
        return None
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    def extras(start: int, end: int) -> Any:
        keys = generate_block_hash_extra_keys(request, start, end, 0)[0]
        if keys and adapter_digest is not None:
            keys = tuple(
                ("lora", adapter_digest) if isinstance(k, tuple) and k and k[0] == "lora" else k for k in keys
            )
        return keys

    return extras


class AdapterDigests:
    """LoRA adapters' content digests, hashed in the background on first
    sight: until an adapter's digest is known, its requests are unkeyed."""

    def __init__(self, cache: DigestCache | None) -> None:
        self._cache = cache
        self._known: dict[tuple[str, int, str], str | None] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="s3kv-adapter-hash")

    def get(self, lora: Any) -> str | None:
        """The adapter's digest, or None while it is being hashed (or could not be)."""
        ident = (str(lora.lora_name), int(lora.lora_int_id), str(lora.lora_path))
        if ident in self._known:
            return self._known[ident]
        self._known[ident] = None
        self._executor.submit(self._hash, ident)
        return None

    def _hash(self, ident: tuple[str, int, str]) -> None:
        try:
            self._known[ident] = "adapter:" + content_digest(Path(ident[2]), self._cache)
        except Exception as e:
            log.error(
                "s3kv: LoRA adapter %s cannot be hashed (%s); its requests are served without the cache",
                ident[0],
                e,
            )

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class Keying:
    """How a request's chunks are keyed: by vLLM's block hashes
    (``block_hashes``, the block scheme), or by their tokens with ``extras``
    (``prefix_ids`` naming prefixes keyed before)."""

    extras: ExtrasFn | None
    prefix_ids: PrefixIds | None
    block_hashes: BlockHashes | None = None


class RequestReader:
    """Reads each request once for the scheduler side: its keying (none
    while its adapter is being hashed), its load policy; counts the
    requests looked up unkeyed."""

    def __init__(
        self,
        block_size: int,
        chunk_tokens: int,
        digests: DigestCache | None,
        counters: Counters,
        hashing: VllmHashing | None = None,
        seed_now: Callable[[], str] = seed_in_use,
    ) -> None:
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        self.counters = counters
        self.hashing = hashing
        """The engine's block scheme (None: chunks keyed by their tokens)."""
        self._seed_now = seed_now
        self._seed_ok: bool | None = None
        """vLLM's hash seed is the namespace's (checked at the first request: vLLM sets it after s3kv starts)."""
        self.adapters = AdapterDigests(digests)
        self._unkeyed: dict[str, None] = {}
        self._bad_policies: set[str] = set()
        self._policies: dict[str, str | None] = {}
        """Each request's own load policy, read once (:meth:`policy`)."""

    def keying(self, request: Request) -> Keying | str:
        """The request's keying, or why it has none (:meth:`unkeyed`):
        "adapter" while its LoRA adapter is hashed; under the block scheme
        "hashes" when vLLM's block hashes do not cover its tokens at the
        engine's hash block size (it is never keyed by its tokens instead),
        "hash_seed" when vLLM's hashes start from another seed than the
        namespace says."""
        adapter = None
        if request.lora_request is not None:
            adapter = self.adapters.get(request.lora_request)
            if adapter is None:
                return "adapter"
        hashing = self.hashing
        if hashing is None:
            return Keying(extras_fn(request, adapter), self.prefix_ids(request))
        if not self._seed_ok:
            if self._seed_ok is None:
                self._seed_ok = self._seed_now() == hashing.seed
                if not self._seed_ok:
                    log.error(
                        "s3kv: vLLM's block hashes start from another seed than s3kv resolved at start-up "
                        "(PYTHONHASHSEED changed?); this replica serves without the KV cache"
                    )
            if not self._seed_ok:
                return "hash_seed"
        hashes = getattr(request, "block_hashes", None)
        if hashes is None or len(hashes) != request.num_tokens // hashing.scheme.hash_block_size:
            return "hashes"
        return Keying(None, None, BlockHashes(hashes, adapter))

    def unkeyed(self, request: Request, why: str) -> None:
        """A lookup of the request found no keys for it (``why``: "model",
        "adapter", "hashes", "hash_seed"): counted once per request."""
        if request.request_id in self._unkeyed:
            return
        if len(self._unkeyed) > 4096:
            self._unkeyed.clear()
        self._unkeyed[request.request_id] = None
        self.counters.add(f"unkeyed_requests_{why}")
        self.counters.add("lookup_requests")
        self.counters.add("lookup_tokens", request.num_prompt_tokens)

    def prefix_ids(self, request: Request) -> Any:
        """vLLM's block hashes, computed when the request arrived (off the
        scheduling loop), name each chunk's prefix within this engine."""
        hashes = getattr(request, "block_hashes", None)
        bs, ct = self.block_size, self.chunk_tokens
        if not hashes or len(hashes) != request.num_tokens // bs:
            return None  # hashed at another granularity, or not at all

        def prefix_id(c: int) -> Any:
            i = (c + 1) * ct // bs - 1
            return hashes[i] if i < len(hashes) else None

        return prefix_id

    def policy(self, request: Request) -> str | None:
        """The request's own load policy (``kv_transfer_params``:
        ``{"s3kv_load_policy": "always"}``), or None: the replica's. Read
        and checked at its first lookup only: vLLM looks a waiting request
        up again every step, and a client's value may be megabytes."""
        req_id = request.request_id
        if req_id in self._policies:
            return self._policies[req_id]
        if len(self._policies) > 4096:  # requests vLLM never finished: a bound, not a loss
            self._policies.clear()
        params = getattr(request, "kv_transfer_params", None)
        value = params.get(POLICY_PARAM) if isinstance(params, dict) else None
        policy = None
        if isinstance(value, str) and len(value) <= max(map(len, LOAD_POLICIES)):
            policy = value.lower() if value.lower() in LOAD_POLICIES else None
        self._policies[req_id] = policy
        if value is None or policy is not None:
            return policy
        excerpt = _excerpt(value)
        if len(self._bad_policies) < 8 and excerpt not in self._bad_policies:
            self._bad_policies.add(excerpt)
            log.warning(
                "s3kv: request %s: kv_transfer_params %s=%s is not one of %s; the replica's policy applies",
                req_id,
                POLICY_PARAM,
                excerpt,
                ", ".join(LOAD_POLICIES),
            )
        return None

    def finished(self, req_id: str) -> None:
        self._policies.pop(req_id, None)

    def close(self) -> None:
        self.adapters.close()
