"""Start-up checks of the connector's scheduler side, against a real S3
server on loopback: what fails start-up, and what only warns."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from s3kv.config import parse_config
from s3kv.errors import ConfigError
from s3kv.identity import ModelSource
from s3kv.tiering.scheduler import runtime

pytest.importorskip("vllm")

from s3kv.connector import scheduler  # noqa: E402
from s3kv.connector.layout import EngineLayout  # noqa: E402
from s3kv.connector.requests import POLICY_PARAM  # noqa: E402
from s3kv.connector.scheduler import SchedulerSide  # noqa: E402
from tests.conftest import wait_until  # noqa: E402

STARTUP_BOUND_S = 120
"""How long a test lets start-up take: a bound for a busy machine."""

LAYOUT = EngineLayout(
    {"model": "unit"},
    ModelSource("unit", digest="unit-test-weights"),
    block_size=32,
    layer_names=("l0",),
    tp_size=1,
    world_size=1,
    page_size_bytes=16 << 10,
)


def side(**cfg):
    config = parse_config({"region": "us-east-1", "s3_connect_timeout_s": 1, "s3_max_attempts": 1, **cfg})
    return SchedulerSide(config, LAYOUT, failure_policy="recompute", model="unit")


@pytest.fixture
def patient_startup(monkeypatch):
    """The constructor waits for start-up (the identity, the tiers, the
    manifest) until it is done, not STARTUP_WAIT_S (5 s): a test that reads
    what start-up made needs it done, however busy the machine."""
    monkeypatch.setattr(runtime, "STARTUP_WAIT_S", STARTUP_BOUND_S)


def test_missing_bucket_fails_startup_naming_it(s3_server):
    with pytest.raises(ConfigError, match="bucket: s3://no-such-bucket does not exist"):
        side(bucket="no-such-bucket", endpoint_url=s3_server.endpoint_url)


def test_existing_bucket_starts_and_lists(s3_server, bucket, patient_startup):
    s = side(bucket=bucket, endpoint_url=s3_server.endpoint_url, chunk_tokens=64)
    try:
        assert s.planner.chunk_tokens == 64
    finally:
        s.shutdown()


def test_unreachable_endpoint_only_warns(caplog):
    caplog.set_level(logging.WARNING, logger="s3kv")
    s = side(bucket="some-bucket", endpoint_url="http://127.0.0.1:9")  # nothing listens
    s.shutdown()
    assert "unreachable at start-up" in caplog.text


def test_fail_policy_warns_to_use_recompute(s3_server, bucket, caplog):
    caplog.set_level(logging.WARNING, logger="s3kv")
    config = parse_config({"bucket": bucket, "endpoint_url": s3_server.endpoint_url, "region": "us-east-1"})
    SchedulerSide(config, LAYOUT, failure_policy="fail", model="unit").shutdown()
    assert '"kv_load_failure_policy": "recompute"' in caplog.text


_NO_CREDS = """
from s3kv.config import parse_config
from s3kv.connector.layout import EngineLayout
from s3kv.connector.scheduler import SchedulerSide
from s3kv.errors import ConfigError
from s3kv.identity import ModelSource
layout = EngineLayout({"m": 1}, ModelSource("m", digest="unit-test-weights"), 32, ("l0",), 1, 1)
try:
    SchedulerSide(parse_config({"bucket": "b-x1", "endpoint_url": "%s", "region": "us-east-1"}), layout, failure_policy="recompute", model="m")
except ConfigError as e:
    print("ConfigError:", e)
