"""Objects that must cost one failed load, never a crash, a loop or wrong KV:
decompression bombs, truncations, 416s, bad shuffle values, forgeries; and
what happens to them (dropped, the next source tried, deleted only if
unchanged, or reported bad)."""

from __future__ import annotations

import asyncio
import json
import struct
import time
import tracemalloc

import numpy as np
import pytest
import xxhash
import zstandard

from s3kv import codec
from s3kv.auth import FleetKeys
from s3kv.errors import CorruptChunk, NotFound, PermissionDenied, Throttled, Transient
from s3kv.stores.base import GetResult
from s3kv.stores.memory import MemoryStore
from s3kv.testing.chunks import chunk_id
from s3kv.testing.pages import Frames, Pages
from s3kv.tiering.chunks import ChunkCodec
from s3kv.tiering.placement import Tier
from tests.unit.test_blosc2_format import plugin_frame, special_frame, watch_python
from tests.unit.test_transfer import (
    FMT,
    LAYERS,
    PAGE,
    chunk,
    engine,
    files,
    job,
    layers,
    put_log,
    stored_chunk,
    wait_for,
)

SECRET = "a-fleet-secret-of-at-least-32-chars!"
OTHER = "another-fleet-secret-32-characters-long"


def rewrite_header(blob: bytes, **changes) -> bytes:
    """``blob`` (an unsigned object, or just its header) with header fields
    changed, frame offsets moved to match and the header checksum fixed:
    checksums pass, so only the other checks can refuse it."""
    _m, version, flags, hlen, _sum, _z = codec.PREFIX.unpack_from(blob)
    assert flags == 0
    start = codec.PREFIX_LEN + hlen
    header = json.loads(blob[codec.PREFIX_LEN : start])
    header.update(changes)
    rel = [f[0] - header["frames"][0][0] for f in header["frames"]]
    length = hlen
    for _ in range(4):
        header["frames"] = [[codec.PREFIX_LEN + length + r, *f[1:]] for r, f in zip(rel, header["frames"])]
        new = json.dumps(header, separators=(",", ":")).encode()
        if len(new) == length:
            break
        length = len(new)
    prefix = codec.PREFIX.pack(codec.MAGIC, version, 0, len(new), xxhash.xxh3_64_intdigest(new), 0)
    return prefix + new + blob[start:]


def bomb(declared: int) -> bytes:
    """A tiny zstd frame that says it holds ``declared`` bytes (and would
    inflate to that much zeros)."""
    c = zstandard.ZstdCompressor(level=19, write_content_size=True)
    small = c.compress(b"\0" * (1 << 20))
    params = zstandard.get_frame_parameters(small)
    assert params.content_size == 1 << 20
    # Rewrite the frame header's content size field: single-segment frames
    # with an 8-byte field (FHD 0xE0 | checksum flag) hold it right after FHD.
    fhd = small[4]
    assert fhd >> 6 == 2  # a 4-byte content size field
    head = bytearray(small[:5])
    head[4] = (fhd & 0x3F) | 0xC0  # 8-byte field
    return bytes(head) + struct.pack("<Q", declared) + small[9:]


def put(store, name, data):
    asyncio.run(store.put(name, data))


def get(store, name):
    return asyncio.run(store.get(name))


def test_a_decompression_bomb_is_refused_before_any_allocation():
    frame = bomb(64 << 30)
    assert zstandard.frame_content_size(frame) == 64 << 30
    key = b"b" * 16
    store = MemoryStore()
    e = stored_chunk(store, key, 1)
    name = chunk_id(e, key).object_key
    # A small object whose every frame claims 64 GiB, in a header whose raw
    # lengths say the same, then one whose header says the page size but
    # whose zstd frames still claim 64 GiB.
    blob = get(store, name)
    h = codec.parse_header(blob)
    frames = [frame] * LAYERS
    for raw in (64 << 30, PAGE):
        body = codec.encode_chunk(
            namespace=h.namespace,
            key=h.key,
            rank=0,
            tokens=h.tokens,
            layers=[np.zeros(8, np.uint8)] * LAYERS,
            dtype=h.dtype,
            itemsize=2,
            page_shape=h.page_shape,
        )
        hb = codec.parse_header(body)
        forged = rewrite_header(
            body[: hb.header_length],
            frames=[[i * len(f), len(f), raw, xxhash.xxh3_64_intdigest(f)] for i, f in enumerate(frames)],
        )
        fixed = codec.parse_header(forged + b"".join(frames))
        assert [f.raw_length for f in fixed.frames] == [raw] * LAYERS
        put(store, name, forged + b"".join(frames))
        assert len(get(store, name)) < 64 << 10
        written = []
        tracemalloc.start()
        e.submit_load(f"j{raw}", [chunk(key)], Pages(lambda c, layer, arr, w=written: w.append(layer)))
        acc = wait_for(e, lambda a, raw=raw: f"j{raw}" in a.finished_loads)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert acc.finished_loads[f"j{raw}"] and written == [] and acc.missing == {Tier.S3: {key}}
        assert peak < 8 * PAGE + (4 << 20), peak  # nothing near what the frames claim
        put(store, name, blob)
    assert e.counters.totals()["load_errors_corrupt"] == 2
    with pytest.raises(CorruptChunk, match="zstd content size 68719476736, the page holds"):
        codec.decode_frame(codec.parse_header(forged + b"".join(frames)), 0, frame)
    e.close()


