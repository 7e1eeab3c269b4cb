"""Namespaces of a model with several KV cache groups in a seeded bucket, as
replicas leave them: a descriptor with ``kv_groups`` fields whose id hashes
right, and each chunk as one part object per group (and rank), every part
of ``num_layers`` frames (a group of fewer layers pads with zero frames)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from s3kv import codec, descriptor
from s3kv.keys import Namespace, fingerprint, namespace_prefix, object_key
from s3kv.kvgroups import part_key
from s3kv.manifest import format as mf
from s3kv.manifest import protocol as mp
from tests.ops.dataset import DAY, PREFIX

BLOCK, PAGE, TOKENS = 16, 1024, 64
FRAME_BYTES = TOKENS // BLOCK * PAGE


def layer_names(*idx: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in idx]


def kv_group(kind: str, window: int, layers: list[str]) -> dict:
    """One ``kv_groups`` entry, as connector/layout.py writes it."""
    return {
        "kind": kind,
        "window": window,
        "spec": "SlidingWindowSpec" if window else "FullAttentionSpec",
        "block_size": BLOCK,
        "page_size_bytes": PAGE,
        "num_kv_heads": 2,
        "head_size": 64,
        "head_size_v": 64,
        "dtype": "torch.bfloat16",
        "layers": layers,
    }


# A Gemma 3 of 8 layers as vLLM's hybrid manager groups it: two sliding-window
# groups (the second padded: 2 layers), one full-attention group.
KV_GROUPS = [
    kv_group("sliding_window", 1024, layer_names(0, 1, 2)),
    kv_group("sliding_window", 1024, layer_names(4, 5)),
    kv_group("full", 0, layer_names(3, 6, 7)),
]
FRAMES = 3


def namespace(model: str, tp: int = 1, num_layers: int = FRAMES, kv_groups=KV_GROUPS) -> Namespace:
    fields = {
        "model": model,
        "tp_size": tp,
        "num_layers": num_layers,
        "block_size": BLOCK,
        "page_size_bytes": PAGE,
        "kv_cache_dtype": "auto",
        "model_dtype": "torch.bfloat16",
    }
    return Namespace.from_fields(fields if kv_groups is None else {**fields, "kv_groups": kv_groups})


def part(ns: str, key: bytes, rank: int, layers: int, frames: int = FRAMES) -> bytes:
    """One rank's part object under ``key``: ``layers`` frames of pages, then zero frames to ``frames``."""
    rng = np.random.default_rng(int.from_bytes(key, "little") + rank)
    pages = [rng.integers(0, 255, FRAME_BYTES, dtype=np.uint8) for _ in range(layers)]
    pages += [np.zeros(FRAME_BYTES, np.uint8)] * (frames - layers)
    return codec.encode_chunk(
        namespace=ns,
        key=key.hex(),
        rank=rank,
        tokens=TOKENS,
        layers=pages,
        dtype="bfloat16",
        itemsize=2,
        page_shape=[4, FRAME_BYTES // 8],
        codec="zstd",
    )


@dataclass
class Seeded:
    ns: Namespace
    chains: list[bytes]
    """The chunks' (chain) keys."""
    parts: dict[tuple[int, int], list[str]] = field(default_factory=dict)
    """(chunk index, group) -> the part's object names, one a rank."""

    def objects(self) -> set[str]:
        return {n for names in self.parts.values() for n in names}

    def part_keys(self) -> set[bytes]:
        return {part_key(c, g) for c in self.chains for g in range(len(KV_GROUPS))}


def seed(
    s3,
    bucket: str,
    ns: Namespace,
    chunks: int,
    *,
    tp: int = 1,
    groups: list[dict] = KV_GROUPS,
    written: float | None = None,
    listed: bool = True,
) -> Seeded:
    """``chunks`` chunks of namespace ``ns``, each a part per group and rank,
    and its descriptor; ``listed``: a segment names every part, as replicas
    publish them."""
    written = time.time() - 2 * DAY if written is None else written
    base = namespace_prefix(PREFIX, ns.id)
    s3.seed(bucket, base + descriptor.NAME, descriptor.encode(ns, "google/gemma-3-1b-it", TOKENS), written)
    out = Seeded(ns, [bytes.fromhex(ns.id[:28]) + i.to_bytes(2, "little") for i in range(chunks)])
    for c, chain in enumerate(out.chains):
        for g, group in enumerate(groups):
            key = part_key(chain, g)
            names = out.parts[c, g] = [object_key(PREFIX, ns.id, key, r) for r in range(tp)]
            for r, name in enumerate(names):
                s3.seed(bucket, name, part(ns.id, key, r, len(group["layers"])), written)
    if listed:
        fps = np.array(sorted(fingerprint(k) for k in out.part_keys()), np.uint64)
        name = mp.segment_name(base + "manifest/", int(written * 1000), "w0", 1)
        s3.seed(bucket, name, mf.encode(mf.ManifestObject("segment", fps)), written)
    return out
