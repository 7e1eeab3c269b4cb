"""The fleet secret: loading it (and never showing it), signed manifest
objects, and bad records, without vLLM."""

from __future__ import annotations

import asyncio
import logging
import pickle
import time

import numpy as np
import pytest

from s3kv.auth import ENV_VAR, FleetKeys, load_keys
from s3kv.config import parse_config
from s3kv.errors import ConfigError, CorruptManifest, UnsignedManifest
from s3kv.keys import Namespace, chain_keys, fingerprint, object_key
from s3kv.manifest import Manifest, ManifestSync, SyncSettings
from s3kv.manifest import format as mf
from s3kv.manifest import protocol as mp
from s3kv.stores.memory import MemoryStore
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import TierReport
from s3kv.tiering.scheduler.planner import Planner
from s3kv.tiering.tiers.s3.manager import S3TierManager
from s3kv.tiering.tiers.s3.report import S3Report

SECRET = "s3kv-test-secret-0123456789abcdef"
OTHER = "s3kv-test-secret-fedcba9876543210"
BASE = "p/" + "ab" * 16 + "/manifest/"


def test_secrets_come_from_the_environment_first_then_the_file(tmp_path):
    f = tmp_path / "key"
    f.write_text(OTHER + "\n")
    f.chmod(0o600)
    assert load_keys(None, {}) is None
    assert load_keys(str(f), {}).signing_kid == FleetKeys([OTHER]).signing_kid
    assert load_keys(str(f), {ENV_VAR: SECRET}).signing_kid == FleetKeys([SECRET]).signing_kid
    both = load_keys(None, {ENV_VAR: f"{SECRET}, {OTHER}"})
    assert both.signing_kid == FleetKeys([SECRET]).signing_kid  # the first signs
    assert both.knows(FleetKeys([OTHER]).signing_kid)  # every one verifies


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("short", "has 5 characters; at least 32"),
        (f"{SECRET},tiny", "secret 2 of 2 has 4 characters"),
        (f"{SECRET},,{OTHER}", "empty fleet secret"),
        ("   ", "empty fleet secret"),
    ],
)
def test_bad_secrets_fail_naming_the_problem_not_the_value(value, message):
    with pytest.raises(ConfigError) as info:
        load_keys(None, {ENV_VAR: value})
    assert message in str(info.value) and ENV_VAR in str(info.value)
    for part in value.split(","):
        if part.strip():
            assert part.strip() not in str(info.value)


PASTED = "q8Zx/3vKmPz9Lq0Wr7TyUi2Op5AsDf8GhJk4LzXcVbN="
"""A base64 secret pasted in place of its file's path: it has a "/"."""


def test_a_key_file_that_cannot_be_read_is_never_shown(tmp_path):
    """Even with a "/": a base64 secret has one about half the time."""
    (tmp_path / "a-directory").mkdir()
    for value, reason in (
        (PASTED, "No such file"),
        (str(tmp_path / "nope"), "No such file"),
        (str(tmp_path / "a-directory"), "Is a directory"),
    ):
        with pytest.raises(ConfigError) as info:
            load_keys(value, {})
        message = str(info.value)
        assert message.startswith(f"auth_key_file (value not shown): cannot read it: {reason}")
        assert "not the secret itself" in message and "/" not in message
        assert "q8Zx" not in message and "a-directory" not in message and "nope" not in message


def test_keys_know_the_key_file_they_were_read_from(tmp_path):
    f = tmp_path / "key"
    f.write_text(SECRET)
    f.chmod(0o600)
    assert load_keys(str(f), {}).key_file == str(f)
    assert load_keys(str(f), {ENV_VAR: SECRET}).key_file is None  # the environment's: the file is unread
    assert FleetKeys([SECRET]).key_file is None


def test_a_key_file_under_home_is_read_as_a_shell_would(tmp_path, monkeypatch):
    """``auth_key_file: ~/.s3kv/key`` names the file in the home directory, not a directory called "~"."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # a literal "~" directory would be looked for here
    (tmp_path / ".s3kv").mkdir()
    f = tmp_path / ".s3kv" / "key"
    f.write_text(SECRET)
    f.chmod(0o600)
    keys = load_keys("~/.s3kv/key", {})
    assert keys is not None and keys.key_file == "~/.s3kv/key"
    assert keys.signing_kid == FleetKeys([SECRET]).signing_kid


def test_a_key_file_value_that_is_no_path_is_never_shown(tmp_path, monkeypatch, caplog):
    """A value without a "/" may be the secret itself, pasted in place of its file's path."""
    with pytest.raises(ConfigError) as info:
        load_keys(SECRET, {})
    assert "auth_key_file (value not shown): cannot read it" in str(info.value)
    assert "not the secret" in str(info.value) and SECRET not in str(info.value)
    monkeypatch.chdir(tmp_path)  # a relative name is no path either: not shown
    (tmp_path / "shortkey").write_text("short")
    (tmp_path / "shortkey").chmod(0o644)
    caplog.set_level(logging.WARNING, logger="s3kv")
    with pytest.raises(
        ConfigError, match=r"^auth_key_file \(value not shown\): the fleet secret has 5"
    ) as info:
        load_keys("shortkey", {})
    assert "shortkey" not in str(info.value) and "shortkey" not in caplog.text
    assert "auth_key_file (value not shown) is readable by other users" in caplog.text
    digits = 12345678901234567890123456789012345  # a secret of digits, pasted unquoted
    with pytest.raises(ConfigError, match=r"auth_key_file: .*\(value not shown\)") as info:
        parse_config({"bucket": "b-x1", "auth_key_file": digits})
    assert str(digits) not in str(info.value)


