"""``s3kv verify`` (:mod:`s3kv.ops.verify`, :mod:`s3kv.cli.verify`) with the
fleet secret, against a real S3 server (moto) on loopback: unsigned and
badly signed objects are reported, every frame is decoded, newer formats are
reported and never deleted, and deleting takes only the versions it listed,
never unsigned into a signed namespace without the secret. gc with the
secret: test_gc_signed.py."""

from __future__ import annotations

import json
import struct
import time

import numpy as np
import pytest
import xxhash
import zstandard

from s3kv import codec
from s3kv.auth import ENV_VAR, FleetKeys
from s3kv.errors import CorruptChunk
from s3kv.keys import object_key
from s3kv.manifest import format as mf
from s3kv.manifest import protocol as mp
from tests.ops.signed import BASE, NS, PREFIX, SECRET, chunk, cli, key


def test_verify_with_the_secret_reports_unsigned_and_badly_signed_objects(
    fleet, s3_server, capsys, monkeypatch
):
    bucket, names, _ = fleet
    rc, plain, _ = cli(capsys, s3_server, bucket, "verify", "--all")
    assert rc == 1 and {p["key"] for p in plain["corrupt"]} == {names[5]} and plain["unsigned"] == []
    monkeypatch.setenv(ENV_VAR, SECRET)
    rc, rep, err = cli(capsys, s3_server, bucket, "verify", "--all")
    assert rc == 1
    assert {p["key"] for p in rep["corrupt"]} == {names[5]}
    unsigned = {p["key"]: p["reason"] for p in rep["unsigned"]}
    assert set(unsigned) == {names[3], names[4], names["forged segment"]}  # not the signed ones
    assert "unsigned" in unsigned[names[3]] and "not one of the fleet's keys" in unsigned[names[4]]
    assert SECRET not in json.dumps(rep) and SECRET not in err


def test_verify_deletes_only_the_versions_it_listed():
    import asyncio

    from s3kv.ops.inventory import scan
    from s3kv.ops.verify import delete_corrupt, verify
    from s3kv.stores.memory import MemoryStore

    async def body():
        store = MemoryStore()
        names = {i: object_key(PREFIX, NS, key(i), 0) for i in (1, 2)}
        for i, name in names.items():
            damaged = bytearray(chunk(i, None))
            damaged[-1] ^= 1
            await store.put(name, bytes(damaged))
        inv = await scan(store, PREFIX)
        rep = await verify(store, inv, sample=None)
        assert {p.key for p in rep.corrupt} == set(names.values())
        await store.put(names[2], chunk(2, None))  # a replica stored a good one since the listing
        deleted = await delete_corrupt(store, inv, rep, lease=None, skew_s=60)
        assert deleted == [names[1]]
        assert not await store.exists(names[1]) and await store.get(names[2]) == chunk(2, None)

    asyncio.run(body())


def forge(i: int, frames: list[tuple[bytes, int]]) -> bytes:
    """An unsigned zstd chunk object of key ``i`` whose frames are exactly
    ``frames`` (stored bytes, raw length), with valid checksums: only
    decoding the frames can tell what is wrong with them."""
    base = chunk(i, None)
    h = codec.parse_header(base)
    header = json.loads(base[codec.PREFIX_LEN : h.header_length])
    length = len(json.dumps(header, separators=(",", ":")))
    for _ in range(4):
        offset, entries = codec.PREFIX_LEN + length, []
        for stored, raw in frames:
            entries.append([offset, len(stored), raw, xxhash.xxh3_64_intdigest(stored)])
            offset += len(stored)
        header["frames"] = entries
        text = json.dumps(header, separators=(",", ":")).encode()
        if len(text) == length:
            break
        length = len(text)
    prefix = codec.PREFIX.pack(codec.MAGIC, 1, 0, len(text), xxhash.xxh3_64_intdigest(text), 0)
    return prefix + text + b"".join(s for s, _ in frames)


def bomb(declared: int) -> bytes:
    """A tiny zstd frame whose header says it holds ``declared`` bytes."""
    small = zstandard.ZstdCompressor(level=19, write_content_size=True).compress(b"\0" * (1 << 20))
    assert small[4] >> 6 == 2  # a 4-byte content size field: rewrite it as an 8-byte one
    return bytes([*small[:4], (small[4] & 0x3F) | 0xC0]) + struct.pack("<Q", declared) + small[9:]


