"""The planner's state of each request it knows: its chain keys, the hit
its last lookup offered, and how far its stores and loads got."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from s3kv.manifest.keyset import EMPTY
from s3kv.tiering.placement import Tier
from s3kv.tiering.scheduler.keychain import BlockHashes, ExtrasFn, PrefixIds
from s3kv.tiering.scheduler.parts import GroupHit, PartKeys
from s3kv.tiering.tiers.manager import TierManager


@dataclass(slots=True)
class RequestState:
    """What the planner knows of one request, from its arrival or first
    lookup until vLLM is done with its blocks."""

    token_ids: Sequence[int]
    """The request's tokens so far (vLLM's live list: prompt, then output)."""
    num_prompt_tokens: int
    extras: ExtrasFn | None
    prefix_ids: PrefixIds | None = None
    block_hashes: BlockHashes | None = None
    """Under the block scheme, what its chunk keys are made from."""
    keys: list[bytes] = field(default_factory=list)
    fps: np.ndarray = field(default_factory=lambda: EMPTY)
    """Fingerprints of ``keys``, for the manifest's vectorised lookup."""
    local_tokens: int = 0
    hit_start: int = 0
    """First chunk of the last lookup's hit (chunks below are local)."""
    hit: list[TierManager] = field(default_factory=list)
    """Tier of each chunk of the hit, from ``hit_start``."""
    hit_tokens: dict[Tier, int] = field(default_factory=dict)
    parts: PartKeys = field(default_factory=PartKeys)
    """Part keys of the groups after the first (a model with several KV cache groups)."""
    group_hit: GroupHit | None = None
    """Where each part of the last lookup's hit is (a model with several KV cache groups)."""
    stored_until: int = 0
    """Chunks below this index are stored or planned."""
    loaded: range = range(0)
    """Chunks planned to load from a tier: they are not stored from the KV
    cache again (promotion copies them up from what was loaded and checked)."""
    load_async: bool = False
    """What the last lookup told vLLM: an asynchronous load."""
    load_failed: bool = False
    """A load for this request failed: vLLM recomputes it, and asking again
    (vLLM does when nothing was computed) would only fail again."""
    decided: bool = False
    """The load policy's first decision on it was counted."""
    looked_up: bool = False
    """vLLM asked for its hit (a request known from its arrival alone was not yet)."""
    waited: bool = False
    """A lookup of it waited for its prefetch (counted once)."""
