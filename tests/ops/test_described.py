"""What the ops commands show of a namespace's descriptor
(:mod:`s3kv.ops.described`): its KV cache groups in a line and as rows, and
the whole descriptor, from any bytes under its name, at a bounded cost."""

from __future__ import annotations

import asyncio
import json

import pytest

from s3kv import descriptor
from s3kv.descriptor import DescribedGroup
from s3kv.errors import CorruptChunk, NotFound
from s3kv.ops.described import group_rows, inspect_descriptor, short_names, summary
from s3kv.stores.memory import MemoryStore
from tests.ops.groups import KV_GROUPS, TOKENS, layer_names, namespace


def _g(kind: str, window: int, n: int) -> DescribedGroup:
    return DescribedGroup(kind, window, tuple(layer_names(*range(n))))


def test_the_groups_in_a_line():
    gemma = [_g("sliding_window", 1024, 1)] * 5 + [_g("full", 0, 1)]
    assert summary(gemma) == "6 groups (5x sliding_window 1024 + 1x full, 1 layer each)"
    padded = [_g("sliding_window", 512, 4), _g("full", 0, 4), _g("sliding_window", 512, 2)]
    assert summary(padded) == "3 groups (2x sliding_window 512 + 1x full, 2-4 layers each)"
    llama4 = [_g("chunked_local", 8192, 3), _g("full", 0, 3)]
    assert summary(llama4) == "2 groups (1x chunked_local 8192 + 1x full, 3 layers each)"
    assert summary([_g("sliding_window", 4096, 32)]) == "1 group (sliding_window 4096, 32 layers)"


def test_layer_names_are_shortened_and_rows_say_each_group():
    assert short_names(["a", "b"]) == "a, b"
    assert short_names(["a", "b", "c", "d", "e"]) == "a, b, c, ... (+2)"
    groups = [_g("sliding_window", 1024, 2), _g("full", 0, 1)]
    assert group_rows(groups) == [
        {"group": 0, "kind": "sliding_window", "window": 1024, "layers": 2},
        {"group": 1, "kind": "full", "window": 0, "layers": 1},
    ]
    assert group_rows(groups, names=True)[1]["layer_names"] == layer_names(0)


def _inspect(name: str, body: bytes | None) -> dict:
    async def go() -> dict:
        store = MemoryStore()
        if body is not None:
            await store.put(name, body)
        return await inspect_descriptor(store, name)

    return asyncio.run(go())


def test_a_replicas_descriptor_reads_whole_and_sound():
    ns = namespace("gemma")
    got = _inspect(f"fleet/{ns.id}/namespace.json", descriptor.encode(ns, "gemma", TOKENS))
    assert got["problems"] == [] and got["namespace"] == ns.id and got["model"] == "gemma"
    assert [g["layer_names"] for g in got["kv_groups"]] == [g["layers"] for g in KV_GROUPS]
    assert got["fields"]["kv_groups"] == KV_GROUPS
    # A local copy (no namespace directory): the namespace it names, checked all the same.
    local = _inspect("file/namespace.json", descriptor.encode(ns, "gemma", TOKENS))
    assert local["namespace"] == ns.id and local["problems"] == [] and local["kv_groups"] == got["kv_groups"]


def test_what_is_not_a_replicas_descriptor_is_said_so_never_raised():
    ns = namespace("gemma")
    name = f"fleet/{ns.id}/namespace.json"
    assert "not a JSON object" in _inspect(name, b"[" * 50_000)["problems"][0]
    assert "not a JSON object" in _inspect(name, b"[1, 2]")["problems"][0]
    other = namespace("other")  # another namespace's, under this one's name
    moved = _inspect(name, descriptor.encode(other, "gemma", TOKENS))
    assert moved["namespace"] == ns.id and "do not hash to that id" in moved["problems"][0]
    assert "kv_groups" not in moved
    ungrouped = namespace("gemma", num_layers=2)  # a group of 3 layers, parts of 2 frames
    short = _inspect(f"fleet/{ungrouped.id}/namespace.json", descriptor.encode(ungrouped, "g", TOKENS))
    assert short["problems"] == [] and short["frames"] is None and len(short["kv_groups"]) == 3
    assert "does not say its chunks' pages" in short["notes"][0]


def test_a_descriptor_larger_than_replicas_write_is_refused_unread_and_a_missing_one_is_not_found():
    ns = namespace("gemma")
    doc = json.loads(descriptor.encode(ns, "gemma", TOKENS))
    doc["pad"] = "x" * descriptor.MAX_BYTES
    with pytest.raises(CorruptChunk, match="more than"):
        _inspect(f"fleet/{ns.id}/namespace.json", json.dumps(doc).encode())
    with pytest.raises(NotFound):
        _inspect(f"fleet/{ns.id}/namespace.json", None)
