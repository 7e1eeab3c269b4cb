"""``s3kv verify`` and ``gc`` with the fleet secret, against a real S3 server
(moto) on loopback: unsigned and badly signed objects are reported, gc signs
what it writes, refuses to write unsigned into a signed namespace, and
deletes the objects replicas reported bad (only if still bad, and only the
version it read)."""

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
from s3kv.cli import main
from s3kv.errors import CorruptChunk
from s3kv.keys import fingerprint, object_key
from s3kv.manifest import format as mf
from s3kv.manifest import protocol as mp

SECRET = "ops-test-fleet-secret-0123456789abcdef"
PREFIX = "authops"
NS = "5a" * 16
BASE = f"{PREFIX}/{NS}/manifest/"
LAYERS = 2


def key(i: int) -> bytes:
    return bytes([i]) * 16


def chunk(i: int, keys: FleetKeys | None) -> bytes:
    rng = np.random.default_rng(i)
    return codec.encode_chunk(
        namespace=NS,
        key=key(i).hex(),
        rank=0,
        tokens=32,
        layers=[rng.integers(0, 255, 4096, dtype=np.uint8) for _ in range(LAYERS)],
        dtype="bfloat16",
        itemsize=2,
        page_shape=(1, 32, 64),
        keys=keys,
    )


@pytest.fixture
def fleet(s3_server, monkeypatch):
    """A bucket as an authenticated fleet leaves it, plus what a forger and
    an unsigned replica added."""
    keys = FleetKeys([SECRET])
    client = s3_server.client()
    bucket = s3_server.new_bucket()
    names = {}
    for i, signer in (
        (1, keys),
        (2, keys),
        (3, None),
        (4, FleetKeys(["forger-secret-0123456789abcdef0123"])),
    ):
        names[i] = object_key(PREFIX, NS, key(i), 0)
        client.put_object(Bucket=bucket, Key=names[i], Body=chunk(i, signer))
    tampered = bytearray(chunk(5, keys))
    h = codec.parse_header(bytes(tampered))
    tampered[h.frames[1].offset] ^= 1  # a frame flipped, its xxh3 left stale: corrupt either way
    names[5] = object_key(PREFIX, NS, key(5), 0)
    client.put_object(Bucket=bucket, Key=names[5], Body=bytes(tampered))
    now = int(time.time() * 1000) - 3_600_000
    seg = mf.ManifestObject("segment", np.array(sorted(fingerprint(key(i)) for i in (1, 2)), np.uint64))
    client.put_object(Bucket=bucket, Key=mp.segment_name(BASE, now, "signed", 1), Body=mf.encode(seg, keys))
    names["forged segment"] = mp.segment_name(BASE, now + 1, "forger", 1)
    client.put_object(Bucket=bucket, Key=names["forged segment"], Body=mf.encode(seg))
    descriptor = {"namespace": NS, "model": "m", "fields": {"tp_size": 1}, "chunk_tokens": 32}
    client.put_object(
        Bucket=bucket, Key=f"{PREFIX}/{NS}/namespace.json", Body=json.dumps(descriptor).encode()
    )
    monkeypatch.delenv(ENV_VAR, raising=False)
    return bucket, names, keys


def cli(capsys, s3_server, bucket, *args):
    capsys.readouterr()
    rc = main(
        [args[0], "--bucket", bucket, "--endpoint-url", s3_server.endpoint_url, "--region", "us-east-1"]
        + ["--prefix", PREFIX, "--json", *args[1:]]
    )
    cap = capsys.readouterr()
    return rc, (json.loads(cap.out) if cap.out.strip() else None), cap.err


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


def test_gc_with_the_secret_signs_what_it_writes(fleet, s3_server, capsys, monkeypatch):
    bucket, _, keys = fleet
    client = s3_server.client()
    rc, _, err = cli(capsys, s3_server, bucket, "gc", "--max-bytes", "0", "--min-age", "0s")
    assert rc == 2 and "give gc the fleet secret" in err and SECRET not in err
    monkeypatch.setenv(ENV_VAR, SECRET)
    recent = mp.segment_name(BASE, int(time.time() * 1000), "forger", 2)  # one gc's compaction reads
    client.put_object(
        Bucket=bucket,
        Key=recent,
        Body=mf.encode(mf.ManifestObject("segment", removed=np.array([7], np.uint64))),
    )
    rc, doc, err = cli(capsys, s3_server, bucket, "gc", "--max-bytes", "0", "--min-age", "0s")
    assert rc == 0, err
    written = [
        o["Key"]
        for o in client.list_objects_v2(Bucket=bucket, Prefix=BASE)["Contents"]
        if "-gc" in o["Key"].rsplit("/", 1)[-1]
    ]
    assert written  # a tombstone segment and a snapshot, at least
    for name in written:
        mf.decode(client.get_object(Bucket=bucket, Key=name)["Body"].read(), name=name, keys=keys)
    assert SECRET not in json.dumps(doc)
    # The forger's recent segment was read, ignored, and said so.
    assert doc["result"]["unsigned_manifest_objects_ignored"] == [recent]