"""


def test_missing_credentials_fail_startup(s3_server, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
        AWS_EC2_METADATA_DISABLED="true",
    )
    out = subprocess.run(
        [sys.executable, "-c", _NO_CREDS % s3_server.endpoint_url],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "ConfigError: no AWS credentials found" in out.stdout, out.stderr[-2000:]


def _request(req_id: str, n: int = 256, lora=None):

    tokens = list(range(3, 3 + n))
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=tokens,
        all_token_ids=tokens,
        num_tokens=n,
        num_prompt_tokens=n,
        lora_request=lora,
        mm_features=None,
        cache_salt=None,
        prompt_embeds=None,
        block_hashes=None,
    )


def test_no_hits_and_no_stores_until_the_identity_is_known(tmp_path, monkeypatch):
    import threading

    release = threading.Event()
    real = runtime.resolve_identity

    def slow(source, cache=None):
        release.wait(STARTUP_BOUND_S)
        return real(source, cache)

    monkeypatch.setattr(runtime, "resolve_identity", slow)
    monkeypatch.setattr(runtime, "STARTUP_WAIT_S", 0.01)
    s = side(write_policy="local_only", cpu_bytes="4MiB", chunk_tokens=64)
    try:
        assert s.planner is None and s.namespace is None
        assert s.lookup(_request("r1"), 0) == (0, False)
        assert s.lookup(_request("r1"), 0) == (0, False)  # asked again: counted once
        assert s.lookup(_request("r2"), 0) == (0, False)
        meta = s.build_meta(SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=None))
        assert meta.namespace is None and not meta.loads and not meta.stores
        assert not s.request_finished(_request("r1"), [0, 1])
        assert s.counters.totals()["unkeyed_requests_model"] == 2
        release.set()
        assert s.runtime.ready.wait(STARTUP_BOUND_S)
        assert s.planner is not None and s.namespace == LAYOUT.namespace(real(LAYOUT.model))
        assert s.lookup(_request("r3"), 0) == (0, False)  # keyed now (an empty cache)
        assert s.planner.knows("r3") and s.counters.totals()["unkeyed_requests_model"] == 2
    finally:
        release.set()
        s.shutdown()


def test_an_unknowable_identity_leaves_the_cache_off(caplog):
    caplog.set_level(logging.ERROR, logger="s3kv")
    layout = EngineLayout({"m": 2}, ModelSource("s3://models/x"), 32, ("l0",), 1, 1, 16 << 10)
    config = parse_config({"write_policy": "local_only", "cpu_bytes": "4MiB", "chunk_tokens": 64})
    s = scheduler.SchedulerSide(config, layout, failure_policy="recompute", model="x")
    try:
        s.runtime.start_task.result(STARTUP_BOUND_S)
        assert s.planner is None and s.lookup(_request("r1"), 0) == (0, False)
        assert "set model_digest" in caplog.text
    finally:
        s.shutdown()


def test_lora_requests_are_keyed_by_the_adapters_content(tmp_path, patient_startup):
    from s3kv.keys import chain_keys

    adapters = {}
    for name, weights in (("a", b"A" * 4096), ("b", b"B" * 4096)):
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text('{"r": 8}')
        (d / "adapter_model.safetensors").write_bytes(weights)
        adapters[name] = d
    twin = tmp_path / "a-copy"  # the same adapter under another name and path
    twin.mkdir()
    for f in adapters["a"].iterdir():
        (twin / f.name).write_bytes(f.read_bytes())

    def lora(name, path, int_id):
        return SimpleNamespace(lora_name=name, lora_int_id=int_id, lora_path=str(path))

    s = side(write_policy="local_only", cpu_bytes="4MiB", chunk_tokens=64)
    try:
        req = _request("l1", lora=lora("sql", adapters["a"], 1))
        assert s.lookup(req, 0) == (0, False)  # hashing the adapter: unkeyed for now
        assert s.counters.totals()["unkeyed_requests_adapter"] == 1
        wait_until("the adapter's digest", lambda: s.requests.adapters.get(req.lora_request), STARTUP_BOUND_S)

        def keys_of(req_id, lo):
            s.lookup(_request(req_id, lora=lo), 0)
            return s.planner._requests[req_id].keys

        ka = keys_of("a", lora("sql", adapters["a"], 1))
        for name, path, int_id in (("sql-v2", twin, 2), ("chat", adapters["b"], 3)):
            probe = lora(name, path, int_id)
            wait_until(
                f"adapter {name}'s digest", lambda p=probe: s.requests.adapters.get(p), STARTUP_BOUND_S
            )
        assert keys_of("twin", lora("sql-v2", twin, 2)) == ka  # same content: same keys
        kb = keys_of("b", lora("chat", adapters["b"], 3))
        plain = chain_keys(s.namespace, list(range(3, 3 + 256)), 64)
        assert kb != ka and ka != plain and kb != plain
    finally:
        s.shutdown()


def test_under_the_block_scheme_two_replicas_share_keys_and_an_adapters_weights_split_them(
    tmp_path, patient_startup, monkeypatch
):
    """Two replicas (scheduler sides) keying by vLLM's block hashes get the
    same keys for the same hashes; a LoRA adapter whose weights differ
    between them (same name and path, so vLLM's hashes are equal) does not."""
    import hashlib

    from s3kv.connector.hashing import VllmHashing
    from s3kv.tiering.scheduler.keychain import HashScheme

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    hashing = VllmHashing(HashScheme(32), "sha256", "vllm-none-hash", 256)
    layout = LAYOUT.keyed_by(hashing)
    adapter = tmp_path / "sql"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    lora = SimpleNamespace(lora_name="sql", lora_int_id=1, lora_path=str(adapter))
    hashes = [hashlib.sha256(b"%d" % i).digest() for i in range(8)]  # 256 tokens of 32-token blocks

    def keys(s, req_id, lo=None):
        req = _request(req_id, lora=lo)
        req.block_hashes = hashes
        s.lookup(req, 0)
        return s.planner._requests[req_id].keys

    out = []
    for weights in (b"A" * 4096, b"B" * 4096):  # the adapter's file changed between the replicas
        (adapter / "adapter_model.safetensors").write_bytes(weights)
        config = parse_config({"write_policy": "local_only", "cpu_bytes": "4MiB", "chunk_tokens": 64})
        s = SchedulerSide(config, layout, failure_policy="recompute", model="unit", hashing=hashing)
        try:
            assert s.lookup(_request("probe", lora=lora), 0) == (0, False)  # hashing the adapter
            wait_until("the adapter's digest", lambda s=s: s.requests.adapters.get(lora), STARTUP_BOUND_S)
            out.append((keys(s, "plain"), keys(s, "lora", lora), s.namespace))
        finally:
            s.shutdown()
    (plain_a, lora_a, ns_a), (plain_b, lora_b, ns_b) = out
    assert ns_a == ns_b and "chunk_keys" in ns_a.fields
    assert plain_a == plain_b and len(plain_a) == 4
    assert lora_a != lora_b and set(lora_a).isdisjoint(plain_a)


class _CountingParams(dict):
    """A request's ``kv_transfer_params`` that counts how often s3kv reads it."""

    reads = 0

    def get(self, *args):
        self.reads += 1
        return super().get(*args)


def test_a_huge_load_policy_param_is_read_once_and_logged_as_a_bounded_excerpt(caplog, patient_startup):
    """A 20 MB ``s3kv_load_policy``: vLLM looks the waiting request up every
    step, and each lookup re-read and re-repr'd it (27 ms on the scheduler
    thread), the warning quoting it whole. Now it is read at the first
    lookup only and the warning quotes 40 characters of it, once."""
    caplog.set_level(logging.WARNING, logger="s3kv")
    s = side(write_policy="local_only", cpu_bytes="4MiB", chunk_tokens=64)
    try:
        huge = "x" * 20_000_000
        req = _request("big")
        req.kv_transfer_params = _CountingParams({POLICY_PARAM: huge})
        for _ in range(5):
            assert s.lookup(req, 0) == (0, False)
        assert req.kv_transfer_params.reads == 1
        warnings = [r.getMessage() for r in caplog.records if POLICY_PARAM in r.getMessage()]
        assert len(warnings) == 1 and len(warnings[0]) < 300, [w[:300] for w in warnings]
        assert "'xxxxxxxx" in warnings[0] and "20000000 characters" in warnings[0]
        req.num_computed_tokens = 0
        s.request_finished(req, [])
        assert "big" not in s.requests._policies
        again = _request("big-again")  # the same bad value: not logged twice
        again.kv_transfer_params = {POLICY_PARAM: huge}
        s.lookup(again, 0)
        assert len([r for r in caplog.records if POLICY_PARAM in r.getMessage()]) == 1
        for value, policy in (("ALWAYS", "always"), ("cost", "cost"), (["always"] * 10**6, None), (7, None)):
            r = _request(f"p-{policy}-{type(value).__name__}")
            r.kv_transfer_params = {POLICY_PARAM: value}
            assert s.requests.policy(r) == policy, value if isinstance(value, str) else type(value)
        assert "a list of 1000000 items" in caplog.text and "=7 is not one of" in caplog.text
        assert s.requests._policies.keys() == {
            "big-again",
            "p-always-str",
            "p-cost-str",
            "p-None-list",
            "p-None-int",
        }
    finally:
        s.shutdown()