def _truncated_at_a_frame_boundary(blob: bytes, frame: int) -> bytes:
    return blob[: codec.parse_header(blob).frames[frame].end]


class HidesSize(MemoryStore):
    """A store that does not say how large an object is (as a LocalStore
    would not): truncation shows only as a 416 on a later range."""

    async def get_object(self, key, range=None):
        return GetResult(await self.get(key, range))


@pytest.mark.parametrize("store_cls", [MemoryStore, HidesSize])
def test_truncation_at_a_frame_boundary_and_416_are_corrupt(store_cls):
    key = b"t" * 16
    store = store_cls()
    e = stored_chunk(store, key, 2)
    name = chunk_id(e, key).object_key
    put(store, name, _truncated_at_a_frame_boundary(get(store, name), 1))
    e.submit_load("j", [chunk(key)], Pages(lambda *a: None))
    acc = wait_for(e, lambda a: "j" in a.finished_loads)
    assert acc.finished_loads["j"] and acc.missing == {Tier.S3: {key}}
    t = e.counters.totals()
    assert t["load_errors_corrupt"] == 1 and "load_errors_other" not in t
    if store_cls is MemoryStore:  # deleted (the version read: If-Match), so a store rewrites it
        assert not asyncio.run(store.exists(name)) and acc.bad == {}
    else:  # no ETag to delete it by: reported bad to the fleet instead
        assert asyncio.run(store.exists(name)) and acc.bad == {key: None}
    e.close()


@pytest.mark.parametrize("fault", [MemoryError(), RuntimeError("the device")], ids=lambda f: type(f).__name__)
def test_pages_that_fail_are_the_engines_fault_not_the_objects(fault):
    """A load whose pages fail as a frame goes into them (out of memory, a
    device error): the load fails with that error, but the object is not
    corrupt (a MemoryError while reading it would be): not deleted, not
    reported bad or missing, no corrupt load counted."""
    key = b"p" * 16
    store = MemoryStore()
    e = stored_chunk(store, key, 2)
    name = chunk_id(e, key).object_key

    def target(c, layer):
        raise fault

    e.submit_load("j", [chunk(key)], Pages(lambda *a: None, target))
    acc = wait_for(e, lambda a: "j" in a.finished_loads)
    assert acc.finished_loads["j"] and not acc.missing and not acc.bad
    t = e.counters.totals()
    assert "load_errors_corrupt" not in t and t["load_errors_other"] == 1
    assert asyncio.run(store.exists(name))
    e.close()


def test_a_bad_disk_copy_falls_back_to_s3(tmp_path):
    key = b"d" * 16
    store = MemoryStore()
    e = engine(store, disk_path=tmp_path)
    e.submit_store(job(key, layers(7), disk=True, s3=True))
    wait_for(e, lambda a: key in a.written.get(Tier.DISK, {}) and key in a.written.get(Tier.S3, {}))
    path = files(e).path(key)
    for damage in (
        lambda b: _truncated_at_a_frame_boundary(b, 2),
        lambda b: rewrite_header(b, shuffle=3),
        lambda b: rewrite_header(b, shuffle=0),
        lambda b: b[:100],
    ):
        good = get(store, chunk_id(e, key).object_key)
        path.write_bytes(damage(good))
        got = {}
        e.submit_load(
            "j",
            [chunk(key, Tier.DISK, Tier.S3)],
            Pages(lambda c, layer, arr, g=got: g.__setitem__(layer, arr.copy())),
        )
        acc = wait_for(e, lambda a: "j" in a.finished_loads)
        assert acc.finished_loads["j"] == [] and acc.missing == {Tier.DISK: {key}}
        assert all(np.array_equal(got[i], layers(7)[i]) for i in range(LAYERS))
        assert not path.exists()
    t = e.counters.totals()
    assert t["load_errors_corrupt"] == 4 and t["load_chunks_s3"] == 4 and "load_errors_other" not in t
    e.close()