def test_gc_deletes_the_objects_replicas_reported_bad(fleet, s3_server, capsys, monkeypatch):
    bucket, names, keys = fleet
    client = s3_server.client()
    etag = client.head_object(Bucket=bucket, Key=names[5])["ETag"]
    # Key 6's object is of a newer s3kv's format: not this gc's to judge.
    newer = bytearray(chunk(6, keys))
    fields = list(codec.PREFIX.unpack_from(newer))
    fields[1] = max(codec.READ_VERSIONS) + 1
    codec.PREFIX.pack_into(newer, 0, *fields)
    names[6] = object_key(PREFIX, NS, key(6), 0)
    client.put_object(Bucket=bucket, Key=names[6], Body=bytes(newer))
    record = mf.ManifestObject(
        "segment",
        removed=np.array(sorted([fingerprint(key(5)), fingerprint(key(1)), fingerprint(key(6))]), np.uint64),
        meta={"bad": [[names[5], etag], [names[1], '"bogus"'], [names[6], '"newer"']]},  # 1 reads well
    )
    now = int(time.time() * 1000)
    client.put_object(
        Bucket=bucket, Key=mp.segment_name(BASE, now, "replica", 9), Body=mf.encode(record, keys)
    )
    monkeypatch.setenv(ENV_VAR, SECRET)
    rc, dry, _ = cli(capsys, s3_server, bucket, "gc", "--dry-run")
    assert rc == 0 and [b["object"] for b in dry["bad_objects"]] == [names[5]]
    assert client.head_object(Bucket=bucket, Key=names[5])  # a dry run deletes nothing
    rc, done, err = cli(capsys, s3_server, bucket, "gc")
    assert rc == 0, err
    assert done["result"]["bad_objects_deleted"] == 1
    left = {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=f"{PREFIX}/{NS}/")["Contents"]}
    assert names[5] not in left and names[1] in left and names[6] in left
    # Stored again (a good one), it stays: gc removes only what is still bad.
    client.put_object(Bucket=bucket, Key=names[5], Body=chunk(5, keys))
    rc, again, _ = cli(capsys, s3_server, bucket, "gc")
    assert rc == 0 and again["bad_objects"] == [] and client.head_object(Bucket=bucket, Key=names[5])


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


# -- verify decodes every frame; unsigned apart from corrupt; unsupported never deleted ---------


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


