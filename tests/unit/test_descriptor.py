"""The namespace descriptor: what a replica writes reads back as its
namespace's TP size, chunk pages and KV cache groups; one whose fields are
not its namespace's (edited, forged, another namespace's), too large or not
JSON says nothing the ops commands act on, and groups that are not what a
replica writes describe no pages."""

from __future__ import annotations

import json

import pytest

from s3kv.descriptor import (
    MAX_BYTES,
    MAX_GROUPS,
    MAX_LAYERS,
    ChunkPages,
    DescribedGroup,
    encode,
    parse_descriptor,
)
from s3kv.keys import Namespace
from s3kv.shards import HEADS, MAX_SHARDS, RANKS, REPLICATED, Slicing

# The kinds of values a replica's namespace holds (connector/layout.py):
# strings, ints, None, a list.
FIELDS = {
    "model_digest": "ab" * 16,
    "model_config": "cd" * 16,
    "quantization": "None",
    "kv_cache_dtype_skip_layers": [],
    "namespace_salt": "",
    "model_dtype": "torch.bfloat16",
    "kv_cache_dtype": "auto",
    "block_size": 16,
    "num_kv_heads": 2,
    "head_size": 64,
    "head_size_v": None,
    "page_size_bytes": 8192,
    "sliding_window": None,
    "num_layers": 24,
    "tp_size": 2,
    "dcp_size": 1,
}


