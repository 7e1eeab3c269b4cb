"""A small random-weights Llama for the demo and the tests (no model hub here).

Random models repeat tokens a lot; this one is wide and deep enough, with
large enough initial weights, that its greedy output varies and depends on
early prompt tokens, so loading wrong KV changes what it says.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

SPEC = {
    "vocab_size": 2048,
    "hidden_size": 384,
    "intermediate_size": 768,
    "num_hidden_layers": 6,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    "initializer_range": 0.1,
}

DEMO_SPEC = {
    # Wider and deeper than the tests' model, so a prefill costs real time
    # on a CPU and a cache hit has something to save.
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
}


GEMMA3_SPEC = {
    # Gemma 3's pattern, five sliding-window layers to one global: vLLM's
    # hybrid KV cache manager makes six KV cache groups of one layer each.
    "vocab_size": 2048,
    "hidden_size": 384,
    "intermediate_size": 768,
    "num_hidden_layers": 6,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "query_pre_attn_scalar": 64,
    "max_position_embeddings": 8192,
    "initializer_range": 0.1,
    "sliding_window": 64,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "tie_word_embeddings": False,  # tied, a random Gemma 3 says one token whatever the prompt
}


def build_gemma3(path: str | Path, *, seed: int = 0, **overrides: object) -> Path:
    """Write a random Gemma 3 text model (local and global layers) to ``path``
    (once: an existing one is reused)."""
    spec = {**GEMMA3_SPEC, **overrides}
    return _build_family(path, "gemma3", ("Gemma3TextConfig", "Gemma3ForCausalLM"), spec, seed)


GPT_OSS_SPEC = {
    # gpt-oss's pattern, sliding-window (128 tokens) and full attention layers
    # alternating: two KV cache groups of three layers each. Mixture of experts.
    "vocab_size": 2048,
    "hidden_size": 384,
    "intermediate_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 131072,  # gpt-oss's: YaRN's 32 x 4096
    "initializer_range": 0.1,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 3,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
        "rope_theta": 150000.0,
    },
    "tie_word_embeddings": False,
}

LLAMA4_SPEC = {
    # Llama 4's pattern, three chunked-local attention layers to one global
    # (NoPE) layer, twice: four KV cache groups of two layers each. The
    # attention chunk (128 tokens) is four of the tests' 32-token blocks.
    "vocab_size": 2048,
    "hidden_size": 384,
    "intermediate_size": 512,
    "intermediate_size_mlp": 768,
    "num_hidden_layers": 8,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_local_experts": 2,
    "num_experts_per_tok": 1,
    "moe_layers": [1, 3, 5, 7],
    "interleave_moe_layer_step": 2,
    "attention_chunk_size": 128,
    "no_rope_layers": [1, 1, 1, 0] * 2,
    "layer_types": (["chunked_attention"] * 3 + ["full_attention"]) * 2,
    "max_position_embeddings": 8192,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}


def _build_family(
    path: str | Path,
    family: str,
    classes: tuple[str, str],
    spec: dict,
    seed: int,
    adjust: Callable[[Any], None] | None = None,
    **marked: object,
) -> Path:
    """Write a random model of ``family`` (transformers' config and model
    classes ``classes``) with config ``spec`` to ``path``, once: an existing
    one of the same family, spec, seed and ``marked`` is reused. ``adjust``
    changes the random weights (in float32, before the cast to bfloat16)."""
    import torch
    import transformers

    path = Path(path)
    marker = path / "s3kv-model.json"
    wanted = json.loads(json.dumps({"seed": seed, "family": family, **marked, **spec}))
    if marker.is_file() and json.loads(marker.read_text()) == wanted:
        return path
    torch.manual_seed(seed)
    config_cls, model_cls = (getattr(transformers, name) for name in classes)
    config = config_cls(**spec, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = model_cls(config)
    if adjust is not None:
        with torch.no_grad():
            adjust(model)
    model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    marker.write_text(json.dumps(wanted))
    return path


def build_gpt_oss(path: str | Path, *, seed: int = 0, **overrides: object) -> Path:
    """Write a random gpt-oss (sliding-window and full attention, MoE) to ``path``."""
    spec = {**GPT_OSS_SPEC, **overrides}
    return _build_family(path, "gpt_oss", ("GptOssConfig", "GptOssForCausalLM"), spec, seed)


def build_llama4(path: str | Path, *, seed: int = 0, **overrides: object) -> Path:
    """Write a random Llama 4 text model (chunked-local and full attention) to ``path``."""
    spec = {**LLAMA4_SPEC, **overrides}
    return _build_family(path, "llama4", ("Llama4TextConfig", "Llama4ForCausalLM"), spec, seed)


DEEPSEEK_V2_SPEC = {
    # DeepSeek V2's multi-head latent attention (MLA): every layer caches one
    # latent of kv_lora_rank + qk_rope_head_dim values per token, the same on
    # every TP rank. vLLM's CPU MLA kernel takes only that 576 (512 + 64).
    # Dense layers only (first_k_dense_replace: every layer): the experts are
    # not what the tests look at.
    "vocab_size": 2048,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 128,
    "first_k_dense_replace": 2,
    "max_position_embeddings": 8192,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}


def build_deepseek_v2(path: str | Path, *, seed: int = 0, **overrides: object) -> Path:
    """Write a random DeepSeek V2 (MLA attention) to ``path`` (once: an
    existing one is reused)."""
    spec = {**DEEPSEEK_V2_SPEC, **overrides}
    return _build_family(path, "deepseek_v2", ("DeepseekV2Config", "DeepseekV2ForCausalLM"), spec, seed)


def build_model(path: str | Path, *, seed: int = 0, **overrides: int | float) -> Path:
    """Write a random Llama to ``path`` (once: an existing one is reused)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    spec = {**SPEC, **overrides}
    marker = path / "s3kv-model.json"
    wanted = {"seed": seed, **spec}
    if marker.is_file() and json.loads(marker.read_text()) == wanted:
        return path
    torch.manual_seed(seed)
    config = LlamaConfig(**spec, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    marker.write_text(json.dumps(wanted))
    return path


QWEN3_NEXT_SPEC = {
    # Qwen3-Next's pattern: three gated-delta-net (linear attention) layers
    # to one full-attention layer; vLLM's CPU kernel wants 128-wide heads.
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "max_position_embeddings": 8192,
    "initializer_range": 0.05,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
}


def _slow_decay(model: Any) -> None:
    """A random gated delta net forgets within a few tokens (its decay
    exp(-A * dt) with A up to 16): slow it so that the state carries the
    prompt's early tokens, and a wrong state changes what the model says."""
    for module in model.modules():
        if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
            module.A_log.fill_(math.log(0.01))
            module.dt_bias.fill_(-2.0)


def build_qwen3_next(path: str | Path, *, seed: int = 0, **overrides: object) -> Path:
    """Write a random Qwen3-Next (linear attention and full attention) to
    ``path`` (once: an existing one is reused)."""
    spec = {**QWEN3_NEXT_SPEC, **overrides}
    classes = ("Qwen3NextConfig", "Qwen3NextForCausalLM")
    return _build_family(path, "qwen3_next", classes, spec, seed, _slow_decay, slow_decay=True)


if __name__ == "__main__":
    import sys

    print(build_model(sys.argv[1], seed=int(sys.argv[2]) if len(sys.argv) > 2 else 0))
