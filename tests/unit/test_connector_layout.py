"""What goes into a namespace from vLLM's config: everything that changes KV
bytes splits it, and dummy weights are refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from s3kv.config import parse_config
from s3kv.errors import ConfigError

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from s3kv.connector.layout import engine_layout  # noqa: E402


class HfConfig(dict):
    def to_dict(self):
        return dict(self)


def _configs(**over):
    model = SimpleNamespace(
        model="/models/llama",
        revision=None,
        dtype=torch.bfloat16,
        hf_config=HfConfig(hidden_size=64, rope_scaling=None, _name_or_path="/models/llama"),
        hf_overrides={},
        quantization=None,
        quantization_config=None,
        get_total_num_kv_heads=lambda: 2,
    )
    cache = SimpleNamespace(cache_dtype="auto", kv_cache_dtype_skip_layers=[])
    load = SimpleNamespace(load_format="auto", download_dir=None)
    for k, v in over.items():
        target, name = k.split("__")
        setattr({"model": model, "cache": cache, "load": load}[target], name, v)
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    vllm_config = SimpleNamespace(
        model_config=model,
        cache_config=cache,
        load_config=load,
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=1, tensor_parallel_size=1, decode_context_parallel_size=1
        ),
        attention_config=None,
    )
    kv = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])])
    return vllm_config, kv


def _ns(extra=None, **over):
    layout = engine_layout(*_configs(**over), parse_config({"bucket": "b-ok", **(extra or {})}))
    return layout.namespace({"model_content": "same-weights"}).id


def test_everything_that_changes_kv_bytes_splits_the_namespace():
    base = _ns()
    assert _ns() == base
    variants = {
        "quantization": _ns(model__quantization="fp8"),
        "quantization_config": _ns(model__quantization_config={"bits": 4}),
        "hf_overrides": _ns(model__hf_overrides={"rope_theta": 1e6}),
        "rope scaling": _ns(model__hf_config=HfConfig(hidden_size=64, rope_scaling={"factor": 4.0})),
        "kv_cache_dtype": _ns(cache__cache_dtype="fp8"),
        "kv skip layers": _ns(cache__kv_cache_dtype_skip_layers=["l0"]),
        "load_format": _ns(load__load_format="bitsandbytes"),
        "namespace_salt": _ns({"namespace_salt": "tenant-a"}),
    }
    assert all(v != base for v in variants.values()), [k for k, v in variants.items() if v == base]
    assert len(set(variants.values())) == len(variants)
    assert _ns({"namespace_salt": "tenant-a"}) != _ns({"namespace_salt": "tenant-b"})


def test_paths_do_not_split_the_namespace():
    moved = HfConfig(hidden_size=64, rope_scaling=None, _name_or_path="/mnt/other/llama")
    assert _ns(model__hf_config=moved, model__model="/mnt/other/llama") == _ns()


def test_dummy_weights_are_refused():
    with pytest.raises(ConfigError, match="load_format: 'dummy'"):
        _ns(load__load_format="dummy")


def test_calculated_kv_scales_are_refused():
    with pytest.raises(ConfigError, match="calculate_kv_scales"):
        _ns(cache__cache_dtype="fp8", cache__calculate_kv_scales=True)


def test_model_digest_reaches_the_model_source():
    layout = engine_layout(
        *_configs(), parse_config({"bucket": "b-ok", "model_digest": "sha256:" + "0" * 64})
    )
    assert layout.model.digest == "sha256:" + "0" * 64 and layout.model.model == "/models/llama"


def _grouped(*groups):
    vllm_config, _ = _configs()
    kv = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=names) for spec, names in groups]
    )
    return engine_layout(vllm_config, kv, parse_config({"bucket": "b-ok"}))


def _full(**kw):
    return FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, **kw)


def test_one_full_group_keeps_its_namespace_fields():
    layout = _grouped((_full(), ["l0", "l1"]))
    assert layout.groups is None and "kv_groups" not in layout.fields
    assert layout.fields["num_layers"] == 2


def test_sliding_and_chunked_groups_are_parts_with_their_windows():
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, SlidingWindowSpec

    swa = SlidingWindowSpec(
        block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=1024
    )
    local = ChunkedLocalAttentionSpec(
        block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, attention_chunk_size=8192
    )
    layout = _grouped((swa, ["s0", "s2"]), (swa, ["s1"]), (_full(), ["f0", "f1"]), (local, ["c0", "c1"]))
    groups = layout.kv_groups.groups
    assert [(g.kind, g.window, g.layers) for g in groups] == [
        ("sliding_window", 1024, (0, 1)),
        ("sliding_window", 1024, (2,)),
        ("full", 0, (3, 4)),
        ("chunked_local", 8192, (5, 6)),
    ]
    assert layout.layer_names == ("s0", "s2", "s1", "f0", "f1", "c0", "c1")
    assert layout.fields["num_layers"] == 2  # frames of every part object: the largest group's layers
    assert [g["layers"] for g in layout.fields["kv_groups"]] == [
        ["s0", "s2"],
        ["s1"],
        ["f0", "f1"],
        ["c0", "c1"],
    ]
    assert layout.shard_bytes(64) == 2 * 2 * swa.page_size_bytes
    other = _grouped((swa, ["s0", "s2"]), (swa, ["s1"]), (_full(), ["f0", "f1"]))
    assert other.namespace({}).id != layout.namespace({}).id


def _mamba(**kw):
    from vllm.v1.kv_cache_interface import MambaSpec

    spec = {"shapes": ((3, 64), (4, 16, 16)), "dtypes": (torch.bfloat16, torch.float32), **kw}
    return MambaSpec(block_size=32, page_size_padded=_full().page_size_bytes, **spec)


def test_a_mamba_group_in_prefix_caching_mode_is_a_state_part():
    layout = _grouped((_full(), ["f0"]), (_mamba(mamba_cache_mode="align"), ["m0"]))
    assert [(g.kind, g.layers) for g in layout.kv_groups.groups] == [("full", (0,)), ("mamba", (1,))]
    assert layout.kv_groups.has_state
    (_, mamba) = layout.fields["kv_groups"]
    assert mamba["shapes"] == [[3, 64], [4, 16, 16]] and mamba["dtypes"] == [
        "torch.bfloat16",
        "torch.float32",
    ]
    other = _grouped(
        (_full(), ["f0"]), (_mamba(mamba_cache_mode="align", shapes=((3, 64), (4, 16, 8))), ["m0"])
    )
    assert other.namespace({}).id != layout.namespace({}).id  # another state layout: another namespace


def test_a_mamba_group_without_prefix_caching_or_with_speculation_fails_naming_what_to_do():
    with pytest.raises(ConfigError, match=r"mamba_cache_mode 'align'.*'none'.*m0.*--enable-prefix-caching"):
        _grouped((_full(), ["f0"]), (_mamba(), ["m0", "m1"]))
    with pytest.raises(ConfigError, match=r"speculative decoding.*m0"):
        _grouped((_full(), ["f0"]), (_mamba(mamba_cache_mode="align", num_speculative_blocks=2), ["m0"]))


def test_a_group_of_a_kind_s3kv_does_not_know_fails_naming_it():
    from vllm.v1.kv_cache_interface import CrossAttentionSpec

    cross = CrossAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=r"kind CrossAttentionSpec.*x0.*without the s3kv"):
        _grouped((_full(), ["f0"]), (cross, ["x0"]))


def test_groups_of_other_block_sizes_fail_naming_them():
    other = FullAttentionSpec(block_size=64, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="one block_size for every KV cache group"):
        _grouped((_full(), ["f0"]), (other, ["f1"]))


def _parallel(tp: int, total_heads: int, spec=None, **extra):
    """A layout at TP ``tp`` of a model with ``total_heads`` KV heads (the spec: each rank's)."""
    vllm_config, kv = _configs()
    vllm_config.parallel_config.tensor_parallel_size = tp
    vllm_config.model_config.get_total_num_kv_heads = lambda: total_heads
    local = max(1, total_heads // tp)
    spec = spec or FullAttentionSpec(block_size=32, num_kv_heads=local, head_size=64, dtype=torch.bfloat16)
    kv.kv_cache_groups[0].kv_cache_spec = spec
    return engine_layout(vllm_config, kv, parse_config({"bucket": "b-ok", **extra}))


def test_by_default_a_namespace_keeps_its_tp_size_and_one_object_per_rank():
    one, two = _parallel(1, 4), _parallel(2, 4)
    assert one.slicing.per_rank and two.slicing.per_rank and "kv_shards" not in two.fields
    ids = {lay.namespace({"model_content": "w"}).id for lay in (one, two)}
    assert len(ids) == 2  # TP 1 and TP 2 never share


def test_share_across_tp_cuts_by_head_and_every_tp_size_shares():
    lays = [_parallel(tp, 4, share_across_tp=True) for tp in (1, 2, 4)]
    assert {lay.namespace({"model_content": "w"}).id for lay in lays} == {
        lays[0].namespace({"model_content": "w"}).id
    }
    for lay in lays:
        assert "tp_size" not in lay.fields and lay.fields["kv_shards"] == {
            "mode": "heads",
            "shards": 4,
            "heads_per_shard": 1,
        }
        assert lay.fields["page_size_bytes"] == lay.page_size_bytes // lay.local_kv_heads  # one head's page
        assert lay.head_axis == 1 and lay.object_bytes(256) * len(lay.roles(0)) == lay.shard_bytes(256)
    assert [r.index for r in lays[1].roles(1)] == [2, 3]
    salted = _parallel(2, 4, share_across_tp=True, namespace_salt="x")
    assert salted.namespace({"model_content": "w"}).id != lays[1].namespace({"model_content": "w"}).id


def test_heads_that_ranks_hold_alike_are_written_once_with_the_tp_size_kept():
    lay = _parallel(2, 1)
    assert lay.fields["tp_size"] == 2 and lay.fields["kv_shards"]["shards"] == 1
    assert [(r.index, r.writer) for rank in (0, 1) for r in lay.roles(rank)] == [(0, True), (0, False)]
    assert lay.writers == [0]
    assert lay.head_axis is None and lay.object_bytes(256) == lay.shard_bytes(
        256
    )  # the rank's whole page, any layout


def test_an_mla_latent_is_one_object_at_any_tp_size():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    lay = _parallel(4, 1, spec=mla)
    assert lay.fields["kv_shards"] == {"mode": "replicated", "shards": 1, "heads_per_shard": 0}
    assert lay.fields["tp_size"] == 4 and lay.writers == [0] and lay.object_bytes(256) == lay.shard_bytes(256)
    shared = _parallel(4, 1, spec=mla, share_across_tp=True)
    assert "tp_size" not in shared.fields
    assert (
        shared.namespace({"model_content": "w"}).id
        == _parallel(1, 1, spec=mla, share_across_tp=True).namespace({"model_content": "w"}).id
    )


def _staged(pp: int, first_stage_layers: int, hidden_layers: int, groups=None, stage: int = 0):
    """A layout as the scheduler side of a ``pp``-stage engine sees it
    (the first stage's KV cache), or a worker of ``stage`` (its own)."""
    vllm_config, kv = _configs()
    vllm_config.parallel_config.pipeline_parallel_size = pp
    vllm_config.model_config.hf_text_config = SimpleNamespace(num_hidden_layers=hidden_layers)
    if groups is not None:
        kv = SimpleNamespace(
            kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=names) for spec, names in groups]
        )
    else:
        kv.kv_cache_groups[0].layer_names = [f"l{i}" for i in range(first_stage_layers)]
    return engine_layout(vllm_config, kv, parse_config({"bucket": "b-ok"}), pp_rank=stage)