def test_a_bad_shuffle_value_in_s3_is_corrupt():
    key = b"s" * 16
    store = MemoryStore()
    e = stored_chunk(store, key, 3)
    name = chunk_id(e, key).object_key
    put(store, name, rewrite_header(get(store, name), shuffle=3))
    e.submit_load("j", [chunk(key)], Pages(lambda *a: None))
    acc = wait_for(e, lambda a: "j" in a.finished_loads)
    assert acc.missing == {Tier.S3: {key}} and e.counters.totals()["load_errors_corrupt"] == 1
    e.close()


class NoDelete(MemoryStore):
    """A role without s3:DeleteObject (the Terraform default for replicas)."""

    async def delete_if(self, key, etag):
        raise PermissionDenied(f"{key}: AccessDenied")

    async def delete_many(self, keys):
        raise PermissionDenied("AccessDenied")


def test_without_delete_permission_a_corrupt_object_is_reported_bad():
    key = b"q" * 16
    store = NoDelete()
    e = stored_chunk(store, key, 4)
    name = chunk_id(e, key).object_key
    blob = bytearray(get(store, name))
    blob[-5] ^= 1
    put(store, name, bytes(blob))
    etag = asyncio.run(store.head(name)).etag
    e.submit_load("j", [chunk(key)], Pages(lambda *a: None))
    acc = wait_for(e, lambda a: "j" in a.finished_loads)
    assert acc.missing == {Tier.S3: {key}} and acc.bad == {key: etag}
    assert asyncio.run(store.exists(name)) and e.counters.totals()["quarantined_chunks"] == 1
    e.close()


def test_a_corrupt_object_rewritten_meanwhile_is_not_deleted():
    class RewritesBeforeDelete(MemoryStore):
        good: bytes = b""

        async def delete_if(self, key, etag):
            await self.put(key, self.good)  # another replica stored a good one just now
            return await super().delete_if(key, etag)

    key = b"r" * 16
    store = RewritesBeforeDelete()
    e = stored_chunk(store, key, 5)
    name = chunk_id(e, key).object_key
    store.good = get(store, name)
    put(store, name, _truncated_at_a_frame_boundary(store.good, 0))
    e.submit_load("j", [chunk(key)], Pages(lambda *a: None))
    wait_for(e, lambda a: "j" in a.finished_loads)
    assert get(store, name) == store.good  # the good object stays
    e.close()


# -- the fleet secret -------------------------------------------------------------


def keys(*secrets):
    return FleetKeys(secrets or (SECRET,))


def test_signed_objects_roundtrip_and_forgeries_fail():
    k = keys()
    cc = ChunkCodec("n" * 32, 0, LAYERS, FMT, keys=k)
    data = layers(9)
    blob = cc.encode(b"k" * 16, data)
    got = {}
    cc.decode(b"k" * 16, blob, got.__setitem__, "x")
    assert all(np.array_equal(got[i], data[i]) for i in range(LAYERS))
    # An unsigned reader still reads it (checksums are kept).
    plain = ChunkCodec("n" * 32, 0, LAYERS, FMT)
    plain.decode(b"k" * 16, blob, {}.__setitem__, "x")
    unsigned = plain.encode(b"k" * 16, data)
    forged = ChunkCodec("n" * 32, 0, LAYERS, FMT, keys=keys(OTHER)).encode(b"k" * 16, data)
    flipped = bytearray(blob)
    flipped[-3] ^= 1
    flipped_frame = bytes(flipped)
    # The frame's xxh3 fixed up: only the MAC can tell.
    h = codec.parse_header(blob)
    tampered = bytearray(blob)
    tampered[h.frames[0].offset] ^= 1
    for bad, why in (
        (unsigned, "unsigned object"),
        (forged, "not one of the fleet's keys"),
        (flipped_frame, "MAC mismatch"),
        (bytes(tampered), "MAC mismatch"),
        (blob[:50] + bytes([blob[50] ^ 1]) + blob[51:], "checksum mismatch|MAC mismatch|malformed"),
    ):
        with pytest.raises(CorruptChunk, match=why):
            cc.decode(b"k" * 16, bad, {}.__setitem__, "x")


