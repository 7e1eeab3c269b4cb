"""What the vLLM engine tells s3kv about KV layout and identity: the
namespace fields that vLLM's config decides (dtypes, page shape, attention
backend, TP, quantization, load format, the effective model config...),
where the weights are (their content digest is resolved later, off the
scheduling loop), block size and layer order."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from s3kv.config import S3KVConfig
from s3kv.errors import ConfigError
from s3kv.identity import ModelSource, canonical_config
from s3kv.keys import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


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
    """Ranks that each store a shard of every chunk."""
    page_size_bytes: int = 0
    """Bytes of one block of one layer on one rank."""

    def namespace(self, identity: Mapping[str, Any]) -> Namespace:
        """The namespace, once the weights' identity is known."""
        return Namespace.from_fields({**identity, **self.fields})

    def shard_bytes(self, chunk_tokens: int) -> int:
        """Bytes of one rank's pages of a chunk, all layers."""
        return chunk_tokens // self.block_size * self.page_size_bytes * len(self.layer_names)


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
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: S3KVConfig | None = None
) -> EngineLayout:
    """Everything that must match for two engines to exchange KV pages.

    Raises ConfigError for setups whose KV must never be shared (dummy
    weights) or that s3kv does not support."""
    from vllm.platforms import current_platform

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"s3kv supports models with one KV cache group (full attention); this model has {len(groups)}"
        )
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ConfigError("s3kv does not support pipeline parallelism yet (pipeline_parallel_size > 1)")
    spec = groups[0].kv_cache_spec
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
        "num_layers": len(groups[0].layer_names),
        "kv_cache_layout": str(getattr(kv_cache_config, "kv_cache_layout", "")),
        "platform": str(current_platform.device_type),
        "attention_backend": str(attention_backend),
        "tp_size": int(parallel.tensor_parallel_size),
        "dcp_size": int(getattr(parallel, "decode_context_parallel_size", 1)),
    }
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
        layer_names=tuple(groups[0].layer_names),
        tp_size=int(parallel.tensor_parallel_size),
        world_size=int(parallel.tensor_parallel_size),
        page_size_bytes=int(spec.page_size_bytes),
    )