def test_pipeline_stages_store_their_own_layers_as_shards_of_their_own():
    lay = _staged(3, 3, 10)  # vLLM splits 10 decoder layers 3 + 4 + 3
    assert lay.fields["pp_size"] == 3 and lay.fields["num_layers"] == 4 and lay.frames == 4
    assert lay.world_size == 3 and lay.shards_per_part == 3 and lay.writers == [0, 1, 2]
    assert lay.shard_bytes(256) == 256 // 32 * lay.page_size_bytes * 4  # every stage's parts padded alike
    second = _staged(3, 4, 10, stage=1)  # the second stage's worker: its own 4 layers
    assert second.frames == 4 and second.pp_rank == 1 and [r.index for r in second.roles(0)] == [1]
    assert second.namespace({"model_content": "w"}) == lay.namespace({"model_content": "w"})
    assert "pp_size" not in _staged(1, 2, 2).fields  # without stages, namespaces are as they were


def test_pipeline_stages_of_layers_vllm_did_not_split_alike_or_of_groups_are_refused():
    with pytest.raises(ConfigError, match="one attention layer"):
        _staged(2, 3, 8)  # vLLM's first stage of 8 layers has 4
    with pytest.raises(ConfigError, match="pipeline stage 1 has 4"):
        _staged(3, 4, 9, stage=1)  # 3 + 3 + 3
    with pytest.raises(ConfigError, match="several KV cache groups under pipeline parallelism"):
        from vllm.v1.kv_cache_interface import SlidingWindowSpec

        swa = SlidingWindowSpec(
            block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=64
        )
        _staged(2, 2, 4, groups=[(_full(), ["l0"]), (swa, ["l1"])])
