"""What the vLLM engine tells s3kv about KV layout and identity: the
namespace fields, block size, layer order and TP rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from s3kv.errors import ConfigError
from s3kv.identity import model_identity
from s3kv.keys import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class EngineLayout:
    namespace: Namespace
    block_size: int
    layer_names: tuple[str, ...]
    tp_size: int
    world_size: int
    """Ranks that each store a shard of every chunk."""
    page_size_bytes: int = 0
    """Bytes of one block of one layer on one rank."""

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


def engine_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> EngineLayout:
    """Everything that must match for two engines to exchange KV pages."""
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
    attention_backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    fields: dict[str, Any] = {
        **model_identity(model.model, getattr(model, "revision", None)),
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
        namespace=Namespace.from_fields(fields),
        block_size=block_size,
        layer_names=tuple(groups[0].layer_names),
        tp_size=int(parallel.tensor_parallel_size),
        world_size=int(parallel.tensor_parallel_size),
        page_size_bytes=int(spec.page_size_bytes),
    )
