"""``s3kv gc`` with the fleet secret, against a real S3 server (moto) on
loopback: gc signs what it writes and refuses to write unsigned into a signed
namespace, and deletes the objects replicas reported bad
(:mod:`s3kv.ops.reported`: only if still bad, reading their heads first, and
only the version it read)."""

from __future__ import annotations

import json
import time

import numpy as np

from s3kv import codec
from s3kv.auth import ENV_VAR, FleetKeys
from s3kv.keys import fingerprint, object_key
from s3kv.manifest import format as mf
from s3kv.manifest import protocol as mp
from tests.ops.signed import BASE, LAYERS, NS, PREFIX, SECRET, chunk, cli, key


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
    # gc's snapshot carries on the record it did not judge, not the one it
    # deleted nor the one that reads well: a replica that starts from it must
    # not publish key 6 from a 412.
    assert _newest_snapshot(client, bucket, keys).meta["bad"] == [[names[6], '"newer"']]
    # Stored again (a good one), it stays: gc removes only what is still bad.
    client.put_object(Bucket=bucket, Key=names[5], Body=chunk(5, keys))
    rc, again, _ = cli(capsys, s3_server, bucket, "gc")
    assert rc == 0 and again["bad_objects"] == [] and client.head_object(Bucket=bucket, Key=names[5])


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


def _newest_snapshot(client, bucket, keys):
    listed = client.list_objects_v2(Bucket=bucket, Prefix=BASE + "snap/")["Contents"]
    name = max(o["Key"] for o in listed)
    return mf.decode(client.get_object(Bucket=bucket, Key=name)["Body"].read(), name=name, keys=keys)


def test_gc_deletes_an_object_reported_bad_in_a_snapshot_once_its_segment_is_gone(
    fleet, s3_server, capsys, monkeypatch
):
    """A snapshot carries the bad records of the segments it covers, which
    gc may have pruned since: gc judges those too."""
    bucket, names, keys = fleet
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key=names[3], Body=chunk(3, keys)[:-7])  # torn: bad
    etag = client.head_object(Bucket=bucket, Key=names[3])["ETag"]
    snapshot = mf.ManifestObject("snapshot", meta={"bad": [[names[3], etag]], "writer": "replica"})
    client.put_object(
        Bucket=bucket,
        Key=mp.snapshot_name(BASE, int(time.time() * 1000), "replica"),
        Body=mf.encode(snapshot, keys),
    )
    monkeypatch.setenv(ENV_VAR, SECRET)
    rc, done, err = cli(capsys, s3_server, bucket, "gc")
    assert rc == 0, err
    assert done["result"]["bad_objects_deleted"] == 1
    left = {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=f"{PREFIX}/{NS}/")["Contents"]}
    assert names[3] not in left and names[2] in left