def test_gc_reads_the_heads_of_reported_objects_and_past_them_only_those_whose_head_is_sound():
    import asyncio

    from s3kv.ops.gc import find_bad
    from s3kv.ops.inventory import scan
    from s3kv.stores.base import HEAD_BYTES
    from s3kv.stores.memory import MemoryStore

    class Recording(MemoryStore):
        def __init__(self) -> None:
            super().__init__()
            self.gets: dict[str, list] = {}

        async def get(self, key, range=None):
            self.gets.setdefault(key, []).append(range)
            return await super().get(key, range)

    def big(i: int, signer: FleetKeys | None) -> bytes:
        """A chunk object whose second frame lies past the first ranged GET."""
        rng = np.random.default_rng(i)
        return codec.encode_chunk(
            namespace=NS,
            key=key(i).hex(),
            rank=0,
            tokens=32,
            layers=[rng.integers(0, 255, 40000, dtype=np.uint8) for _ in range(LAYERS)],
            dtype="uint8",
            itemsize=1,
            page_shape=(1, 40000),
            keys=signer,
        )

    keys = FleetKeys([SECRET])
    names = {i: object_key(PREFIX, NS, key(i), 0) for i in range(1, 8)}
    frame = bytearray(big(4, keys))
    frame[codec.parse_header(bytes(frame)).frames[1].offset] ^= 1
    bodies = {
        1: big(1, FleetKeys(["forger-secret-0123456789abcdef0123"])),  # signed, not by the fleet
        2: big(6, keys),  # another chunk's object, under this name
        3: big(3, keys)[:-100],  # torn: shorter than its header says
        4: bytes(frame),  # a frame flipped: only its frames tell
        5: big(5, keys),  # sound: a bogus record
        6: b"",
        7: big(7, None),  # unsigned
    }
    assert all(len(b) > HEAD_BYTES for b in bodies.values() if b)

    async def body():
        store = Recording()
        for i, data in bodies.items():
            await store.put(names[i], data)
        record = mf.ManifestObject(
            "segment",
            removed=np.array(sorted(fingerprint(key(i)) for i in names), np.uint64),
            meta={"bad": [[n, "etag"] for n in names.values()]},
        )
        await store.put(mp.segment_name(BASE, int(time.time() * 1000), "replica", 1), mf.encode(record, keys))
        inv = await scan(store, PREFIX)
        store.gets.clear()
        found = (await find_bad(store, inv, keys=keys)).objects
        return store, {b.name: b for b in found}

    store, bad = asyncio.run(body())
    assert set(bad) == {names[i] for i in (1, 2, 3, 4, 6, 7)}
    gets = {n: g for n, g in store.gets.items() if not n.startswith(BASE)}
    assert all(r is not None for g in gets.values() for r in g)  # none read whole
    assert sorted(n for n, g in gets.items() if len(g) > 1) == [names[4], names[5]]
    assert "not one of the fleet's keys" in bad[names[1]].reason and "unsigned" in bad[names[7]].reason
    assert "its header says" in bad[names[3]].reason and "frame 1" in bad[names[4]].reason
    assert all(b.etag is not None for b in bad.values())  # each deleted by the version read


def test_a_chunk_head_longer_than_one_ranged_get_is_read_in_two():
    import asyncio

    from s3kv.chunk_reader import check_chunk_head, read_chunk_head
    from s3kv.stores.base import HEAD_BYTES
    from s3kv.stores.memory import MemoryStore

    keys = FleetKeys([SECRET])
    data = codec.encode_chunk(
        namespace=NS,
        key=key(1).hex(),
        rank=0,
        tokens=32,
        layers=[np.full(64, i % 251, np.uint8) for i in range(1500)],  # a frame table of ~150 KiB
        dtype="uint8",
        itemsize=1,
        page_shape=(1, 64),
        keys=keys,
    )
    assert codec.header_length(data) > HEAD_BYTES
    store = MemoryStore()
    name = object_key(PREFIX, NS, key(1), 0)
    asyncio.run(store.put(name, data))
    head = asyncio.run(read_chunk_head(store, name))
    assert head.data == data[: codec.header_length(data)] and head.size == len(data)
    check_chunk_head(name, head.data, head.size, keys)


PASTED = "q8Zx/3vKmPz9Lq0Wr7TyUi2Op5AsDf8GhJk4LzXcVbN="
"""A base64 secret pasted where its file's path goes: it has a "/"."""


@pytest.mark.parametrize("given_by", ["flag", "env", "config"])
def test_a_secret_pasted_as_the_key_file_is_never_printed(s3_server, bucket, tmp_path, given_by):
    """``python -m s3kv.cli`` told the secret itself where the key file's path
    goes (by --auth-key-file, S3KV_AUTH_KEY_FILE or the config's
    auth_key_file) says it cannot read it, without the value."""
    import os
    import subprocess
    import sys

    args = [sys.executable, "-m", "s3kv.cli", "ls", "--endpoint-url", s3_server.endpoint_url]
    env = {k: v for k, v in os.environ.items() if not k.startswith("S3KV_")}
    if given_by == "flag":
        args += ["--bucket", bucket, "--auth-key-file", PASTED]
    elif given_by == "env":
        args += ["--bucket", bucket]
        env["S3KV_AUTH_KEY_FILE"] = PASTED
    else:
        config = tmp_path / "kv.json"
        config.write_text(
            json.dumps({"kv_connector_extra_config": {"bucket": bucket, "auth_key_file": PASTED}})
        )
        args += ["--config", str(config)]
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "s3kv: error: auth_key_file (value not shown): cannot read it" in out.stderr
    assert "not the secret itself" in out.stderr
    assert PASTED not in out.stderr + out.stdout and "q8Zx" not in out.stderr + out.stdout
