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