def test_rotation_reads_old_and_new_signs_with_the_first():
    old = ChunkCodec("n" * 32, 0, LAYERS, FMT, keys=keys(OTHER))
    both = ChunkCodec("n" * 32, 0, LAYERS, FMT, keys=keys(SECRET, OTHER))
    blob_old = old.encode(b"k" * 16, layers(1))
    both.decode(b"k" * 16, blob_old, {}.__setitem__, "x")  # the old key still verifies
    blob_new = both.encode(b"k" * 16, layers(1))
    assert codec.parse_header(blob_new).kid == keys(SECRET).signing_kid
    with pytest.raises(CorruptChunk):
        old.decode(b"k" * 16, blob_new, {}.__setitem__, "x")


def test_a_forged_object_in_the_way_of_a_store_is_replaced_not_published():
    key = b"f" * 16
    store = MemoryStore()
    e = engine(store, keys=keys())
    log = put_log(e)
    name = chunk_id(e, key).object_key
    forger = engine(MemoryStore())  # valid checksums, no secret, other KV
    put(store, name, forger.codec.encode(key, layers(99)))
    forger.close()
    e.submit_store(job(key, layers(1), s3=True))
    acc = wait_for(e, lambda a: key in a.written.get(Tier.S3, {}) or key in a.failed.get(Tier.S3, ()))
    assert key in acc.written[Tier.S3]
    assert codec.parse_header(get(store, name), keys()).signed  # ours now
    assert log == [("I", key), ("N", key), ("I", key), ("S", key)]  # the second PUT created it
    e.close()


def test_a_forged_object_that_cannot_be_deleted_is_never_published():
    key = b"g" * 16
    store = NoDelete()
    e = engine(store, keys=keys())
    name = chunk_id(e, key).object_key
    put(store, name, ChunkCodec("n" * 32, 0, LAYERS, FMT).encode(key, layers(99)))
    e.submit_store(job(key, layers(1), s3=True))
    acc = wait_for(e, lambda a: key in a.failed.get(Tier.S3, ()) or key in a.written.get(Tier.S3, {}))
    assert key in acc.failed[Tier.S3] and key not in acc.written.get(Tier.S3, {})
    assert key in acc.bad and key not in acc.existing
    e.close()


def test_a_good_signed_object_in_the_way_counts_as_stored():
    key = b"h" * 16
    store = MemoryStore()
    a = stored_chunk(store, key, 1, keys=keys())
    b = engine(store, keys=keys())
    log = put_log(b)
    b.submit_store(job(key, layers(2), s3=True))
    acc = wait_for(b, lambda r: key in r.written.get(Tier.S3, {}))
    assert acc.existing == {key} and b.counters.totals()["store_chunks_existing"] == 1
    assert log == [("I", key), ("N", key)]  # a's object: the journal never publishes it
    a.close()
    b.close()


# -- tiers in trouble -------------------------------------------------------------


def test_a_slow_disk_read_falls_back_to_s3_and_blames_only_the_disk(tmp_path, monkeypatch):
    import threading

    key = b"w" * 16
    store = MemoryStore()
    e = engine(store, disk_path=tmp_path)
    e.submit_store(job(key, layers(3), disk=True, s3=True))
    wait_for(e, lambda a: key in a.written.get(Tier.DISK, {}) and key in a.written.get(Tier.S3, {}))
    e.handlers[Tier.DISK].timeout_s = 0.2  # short for the read under test, not the write before it
    stuck = threading.Event()
    real_read = files(e).read

    def hung_read(*a, **kw):
        stuck.wait(30)  # a disk that stopped answering
        return real_read(*a, **kw)

    monkeypatch.setattr(files(e), "read", hung_read)
    got = {}
    e.submit_load(
        "j", [chunk(key, Tier.DISK, Tier.S3)], Pages(lambda c, layer, arr: got.__setitem__(layer, arr.copy()))
    )
    acc = wait_for(e, lambda a: "j" in a.finished_loads)
    assert acc.finished_loads["j"] == [] and all(np.array_equal(got[i], layers(3)[i]) for i in range(LAYERS))
    assert acc.tier_failed == {Tier.DISK: 1} and acc.tier_ok == {Tier.S3: 1}
    seen = dict(got)
    stuck.set()  # the disk answers late: its thread must not write any more
    e.drain(5)
    assert got.keys() == seen.keys() and all(got[i] is seen[i] for i in got)
    e.close()


