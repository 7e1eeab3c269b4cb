"""The ranks' journal (s3kv.manifest.journal) against a real S3 server: what a
rank stored but had not published when its process died is published by
the front end at exit; a rank that stopped cleanly leaves nothing."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys
import time

import pytest

from s3kv.config import parse_config
from s3kv.errors import UnsignedManifest
from s3kv.manifest import format as mf
from s3kv.manifest import protocol as mp
from s3kv.manifest.journal import ENV_VAR, RankJournal, recorded_config, recover
from s3kv.manifest.publish import ShardPublisher
from s3kv.stores.factory import make_store
from s3kv.tiering.loop import JobLoop
from tests.conftest import load_manifest, wait_until
from tests.stores.wrappers import HeldPuts

NS = "cd" * 16
BASE = f"jnl/{NS}/manifest/"


def config_of(s3_server, bucket, **extra):
    return parse_config(
        {"bucket": bucket, "endpoint_url": s3_server.endpoint_url, "region": "us-east-1", "prefix": "jnl"}
        | extra
    )


def journal(directory, config, writer="w0", rank=0, ranks=1, keys=None):
    info = {
        "config": recorded_config(config, keys),
        "base": BASE,
        "namespace": NS,
        "rank": rank,
        "ranks": ranks,
    }
    return RankJournal(directory, f"{writer}r{rank}", info)


def manifest(config) -> set[int]:
    return load_manifest(config.endpoint_url, config.bucket, BASE)


def test_what_a_killed_rank_had_not_published_is_published_at_exit(s3_server, bucket, tmp_path):
    config = config_of(s3_server, bucket)

    async def rank_life():
        store = make_store(config)
        try:
            p = ShardPublisher(store, BASE, "w0", rank=0, ranks=1, journal=journal(tmp_path, config))
            for fp in (11, 12, 13):
                p.stored(fp)
            await p.publish()
            for fp in (14, 15):  # stored; then vLLM kills the process before the next segment
                p.stored(fp)
        finally:
            await store.close()

    asyncio.run(rank_life())
    assert manifest(config) == {11, 12, 13}
    assert recover(tmp_path) == 2
    assert manifest(config) == {11, 12, 13, 14, 15}
    assert not tmp_path.exists()
    names = asyncio.run(_names(config))
    assert [mp.parse_name(BASE, n).writer for n in names] == ["w0r0", "w0r0j"]


async def _names(config):
    store = make_store(config)
    try:
        return sorted(await store.list_keys(BASE + "seg/"))
    finally:
        await store.close()


def test_a_rank_that_published_everything_leaves_no_journal(s3_server, bucket, tmp_path):
    config = config_of(s3_server, bucket)

    async def rank_life():
        store = make_store(config)
        try:
            p = ShardPublisher(store, BASE, "w1", rank=0, ranks=1, journal=journal(tmp_path, config, "w1"))
            p.stored(21)
            await p.publish()
            assert p.close() == 0
        finally:
            await store.close()

    asyncio.run(rank_life())
    assert list(tmp_path.iterdir()) == []
    assert recover(tmp_path) == 0 and manifest(config) == {21}


def test_a_stop_while_a_segment_put_is_in_flight_leaves_every_store_to_a_segment_or_the_journal(
    s3_server, bucket, tmp_path
):
    """The drain stop of a rank whose periodic segment PUT is held in flight
    (a slow S3) past ``shutdown_flush_s``: the flush must not publish the
    later stores and count them, in the journal, past the held ones that the
    stop then cancels; every stored chunk ends in a segment or the front
    end's replay publishes it."""
    config = config_of(s3_server, bucket)
    loop = JobLoop("test-io", 1)
    store = HeldPuts(make_store(config), hold="/seg/")  # the first segment PUT never reaches S3
    p = ShardPublisher(
        store, BASE, "w6", rank=0, ranks=1, publish_s=0.01, journal=journal(tmp_path, config, "w6")
    )
    p.stored(61)
    loop.submit(p.run())
    wait_until("the periodic segment PUT to be in flight", lambda: store.held == 1)
    p.stored(62)
    p.stored(63)
    loop.close(1.0, p.publish, store.close)  # as the worker's shutdown: the flush, then cancel the rest
    left, in_segments = p.close(), manifest(config)
    recovered = recover(tmp_path)  # the front end, as it exits
    assert manifest(config) == {61, 62, 63}  # every store: in a segment, or the replay's
    assert (left, in_segments, recovered) == (3, set(), 3)  # the flush waited for the held PUT