def test_a_replicas_descriptor_says_its_tp_size_and_pages():
    ns = Namespace.from_fields(FIELDS)
    got = parse_descriptor(ns.id, encode(ns, "Qwen/Qwen3-0.6B", 256))
    assert got is not None and got.tp_size == 2
    assert got.pages == ChunkPages(num_layers=24, tokens=256, layer_bytes=256 // 16 * 8192)


def test_a_descriptor_that_is_not_its_namespaces_says_nothing():
    ns = Namespace.from_fields(FIELDS)
    doc = json.loads(encode(ns, "m", 256))
    forged = json.dumps({**doc, "fields": {**doc["fields"], "tp_size": 1}}).encode()
    assert parse_descriptor(ns.id, forged) is None  # the fields no longer hash to the id
    other = Namespace.from_fields({**FIELDS, "namespace_salt": "b"})
    assert parse_descriptor(other.id, encode(ns, "m", 256)) is None
    assert parse_descriptor(ns.id, encode(ns, "m", 256) + b" " * MAX_BYTES) is None  # too large
    assert parse_descriptor(ns.id, b"[" * 50_000) is None  # not JSON, however nested
    assert parse_descriptor(ns.id, b'{"namespace": "x"}') is None


def test_pages_it_cannot_bound_are_not_said():
    ns = Namespace.from_fields(FIELDS)
    uneven = parse_descriptor(ns.id, encode(ns, "m", 250))  # not whole blocks
    assert uneven is not None and uneven.tp_size == 2 and uneven.pages is None
    huge = parse_descriptor(ns.id, encode(ns, "m", 1 << 20))  # 512 MiB a layer
    assert huge is not None and huge.pages is None
    bare = Namespace.from_fields({"model": "m", "tp_size": True})  # a bool is no TP size
    got = parse_descriptor(bare.id, encode(bare, "m", 256))
    assert got is not None and got.tp_size is None and got.pages is None


def _group(kind: str, window: int, layers: list[str], **over) -> dict:
    """One ``kv_groups`` entry, as connector/layout.py writes it."""
    return {
        "kind": kind,
        "window": window,
        "spec": "SlidingWindowSpec" if window else "FullAttentionSpec",
        "block_size": 16,
        "page_size_bytes": 8192,
        "num_kv_heads": 2,
        "head_size": 64,
        "head_size_v": 64,
        "dtype": "torch.bfloat16",
        "layers": layers,
        **over,
    }


def _layers(*idx: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in idx]


# A Gemma 3 as vLLM's hybrid manager groups it: two sliding-window groups of
# 3 layers (the second padded to 2), one full-attention group of 1.
GROUPS = [
    _group("sliding_window", 1024, _layers(0, 1, 2)),
    _group("sliding_window", 1024, _layers(4, 6)),
    _group("full", 0, _layers(3)),
]
GROUPED = {**FIELDS, "num_layers": 3, "kv_groups": GROUPS}


def _parse(fields: dict, chunk_tokens: int = 256, compact: bool = False):
    ns = Namespace.from_fields(fields)
    if compact:  # as small as JSON gets: the bounds on groups and layers, not on bytes, refuse it
        doc = {"namespace": ns.id, "fields": dict(ns.fields), "chunk_tokens": chunk_tokens}
        return parse_descriptor(ns.id, json.dumps(doc, separators=(",", ":")).encode())
    return parse_descriptor(ns.id, encode(ns, "google/gemma-3-1b-it", chunk_tokens))


def test_a_grouped_descriptor_says_its_groups_and_the_pages_of_each_part():
    got = _parse(GROUPED)
    assert got is not None and got.tp_size == 2 and not got.groups_unread
    assert got.groups == (
        DescribedGroup("sliding_window", 1024, tuple(_layers(0, 1, 2))),
        DescribedGroup("sliding_window", 1024, tuple(_layers(4, 6))),
        DescribedGroup("full", 0, tuple(_layers(3))),
    )
    # Every part object holds num_layers frames of one chunk's pages each.
    assert got.pages == ChunkPages(num_layers=3, tokens=256, layer_bytes=256 // 16 * 8192)
    one = _parse(FIELDS)  # one full-attention group: no kv_groups field, no groups
    assert one is not None and one.groups is None and not one.groups_unread and one.pages is not None


@pytest.mark.parametrize(
    "kv_groups",
    [
        pytest.param(None, id="null"),
        pytest.param({"0": GROUPS[0]}, id="not-a-list"),
        pytest.param([], id="no-group"),
        pytest.param([*GROUPS, "full"], id="a-group-not-an-object"),
        pytest.param([_group("cross_attention", 0, _layers(0))], id="a-kind-s3kv-does-not-share"),
        pytest.param([_group(["full"], 0, _layers(0))], id="a-kind-not-a-string"),
        pytest.param([_group("full", 128, _layers(0))], id="full-with-a-window"),
        pytest.param([_group("sliding_window", 0, _layers(0))], id="sliding-without-a-window"),
        pytest.param([_group("sliding_window", -4, _layers(0))], id="negative-window"),
        pytest.param([_group("sliding_window", True, _layers(0))], id="bool-window"),
        pytest.param([_group("sliding_window", "1024", _layers(0))], id="string-window"),
        pytest.param([_group("chunked_local", 1 << 40, _layers(0))], id="huge-window"),
        pytest.param([_group("full", 0, [])], id="no-layer"),
        pytest.param([_group("full", 0, "model.layers.0")], id="layers-a-string"),
        pytest.param([_group("full", 0, [0, 1])], id="layers-not-names"),
        pytest.param([*GROUPS[:2], _group("full", 0, _layers(3), block_size=32)], id="other-block-size"),
        pytest.param([*GROUPS[:2], _group("full", 0, _layers(3), page_size_bytes=4096)], id="other-page"),
        pytest.param([*GROUPS[:2], _group("full", 0, _layers(3), page_size_bytes=None)], id="no-page"),
    ],
)
def test_groups_it_cannot_read_are_not_said_and_describe_no_pages(kv_groups):
    """Whoever writes the bucket may make a namespace of any fields: kv_groups
    that are not what a replica writes say nothing (never an exception), and
    the pages of its parts are then not known either."""
    got = _parse({**GROUPED, "kv_groups": kv_groups})
    assert got is not None and got.tp_size == 2  # the rest of it still reads
    assert got.groups is None and got.groups_unread and got.pages is None


def test_more_groups_or_layers_than_a_model_has_are_not_said():
    small = {"kind": "full", "window": 0, "block_size": 16, "page_size_bytes": 8192, "layers": ["a"]}
    for kv_groups in ([small] * (MAX_GROUPS + 1), [{**small, "layers": ["a"] * (MAX_LAYERS + 1)}]):
        got = _parse({**GROUPED, "kv_groups": kv_groups}, compact=True)
        assert got is not None and got.tp_size == 2
        assert got.groups is None and got.groups_unread and got.pages is None
    fits = _parse({**GROUPED, "kv_groups": [small] * MAX_GROUPS}, compact=True)
    assert fits is not None and fits.groups is not None and len(fits.groups) == MAX_GROUPS


def test_a_group_with_more_layers_than_the_frames_of_a_part_describes_no_pages():
    """num_layers is the frames of every part: the most layers a group has.
    A descriptor naming fewer frames than a group's layers does not say what
    its parts hold (a part of that group would look corrupt against it)."""
    got = _parse({**GROUPED, "num_layers": 2})
    assert got is not None and got.groups is not None and len(got.groups) == 3
    assert got.pages is None
    more = _parse({**GROUPED, "num_layers": 4})  # more frames than any group: still bounded
    assert more is not None and more.pages == ChunkPages(4, 256, 256 // 16 * 8192)


# A namespace replicas of every TP size share (s3kv.shards): kv_shards, no tp_size.
SHARED = {k: v for k, v in FIELDS.items() if k != "tp_size"}
GROUPED_SHARED = {k: v for k, v in GROUPED.items() if k != "tp_size"}
BY_HEAD = {"mode": "heads", "shards": 4, "heads_per_shard": 2}


def test_a_shared_namespace_says_its_shards_and_the_pages_of_each():
    got = _parse({**SHARED, "kv_shards": BY_HEAD})
    assert got is not None and got.tp_size is None and not got.shards_unread
    assert got.shards == 4 and got.slicing == Slicing(HEADS, 4, 2) and not got.slicing.per_rank
    # page_size_bytes is one shard's page: each shard object holds num_layers frames of them.
    assert got.pages == ChunkPages(num_layers=24, tokens=256, layer_bytes=256 // 16 * 8192)
    mla = _parse({**SHARED, "kv_shards": {"mode": "replicated", "shards": 1, "heads_per_shard": 0}})
    assert mla is not None and mla.shards == 1 and mla.slicing == Slicing(REPLICATED, 1)
    widest = _parse({**SHARED, "kv_shards": {**BY_HEAD, "shards": MAX_SHARDS}})
    assert widest is not None and widest.shards == MAX_SHARDS
    grouped = _parse({**GROUPED_SHARED, "kv_shards": BY_HEAD})  # every part of 4 shards
    assert grouped is not None and grouped.shards == 4 and grouped.groups is not None
    assert grouped.pages == ChunkPages(num_layers=3, tokens=256, layer_bytes=256 // 16 * 8192)


def test_without_kv_shards_a_part_is_one_object_a_rank():
    got = _parse(FIELDS)
    assert got is not None and got.shards == 2 and got.slicing == Slicing(RANKS, 2)
    assert got.slicing.per_rank and not got.shards_unread
    bare = _parse({k: v for k, v in FIELDS.items() if k != "tp_size"})  # neither said
    assert bare is not None and bare.shards is None and bare.slicing is None and not bare.shards_unread


@pytest.mark.parametrize(
    "kv_shards",
    [
        pytest.param(None, id="null"),
        pytest.param([4, 2], id="not-an-object"),
        pytest.param("heads", id="a-string"),
        pytest.param({"mode": "heads", "shards": 4}, id="no-heads-per-shard"),
        pytest.param({**BY_HEAD, "order": "reversed"}, id="a-field-s3kv-does-not-write"),
        pytest.param({**BY_HEAD, "mode": "ranks"}, id="ranks-mode-is-no-field"),
        pytest.param({**BY_HEAD, "mode": "layers"}, id="unknown-mode"),
        pytest.param({**BY_HEAD, "mode": ["heads"]}, id="mode-not-a-string"),
        pytest.param({**BY_HEAD, "shards": True}, id="bool-shards"),
        pytest.param({**BY_HEAD, "shards": 4.0}, id="float-shards"),
        pytest.param({**BY_HEAD, "shards": "4"}, id="string-shards"),
        pytest.param({**BY_HEAD, "shards": 0}, id="no-shard"),
        pytest.param({**BY_HEAD, "shards": -4}, id="negative-shards"),
        pytest.param({**BY_HEAD, "shards": MAX_SHARDS + 1}, id="more-shards-than-s3kv-cuts"),
        pytest.param({**BY_HEAD, "shards": 1 << 40}, id="huge-shards"),
        pytest.param({**BY_HEAD, "heads_per_shard": 0}, id="slices-of-no-head"),
        pytest.param({**BY_HEAD, "heads_per_shard": -1}, id="negative-heads"),
        pytest.param({**BY_HEAD, "heads_per_shard": True}, id="bool-heads"),
        pytest.param({"mode": "replicated", "shards": 2, "heads_per_shard": 0}, id="replicated-twice"),
        pytest.param({"mode": "replicated", "shards": 1, "heads_per_shard": 1}, id="replicated-heads"),
        pytest.param({"mode": "replicated", "shards": 1, "heads_per_shard": False}, id="replicated-bool"),
    ],
)
def test_kv_shards_it_cannot_read_say_no_objects_and_no_pages(kv_shards):
    """Whoever writes the bucket may make a namespace of any fields: a
    kv_shards that is not what a replica writes says nothing (never an
    exception): neither how many objects a part has nor what they hold."""
    got = _parse({**SHARED, "kv_shards": kv_shards})
    assert got is not None and got.shards_unread
    assert got.shards is None and got.slicing is None and got.pages is None
    grouped = _parse({**GROUPED_SHARED, "kv_shards": kv_shards})  # the groups still read
    assert grouped is not None and grouped.groups is not None and grouped.shards is None


def test_kv_shards_beside_a_tp_size_is_a_cut_that_keeps_its_tp_size():
    """Replicas that do not share across TP sizes (``share_across_tp`` off)
    still store replicated KV once: kv_shards says the objects, tp_size stays."""
    got = _parse({**FIELDS, "kv_shards": BY_HEAD})
    assert got is not None and not got.shards_unread and got.tp_size == 2
    assert got.slicing is not None and got.shards == BY_HEAD["shards"] and got.pages is not None


def test_pipeline_stages_each_have_their_shards():
    """Each pipeline stage stores its own layers' shards: a part is its
    stages' shards together; a pp_size that is not one says no shards."""
    got = _parse({**FIELDS, "pp_size": 2})
    assert got is not None and got.pp_size == 2 and got.shards == 2 * 2  # tp 2, two stages
    cut = _parse({**SHARED, "kv_shards": BY_HEAD, "pp_size": 3})
    assert cut is not None and cut.shards == BY_HEAD["shards"] * 3
    for bad in (0, True, "2", 1 << 9):
        got = _parse({**FIELDS, "pp_size": bad})
        assert got is not None and got.pp_size is None and got.shards is None, bad
    assert _parse(FIELDS).pp_size == 1