async def _until(done, timeout_s: float) -> None:
    """Wait (on the engine's loop) until ``done()`` holds, for at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def test_an_s3_failure_makes_loads_in_flight_give_up():
    import threading

    class HangsThenFails(MemoryStore):
        """S3 hangs for every object but one, whose GET fails once another
        load's GET is in flight."""

        in_flight = threading.Event()
        released = threading.Event()

        async def get_object(self, key, range=None):
            if key.endswith("a" * 32 + ".r0"):
                await _until(self.in_flight.is_set, 60)
                raise Transient("connection reset")
            self.in_flight.set()
            await _until(self.released.is_set, 60)  # S3 hangs for the others
            raise AssertionError("unreachable")

    store = HangsThenFails()
    e = engine(store, load_timeout_s=30)
    started = time.monotonic()
    e.submit_load("a", [chunk(b"\xaa" * 16)], Pages(lambda *a: None))
    e.submit_load("b", [chunk(b"\xbb" * 16)], Pages(lambda *a: None))
    acc = wait_for(e, lambda a: {"a", "b"} <= a.finished_loads.keys())
    assert time.monotonic() - started < 10  # not the 30 s timeout
    assert acc.finished_loads["a"] and acc.finished_loads["b"]
    assert acc.tier_failed[Tier.S3] >= 1
    store.released.set()
    e.close(0.1)


# -- what a failure to read means: only the bytes make an object corrupt ----------------------

LEAKY = "https://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI%2FK7MDENG@bucket.s3.amazonaws.com/x?X-Amz-Signature=abc"
"""What a library's error text may hold: an endpoint with credentials, a signed URL."""


class Faulty(MemoryStore):
    """Raises ``fault`` on GET number ``at`` of the object (1: the header's,
    2: the first range of frames after it: mid-body)."""

    def __init__(self, fault: BaseException, at: int) -> None:
        super().__init__()
        self.fault, self.at, self.gets = fault, at, 0

    async def get(self, key, range=None):
        self.gets += 1
        if self.gets == self.at:
            raise self.fault
        return await super().get(key, range)


def _network_faults():
    import aiohttp
    import botocore.exceptions as bexc

    from s3kv.errors import S3KVError

    return [
        ConnectionResetError(104, f"Connection reset by peer ({LEAKY})"),
        aiohttp.ClientPayloadError(f"Response payload is not completed ({LEAKY})"),
        bexc.IncompleteReadError(actual_bytes=10, expected_bytes=100),
        bexc.ResponseStreamingError(error=LEAKY),
        S3KVError(f"{LEAKY}: IncompleteReadError"),  # what the S3 store makes of a BotoCoreError
        RuntimeError(f"Session is closed ({LEAKY})"),
        TimeoutError(),
    ]


def _load(store, key, e):
    from s3kv.tiering.chunks import load_chunk

    return asyncio.run(
        load_chunk(
            store, chunk_id(e, key), Frames(lambda *a: None), chunk_codec=e.codec, range_bytes=PAGE + 200
        )
    )


@pytest.mark.parametrize("at", [1, 2])
@pytest.mark.parametrize("fault", _network_faults(), ids=lambda f: type(f).__name__)
def test_a_network_fault_is_transient_never_corrupt(fault, at):
    key = b"n" * 16
    store = Faulty(fault, at=0)
    e = stored_chunk(store, key, 6)
    name = chunk_id(e, key).object_key
    good = get(store, name)
    store.gets, store.at = 0, at
    with pytest.raises(Transient) as raised:
        _load(store, key, e)
    assert not isinstance(raised.value, CorruptChunk) and raised.value.__cause__ is fault
    assert name in str(raised.value) and type(fault).__name__ in str(raised.value)
    assert "AKIA" not in str(raised.value) and "wJalr" not in str(raised.value)
    # Through the engine: the tier is blamed, the object is kept, not reported bad.
    _kept_and_the_tier_blamed(e, store, key, name, good)