def test_a_key_file_others_can_read_is_warned_about(tmp_path, caplog):
    f = tmp_path / "key"
    f.write_text(SECRET)
    f.chmod(0o644)
    caplog.set_level(logging.WARNING, logger="s3kv")
    load_keys(str(f), {})
    assert "readable by other users" in caplog.text and SECRET not in caplog.text


def test_the_secret_never_shows(caplog):
    keys = FleetKeys([SECRET, OTHER])
    for text in (repr(keys), str(keys), f"{keys}", str([keys])):
        assert SECRET not in text and OTHER not in text and "2 key(s)" in text
    with pytest.raises(TypeError):
        pickle.dumps(keys)
    assert not hasattr(keys, "__dict__")


# -- signed manifest objects ------------------------------------------------------


def _segment(added=(1, 2, 3), removed=()):
    return mf.ManifestObject("segment", np.array(added, np.uint64), np.array(removed, np.uint64), {"w": 1})


def test_signed_manifest_objects_roundtrip_and_forgeries_fail():
    keys = FleetKeys([SECRET])
    signed = mf.encode(_segment(), keys)
    assert mf.is_signed(signed) and not mf.is_signed(mf.encode(_segment()))
    assert mf.decode(signed, keys=keys).added.tolist() == [1, 2, 3]
    assert mf.decode(signed).added.tolist() == [1, 2, 3]  # readers without the secret still read it
    assert mf.decode(signed, keys=FleetKeys([OTHER, SECRET])).added.tolist() == [1, 2, 3]  # rotation
    tampered = bytearray(signed)
    tampered[-30] ^= 1  # in the arrays; the checksum would catch it too
    unsigned = mf.encode(_segment(added=(7,)))
    for bad, why in (
        (unsigned, "unsigned"),
        (mf.encode(_segment(), FleetKeys([OTHER])), "not one of the fleet's keys"),
        (bytes(tampered), "MAC mismatch"),
    ):
        with pytest.raises(UnsignedManifest, match=why):
            mf.decode(bad, keys=keys)
    # Version 1 (what an older s3kv wrote) is read without a secret; a newer
    # version is refused by its number.
    v1 = bytearray(unsigned)
    v1[4:6] = (1).to_bytes(2, "little")
    import xxhash

    head = mf.PREFIX.size + mf.CHECKSUM.size
    v1[mf.PREFIX.size : head] = mf.CHECKSUM.pack(
        xxhash.xxh3_64_intdigest(bytes(v1[: mf.PREFIX.size] + v1[head:]))
    )
    assert mf.decode(bytes(v1)).added.tolist() == [7]
    v9 = bytearray(unsigned)
    v9[4:6] = (9).to_bytes(2, "little")
    with pytest.raises(CorruptManifest, match="manifest format version 9; this s3kv reads 1, 2"):
        mf.decode(bytes(v9))


def _sync(store, keys=None, writer=None):
    m = Manifest()
    return ManifestSync(store, BASE, m, SyncSettings(skew_s=5.0), writer=writer, keys=keys), m


def test_with_a_secret_only_signed_segments_are_applied():
    keys = FleetKeys([SECRET])
    store = MemoryStore()
    a, _ = _sync(store, keys, "writera")
    for fp in (11, 12):
        a.stored(fp)
    asyncio.run(a.publish())
    # A forger (no secret) writes a segment adding a key and one removing ours.
    forger, _ = _sync(store, None, "forger")
    forger.stored(99)
    asyncio.run(forger.publish())
    asyncio.run(
        store.put(
            mp.segment_name(BASE, int(time.time() * 1000) + 1000, "forger", 7),
            mf.encode(_segment(added=(), removed=(11,))),
        )
    )
    b, mb = _sync(store, keys, "writerb")
    asyncio.run(b.load())
    assert 11 in mb.fps and 12 in mb.fps and 99 not in mb.fps
    assert b.counters.totals()["manifest_skipped_unsigned"] == 2
    # Without the secret, the same bucket's forgeries are applied: the MAC is what stops them.
    c, mc = _sync(store, None, "writerc")
    asyncio.run(c.load())
    assert 99 in mc.fps and 11 not in mc.fps