def test_verify_decodes_every_frame():
    from s3kv.ops.chunks import check_chunk

    good = codec.parse_header(chunk(1, None))
    blob = chunk(1, None)
    stored = [bytes(blob[f.offset : f.end]) for f in good.frames]
    raw = good.frames[0].raw_length
    z = zstandard.ZstdCompressor(write_content_size=True)
    name = object_key(PREFIX, NS, key(1), 0)
    check_chunk(name, blob)
    cases = {
        "bad zstd bytes": ([(b"\x28\xb5\x2f\xfd" + b"\x55" * 60, raw), (stored[1], raw)], "zstd"),
        "another content size": ([(stored[0], raw), (z.compress(b"\1" * (raw - 2)), raw)], "content size"),
        "a bomb in the frame": ([(bomb(64 << 30), raw), (stored[1], raw)], "content size 68719476736"),
        "a bomb in the header": (
            [(stored[0], raw), (bomb(64 << 30), 64 << 30)],
            f"decodes to {64 << 30} bytes, more than {codec.MAX_FRAME_RAW}",
        ),
    }
    for what, (frames, why) in cases.items():
        forged = forge(1, frames)
        codec.parse_header(forged)  # the header and every checksum are fine
        started = time.monotonic()
        with pytest.raises(CorruptChunk, match=why) as e:
            check_chunk(name, forged)
        assert type(e.value) is CorruptChunk, what  # corrupt, not unsigned or unsupported
        assert time.monotonic() - started < 1, what  # nothing inflated


def resigned(blob: bytes, keys: FleetKeys, frame: int) -> bytes:
    """``blob`` (signed) with frame ``frame``'s MAC zeroed and the header
    signed again with ``keys``: with the fleet's keys, every check passes
    but that frame's MAC."""
    h = codec.parse_header(blob)
    hlen = h.header_length - codec.PREFIX_LEN - codec.TAG_BYTES
    header = json.loads(blob[codec.PREFIX_LEN : codec.PREFIX_LEN + hlen])
    header["frames"][frame][4] = "00" * codec.TAG_BYTES
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) == hlen
    prefix = codec.PREFIX.pack(codec.MAGIC, 2, codec.FLAG_SIGNED, hlen, xxhash.xxh3_64_intdigest(text), 0)
    return prefix + text + keys.sign("chunk", b"header", prefix, text) + blob[h.header_length :]


def test_verify_tells_unsigned_from_corrupt():
    from s3kv.errors import Unsigned
    from s3kv.ops.chunks import check_chunk

    keys = FleetKeys([SECRET])
    name = object_key(PREFIX, NS, key(1), 0)
    signed = chunk(1, keys)
    assert check_chunk(name, signed, keys).signed and check_chunk(name, signed).signed
    damaged = bytearray(signed)
    damaged[-3] ^= 1  # a frame's byte, its checksum stale
    forger = FleetKeys(["forger-secret-0123456789abcdef0123"])
    for data, keys_used, kind, why in (
        (chunk(1, None), keys, Unsigned, "unsigned object"),
        (chunk(1, forger), keys, Unsigned, "not one of the fleet's keys"),
        (resigned(signed, forger, 1), keys, Unsigned, "header MAC mismatch"),
        (resigned(signed, keys, 1), keys, Unsigned, "frame 1: MAC mismatch"),
        (bytes(damaged), keys, CorruptChunk, "checksum mismatch"),  # damaged: corrupt, whoever wrote it
        (bytes(damaged), None, CorruptChunk, "checksum mismatch"),
    ):
        with pytest.raises(CorruptChunk, match=why) as e:
            check_chunk(name, data, keys_used)
        assert type(e.value) is kind
    check_chunk(name, resigned(signed, keys, 1))  # sound without the secret: only a MAC fails


def _newer(data: bytes, version: int = 4) -> bytes:
    """The same object as a newer s3kv's format ``version`` would carry it
    (chunks: 4, the first this s3kv does not read; manifests: 3)."""
    out = bytearray(data)
    out[4:6] = version.to_bytes(2, "little")
    return bytes(out)


