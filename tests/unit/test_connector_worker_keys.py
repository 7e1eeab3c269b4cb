"""Fleet key agreement between the scheduler side and each worker rank:
every process reads the fleet secret on its own (a Ray worker does not
inherit the environment unless told to), so the scheduler side sends the id
of the key it signs with, and a rank whose own differs refuses every
transfer (loads fail and are recomputed, stores are dropped), saying so
once. With vLLM's CPU build and host tensors; no S3."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from s3kv.auth import FleetKeys  # noqa: E402
from s3kv.config import parse_config  # noqa: E402
from s3kv.connector.layout import EngineLayout  # noqa: E402
from s3kv.connector.metadata import S3KVMetadata  # noqa: E402
from s3kv.connector.scheduler import SchedulerSide  # noqa: E402
from s3kv.connector.worker import WorkerSide  # noqa: E402
from s3kv.identity import ModelSource  # noqa: E402
from s3kv.tiering.placement import Tier  # noqa: E402
from s3kv.tiering.plan import LoadChunk, LoadPlan, Place, StoreChunk  # noqa: E402

SECRET = "s3kv-worker-key-test-0123456789abcdef"
OTHER = "s3kv-worker-key-test-fedcba9876543210"
BLOCKS, BLOCK_SIZE, CHUNK_TOKENS = 12, 16, 32
PAGE_SHAPE = (2, BLOCK_SIZE, 4)  # K/V, tokens, head dim: 128 bytes of bfloat16 a block
LAYOUT = EngineLayout(
    {"model": "unit"},
    ModelSource("unit", digest="unit-test-weights"),
    block_size=BLOCK_SIZE,
    layer_names=("l0", "l1"),
    tp_size=1,
    world_size=1,
    page_size_bytes=2 * BLOCK_SIZE * 4 * 2,
)
CONFIG = parse_config(
    {"write_policy": "local_only", "cpu_bytes": "64KiB", "chunk_tokens": CHUNK_TOKENS, "promote": True}
)
K = [bytes([i]) * 16 for i in range(6)]


def worker(keys: FleetKeys | None) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    w = WorkerSide(CONFIG, LAYOUT, 0, BLOCKS, keys)
    caches = {name: torch.zeros((BLOCKS, *PAGE_SHAPE), dtype=torch.bfloat16) for name in LAYOUT.layer_names}
    w.register(caches)
    return w, caches


def step(namespace: str, kid: bytes | None) -> S3KVMetadata:
    """A step with a load of each kind and a store of each kind."""
    return S3KVMetadata(
        loads=[
            LoadPlan(
                "async",
                (LoadChunk(K[0], (0, 1), 0, 2, (Place(Tier.DISK),), (Place(Tier.CPU, 3),)),),
                sync=False,
            ),
            LoadPlan("sync", (LoadChunk(K[1], (2, 3), 1, 2, (Place(Tier.CPU, 0),)),), sync=True),
        ],
        stores=[
            StoreChunk(K[2], (4, 5), (Place(Tier.CPU, 1), Place(Tier.DISK)), pinned=True),
            StoreChunk(K[3], (6, 7), (Place(Tier.DISK),)),
        ],
        held=["done"],
        namespace=namespace,
        signing_kid=kid,
    )


def run_step(w: WorkerSide, meta: S3KVMetadata):
    w.bind(meta)
    w.start_load(meta)
    for layer in LAYOUT.layer_names:
        w.wait_for_layer(layer)
        w.save_layer(meta, layer)
    w.save(meta)
    sent, recved = w.get_finished({"done"})
    return sent, recved, w.take_load_errors(), w.take_report().report  # the TierReport vLLM's metadata wraps


@pytest.mark.parametrize(
    ("worker_secret", "scheduler_secret"),
    [(None, SECRET), (SECRET, None), (OTHER, SECRET)],
    ids=["worker-without-key", "scheduler-without-key", "other-key"],
)
def test_a_rank_without_the_scheduler_sides_key_refuses_every_transfer(
    worker_secret, scheduler_secret, caplog
):
    own = FleetKeys([worker_secret]) if worker_secret else None
    theirs = FleetKeys([scheduler_secret]) if scheduler_secret else None
    w, caches = worker(own)
    caplog.set_level(logging.ERROR, logger="s3kv")
    try:
        sent, recved, errors, report = run_step(w, step("ns1", theirs.signing_kid if theirs else None))
    finally:
        w.shutdown()
    # Loads: failed (their blocks recomputed), over, never written into the KV cache.
    assert recved == {"async"} and errors == {0, 1, 3}
    assert report.load_failed == {"async", "sync"} and report.sync_loaded == {"sync": 1}
    assert all(not c.any() for c in caches.values())
    # Stores: dropped, uncopied; every tier they were for hears of it, the CPU slots go back.
    assert report.failed == {
        (Tier.CPU, K[0]): 1,
        (Tier.CPU, K[2]): 1,
        (Tier.DISK, K[2]): 1,
        (Tier.DISK, K[3]): 1,
    }
    assert report.released == {K[2]: 1} and not report.written and not report.tier_failed
    assert sent == {"done"}  # held blocks go back to vLLM: nothing reads them
    # Said once, naming both key ids (or "none") and the fix; never the secret.
    errors_logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors_logged) == 1
    msg = errors_logged[0]
    for keys in (own, theirs):
        assert (keys.signing_kid.hex() if keys else "key id none") in msg
    assert "S3KV_AUTH_KEY" in msg and "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY" in msg
    assert SECRET not in caplog.text and OTHER not in caplog.text
    assert w.counters.totals()["key_mismatch"] == 1


def test_a_rank_with_the_scheduler_sides_key_transfers(caplog):
    keys = FleetKeys([SECRET])
    w, caches = worker(FleetKeys([SECRET]))  # read on its own: another object, the same key
    try:
        meta = step("ns1", keys.signing_kid)
        meta.loads.pop(0)  # no NVMe tier here to load from
        meta.stores.pop()
        w.pool.claim(0, K[1])  # the CPU slot the synchronous load reads
        w.pool.layer_views(0)[0][:] = 7
        sent, recved, errors, report = run_step(w, meta)
        assert w.engine.drain(10)
        w.get_finished(set())
        # the store into the CPU slot, done in the background: in this report
        # or (it finished before the step's) already in the step's
        later = w.take_report()
        if later is not None:
            report = report.aggregate(later.report)
    finally:
        w.shutdown()
    assert w.refusal is None and "fleet secret" not in caplog.text
    assert errors == set() and report.load_failed == set() and report.sync_loaded == {"sync": 1}
    loaded = caches["l0"].view(torch.uint8)
    assert (loaded[3] == 7).all() and not loaded[2].any()  # the block the load writes, only it
    assert report.written.get((Tier.CPU, K[2])) == 1
    assert "key_mismatch" not in w.counters.totals()


@pytest.mark.parametrize("secret", [SECRET, None], ids=["with-key", "without-key"])
def test_the_scheduler_side_sends_its_signing_key_id_never_the_key(secret):
    keys = FleetKeys([secret]) if secret else None
    side = SchedulerSide(CONFIG, LAYOUT, failure_policy="recompute", model="unit", keys=keys)
    try:
        assert side.planner is not None
        out = SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
            num_scheduled_tokens={},
            preempted_req_ids=set(),
        )
        meta = side.build_meta(out)
    finally:
        side.shutdown()
    assert meta.signing_kid == (keys.signing_kid if keys else None)
    assert meta.namespace == side.namespace.id
    if secret:
        assert len(meta.signing_kid) == 8 and secret.encode() not in repr(meta).encode()
    w, _ = worker(FleetKeys([secret]) if secret else None)
    try:
        w.bind(meta)
    finally:
        w.shutdown()
    assert w.refusal is None


def test_a_secret_pasted_as_the_key_file_never_reaches_the_journal(s3_server, bucket, tmp_path, monkeypatch):
    """auth_key_file holding the secret itself, with S3KV_AUTH_KEY set (so the
    file is never read and the engine starts): the rank's journal, a file in
    $TMPDIR the front end reads, holds neither the value nor a path that may
    be it. A key file the keys were read from is recorded, for the front
    end's replay to sign with (tests/stores/test_manifest_journal_s3.py)."""
    from s3kv.auth import ENV_VAR, load_keys
    from s3kv.manifest.journal import ENV_VAR as JOURNAL_ENV

    pasted = "q8Zx/3vKmPz9Lq0Wr7TyUi2Op5AsDf8GhJk4LzXcVbN="
    key_file = tmp_path / "fleet.key"
    key_file.write_text(OTHER)
    key_file.chmod(0o600)
    s3 = {"bucket": bucket, "endpoint_url": s3_server.endpoint_url, "region": "us-east-1"}
    for n, (value, environ) in enumerate([(pasted, {ENV_VAR: SECRET}), (str(key_file), {})]):
        journals = tmp_path / f"journal{n}"
        journals.mkdir()
        monkeypatch.setenv(JOURNAL_ENV, str(journals))
        config = parse_config({**s3, "chunk_tokens": CHUNK_TOKENS, "auth_key_file": value})
        keys = load_keys(config.auth_key_file, environ)
        w = WorkerSide(config, LAYOUT, 0, BLOCKS, keys)
        try:
            w.bind(S3KVMetadata(namespace="ns1", writer="wkr1", signing_kid=keys.signing_kid))
            assert w.publisher is not None and w.publisher.journal is not None
            (info,) = journals.glob("*.json")
            written = b"".join(f.read_bytes() for f in journals.iterdir())
            assert b"q8Zx" not in written and pasted.encode() not in written
            assert SECRET.encode() not in written and OTHER.encode() not in written
            recorded = json.loads(info.read_text())["config"]["auth_key_file"]
            assert recorded == (None if value == pasted else str(key_file))
        finally:
            w.shutdown()


