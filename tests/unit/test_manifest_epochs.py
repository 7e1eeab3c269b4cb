"""Epoch objects (s3kv.manifest.epochs): a round trip, and every epoch that
is not what its name says refused."""

import numpy as np
import pytest

from s3kv.auth import FleetKeys
from s3kv.errors import CorruptManifest, UnsignedManifest
from s3kv.manifest import epochs as me
from s3kv.manifest import format as mf
from s3kv.manifest import protocol as mp

BASE = "pfx/" + "ab" * 16 + "/manifest/"
T_MS = 1_700_000_000_000
E_MS = 5000
E = T_MS // E_MS
SECRET = "s" * 32


def fps(*values):
    return np.array(values, dtype=np.uint64)


def seg(ts, writer, seq, added=(), removed=(), meta=None):
    return (
        mp.segment_name(BASE, ts, writer, seq),
        mf.ManifestObject("segment", fps(*added), fps(*removed), meta or {}),
    )


def sample(e=E):
    return me.Epoch(
        e,
        E_MS,
        "aggr",
        T_MS + 6000,
        [
            seg(T_MS + 2, "bbbb", 1, (5, 3), (), {"rank": 1, "ranks": 2}),
            seg(T_MS + 1, "aaaa", 1, (1, 2, 3), (9,)),
            seg(T_MS + 3, "cccc", 2, (), (4,), {"bad": [["x", None]]}),
        ],
    )


def test_an_epoch_round_trips_its_members_in_name_order():
    name = mp.epoch_name(BASE, E, E_MS)
    back = me.decode(BASE, name, me.encode(BASE, sample()))
    assert (back.e, back.e_ms, back.writer, back.ts) == (E, E_MS, "aggr", T_MS + 6000)
    assert [n for n, _ in back.members] == sorted(n for n, _ in sample().members)
    got = {n: (o.added.tolist(), o.removed.tolist(), o.meta) for n, o in back.members}
    assert got[mp.segment_name(BASE, T_MS + 1, "aaaa", 1)] == ([1, 2, 3], [9], {})
    assert got[mp.segment_name(BASE, T_MS + 2, "bbbb", 1)] == ([3, 5], [], {"rank": 1, "ranks": 2})
    empty = me.decode(BASE, name, me.encode(BASE, me.Epoch(E, E_MS, "aggr", T_MS, [])))
    assert empty.members == []


def test_every_corruption_and_an_epoch_under_another_name_are_refused():
    name = mp.epoch_name(BASE, E, E_MS)
    blob = me.encode(BASE, sample())
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x10
        with pytest.raises(CorruptManifest):
            me.decode(BASE, name, bytes(bad))
    for other in (mp.epoch_name(BASE, E + 1, E_MS), mp.epoch_name(BASE, E, E_MS + 1)):
        with pytest.raises(CorruptManifest, match="copied"):
            me.decode(BASE, other, blob)
    segment = mf.encode(mf.ManifestObject("segment", fps(1)))
    with pytest.raises(CorruptManifest, match="not an epoch"):
        me.decode(BASE, name, segment)


def _framed(meta, added=(), removed=()):
    return mf.frame("epoch", meta, fps(*added), fps(*removed))


def test_members_that_do_not_add_up_or_are_no_segments_are_refused():
    name = mp.epoch_name(BASE, E, E_MS)
    a = mp.segment_name(BASE, T_MS, "aaaa", 1)[len(BASE) :]
    b = mp.segment_name(BASE, T_MS + 1, "bbbb", 1)[len(BASE) :]
    head = {"e": E, "e_ms": E_MS, "writer": "w", "ts": T_MS}
    cases = {
        "unsorted": _framed({**head, "members": [[a, 2, 0, {}]]}, (2, 1)),
        "order": _framed({**head, "members": [[b, 1, 0, {}], [a, 1, 0, {}]]}, (1, 2)),
        "runs past": _framed({**head, "members": [[a, 3, 0, {}]]}, (1, 2)),
        "account": _framed({**head, "members": [[a, 1, 0, {}]]}, (1, 2)),
        "no segment": _framed({**head, "members": [["snap/" + mp.stamp(T_MS) + "-w", 0, 0, {}]]}),
        "elsewhere": _framed({**head, "members": [["../x/" + a, 0, 0, {}]]}),
        "counts": _framed({**head, "members": [[a, -1, 0, {}]]}),
        "rank": _framed({**head, "members": [[a, 0, 0, {"rank": 5, "ranks": 2}]]}),
        "writer": _framed({"e": E, "e_ms": E_MS, "ts": T_MS, "members": []}),
    }
    for why, data in cases.items():
        with pytest.raises(CorruptManifest):
            me.decode(BASE, name, data)
        assert why


def test_with_the_fleet_secret_only_an_epoch_signed_with_it_reads():
    name = mp.epoch_name(BASE, E, E_MS)
    keys = FleetKeys([SECRET])
    signed = me.encode(BASE, sample(), keys)
    assert len(me.decode(BASE, name, signed, keys=keys).members) == 3
    with pytest.raises(UnsignedManifest):
        me.decode(BASE, name, me.encode(BASE, sample()), keys=keys)
    with pytest.raises(UnsignedManifest):
        me.decode(BASE, name, me.encode(BASE, sample(), FleetKeys(["o" * 32])), keys=keys)
