import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from s3kv.keys import (
    Namespace,
    canonical_bytes,
    chain_keys,
    chunk_path,
    fingerprint,
    hash_key_mask,
    hash_keys,
    object_key,
    parse_chunk_name,
    parse_object_key,
)

NS = Namespace.from_fields({"model_content": "abc", "model_dtype": "torch.bfloat16", "block_size": 32})
TOKENS = list(range(1000, 1000 + 700))

_SCRIPT = """
import json, sys
from s3kv.keys import Namespace, chain_keys
ns = Namespace.from_fields({"model_content": "abc", "model_dtype": "torch.bfloat16", "block_size": 32})
keys = chain_keys(ns, list(range(1000, 1700)), 64, [None, ("lora", "x", "/p"), None, ("cache_salt", "s")])
print(json.dumps([k.hex() for k in keys]))
"""


def _same_output_whatever_the_hash_seed(script: str) -> str:
    """``script``'s stdout, run in two processes with different hash seeds;
    asserts both printed the same."""
    outs = []
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.append(
            subprocess.run(
                [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
            ).stdout
        )
    assert outs[0] == outs[1]
    return outs[0]


def test_same_keys_in_separate_processes_with_different_hash_seeds():
    out = _same_output_whatever_the_hash_seed(_SCRIPT)
    here = chain_keys(NS, TOKENS, 64, [None, ("lora", "x", "/p"), None, ("cache_salt", "s")])
    assert out.strip() == "[" + ", ".join(f'"{k.hex()}"' for k in here) + "]"


_HASH_SCRIPT = """
import hashlib, json
from s3kv.keys import Namespace, hash_key_mask, hash_keys
ns = Namespace.from_fields({"model_content": "abc", "model_dtype": "torch.bfloat16", "block_size": 32})
hashes = [hashlib.sha256(b"block %d" % i).digest() for i in range(4)]
keys, fps = hash_keys(hashes, hash_key_mask(ns), 32)
print(json.dumps([[k.hex() for k in keys], fps.tolist()]))
"""


def test_keys_from_block_hashes_are_the_same_in_separate_processes():
    """Two "processes" (replicas) given the same vLLM block hashes get the
    same chunk keys and fingerprints, whatever their own hash seeds."""
    out = _same_output_whatever_the_hash_seed(_HASH_SCRIPT)
    hashes = [hashlib.sha256(b"block %d" % i).digest() for i in range(4)]
    keys, fps = hash_keys(hashes, hash_key_mask(NS), 32)
    assert json.loads(out) == [[k.hex() for k in keys], fps.tolist()]


def test_a_key_from_a_block_hash_is_its_first_16_bytes_masked_by_the_namespace():
    hashes = [hashlib.sha256(b"block %d" % i).digest() for i in range(5)]
    mask = hash_key_mask(NS)
    keys, fps = hash_keys(hashes, mask, 32)
    assert keys == [bytes(a ^ b for a, b in zip(h[:16], mask, strict=True)) for h in hashes]
    assert fps.dtype == np.uint64 and fps.tolist() == [fingerprint(k) for k in keys]
    assert hash_keys(hashes[2:4], mask, 32)[0] == keys[2:4]  # a key names its hash alone: any slice
    assert hash_keys([], mask, 32)[0] == [] and len(hash_keys([], mask, 32)[1]) == 0


@pytest.mark.parametrize("hash_bytes", [16, 24, 32, 64])
def test_keys_from_block_hashes_agree_with_each_hash_masked_alone(hash_bytes):
    """All chunks at once (one XOR of the joined hashes) is each hash's
    first 16 bytes XOR the mask, for any count and hash size."""
    rng = np.random.default_rng(hash_bytes)
    mask = hash_key_mask(NS)
    for n in (1, 2, 3, 32, 100):
        hashes = [rng.bytes(hash_bytes) for _ in range(n)]
        keys, fps = hash_keys(hashes, mask, hash_bytes)
        assert keys == [bytes(a ^ b for a, b in zip(h[:16], mask, strict=True)) for h in hashes]
        assert fps.dtype == np.uint64 and fps.tolist() == [fingerprint(k) for k in keys]
        assert fps.flags.c_contiguous and fps.flags.writeable


def test_keys_from_block_hashes_differ_by_namespace_and_adapter():
    hashes = [hashlib.sha256(b"block %d" % i).digest() for i in range(4)]
    other = Namespace.from_fields({"model_content": "abd"})
    base = hash_keys(hashes, hash_key_mask(NS), 32)[0]
    for mask in (hash_key_mask(other), hash_key_mask(NS, "adapter:x"), hash_key_mask(NS, "adapter:y")):
        assert set(hash_keys(hashes, mask, 32)[0]).isdisjoint(base)
    assert hash_key_mask(NS, "adapter:x") != hash_key_mask(NS, "adapter:y")
    assert hash_key_mask(NS, None) == hash_key_mask(NS)


def test_block_hashes_of_another_size_are_refused():
    mask = hash_key_mask(NS)
    with pytest.raises(ValueError):
        hash_keys([b"x" * 32, b"y" * 31], mask, 32)
    with pytest.raises(ValueError):
        hash_keys([b"x" * 8], mask, 8)  # shorter than a key
    with pytest.raises(ValueError):
        hash_keys([b"x" * 32], mask[:8], 32)


def test_keys_chain_over_the_prefix():
    keys = chain_keys(NS, TOKENS, 64)
    assert len(keys) == 700 // 64 and len(set(keys)) == len(keys)
    changed = list(TOKENS)
    changed[5] += 1  # a change in chunk 0 changes every later key
    assert set(chain_keys(NS, changed, 64)).isdisjoint(keys)
    later = list(TOKENS)
    later[64 * 3] += 1  # a change in chunk 3 keeps chunks 0..2
    k2 = chain_keys(NS, later, 64)
    assert k2[:3] == keys[:3] and set(k2[3:]).isdisjoint(keys)


def test_extending_a_chain_equals_computing_it_whole():
    keys = chain_keys(NS, TOKENS, 64)
    tail = chain_keys(NS, TOKENS[4 * 64 :], 64, parent=keys[3], start_chunk=4)
    assert keys[4:] == tail


@pytest.mark.parametrize(
    "field,value",
    [
        ("model_content", "other-weights"),
        ("model_dtype", "torch.float16"),
        ("block_size", 64),
        ("tp_size", 2),
    ],
)
def test_namespace_fields_give_disjoint_keys(field, value):
    other = Namespace.from_fields({**NS.fields, field: value})
    assert other.id != NS.id
    assert set(chain_keys(other, TOKENS, 64)).isdisjoint(chain_keys(NS, TOKENS, 64))


def test_extra_keys_change_keys():
    plain = chain_keys(NS, TOKENS, 64)
    salted = chain_keys(NS, TOKENS, 64, [("cache_salt", "tenant-a")])
    salted_b = chain_keys(NS, TOKENS, 64, [("cache_salt", "tenant-b")])
    lora = chain_keys(NS, TOKENS, 64, [("lora", "adapter", "/path")] * 10)
    mm = chain_keys(NS, TOKENS, 64, [None, (("mm", "hash1", 3),)])
    assert set(salted).isdisjoint(plain) and set(salted).isdisjoint(salted_b)
    assert set(lora).isdisjoint(plain)
    assert mm[0] == plain[0] and set(mm[1:]).isdisjoint(plain)


def test_canonical_bytes_is_unambiguous():
    assert canonical_bytes(("a", "bc")) != canonical_bytes(("ab", "c"))
    assert canonical_bytes(1) != canonical_bytes("1") != canonical_bytes(b"1")
    assert canonical_bytes({"b": 1, "a": 2}) == canonical_bytes({"a": 2, "b": 1})
    with pytest.raises(TypeError):
        canonical_bytes(object())


def test_object_key_layout_per_rank():
    key = chain_keys(NS, TOKENS, 64)[0]
    names = [object_key("fleet", NS.id, key, r) for r in range(4)]
    assert names[0] == f"fleet/{NS.id}/{key.hex()[:2]}/{key.hex()}.r0"
    assert len(set(names)) == 4
    for r, name in enumerate(names):
        assert parse_object_key(name) == (NS.id, key, r)
    assert object_key("", NS.id, key, 1) == f"{NS.id}/{key.hex()[:2]}/{key.hex()}.r1"
    assert parse_object_key(f"fleet/{NS.id}/manifest/seg-1") is None
    assert parse_object_key(f"fleet/{NS.id}/namespace.json") is None
    assert parse_object_key(f"fleet/{NS.id}/zz/{key.hex()}.r0") is None  # shard must match
    assert fingerprint(key) == int.from_bytes(key[:8], "big")


def test_one_chunk_name_in_s3_and_on_nvme(tmp_path):
    """The S3 object key is the prefix and the NVMe file's path below
    ``disk_path``; both parse back with the one parser, which takes exactly
    the names s3kv builds."""
    from s3kv.tiering.tiers.nvme.files import shard_path

    key = chain_keys(NS, TOKENS, 64)[0]
    path = chunk_path(NS.id, key, 3)
    assert path == f"{NS.id}/{key.hex()[:2]}/{key.hex()}.r3"
    assert object_key("fleet", NS.id, key, 3) == f"fleet/{path}" and object_key("", NS.id, key, 3) == path
    assert shard_path(tmp_path, NS.id, key, 3) == tmp_path / NS.id / key.hex()[:2] / f"{key.hex()}.r3"
    assert parse_chunk_name(f"{key.hex()}.r3", key.hex()[:2]) == (key, 3)
    for name in (f"{key.hex().upper()}.r3", f"{key.hex()}.r03", f"{key.hex()}.r+3", f"{key.hex()}.r\u0663"):
        assert parse_chunk_name(name, key.hex()[:2]) is None
        assert parse_object_key(f"fleet/{NS.id}/{key.hex()[:2]}/{name}") is None
    assert parse_object_key(f"fleet/{NS.id.upper()}/{key.hex()[:2]}/{key.hex()}.r3") is None


def test_max_chunks_bounds_a_chain():
    keys = chain_keys(NS, TOKENS, 64)
    assert chain_keys(NS, TOKENS, 64, max_chunks=3) == keys[:3]
    assert chain_keys(NS, TOKENS[:200], 64, max_chunks=3) == keys[:3]  # a tail makes no key
    assert chain_keys(NS, TOKENS, 64, max_chunks=100) == keys
