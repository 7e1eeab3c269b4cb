"""What the vLLM engine tells s3kv about KV layout and identity: the
namespace fields that vLLM's config decides (dtypes, page shape, attention
backend, TP, quantization, load format, the effective model config...),
where the weights are (their content digest is resolved later, off the
scheduling loop), block size and layer order."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from s3kv.config import S3KVConfig
from s3kv.errors import ConfigError
from s3kv.identity import ModelSource, canonical_config
from s3kv.keys import Namespace
from s3kv.kvgroups import CHUNKED, FULL, MAMBA, SLIDING, GroupLayout, KVGroup
from s3kv.shards import HEADS, ShardRole, Slicing, choose
from s3kv.shards import ranks as rank_slicing
from s3kv.shards import roles as shard_roles
from s3kv.shards import writers as shard_writers
from s3kv.tiering.scheduler.keychain import HashScheme

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from s3kv.connector.hashing import VllmHashing


@dataclass(frozen=True)
class EngineLayout:
    fields: Mapping[str, Any]
    """Namespace fields from vLLM's config (everything but the weights' digest)."""
    model: ModelSource
    """Where the weights are: :func:`s3kv.identity.resolve_identity` names them."""
    block_size: int
    layer_names: tuple[str, ...]
    tp_size: int
    world_size: int
    """Workers that each report on every chunk: TP ranks times pipeline stages."""
    page_size_bytes: int = 0
    """Bytes of one block of one layer on one rank."""
    groups: GroupLayout | None = None
    """The KV cache groups, their layers as indexes into ``layer_names``
    (None: one full-attention group of every layer)."""
    cut: Slicing | None = None
    """How each part is cut into shards (None: one per rank)."""
    total_kv_heads: int | None = None
    """The model's KV heads (all ranks'), where its pages are KV heads."""
    head_axis: int | None = None
    """The axis of the KV heads in every layer's KV cache tensor, where parts are cut by head."""
    pp_size: int = 1
    """Pipeline stages: each stores its own layers' part, as shards of its own."""
    pp_rank: int = 0
    """This worker's stage (0 on the scheduler side)."""
    stage_frames: int = 0
    """Frames of every part with pipeline stages: the most layers a stage
    has, so that every stage's objects are one size (0: the groups')."""
    hash_scheme: HashScheme | None = None
    """Chunk keys from vLLM's block hashes (None: from the tokens; :meth:`keyed_by`)."""

    def keyed_by(self, hashing: VllmHashing | None) -> EngineLayout:
        """This layout with chunks keyed by vLLM's block hashes as ``hashing``
        says (a namespace field), or unchanged under the token scheme."""
        if hashing is None:
            return self
        fields = {**self.fields, "chunk_keys": hashing.fields()}
        return dataclasses.replace(self, fields=fields, hash_scheme=hashing.scheme)

    @property
    def frames(self) -> int:
        """Frames of every part object (the groups' most layers, or a stage's)."""
        return max(self.kv_groups.frames, self.stage_frames)

    @property
    def local_kv_heads(self) -> int | None:
        """KV heads in each rank's pages, where parts are cut by head."""
        if self.total_kv_heads is None:
            return None
        return max(1, self.total_kv_heads // self.tp_size)

    @property
    def writers(self) -> list[int]:
        """The workers (``stage * tp_size + rank``) that write a shard to the
        shared tiers, and publish what they stored."""
        ranks = shard_writers(self.slicing, self.tp_size, self.total_kv_heads)
        return [stage * self.tp_size + r for stage in range(self.pp_size) for r in ranks]

    @property
    def slicing(self) -> Slicing:
        return self.cut or rank_slicing(self.tp_size)

    @property
    def shards_per_part(self) -> int:
        """Objects of every part: each stage's shards."""
        return self.slicing.shards * self.pp_size

    def roles(self, rank: int) -> tuple[ShardRole, ...]:
        """The shards TP rank ``rank`` of this worker's stage holds
        (:func:`s3kv.shards.roles`; a later stage's indexes follow the earlier ones')."""
        held = shard_roles(self.slicing, tp_size=self.tp_size, rank=rank, total_heads=self.total_kv_heads)
        offset = self.pp_rank * self.slicing.shards
        return tuple(dataclasses.replace(r, index=r.index + offset) for r in held)

    def object_bytes(self, chunk_tokens: int) -> int:
        """Raw bytes of one shard's object of a part: a rank's shard
        (:meth:`shard_bytes`) or the slice of it one shard holds."""
        held = self.roles(0)
        return self.shard_bytes(chunk_tokens) // len(held)

    @property
    def kv_groups(self) -> GroupLayout:
        return self.groups or GroupLayout(
            (KVGroup(FULL, tuple(range(len(self.layer_names)))),), self.block_size
        )

    def namespace(self, identity: Mapping[str, Any]) -> Namespace:
        """The namespace, once the weights' identity is known."""
        return Namespace.from_fields({**identity, **self.fields})

    def shard_bytes(self, chunk_tokens: int) -> int:
        """Bytes of one rank's object of a chunk's part (every layer of a
        one-group model): :attr:`GroupLayout.frames` layers' pages."""
        return chunk_tokens // self.block_size * self.page_size_bytes * self.frames


SERVED = "full attention, sliding-window, chunked-local attention and Mamba / linear attention"


def _group(spec: Any, layers: tuple[int, ...], names: list[str]) -> KVGroup:
    """s3kv's view of one of vLLM's KV cache groups, or ConfigError naming
    a kind s3kv cannot share yet."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    kind = type(spec)
    if kind in (FullAttentionSpec, MLAAttentionSpec):
        return KVGroup(FULL, layers)
    if kind is SlidingWindowSpec:
        return KVGroup(
            SLIDING, layers, int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0))
        )
    if kind is ChunkedLocalAttentionSpec:
        return KVGroup(CHUNKED, layers, int(spec.attention_chunk_size))
    if kind is MambaSpec:
        if spec.mamba_cache_mode != "align":
            raise ConfigError(
                f"s3kv shares Mamba / linear-attention state only in vLLM's prefix-caching mode for it "
                f"(mamba_cache_mode 'align'); this engine's is {spec.mamba_cache_mode!r} (layers "
                f"{', '.join(names[:3])}): turn prefix caching on (--enable-prefix-caching)"
            )
        if spec.num_speculative_blocks:
            raise ConfigError(
                "s3kv does not share Mamba / linear-attention state with speculative decoding yet "
                f"(layers {', '.join(names[:3])}): turn speculative decoding off, or serve without s3kv"
            )
        return KVGroup(MAMBA, layers)
    raise ConfigError(
        f"s3kv cannot share this KV cache yet: KV cache group of kind {kind.__name__} "
        f"(layers {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}). s3kv shares {SERVED} "
        "groups; serve this model without the s3kv KV connector (remove --kv-transfer-config)"
    )


def _groups(kv_cache_config: Any) -> tuple[tuple[str, ...], GroupLayout | None, Any]:
    """(layer order, groups, the spec of the first group) of vLLM's KV cache
    config; groups None for one full-attention group. Every group must have
    one block size and page size (vLLM's hybrid manager makes them so)."""
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise ConfigError("this model has no KV cache (no attention layers): nothing for s3kv to share")
    first = groups[0].kv_cache_spec
    names: list[str] = []
    kv_groups: list[KVGroup] = []
    for g in groups:
        spec = g.kv_cache_spec
        layers = tuple(range(len(names), len(names) + len(g.layer_names)))
        kv_groups.append(_group(spec, layers, list(g.layer_names)))
        names += g.layer_names
        for what in ("block_size", "page_size_bytes"):
            if getattr(spec, what) != getattr(first, what):
                raise ConfigError(
                    f"s3kv needs one {what} for every KV cache group: group {type(first).__name__} has "
                    f"{getattr(first, what)}, group {type(spec).__name__} {getattr(spec, what)}"
                )
    layout = GroupLayout(tuple(kv_groups), int(first.block_size))
    # The namespace's attention fields (and the CPU kernel's ISA) are an attention group's.
    attention = next((g.kv_cache_spec for g in groups if hasattr(g.kv_cache_spec, "head_size")), first)
    return tuple(names), (None if layout.single else layout), attention


def _group_fields(kv_cache_config: Any, layout: GroupLayout) -> list[dict[str, Any]]:
    """The group structure, a namespace field: what makes two engines' parts interchangeable."""
    out = []
    for g, kv in zip(kv_cache_config.kv_cache_groups, layout.groups, strict=True):
        spec = g.kv_cache_spec
        out.append(
            {
                "kind": kv.kind,
                "window": kv.window,
                "spec": type(spec).__name__,
                "block_size": int(spec.block_size),
                "page_size_bytes": int(spec.page_size_bytes),
                "num_kv_heads": getattr(spec, "num_kv_heads", None),
                "head_size": getattr(spec, "head_size", None),
                "head_size_v": getattr(spec, "head_size_v", None),
                "dtype": str(getattr(spec, "dtype", "")),
                **(
                    {  # a state's layout: what its page bytes are
                        "shapes": [list(x) for x in spec.shapes],
                        "dtypes": [str(d) for d in spec.dtypes],
                        "mamba_type": str(spec.mamba_type),
                    }
                    if kv.kind == MAMBA
                    else {}
                ),
                "layers": list(g.layer_names),
            }
        )
    return out


def _stage_frames(vllm_config: Any, groups: GroupLayout | None, layers: int, stage: int) -> int:
    """Frames of every part with pipeline stages: the most decoder layers a
    stage has (vLLM's own split of them), each stage's part padded to it.

    The scheduler side sees only the first stage's KV cache, so s3kv shares
    a pipeline-parallel model whose decoder layers each have one attention
    layer of one KV cache group: then every stage's layer count follows
    from vLLM's split, and ``stage``'s (``layers``) is checked against it."""
    from vllm.distributed.utils import get_pp_indices

    pp = int(vllm_config.parallel_config.pipeline_parallel_size)
    if groups is not None:
        raise ConfigError(
            "s3kv does not share a model with several KV cache groups under pipeline parallelism yet "
            "(pipeline_parallel_size > 1): serve it with pipeline_parallel_size 1, or without the s3kv "
            "KV connector"
        )
    hf = vllm_config.model_config.hf_text_config
    total = int(hf.num_hidden_layers)
    spans = [get_pp_indices(total, stage, pp) for stage in range(pp)]
    own = spans[stage][1] - spans[stage][0]
    if layers != own:
        raise ConfigError(
            f"s3kv shares a pipeline-parallel model only where each decoder layer has one attention "
            f"layer: pipeline stage {stage} has {layers} KV cache layers for {own} decoder layers"
        )
    return max(end - start for start, end in spans)


_SLICED_SPECS = ("FullAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec")
"""Attention kinds whose pages are KV heads (MLA's latent is one shared page; Mamba state is no heads)."""


def _slicing(
    vllm_config: Any, kv_cache_config: Any, platform: str, across_tp: bool
) -> tuple[Slicing, int | None, int | None]:
    """How this engine's parts are cut into shards, the model's KV heads
    and the head axis of its KV cache tensors (:mod:`s3kv.shards`).

    What every rank holds alike is one shard, written once: MLA's latent
    KV, and a KV head each of several ranks holds (fewer KV heads than
    ranks: a rank's page is that one head's, on any platform). Where
    replicas of every TP size share (``across_tp``), parts are cut by head
    only where a head's bytes are the same whatever the TP size: vLLM's CPU
    attention pages are ``[blocks, heads, block_size, 2*head_size]`` (the
    ISA kernel lays out each head's page; the ISA is in the namespace), so
    a head is a run of bytes per block. Anything else (a device's layout,
    Mamba state, context parallelism, per-token-head scales) stays one
    shard per rank."""
    parallel = vllm_config.parallel_config
    tp = int(parallel.tensor_parallel_size)
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    if (
        int(getattr(parallel, "decode_context_parallel_size", 1)) > 1
        or int(getattr(parallel, "prefill_context_parallel_size", 1) or 1) > 1
    ):
        return rank_slicing(tp), None, None
    if any(getattr(getattr(spec, "kv_quant_mode", None), "is_per_token_head", False) for spec in specs):
        return rank_slicing(tp), None, None
    if all(type(spec).__name__ == "MLAAttentionSpec" for spec in specs):
        return choose(total_heads=1, tp_size=tp, replicated=True, sliceable=False), None, None
    total = int(vllm_config.model_config.get_total_num_kv_heads())
    heads_alike = (
        all(type(spec).__name__ in _SLICED_SPECS for spec in specs)
        and {spec.num_kv_heads for spec in specs} == {max(1, total // tp)}
        and len({spec.head_size for spec in specs}) == 1
    )
    by_head = heads_alike and across_tp and platform == "cpu"
    held_alike = heads_alike and total < tp
    cut = choose(total_heads=total, tp_size=tp, replicated=False, sliceable=by_head or held_alike)
    if cut.mode != HEADS:
        return rank_slicing(tp), None, None
    return cut, total, (1 if by_head else None)  # a head held alike is a rank's whole page


def _cpu_attention_isa(dtype: Any, block_size: int, head_size: int, cache_dtype: str) -> str:
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(dtype, block_size, head_size, cache_dtype))
    except Exception as e:  # the private helper moved: fall back to CPU flags
        import torch

        return f"flags(amx={torch.cpu._is_amx_tile_supported()},avx512={torch.cpu._is_avx512_supported()},{type(e).__name__})"


def _digest_of(value: Any) -> str | None:
    """A stable digest of a config value (None stays None)."""
    if value is None or value == {}:
        return None
    if callable(value):  # hf_overrides may be a function: its effect is in the effective config
        return f"callable:{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
    return xxhash.xxh3_128_hexdigest(json.dumps(value, sort_keys=True, default=str).encode())


def _hf_config_dict(model: Any) -> dict[str, Any]:
    hf = getattr(model, "hf_config", None)
    if hf is None:
        return {}
    try:
        return dict(hf.to_dict())
    except Exception:  # a config class without to_dict: its attributes
        return {k: v for k, v in vars(hf).items() if not k.startswith("_")}


def engine_layout(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    config: S3KVConfig | None = None,
    *,
    pp_rank: int = 0,
) -> EngineLayout:
    """Everything that must match for two engines to exchange KV pages.

    Raises ConfigError for setups whose KV must never be shared (dummy
    weights) or that s3kv does not support."""
    from vllm.platforms import current_platform

    layer_names, kv_groups, spec = _groups(kv_cache_config)
    pp = int(vllm_config.parallel_config.pipeline_parallel_size)
    stage_frames = _stage_frames(vllm_config, kv_groups, len(layer_names), pp_rank) if pp > 1 else 0
    block_size = int(spec.block_size)
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    load = getattr(vllm_config, "load_config", None)
    load_format = str(getattr(load, "load_format", "auto"))
    if load_format == "dummy":
        raise ConfigError(
            "load_format: 'dummy' fills the model with random weights; their KV must never be "
            "shared, so s3kv refuses to run with it (remove the KV connector, or load real weights)"
        )
    if getattr(cache, "calculate_kv_scales", False) and str(cache.cache_dtype) != "auto":
        raise ConfigError(
            "calculate_kv_scales: KV scales computed from each replica's first batch make its "
            "quantized KV bytes its own; s3kv needs scales from the checkpoint"
        )
    attention_backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    config = config or S3KVConfig()
    fields: dict[str, Any] = {
        "model_config": xxhash.xxh3_128_hexdigest(canonical_config(_hf_config_dict(model)).encode()),
        "hf_overrides": _digest_of(getattr(model, "hf_overrides", None)),
        "quantization": str(getattr(model, "quantization", None)),
        "quantization_config": _digest_of(getattr(model, "quantization_config", None)),
        "load_format": load_format,
        "kv_scales": "calculated" if getattr(cache, "calculate_kv_scales", False) else "checkpoint",
        "kv_cache_dtype_skip_layers": sorted(getattr(cache, "kv_cache_dtype_skip_layers", None) or []),
        "namespace_salt": config.namespace_salt,
        "model_dtype": str(model.dtype),
        "kv_cache_dtype": str(cache.cache_dtype),
        "block_size": block_size,
        "kv_spec": type(spec).__name__,
        "kv_spec_dtype": str(getattr(spec, "dtype", "")),
        "num_kv_heads": getattr(spec, "num_kv_heads", None),
        "head_size": getattr(spec, "head_size", None),
        "head_size_v": getattr(spec, "head_size_v", None),
        "page_size_bytes": int(spec.page_size_bytes),
        "sliding_window": getattr(spec, "sliding_window", None),
        "num_layers": max(kv_groups.frames if kv_groups is not None else len(layer_names), stage_frames),
        "kv_cache_layout": str(getattr(kv_cache_config, "kv_cache_layout", "")),
        "platform": str(current_platform.device_type),
        "attention_backend": str(attention_backend),
        "tp_size": int(parallel.tensor_parallel_size),
        "dcp_size": int(getattr(parallel, "decode_context_parallel_size", 1)),
    }
    if pp > 1:  # absent without pipeline stages: those namespaces are unchanged
        fields["pp_size"] = pp
    if kv_groups is not None:  # absent for one full-attention group: those namespaces are unchanged
        fields["kv_groups"] = _group_fields(kv_cache_config, kv_groups)
    cut, total_heads, head_axis = _slicing(
        vllm_config, kv_cache_config, str(current_platform.device_type), config.share_across_tp
    )
    if not cut.per_rank:  # pages are one shard's; without a TP size, every TP size reads these shards
        if config.share_across_tp:
            del fields["tp_size"]
        fields["kv_shards"] = cut.field()
        if cut.mode == HEADS:
            assert total_heads is not None
            local = max(1, total_heads // int(parallel.tensor_parallel_size))
            shard_page = int(spec.page_size_bytes) // local * cut.heads_per_shard
            fields.update(num_kv_heads=total_heads, page_size_bytes=shard_page)
            for group in fields.get("kv_groups", ()):
                group.update(num_kv_heads=total_heads, page_size_bytes=shard_page)
    if current_platform.device_type == "cpu":
        fields["cpu_attention_isa"] = _cpu_attention_isa(
            getattr(spec, "dtype", model.dtype),
            block_size,
            int(getattr(spec, "head_size", 0) or 0),
            str(cache.cache_dtype),
        )
    return EngineLayout(
        fields=fields,
        model=ModelSource(
            str(model.model),
            getattr(model, "revision", None),
            config.model_digest,
            getattr(load, "download_dir", None),
        ),
        block_size=block_size,
        layer_names=layer_names,
        tp_size=int(parallel.tensor_parallel_size),
        world_size=int(parallel.tensor_parallel_size) * pp,
        page_size_bytes=int(spec.page_size_bytes),
        groups=kv_groups,
        cut=cut,
        total_kv_heads=total_heads,
        head_axis=head_axis,
        pp_size=pp,
        pp_rank=pp_rank,
        stage_frames=stage_frames,
    )