def _kept_and_the_tier_blamed(e, store, key, name, good):
    """A load through the engine whose S3 read fails as before: the load
    fails, S3 is blamed, the object is kept as it was and not reported bad."""
    store.gets = 0
    e.submit_load("j", [chunk(key)], Pages(lambda *a: None))
    acc = wait_for(e, lambda a: "j" in a.finished_loads)
    assert acc.finished_loads["j"] and acc.bad == {} and acc.missing == {}
    assert acc.tier_failed == {Tier.S3: 1}
    assert get(store, name) == good and "load_errors_corrupt" not in e.counters.totals()
    e.close()


@pytest.mark.parametrize("at", [1, 2])
def test_a_416_is_corrupt_with_the_etag_read(at):
    from s3kv.errors import RangeNotSatisfiable

    key = b"m" * 16
    fault = RangeNotSatisfiable("range not satisfiable")
    store = Faulty(fault, at=0)
    e = stored_chunk(store, key, 7)
    name = chunk_id(e, key).object_key
    etag = asyncio.run(store.head(name)).etag
    store.gets, store.at = 0, at
    with pytest.raises(CorruptChunk, match="shorter than its header says") as raised:
        _load(store, key, e)
    # The ETag of the GET that brought the header (none: the first GET failed).
    assert raised.value.etag == (etag if at > 1 else None) and raised.value.__cause__ is fault
    e.close()


@pytest.mark.parametrize("where", ["get 1", "get 2", "decode"])
def test_out_of_memory_is_the_hosts_never_the_objects(where, monkeypatch):
    """A MemoryError while reading an object (its GET, or decoding a frame:
    what a decode allocates is bounded by the reader's layout, so memory
    pressure is the host's) is Transient: the object is not deleted, not
    reported bad, no corrupt load counted; the tier is blamed instead."""
    from s3kv import codec

    key = b"o" * 16
    fault = MemoryError()
    store = Faulty(fault, at=0)
    e = stored_chunk(store, key, 7)
    name = chunk_id(e, key).object_key
    good = get(store, name)
    if where == "decode":

        def out_of_memory(*a, **k):
            raise fault

        monkeypatch.setattr(codec, "decode_frame", out_of_memory)
        monkeypatch.setattr(codec, "check_frame", out_of_memory)
    else:
        store.gets, store.at = 0, int(where[-1])
    with pytest.raises(Transient, match="out of memory") as raised:
        _load(store, key, e)
    assert not isinstance(raised.value, CorruptChunk) and raised.value.__cause__ is fault
    assert name in str(raised.value)
    # Through the engine: the object is kept and not reported bad.
    _kept_and_the_tier_blamed(e, store, key, name, good)


@pytest.mark.parametrize(
    "fault",
    [NotFound("x"), PermissionDenied("x: AccessDenied"), Transient("x: 503"), Throttled("x: SlowDown")],
    ids=lambda f: type(f).__name__,
)
def test_store_errors_pass_as_they_are(fault):
    key = b"e" * 16
    store = Faulty(fault, at=0)
    e = stored_chunk(store, key, 8)
    store.gets, store.at = 0, 2
    with pytest.raises(type(fault)) as raised:
        _load(store, key, e)
    assert raised.value is fault
    e.close()


def test_bad_bytes_are_corrupt_whatever_the_check_raises(monkeypatch):
    """A check of the bytes that fails in an unforeseen way (a numpy or zstd
    error it does not catch) still makes the object corrupt, not Transient:
    a forged object must not trip the S3 breaker on every hit."""
    key = b"c" * 16
    store = MemoryStore()
    e = stored_chunk(store, key, 9)
    etag = asyncio.run(store.head(chunk_id(e, key).object_key)).etag

    def broken(*a, **kw):
        raise IndexError("a check that did not expect these bytes")

    for target in ("parse_header", "decode_frame"):
        with monkeypatch.context() as m:
            m.setattr(codec, target, broken)
            with pytest.raises(CorruptChunk, match="IndexError") as raised:
                _load(store, key, e)
        assert raised.value.etag == etag
    e.close()