def test_verify_reports_newer_formats_and_never_deletes_them():
    import asyncio

    from s3kv.ops.inventory import scan
    from s3kv.ops.verify import delete_corrupt, verify
    from s3kv.stores.memory import MemoryStore

    async def body():
        store = MemoryStore()
        names = {i: object_key(PREFIX, NS, key(i), 0) for i in (1, 2, 3)}
        damaged = bytearray(chunk(3, None))
        damaged[-1] ^= 1
        for i, data in ((1, chunk(1, None)), (2, _newer(chunk(2, None))), (3, bytes(damaged))):
            await store.put(names[i], data)
        seg = mp.segment_name(BASE, int(time.time() * 1000), "newer", 1)
        await store.put(seg, _newer(mf.encode(mf.ManifestObject("segment", np.array([5], np.uint64))), 3))
        inv = await scan(store, PREFIX)
        rep = await verify(store, inv, sample=None)
        assert {p.key for p in rep.unsupported} == {names[2], seg}
        assert {p.key for p in rep.corrupt} == {names[3]}
        doc = rep.as_dict()
        assert "chunk format version 4; this s3kv reads versions 1, 2, 3" in doc["unsupported"][0]["reason"]
        assert "manifest format version 3" in doc["unsupported"][1]["reason"]
        assert await delete_corrupt(store, inv, rep, lease=None, skew_s=60) == [names[3]]
        assert await store.exists(names[2]) and await store.exists(seg)

    asyncio.run(body())


def test_delete_corrupt_without_the_secret_deletes_nothing_in_a_signed_namespace():
    import asyncio

    from s3kv.errors import UnsignedWrite
    from s3kv.ops.inventory import scan
    from s3kv.ops.verify import delete_corrupt, verify
    from s3kv.stores.memory import MemoryStore

    keys = FleetKeys([SECRET])

    async def body(signed_manifest_only: bool):
        store = MemoryStore()
        names = {i: object_key(PREFIX, NS, key(i), 0) for i in (1, 2)}
        damaged = bytearray(chunk(2, keys))
        damaged[-1] ^= 1
        if not signed_manifest_only:
            await store.put(names[1], chunk(1, keys))
        await store.put(names[2], bytes(damaged))
        seg = mp.segment_name(BASE, int(time.time() * 1000), "replica", 1)
        await store.put(seg, mf.encode(mf.ManifestObject("segment", np.array([5], np.uint64)), keys))
        before = {m.key: await store.get(m.key) async for m in store.list("")}
        inv = await scan(store, PREFIX)
        # A sample reads chunk objects only: then only the manifest says the namespace signs.
        rep = await verify(store, inv, sample=1 if signed_manifest_only else None)
        assert {p.key for p in rep.corrupt} == {names[2]}
        assert rep.signed_namespaces == (set() if signed_manifest_only else {NS})
        with pytest.raises(UnsignedWrite, match="without the fleet secret") as e:
            await delete_corrupt(store, inv, rep, lease=None, skew_s=60)
        assert SECRET not in str(e.value)
        assert {m.key: await store.get(m.key) async for m in store.list("")} == before  # no tombstone either
        # With the secret it goes ahead.
        rep = await verify(store, inv, sample=None, keys=keys)
        assert await delete_corrupt(store, inv, rep, lease=None, skew_s=60, keys=keys) == [names[2]]

    asyncio.run(body(False))
    asyncio.run(body(True))


def test_verify_delete_corrupt_without_the_secret_refuses(fleet, s3_server, capsys, monkeypatch):
    bucket, names, _ = fleet
    client = s3_server.client()

    def listing():
        return {o["Key"]: o["ETag"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}

    before = listing()
    rc, _, err = cli(capsys, s3_server, bucket, "verify", "--all", "--delete-corrupt")
    assert rc == 2 and "without the fleet secret" in err and SECRET not in err
    assert listing() == before
    monkeypatch.setenv(ENV_VAR, SECRET)
    rc, rep, err = cli(capsys, s3_server, bucket, "verify", "--all", "--delete-corrupt")
    assert rc == 1, err
    assert names[5] in rep["deleted"] and names[5] not in listing() and names[1] in listing()