def test_the_replay_signs_with_the_key_file_the_rank_read(s3_server, bucket, tmp_path, monkeypatch):
    """The journal records the rank's auth_key_file only as a file its keys
    were read from (a value never read may be the secret itself): the front
    end's replay loads the same keys from it and signs what it publishes."""
    from s3kv.auth import ENV_VAR as AUTH_ENV
    from s3kv.auth import FleetKeys, load_keys

    monkeypatch.delenv(AUTH_ENV, raising=False)
    key_file = tmp_path / "fleet.key"
    key_file.write_text("jnl-test-fleet-secret-0123456789abcdef")
    key_file.chmod(0o600)
    config = config_of(s3_server, bucket, auth_key_file=str(key_file))
    keys = load_keys(config.auth_key_file)
    journals = tmp_path / "journals"
    journals.mkdir()
    journal(journals, config, "w7", keys=keys).stored(71)
    assert recover(journals) == 1
    (name,) = asyncio.run(_names(config))
    body = s3_server.client().get_object(Bucket=bucket, Key=name)["Body"].read()
    assert mf.decode(body, name=name, keys=keys).added.tolist() == [71]  # signed with the file's key
    other = FleetKeys(["jnl-test-other-secret-0123456789abcdef"])
    with pytest.raises(UnsignedManifest):
        mf.decode(body, name=name, keys=other)


def test_recovery_is_bounded_when_s3_is_gone(tmp_path):
    from tests.conftest import free_port

    gone = parse_config(
        {
            "bucket": "nowhere-bucket",
            "endpoint_url": f"http://127.0.0.1:{free_port()}",
            "region": "us-east-1",
            "shutdown_flush_s": 1,
            "s3_max_attempts": 10,
        }
    )
    j = journal(tmp_path, gone, "w2")
    j.stored(31)
    start = time.monotonic()
    assert recover(tmp_path) == 0  # nothing published, nothing raised
    assert time.monotonic() - start < 5 and not tmp_path.exists()


def test_the_front_end_publishes_the_journals_as_it_exits(s3_server, bucket):
    """A front end (a process vLLM's engine did not start) makes the journal
    directory; what a rank left in it is published when that process exits."""
    assert multiprocessing.parent_process() is None  # this test process is a front end too
    code = f"""
import os, s3kv.manifest.journal as j
from s3kv.config import parse_config
from s3kv.errors import UnsignedManifest
d = j.start_front_end()
assert d is not None and os.environ[j.ENV_VAR] == str(d) and d.is_dir()
assert j.start_front_end() is None
c = parse_config({{"bucket": "{bucket}", "endpoint_url": "{s3_server.endpoint_url}", "region": "us-east-1"}})
info = {{"config": j.recorded_config(c, None), "base": "{BASE}", "rank": 0, "ranks": 1}}
j.RankJournal(d, "w3r0", info).stored(41)  # then the engine is killed
print(d)
"""
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    directory = out.stdout.strip()
    assert directory and not os.path.exists(directory)  # removed at exit
    assert manifest(config_of(s3_server, bucket)) == {41}


def test_a_put_whose_answer_never_came_is_published_if_its_object_is_sound(s3_server, bucket, tmp_path):
    """Killed while PUTs were in flight: S3 may have committed some of them.
    Each is read back; a sound object is published, an absent or foreign one
    is not."""
    import random

    from s3kv.keys import fingerprint, object_key
    from tests.ops.dataset import _blob

    config = config_of(s3_server, bucket)
    rng = random.Random(1)
    committed, lost, forged = (bytes([i]) * 16 for i in (7, 8, 9))
    client = s3_server.client()
    client.put_object(
        Bucket=bucket, Key=object_key("jnl", NS, committed, 0), Body=_blob(NS, committed, 0, rng)
    )
    other = _blob(NS, committed, 0, rng)  # a sound object, but of another key
    client.put_object(Bucket=bucket, Key=object_key("jnl", NS, forged, 0), Body=other)
    j = journal(tmp_path, config, "w4")
    for key in (committed, lost, forged):
        j.storing(key)  # then the process dies before any answer
    assert recover(tmp_path) == 1
    assert manifest(config) == {fingerprint(committed)}


def test_a_put_answered_by_a_412_is_not_published_by_the_journal(s3_server, bucket, tmp_path):
    """A 412 is an answer: the object in the way is another's (maybe one a
    replica reported bad to the fleet), so the journal of a rank killed
    afterwards does not publish it, however sound its header; a later PUT
    of the same key that never returned is read back as usual."""
    import random

    from s3kv.keys import fingerprint, object_key
    from tests.ops.dataset import _blob

    config = config_of(s3_server, bucket)
    rng = random.Random(2)
    theirs, retried = (bytes([i]) * 16 for i in (5, 6))
    client = s3_server.client()
    for key in (theirs, retried):
        client.put_object(Bucket=bucket, Key=object_key("jnl", NS, key, 0), Body=_blob(NS, key, 0, rng))
    j = journal(tmp_path, config, "w5")
    for key in (theirs, retried):
        j.storing(key)
        j.settled(key)  # both 412s
    j.storing(retried)  # tried again, then the process dies before the answer
    assert recover(tmp_path) == 1
    assert manifest(config) == {fingerprint(retried)}