def test_an_object_of_a_newer_format_is_missing_not_corrupt():
    """A newer s3kv's object (format version 4): this replica cannot use it,
    but it is not damaged: not deleted, not reported bad, only missing here."""
    key = b"v" * 16
    store = MemoryStore()
    e = stored_chunk(store, key, 10)
    name = chunk_id(e, key).object_key
    newer = bytearray(get(store, name))
    newer[4:6] = (4).to_bytes(2, "little")
    put(store, name, bytes(newer))
    with pytest.raises(NotFound, match="chunk format version 4; this s3kv reads versions 1, 2, 3"):
        _load(store, key, e)
    e.submit_load("j", [chunk(key)], Pages(lambda *a: None))
    acc = wait_for(e, lambda a: "j" in a.finished_loads)
    assert acc.finished_loads["j"] and acc.missing == {Tier.S3: {key}} and acc.bad == {}
    assert get(store, name) == bytes(newer) and "load_errors_corrupt" not in e.counters.totals()
    e.close()


def test_read_header_reads_and_classifies_as_loads_do():
    from s3kv.tiering.chunks import read_header

    key = b"k" * 16
    store = Faulty(ConnectionResetError(104, "reset"), at=0)
    e = stored_chunk(store, key, 11)
    name = chunk_id(e, key).object_key
    got = asyncio.run(read_header(store, chunk_id(e, key), chunk_codec=e.codec, prefetch=64))
    assert got.etag == asyncio.run(store.head(name)).etag and got.size == len(get(store, name))
    assert len(got.header.frames) == LAYERS and got.data == get(store, name)[: len(got.data)]
    store.gets, store.at = 0, 2  # the header's second GET (64 bytes were not all of it)
    with pytest.raises(Transient, match="ConnectionResetError"):
        asyncio.run(read_header(store, chunk_id(e, key), chunk_codec=e.codec, prefetch=64))
    put(store, name, get(store, name)[:100])
    with pytest.raises(CorruptChunk) as raised:
        asyncio.run(read_header(store, chunk_id(e, key), chunk_codec=e.codec, prefetch=64))
    assert raised.value.etag == asyncio.run(store.head(name)).etag
    e.close()


class FaultyGets(MemoryStore):
    """Every GET fails with ``fault`` (PUTs and the rest work)."""

    def __init__(self, fault: BaseException) -> None:
        super().__init__()
        self.fault = fault

    async def get_object(self, key, range=None):
        raise self.fault

    async def get(self, key, range=None):
        raise self.fault


@pytest.mark.parametrize("fault", _network_faults(), ids=lambda f: type(f).__name__)
def test_a_network_fault_checking_an_object_in_the_way_never_deletes_it(fault):
    """With the fleet secret, a store that finds an object in the way checks
    its header: a connection dropped meanwhile fails the store (not
    published), and the object, which may be good, stays."""
    key = b"j" * 16
    store = FaultyGets(fault)
    e = engine(store, keys=keys())
    name = chunk_id(e, key).object_key
    good = e.codec.encode(key, layers(1))
    put(store, name, good)
    e.submit_store(job(key, layers(1), s3=True))
    acc = wait_for(e, lambda a: key in a.failed.get(Tier.S3, ()) or key in a.written.get(Tier.S3, {}))
    assert key in acc.failed[Tier.S3] and key not in acc.existing and key not in acc.missing.get(Tier.S3, ())
    assert asyncio.run(MemoryStore.get(store, name)) == good and not acc.bad
    e.close()


# -- blosc2 chunks s3kv never writes, through the engine and verify -----------------------


def with_frames(blob: bytes, frames: list[bytes]) -> bytes:
    """The unsigned object ``blob`` with its frames replaced by ``frames``
    (each with a checksum that passes): what anyone who may write to the
    bucket makes without the fleet secret."""
    h = codec.parse_header(blob)
    table, at = [], 0
    for f, stored in zip(h.frames, frames):
        table.append([at, len(stored), f.raw_length, xxhash.xxh3_64_intdigest(stored)])
        at += len(stored)
    return rewrite_header(blob[: h.header_length], frames=table) + b"".join(frames)


HOSTILE_OBJECTS = {
    "plugin codec": lambda raw: plugin_frame(36, raw),  # OPENHTJ2K: blosc2 would run python to find it
    "uninitialized": lambda raw: special_frame(4, raw),  # decodes without writing a byte
}