def test_the_s3_handler_tells_the_ranks_publisher_of_each_put(s3_server, bucket, tmp_path, monkeypatch):
    """The rank's publisher is made once the namespace is known, and the S3
    handler is built with it (no callback set on the engine later): a chunk
    it creates is journaled, then published; a store that finds the object
    there (a 412) is journaled as answered, and not published by the rank."""
    import numpy as np

    from s3kv.keys import fingerprint
    from s3kv.manifest.journal import ENV_VAR as JOURNAL_ENV
    from s3kv.manifest.journal import _unpublished
    from s3kv.tiering.worker.transfer import StoreJob

    monkeypatch.setenv(JOURNAL_ENV, str(tmp_path))
    s3 = {"bucket": bucket, "endpoint_url": s3_server.endpoint_url, "region": "us-east-1"}
    w = WorkerSide(parse_config({**s3, "chunk_tokens": CHUNK_TOKENS}), LAYOUT, 0, BLOCKS)
    caches = {name: torch.zeros((BLOCKS, *PAGE_SHAPE), dtype=torch.bfloat16) for name in LAYOUT.layer_names}
    w.register(caches)
    try:
        w.bind(S3KVMetadata(namespace="ns1", writer="wkr1"))
        assert w.publisher is not None and w.engine.handlers[Tier.S3].published is w.publisher
        layer_bytes = 2 * BLOCK_SIZE * 4 * 2 * (CHUNK_TOKENS // BLOCK_SIZE)
        pages = [np.full(layer_bytes, i, dtype=np.uint8) for i in range(len(LAYOUT.layer_names))]
        for _ in range(2):  # the second finds the first's object (a 412)
            assert w.engine.submit_store(StoreJob(K[4], pages, (Place(Tier.S3),)))
            assert w.drain(60)
        (fps_file,) = tmp_path.glob("*.fps")
        stored, unanswered, _ = _unpublished(tmp_path, fps_file.stem)
        assert stored == [fingerprint(K[4])] and unanswered == []  # created once, the 412 answered
        assert w.publisher.pending == 1
        assert w.engine.counters.totals()["store_chunks_existing"] == 1
    finally:
        w.shutdown()
    assert w.publisher.pending == 0 and not list(tmp_path.iterdir())  # published: the journal is gone