def test_bad_records_drop_a_key_everywhere_and_block_publishing_it_from_a_412():
    store = MemoryStore()
    ns = Namespace.from_fields({"m": "bad"})
    keys = chain_keys(ns, list(range(128)), 64)
    a, ma = _sync(store, writer="writera")
    b, mb = _sync(store, writer="writerb")
    for m in (ma, mb):
        m.update(keys)
    asyncio.run(a.publish())
    ma.quarantine(keys[0], "p/x/obj.r0", '"etag-1"')
    assert keys[0] not in ma and ma.is_bad(keys[0])
    asyncio.run(a.publish())
    asyncio.run(b.refresh())
    assert keys[0] not in mb and keys[1] in mb and mb.is_bad(keys[0])
    record = [mf.decode(asyncio.run(store.get(n))) for n in asyncio.run(store.list_keys(BASE + "seg/"))][-1]
    assert record.meta["bad"] == [["p/x/obj.r0", '"etag-1"']] and record.removed.tolist() == [
        fingerprint(keys[0])
    ]
    # The planner of replica b: a store of the bad key that found it there (a
    # 412) is not published; one that wrote it is.
    s3_tier = S3TierManager(mb)
    p = Planner(namespace=ns, chunk_tokens=64, block_size=32, tiers=[s3_tier])
    s3_tier._storing[keys[0]] = 0.0
    p.on_report(TierReport(written={(Tier.S3, keys[0]): 1}, sections={Tier.S3: S3Report(existing={keys[0]})}))
    assert keys[0] not in mb
    p.on_report(TierReport(written={(Tier.S3, keys[0]): 1}))  # written anew (after gc removed the bad one)
    assert keys[0] in mb


def test_a_replica_that_starts_from_a_snapshot_knows_the_bad_records_it_covers():
    """A snapshot covers the segments before its horizon, their bad records
    too: a replica that starts from one written after a bad record must not
    publish that chunk from a 412 either. (One did: it then took the chunk
    for stored, and never stored it again once gc removed the bad object.)
    Its own snapshots carry the record on; one that names no chunk object
    is skipped."""
    store = MemoryStore()
    ns = Namespace.from_fields({"m": "bad-snapshot"})
    keys = chain_keys(ns, list(range(256)), 64)
    name = object_key("p", ns.id, keys[0], 0)
    every = SyncSettings(skew_s=5.0, snapshot_every=1, snapshot_interval_s=0)
    ma, mb, mc = Manifest(), Manifest(), Manifest()
    a = ManifestSync(store, BASE, ma, every, writer="writerz")
    ma.update(keys[:3])
    ma.quarantine(keys[0], name, '"etag-1"')
    ma.quarantine(keys[1], "p/x/not-a-chunk.r0", '"etag-2"')
    asyncio.run(a.publish())
    assert asyncio.run(a.maybe_snapshot())
    snaps = asyncio.run(store.list_keys(BASE + "snap/"))
    assert mf.decode(asyncio.run(store.get(snaps[-1]))).meta["bad"] == [
        [name, '"etag-1"'],
        ["p/x/not-a-chunk.r0", '"etag-2"'],
    ]
    b = ManifestSync(store, BASE, mb, every, writer="writerb")
    asyncio.run(b.load())
    assert b.counters.totals().get("manifest_segments_loaded", 0) == 0  # the snapshot alone
    assert (
        keys[0] not in mb
        and keys[2] in mb
        and keys[3] not in mb
        and mb.is_bad(keys[0])
        and not mb.is_bad(keys[1])
    )
    s3_tier = S3TierManager(mb)
    p = Planner(namespace=ns, chunk_tokens=64, block_size=32, tiers=[s3_tier])
    s3_tier._storing[keys[0]] = 0.0
    p.on_report(TierReport(written={(Tier.S3, keys[0]): 1}, sections={Tier.S3: S3Report(existing={keys[0]})}))
    assert keys[0] not in mb  # the bad object in the way: not published
    # Replica b's snapshot carries the record on to a replica that starts from it.
    mb.add(keys[3])
    asyncio.run(b.publish())
    assert asyncio.run(b.maybe_snapshot())
    assert asyncio.run(store.list_keys(BASE + "snap/"))[-1] != snaps[-1]
    c = ManifestSync(store, BASE, mc, every, writer="writerc")
    asyncio.run(c.load())
    assert mc.is_bad(keys[0]) and keys[3] in mc


def test_one_bad_object_reported_by_many_loads_is_recorded_once():
    store = MemoryStore()
    keys = chain_keys(Namespace.from_fields({"m": "bad-once"}), list(range(64)), 64)
    a, ma = _sync(store, writer="writera")
    for _ in range(3):  # three loads (or ranks) found the same object bad
        ma.quarantine(keys[0], "p/x/obj.r0", '"etag-1"')
    ma.quarantine(keys[0], "p/x/obj.r0", '"etag-2"')  # stored again since, and bad again: a new record
    asyncio.run(a.publish())
    ma.quarantine(keys[0], "p/x/obj.r0", '"etag-1"')  # reported again after it was published
    asyncio.run(a.publish())
    records = [mf.decode(asyncio.run(store.get(n))) for n in asyncio.run(store.list_keys(BASE + "seg/"))]
    assert [r.meta["bad"] for r in records] == [[["p/x/obj.r0", '"etag-1"'], ["p/x/obj.r0", '"etag-2"']]]