@pytest.mark.parametrize("kind", list(HOSTILE_OBJECTS))
def test_a_blosc2_chunk_s3kv_never_writes_fails_the_load_and_leaves_the_pages_alone(
    kind, s3_server, bucket, tmp_path, monkeypatch
):
    """A chunk in S3 whose every frame is such a blosc2 chunk, loaded by the
    worker's engine straight into pages that hold a sentinel (another
    request's KV) and promoted to the NVMe tier (codec none: re-encoded from
    what decoded): the load is corrupt, no page is written or committed, no
    process starts, no NVMe file is written. A good chunk, loaded the same
    way first, fills its pages and its file."""
    from s3kv.config import parse_config
    from s3kv.frame_sinks import PageTarget
    from s3kv.stores.factory import make_store

    store = make_store(parse_config({"bucket": bucket, "endpoint_url": s3_server.endpoint_url}))
    e = engine(store, disk_path=tmp_path / "nvme")
    nvme = e.s.wings[Tier.DISK]
    assert (e.s.codec, nvme.codec) == ("blosc2", "none")  # the defaults: a promotion re-encodes
    good, bad = b"g" * 16, b"h" * 16
    blob = e.codec.encode(good, layers(1))
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key=chunk_id(e, good).object_key, Body=blob)
    forged = with_frames(e.codec.encode(bad, layers(2)), [HOSTILE_OBJECTS[kind](PAGE)] * LAYERS)
    client.put_object(Bucket=bucket, Key=chunk_id(e, bad).object_key, Body=forged)
    runs = watch_python(tmp_path, monkeypatch)

    for key, job_id in ((good, "good"), (bad, "bad")):
        pages = [np.full(PAGE, 0xA5, np.uint8) for _ in range(LAYERS)]
        commits = []
        target = lambda c, layer, p=pages, m=commits: PageTarget([p[layer]], lambda: m.append(layer))  # noqa: E731
        e.submit_load(job_id, [chunk(key, Tier.S3, promote_disk=True)], Pages(lambda *a: None, target))
        # the promotion is reported written (from a later task) or failed
        acc = wait_for(
            e,
            lambda a, j=job_id, k=key: (
                j in a.finished_loads
                and (k in a.written.get(Tier.DISK, {}) or k in a.failed.get(Tier.DISK, set()))
            ),
        )
        if key == good:  # the control: pages and file written
            assert acc.finished_loads["good"] == [] and sorted(commits) == list(range(LAYERS))
            assert all(np.array_equal(p, ls) for p, ls in zip(pages, layers(1)))
            assert good in acc.written[Tier.DISK] and files(e).path(good).exists()
    assert acc.finished_loads["bad"] and acc.missing == {Tier.S3: {bad}} and acc.failed == {Tier.DISK: {bad}}
    assert e.counters.totals()["load_errors_corrupt"] == 1
    assert all((p == 0xA5).all() for p in pages) and commits == []
    assert not runs.exists()
    e.close()
    assert not files(e).path(bad).exists()


def test_verify_reports_blosc2_chunks_s3kv_never_writes_as_corrupt(
    s3_server, bucket, tmp_path, monkeypatch, capsys
):
    """``s3kv verify`` over a bucket of three blosc2 chunk objects: a good one,
    one whose frames name a plugin codec, one of uninitialized chunks (both
    with checksums that pass): the two are corrupt, no process started."""
    from s3kv.keys import Namespace, object_key
    from tests.ops.dataset import PREFIX
    from tests.ops.helpers import run_json

    ns = Namespace.from_fields({"model": "m", "tp_size": 1}).id
    names = {}
    for kind, make in {"good": None, **HOSTILE_OBJECTS}.items():
        key = kind.encode().ljust(16, b"k")
        blob = codec.encode_chunk(
            namespace=ns,
            key=key.hex(),
            rank=0,
            tokens=64,
            layers=layers(3),
            dtype="bfloat16",
            itemsize=2,
            page_shape=FMT.page_shape,
            codec="blosc2",
        )
        if make is not None:
            blob = with_frames(blob, [make(PAGE)] * LAYERS)
        names[kind] = object_key(PREFIX, ns, key, 0)
        s3_server.client().put_object(Bucket=bucket, Key=names[kind], Body=blob)
    runs = watch_python(tmp_path, monkeypatch)
    rc, rep = run_json(capsys, s3_server, bucket, "verify", "--all")
    assert rc == 1 and rep["checked"] == 3
    got = {p["key"]: p["reason"] for p in rep["corrupt"]}
    assert set(got) == {names["plugin codec"], names["uninitialized"]}
    assert "compressor format 6 (codec id 36)" in got[names["plugin codec"]]
    assert "a chunk of uninitialized bytes" in got[names["uninitialized"]]
    assert not runs.exists()
