"""What the scheduler side reads of a vLLM request
(:mod:`s3kv.connector.requests`), on its own; through the scheduler side
(adapters hashed by content, a huge policy parameter), see
test_connector_scheduler.py."""

import logging
from types import SimpleNamespace

from s3kv.connector.requests import POLICY_PARAM, RequestReader
from s3kv.stats import Counters


def reader(block_size=16, chunk_tokens=64):
    return RequestReader(block_size, chunk_tokens, None, Counters())


def request(req_id="r", **kw):
    fields = {
        "request_id": req_id,
        "lora_request": None,
        "mm_features": None,
        "cache_salt": None,
        "prompt_embeds": None,
        "num_tokens": 160,
        "num_prompt_tokens": 160,
        "block_hashes": [],
        **kw,
    }
    return SimpleNamespace(**fields)


def test_prefix_ids_from_vllm_block_hashes():
    """Chunk c's prefix is named by the hash of its last block; another
    hashing granularity than the block size gives no ids."""
    r = reader()
    hashes = [f"h{i}" for i in range(10)]  # 160 tokens: 2 full chunks and a half
    ids = r.prefix_ids(SimpleNamespace(block_hashes=hashes, num_tokens=160))
    assert [ids(c) for c in range(3)] == ["h3", "h7", None]
    assert r.prefix_ids(SimpleNamespace(block_hashes=hashes[:5], num_tokens=160)) is None
    assert r.prefix_ids(SimpleNamespace(block_hashes=[], num_tokens=160)) is None


def test_a_plain_request_is_keyed_by_its_tokens_and_block_hashes_alone():
    r = reader()
    keying = r.keying(request(block_hashes=[f"h{i}" for i in range(10)]))
    assert keying is not None and keying.extras is None and keying.prefix_ids(1) == "h7"


def test_an_unkeyed_request_is_counted_once():
    r = reader()
    for _ in range(3):
        r.unkeyed(request("u"), "adapter")
    r.unkeyed(request("v"), "model")
    totals = r.counters.totals()
    assert totals["unkeyed_requests_adapter"] == 1 and totals["unkeyed_requests_model"] == 1
    assert totals["lookup_requests"] == 2 and totals["lookup_tokens"] == 320


def test_a_requests_load_policy_is_read_once_and_forgotten_when_it_finishes(caplog):
    caplog.set_level(logging.WARNING, logger="s3kv")
    r = reader()
    assert r.policy(request("a", kv_transfer_params={POLICY_PARAM: "Always"})) == "always"
    assert r.policy(request("a", kv_transfer_params={POLICY_PARAM: "cost"})) == "always"  # read once
    assert r.policy(request("n")) is None and not caplog.records
    assert r.policy(request("bad", kv_transfer_params={POLICY_PARAM: "never"})) is None
    assert "'never' is not one of" in caplog.text
    r.finished("a")
    assert r.policy(request("a", kv_transfer_params={POLICY_PARAM: "cost"})) == "cost"


def _hashing(seed="vllm-none-hash", hash_block_size=16):
    from s3kv.connector.hashing import VllmHashing
    from s3kv.tiering.scheduler.keychain import HashScheme

    return VllmHashing(HashScheme(hash_block_size), "sha256", seed, 64)


def block_reader(seed_now=lambda: "vllm-none-hash", **kw):
    return RequestReader(16, 64, None, Counters(), _hashing(**kw), seed_now)


def test_under_the_block_scheme_a_request_is_keyed_by_its_block_hashes_alone():
    r = block_reader()
    hashes = [bytes([i]) * 32 for i in range(10)]  # 160 tokens of 16-token blocks
    keying = r.keying(request(block_hashes=hashes, cache_salt="s"))
    assert keying.extras is None and keying.prefix_ids is None  # the hashes hold the extra keys
    assert keying.block_hashes.hashes is hashes and keying.block_hashes.adapter is None


def test_under_the_block_scheme_hashes_of_another_granularity_leave_a_request_unkeyed():
    r = block_reader(hash_block_size=32)
    hashes = [bytes([i]) * 32 for i in range(10)]  # 16-token blocks, where 32 were promised
    assert r.keying(request(block_hashes=hashes)) == "hashes"
    assert r.keying(request(block_hashes=None)) == "hashes"
    assert r.keying(request(block_hashes=hashes[:5])).block_hashes.hashes == hashes[:5]


def test_under_the_block_scheme_a_seed_not_the_namespaces_leaves_every_request_unkeyed(caplog):
    caplog.set_level(logging.ERROR, logger="s3kv")
    asked = []
    r = block_reader(seed_now=lambda: asked.append(1) or "4242")
    hashes = [bytes([i]) * 32 for i in range(10)]
    assert r.keying(request(block_hashes=hashes)) == "hash_seed"
    assert r.keying(request(block_hashes=hashes)) == "hash_seed"
    assert len(asked) == 1 and caplog.text.count("another seed") == 1  # checked and logged once
    assert "4242" not in caplog.text


def test_under_the_block_scheme_a_lora_request_carries_its_adapters_content_digest():
    r = block_reader()
    lora = SimpleNamespace(lora_name="sql", lora_int_id=1, lora_path="/adapters/sql")
    r.adapters._known[("sql", 1, "/adapters/sql")] = "adapter:abc"  # as its background hash leaves it
    keying = r.keying(request(lora_request=lora, block_hashes=[b"x" * 32] * 10))
    assert keying.block_hashes.adapter == "adapter:abc"
    other = SimpleNamespace(lora_name="new", lora_int_id=2, lora_path="/adapters/new")
    assert r.keying(request(lora_request=other, block_hashes=[b"x" * 32] * 10)) == "adapter"
    r.close()
