"""``s3kv ls``, ``stats``, ``inspect`` and ``verify`` over a bucket whose
manifest holds epoch objects (:mod:`s3kv.manifest.epochs`), against a real
S3 server (moto) on loopback: ls and stats count them and say how far the
newest is behind now, inspect decodes one (its members and their keys),
verify checks each whole and reports one that does not decode (corrupt,
copied under another epoch's name, or, with the fleet secret, unsigned or
signed with another key) like any bad manifest object; names under ``ep/``
that are no epoch's are foreign. gc's pruning: test_epochs_gc.py."""

from __future__ import annotations

import time

import numpy as np

from s3kv.auth import ENV_VAR, FleetKeys
from s3kv.cli import main
from s3kv.keys import fingerprint
from s3kv.manifest import epochs
from s3kv.manifest import format as mf
from s3kv.manifest import protocol as mp
from tests.ops.signed import BASE, NS, SECRET, bucket_args, cli, key

E_MS = 5000


def members(e: int, writers: int, per: int) -> list[epochs.Member]:
    """``writers`` segments stamped in epoch ``e``, ``per`` keys each."""
    out = []
    for w in range(writers):
        fps = np.array(sorted(fingerprint(key(100 * w + i + 1)) for i in range(per)), np.uint64)
        name = mp.segment_name(BASE, mp.epoch_start(e, E_MS) + 10 * w, f"w{w}r0", 1)
        out.append((name, mf.ManifestObject("segment", fps, meta={"rank": 0, "ranks": 1})))
    return out


def epoch_body(e: int, keys: FleetKeys | None, writers: int = 3, per: int = 4) -> bytes:
    return epochs.encode(
        BASE, epochs.Epoch(e, E_MS, "aggr01", mp.epoch_end(e, E_MS) + 1200, members(e, writers, per)), keys
    )


def seed(s3_server, keys: FleetKeys | None) -> tuple[str, dict[str, str], int]:
    """A bucket with a namespace whose fleet wrote three epochs (the newest
    10 s ago), plus a corrupt one, one copied under another epoch's name,
    an unsigned one, one signed with another key, and junk under ``ep/``."""
    client = s3_server.client()
    bucket = s3_server.new_bucket()
    newest = mp.epoch_of(int(time.time() * 1000) - 10_000, E_MS)
    names = {f"e{i}": mp.epoch_name(BASE, newest - i, E_MS) for i in (2, 1, 0)}
    bodies = {n: epoch_body(newest - int(n[1:]), keys) for n in names}
    flipped = bytearray(epoch_body(newest - 3, keys))
    flipped[-40] ^= 1
    names["corrupt"] = mp.epoch_name(BASE, newest - 3, E_MS)
    bodies["corrupt"] = bytes(flipped)
    names["copied"] = mp.epoch_name(BASE, newest - 4, E_MS)
    bodies["copied"] = epoch_body(newest - 5, keys)
    names["unsigned"] = mp.epoch_name(BASE, newest - 6, E_MS)
    bodies["unsigned"] = epoch_body(newest - 6, None)
    names["forged"] = mp.epoch_name(BASE, newest - 7, E_MS)
    bodies["forged"] = epoch_body(newest - 7, FleetKeys(["forger-secret-0123456789abcdef0123"]))
    names["junk"] = BASE + "ep/005000/notes.txt"
    bodies["junk"] = b"not an epoch"
    for n, name in names.items():
        client.put_object(Bucket=bucket, Key=name, Body=bodies[n])
    return bucket, names, newest


