"""The namespace descriptor: what a replica writes reads back as its
namespace's TP size and chunk pages; one whose fields are not its
namespace's (edited, forged, another namespace's), too large or not JSON
says nothing the ops commands act on."""

from __future__ import annotations

import json

from s3kv.descriptor import MAX_BYTES, ChunkPages, encode, parse_descriptor
from s3kv.keys import Namespace

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
