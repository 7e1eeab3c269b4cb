"""How an engine keys chunks (:mod:`s3kv.connector.hashing`): by vLLM's
block hashes only where every replica computes the same ones, and then in a
namespace of their own that says how they were computed."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from s3kv.config import parse_config  # noqa: E402
from s3kv.connector.hashing import choose  # noqa: E402
from s3kv.connector.layout import EngineLayout  # noqa: E402
from s3kv.errors import ConfigError  # noqa: E402
from s3kv.identity import ModelSource  # noqa: E402

LAYOUT = EngineLayout({"m": 2}, ModelSource("/models/x"), 16, ("l0",), 1, 1, 16 << 10)


def _vllm(prefix_caching=True, algo="sha256", connector=True):
    cache = SimpleNamespace(enable_prefix_caching=prefix_caching, prefix_caching_hash_algo=algo)
    return SimpleNamespace(cache_config=cache, kv_transfer_config=object() if connector else None)


def _kv(hash_block_size=16):
    return SimpleNamespace(hash_block_size=hash_block_size)


def _namespace(hashing):
    return LAYOUT.keyed_by(hashing).namespace({"model_content": "w"}).id


@pytest.fixture(autouse=True)
def _no_hash_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


@pytest.mark.parametrize(
    ("vllm", "kv", "chunk_tokens", "setting", "block"),
    [
        (_vllm(), _kv(), 64, "auto", True),
        (_vllm(algo="sha256_cbor"), _kv(), 64, "auto", True),
        (_vllm(prefix_caching=False), _kv(), 64, "auto", True),  # vLLM hashes for a connector too
        (_vllm(prefix_caching=False, connector=False), _kv(), 64, "auto", False),
        (_vllm(algo="xxhash"), _kv(), 64, "auto", False),  # seeded at random per process
        (_vllm(algo="xxhash_cbor"), _kv(), 64, "auto", False),
        (_vllm(), _kv(48), 64, "auto", False),  # chunks end inside a hash block
        (_vllm(), _kv(None), 64, "auto", False),  # vLLM did not say
        (_vllm(), _kv(), 64, "tokens", False),
    ],
)
def test_the_block_scheme_needs_shared_hashes_of_whole_hash_blocks(vllm, kv, chunk_tokens, setting, block):
    hashing, why = choose(vllm, kv, chunk_tokens, setting)
    assert (hashing is not None) == block, why
    if block:
        assert hashing.scheme.hash_block_size == kv.hash_block_size and hashing.scheme.hash_bytes == 32


def test_the_hash_block_size_is_vllms_not_the_block_size():
    """With several KV cache groups vLLM may hash at a finer granularity than a group's block size."""
    hashing, _ = choose(_vllm(), _kv(8), 64, "auto")
    assert hashing is not None and hashing.scheme.hash_block_size == 8


def test_replicas_that_hash_differently_never_share_a_namespace(monkeypatch):
    base = _namespace(choose(_vllm(), _kv(), 64, "auto")[0])
    assert _namespace(choose(_vllm(), _kv(), 64, "auto")[0]) == base  # another process, same settings
    variants = {
        "token scheme": _namespace(None),
        "algorithm": _namespace(choose(_vllm(algo="sha256_cbor"), _kv(), 64, "auto")[0]),
        "hash block size": _namespace(choose(_vllm(), _kv(32), 64, "auto")[0]),
        # The same last block ends a chunk of 64 tokens and one of 128: keys alike, contents not.
        "chunk tokens": _namespace(choose(_vllm(), _kv(), 128, "auto")[0]),
    }
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    variants["seed"] = _namespace(choose(_vllm(), _kv(), 64, "auto")[0])
    monkeypatch.setenv("PYTHONHASHSEED", "8")
    variants["another seed"] = _namespace(choose(_vllm(), _kv(), 64, "auto")[0])
    assert all(v != base for v in variants.values()), [k for k, v in variants.items() if v == base]
    assert len(set(variants.values())) == len(variants)


def test_the_token_scheme_keeps_the_namespace_as_it_was():
    """Existing caches of replicas that key by tokens stay valid: no field is added."""
    assert LAYOUT.keyed_by(None) is LAYOUT
    keyed = LAYOUT.keyed_by(choose(_vllm(), _kv(), 64, "auto")[0])
    assert set(keyed.fields) - set(LAYOUT.fields) == {"chunk_keys"} and keyed.hash_scheme is not None
    assert dataclasses.replace(keyed, fields=LAYOUT.fields, hash_scheme=None) == LAYOUT


def test_the_seed_is_in_the_namespace_as_a_digest_only(monkeypatch):
    """Not as it is (a digest of a 32-bit PYTHONHASHSEED hides nothing from
    whoever tries them all, the docstring says; it keeps logs tidy)."""
    monkeypatch.setenv("PYTHONHASHSEED", "3141592653")
    hashing, _ = choose(_vllm(), _kv(), 64, "auto")
    assert hashing is not None and hashing.seed == "3141592653"
    assert "3141592653" not in repr(hashing.fields())


def test_chunk_keys_is_a_config_key():
    assert parse_config({"bucket": "b-ok"}).chunk_keys == "auto"
    assert parse_config({"bucket": "b-ok", "chunk_keys": "tokens"}).chunk_keys == "tokens"
    with pytest.raises(ConfigError, match="chunk_keys"):
        parse_config({"bucket": "b-ok", "chunk_keys": "blocks"})


_VLLM_HASH_SCRIPT = """
import json
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash
from s3kv.connector.hashing import choose
from s3kv.connector.layout import EngineLayout
from s3kv.identity import ModelSource
from s3kv.keys import hash_key_mask, hash_keys
from types import SimpleNamespace as S

init_none_hash(get_hash_fn_by_name("sha256"))  # as vLLM's engine core does at start-up
parent, hashes = None, []
for b in range(8):
    parent = hash_block_tokens(get_hash_fn_by_name("sha256"), parent, list(range(16 * b, 16 * b + 16)))
    hashes.append(bytes(parent))
vllm = S(cache_config=S(enable_prefix_caching=True, prefix_caching_hash_algo="sha256"), kv_transfer_config=1)
hashing, _ = choose(vllm, S(hash_block_size=16), 64, "auto")
layout = EngineLayout({"m": 2}, ModelSource("/models/x"), 16, ("l0",), 1, 1, 16 << 10).keyed_by(hashing)
ns = layout.namespace({"model_content": "w"})
keys, _ = hash_keys(hashes[3::4], hash_key_mask(ns), 32)
print(json.dumps([ns.id, [k.hex() for k in keys]]))
"""


def test_replicas_get_the_same_block_hash_keys_from_vllms_own_hashes():
    """vLLM's own block hashes (sha256, its default), in separate processes
    as replicas are, with PYTHONHASHSEED unset: equal keys in one namespace
    (vLLM's fixed seed). A vLLM that seeded sha256 at random would fail here;
    that another seed makes another namespace is checked in process above."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", _VLLM_HASH_SCRIPT], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [json.loads(p.communicate(timeout=300)[0]) for p in runs]
    assert [p.returncode for p in runs] == [0, 0]
    assert outs[0] == outs[1] and len(outs[0][1]) == 2
    hashing, _ = choose(_vllm(), _kv(), 64, "auto")
    assert outs[0][0] == _namespace(
        hashing
    )  # the namespace this process computes: the seed is vLLM's default