def test_ls_and_stats_count_epochs_and_say_how_far_the_newest_is_behind(s3_server, capsys, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    bucket, names, newest = seed(s3_server, None)
    epoch_names = [v for k, v in names.items() if k != "junk"]
    rc, doc, _ = cli(capsys, s3_server, bucket, "ls")
    assert rc == 0
    (row,) = doc["namespaces"]
    assert row["epochs"] == len(epoch_names) and row["newest_epoch"] == newest and row["epoch_ms"] == E_MS
    behind = time.time() - mp.epoch_end(newest, E_MS) / 1000
    assert (
        5 <= row["newest_epoch_behind_s"] <= behind + 0.01
    )  # the epoch of 10 s ago ended 5 to 10 s ago (ms rounded)
    assert row["foreign_objects"] == 1  # the junk, not the epochs
    rc, st, _ = cli(capsys, s3_server, bucket, "stats")
    m = st["manifest"][NS]
    assert rc == 0 and m["epochs"] == len(epoch_names) and m["newest_epoch"] == newest
    assert m["epoch_bytes"] == sum(_sizes(s3_server, bucket, epoch_names))
    assert [c["e_ms"] for c in m["epoch_chains"]] == [E_MS]
    capsys.readouterr()
    args = bucket_args(s3_server, bucket)
    assert main(["ls", *args]) == 0
    text = capsys.readouterr().out
    assert "epochs" in text and f"{len(epoch_names)} (#{newest}," in text


def _sizes(s3_server, bucket: str, names: list[str]) -> list[int]:
    client = s3_server.client()
    return [client.head_object(Bucket=bucket, Key=n)["ContentLength"] for n in names]


def test_inspect_decodes_an_epoch(s3_server, capsys, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    bucket, names, newest = seed(s3_server, None)
    rc, doc, _ = cli(capsys, s3_server, bucket, "inspect", names["e0"])
    assert rc == 0 and doc["type"] == "manifest epoch" and doc["problems"] == []
    assert doc["epoch"] == newest and doc["epoch_ms"] == E_MS and doc["aggregated_by"] == "aggr01"
    assert doc["members"] == 3 and doc["writers"] == 3 and doc["added"] == 12 and doc["removed"] == 0
    assert [m["segment"] for m in doc["member_table"]] == [n[len(BASE) :] for n, _ in members(newest, 3, 4)]
    assert [m["writer"] for m in doc["member_table"]] == ["w0r0", "w1r0", "w2r0"]
    rc, bad, _ = cli(capsys, s3_server, bucket, "inspect", names["corrupt"])
    assert rc == 1 and bad["type"] == "unreadable" and "checksum" in bad["problems"][0]
    rc, moved, _ = cli(capsys, s3_server, bucket, "inspect", names["copied"])
    assert rc == 1 and "another name" in moved["problems"][0]
    capsys.readouterr()
    args = bucket_args(s3_server, bucket)
    assert main(["inspect", *args, "--members", names["e0"]]) == 0
    text = capsys.readouterr().out
    assert "manifest epoch" in text and all(n[len(BASE) :] in text for n, _ in members(newest, 3, 4))


def test_verify_reports_epochs_that_do_not_decode(s3_server, capsys, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    bucket, names, _ = seed(s3_server, FleetKeys([SECRET]))
    rc, rep, _ = cli(capsys, s3_server, bucket, "verify", "--all")
    assert rc == 1
    assert {p["key"] for p in rep["corrupt"]} == {names["corrupt"], names["copied"]}
    assert {p["key"] for p in rep["foreign"]} == {names["junk"]} and rep["unsigned"] == []
    assert rep["checked"] == 7  # every epoch object read and decoded
    monkeypatch.setenv(ENV_VAR, SECRET)
    rc, rep, err = cli(capsys, s3_server, bucket, "verify", "--all")
    assert rc == 1
    assert {p["key"] for p in rep["corrupt"]} == {names["corrupt"], names["copied"]}
    unsigned = {p["key"]: p["reason"] for p in rep["unsigned"]}
    assert set(unsigned) == {names["unsigned"], names["forged"]}
    assert "not one of the fleet's keys" in unsigned[names["forged"]]
    assert SECRET not in err
    rc, doc, _ = cli(capsys, s3_server, bucket, "inspect", names["forged"])
    assert rc == 1 and doc["problems"] and doc["problems"][0].startswith("unsigned:")
    rc, doc, _ = cli(capsys, s3_server, bucket, "inspect", names["e1"])
    assert rc == 0 and doc["signed"] and doc["problems"] == []
