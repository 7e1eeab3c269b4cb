"""What objects under chunk names can make ``s3kv verify`` and ``gc`` do,
against a real S3 server: the frames they decode are bounded by the pages
the namespace's descriptor names (as the engine's reader bounds its loads),
no object is read whole, an orphan gc may not read (or that fails to read)
is skipped and counted while the compaction goes on, and a TP chunk is
published only with every rank's object."""

from __future__ import annotations

import asyncio
import json
import random
import time
from types import SimpleNamespace

import blosc2
import numpy as np
import pytest
import xxhash

from s3kv import blosc2_format, codec, descriptor
from s3kv.config import parse_config
from s3kv.keys import Namespace, fingerprint, namespace_prefix, object_key
from s3kv.ops import gc as gcmod
from s3kv.ops.inventory import scan
from s3kv.ops.verify import verify
from s3kv.stores.base import HEAD_BYTES
from s3kv.stores.factory import make_store
from tests.ops.dataset import DAY, PREFIX
from tests.ops.helpers import run_json
from tests.ops.test_gc import manifest_of
from tests.stores.wrappers import WrappedStore

LAYERS, BLOCK, PAGE, TOKENS = 2, 16, 1024, 64
LAYER_BYTES = TOKENS // BLOCK * PAGE


def namespace(model: str, tp: int = 1) -> Namespace:
    """A namespace whose descriptor names its pages: LAYERS layers of LAYER_BYTES a chunk."""
    return Namespace.from_fields(
        {"model": model, "tp_size": tp, "num_layers": LAYERS, "block_size": BLOCK, "page_size_bytes": PAGE}
    )


def key(i: int) -> bytes:
    return bytes([i]) * 16


def sound(ns: str, k: bytes, rank: int = 0, codec_name: str = "zstd") -> bytes:
    rng = np.random.default_rng(k[0] * 10 + rank)
    return codec.encode_chunk(
        namespace=ns,
        key=k.hex(),
        rank=rank,
        tokens=TOKENS,
        layers=[rng.integers(0, 255, LAYER_BYTES, dtype=np.uint8) for _ in range(LAYERS)],
        dtype="bfloat16",
        itemsize=2,
        page_shape=[4, LAYER_BYTES // 8],
        codec=codec_name,
    )


def zero_frames(ns: str, k: bytes, frames: int, raw: int, rank: int = 0) -> bytes:
    """A chunk object of ``frames`` blosc2 special "zero" chunks of 32
    bytes, each saying it holds ``raw`` bytes: valid checksums, every frame
    decodes (to zeros), and each costs a ``raw``-byte memset to decode."""
    schunk = blosc2.SChunk(chunksize=raw, cparams={"typesize": 1})
    schunk.fill_special(raw, blosc2.SpecialValue.ZERO)
    zero = schunk.get_chunk(0)
    assert len(zero) == 32 and blosc2.get_cbuffer_sizes(zero)[0] == raw
    checksum = xxhash.xxh3_64_intdigest(zero)
    header_len = 0
    for _ in range(8):  # offsets depend on the header's length, as encode_chunk's do
        start = codec.PREFIX_LEN + header_len
        fields = {
            "ns": ns,
            "key": k.hex(),
            "rank": rank,
            "tokens": TOKENS,
            "codec": "blosc2",
            "shuffle": 1,
            "dtype": "uint8",
            "page_shape": [raw],
            "frames": [[start + 32 * i, 32, raw, checksum] for i in range(frames)],
        }
        header = json.dumps(fields, separators=(",", ":")).encode()
        if len(header) == header_len:
            break
        header_len = len(header)
    else:
        raise AssertionError("header length did not converge")
    prefix = codec.PREFIX.pack(
        codec.MAGIC, codec.BLOSC2_VERSION, 0, len(header), xxhash.xxh3_64_intdigest(header), 0
    )
    return prefix + header + zero * frames


@pytest.fixture
def decodes(monkeypatch) -> list[int]:
    """Every blosc2 frame decoded in this process, by its raw length."""
    seen: list[int] = []
    real = blosc2_format.decode_blosc2

    def counting(index, stored, raw_length, *rest):
        seen.append(raw_length)
        return real(index, stored, raw_length, *rest)

    monkeypatch.setattr(blosc2_format, "decode_blosc2", counting)
    return seen


def seed_namespace(s3, bucket: str, ns: Namespace | str, model: str = "m") -> str:
    """The namespace's base, with its descriptor (as a replica writes it) for a Namespace."""
    ns_id = ns.id if isinstance(ns, Namespace) else ns
    base = namespace_prefix(PREFIX, ns_id)
    if isinstance(ns, Namespace):
        s3.seed(bucket, base + descriptor.NAME, descriptor.encode(ns, model, TOKENS), time.time() - DAY)
    return base


def test_a_bomb_of_tiny_zero_frames_is_refused_without_decoding_a_frame(seeded_s3, capsys, decodes):
    """The objects the issue measured (a 1.8 MiB object of 32-byte frames
    cost 32 minutes of a core, and gc published it), scaled down: frames
    that are not the descriptor's pages are refused from the header."""
    s3, bucket = seeded_s3, seeded_s3.new_bucket()
    ns = namespace("bombs")
    seed_namespace(s3, bucket, ns)
    bombs = {
        "many": zero_frames(ns.id, key(1), 2000, 1 << 20),  # a frame table longer than the pages' header
        "few": zero_frames(ns.id, key(2), 20, 1 << 20),  # 20 layers, of 1 MiB each
        "wide": zero_frames(ns.id, key(3), LAYERS, 16 << 20),  # the right count, not a layer's pages
    }
    names = {what: object_key(PREFIX, ns.id, key(i), 0) for i, what in enumerate(bombs, 1)}
    for what, body in bombs.items():
        s3.seed(bucket, names[what], body, time.time() - 2 * DAY)
    s3.seed(bucket, object_key(PREFIX, ns.id, key(9), 0), sound(ns.id, key(9)), time.time() - 2 * DAY)

    rc, out = run_json(capsys, s3, bucket, "gc")
    assert rc == 0, out
    res = out["result"]
    assert (res["orphan_chunks_published"], res["orphan_chunks_refused"]) == (1, 3)
    assert manifest_of(s3, SimpleNamespace(bucket=bucket), ns.id) == {fingerprint(key(9))}
    assert decodes == []  # not one frame decoded

    rc, rep = run_json(capsys, s3, bucket, "verify", "--all")
    assert rc == 1
    reasons = {p["key"]: p["reason"] for p in rep["corrupt"]}
    assert set(reasons) == set(names.values())
    assert "header length" in reasons[names["many"]]
    assert "20 layers, this model has 2" in reasons[names["few"]]
    assert f"a layer's pages are {LAYER_BYTES} bytes" in reasons[names["wide"]]
    assert decodes == []


def test_without_a_descriptor_a_bomb_is_not_decoded_and_not_judged_sound(seeded_s3, capsys, decodes):
    """No descriptor names the pages: an object claiming more page bytes
    than one chunk holds is reported, undecoded, and never deleted."""
    s3, bucket = seeded_s3, seeded_s3.new_bucket()
    ns = "7e" * 16
    bomb = object_key(PREFIX, ns, key(1), 0)
    s3.seed(bucket, bomb, zero_frames(ns, key(1), 1100, 1 << 20), time.time() - 2 * DAY)  # 1.07 GiB
    small = object_key(PREFIX, ns, key(2), 0)
    s3.seed(bucket, small, sound(ns, key(2), codec_name="blosc2"), time.time() - 2 * DAY)  # a control

    rc, rep = run_json(capsys, s3, bucket, "verify", "--all", "--delete-corrupt")
    assert rc == 1, rep  # a problem reported
    assert [p["key"] for p in rep["unsupported"]] == [bomb] and not rep["corrupt"]
    assert "not decoded" in rep["unsupported"][0]["reason"]
    assert bomb in s3.listing(bucket) and rep["deleted"] == []
    assert decodes == [LAYER_BYTES] * LAYERS  # the control's frames only


def junk(size: int) -> bytes:
    return random.Random(size).randbytes(size)


def store_of(s3, bucket: str, **faults) -> WrappedStore:
    config = parse_config(
        {"bucket": bucket, "endpoint_url": s3.endpoint_url, "region": "us-east-1", "prefix": PREFIX}
    )
    return WrappedStore(make_store(config), **faults)


async def _verify_and_gc(store: WrappedStore) -> tuple[object, gcmod.Result]:
    try:
        inv = await scan(store, PREFIX)
        report = await verify(store, inv, sample=None)
        p = gcmod.plan(inv, gcmod.Policy(), time.time())
        return report, await gcmod.execute(store, inv, p, lease=None)
    finally:
        await store.close()


def test_verify_and_gc_read_no_chunk_named_object_whole(seeded_s3):
    """A 64 MiB junk object under a chunk name: judged from its first
    ranged GET, by verify and by gc's orphan check alike."""
    s3, bucket = seeded_s3, seeded_s3.new_bucket()
    ns = namespace("junk")
    seed_namespace(s3, bucket, ns)
    big = object_key(PREFIX, ns.id, key(1), 0)
    s3.seed(bucket, big, junk(64 << 20), time.time() - 2 * DAY)
    ok = object_key(PREFIX, ns.id, key(2), 0)
    s3.seed(bucket, ok, sound(ns.id, key(2)), time.time() - 2 * DAY)

    store = store_of(s3, bucket)
    report, res = asyncio.run(_verify_and_gc(store))
    assert [p.key for p in report.corrupt] == [big] and "bad magic" in report.corrupt[0].reason
    assert (res.orphans_published, res.orphans_refused) == (1, 1)
    gets = store.gets_of(big)
    assert len(gets) == 2  # one by verify, one by gc
    assert all(g.range is not None and g.returned <= HEAD_BYTES for g in gets)
    assert all(g.range is not None for g in store.gets_of(ok))


def test_an_orphan_gc_may_not_read_is_skipped_and_counted_and_the_compaction_goes_on(seeded_s3):
    s3, bucket = seeded_s3, seeded_s3.new_bucket()
    ns = namespace("faults")
    base = seed_namespace(s3, bucket, ns)
    names = {i: object_key(PREFIX, ns.id, key(i), 0) for i in (1, 2, 3)}
    for i, name in names.items():
        s3.seed(bucket, name, sound(ns.id, key(i)), time.time() - 2 * DAY)
    # 1: a 403 (another KMS key, a bucket policy); 2: a 503 that lasts; 3: readable.
    store = store_of(s3, bucket, denied={names[1]}, failing={names[2]})
    _, res = asyncio.run(_verify_and_gc_only(store))
    assert (res.orphans_published, res.orphans_refused, res.orphans_skipped) == (1, 0, 2)
    assert res.as_dict()["orphan_chunks_skipped"] == 2
    seen = manifest_of(s3, SimpleNamespace(bucket=bucket), ns.id)
    assert seen == {fingerprint(key(3))} and res.snapshots_written == 1
    # Judged again the next run, readable now: published.
    _, res = asyncio.run(_verify_and_gc_only(store_of(s3, bucket)))
    assert (res.orphans_published, res.orphans_skipped) == (2, 0)
    assert manifest_of(s3, SimpleNamespace(bucket=bucket), ns.id) == {fingerprint(key(i)) for i in names}
    assert base + descriptor.NAME in s3.listing(bucket)


async def _verify_and_gc_only(store: WrappedStore) -> tuple[None, gcmod.Result]:
    """gc alone (verify would read the faulty objects first)."""
    try:
        inv = await scan(store, PREFIX)
        p = gcmod.plan(inv, gcmod.Policy(), time.time())
        return None, await gcmod.execute(store, inv, p, lease=None)
    finally:
        await store.close()


def test_a_tp_chunk_is_published_only_with_every_ranks_object(seeded_s3, capsys):
    s3, bucket = seeded_s3, seeded_s3.new_bucket()
    described = namespace("tp2", tp=2)
    seed_namespace(s3, bucket, described)
    undescribed = "6d" * 16  # its descriptor gone: how many ranks is unknown
    old = time.time() - 2 * DAY
    for rank in (0, 1):  # whole: published
        s3.seed(
            bucket, object_key(PREFIX, described.id, key(1), rank), sound(described.id, key(1), rank), old
        )
    for rank in (0, 2):  # .r1 missing (a .r2 is no TP=2 chunk's)
        s3.seed(
            bucket, object_key(PREFIX, described.id, key(2), rank), sound(described.id, key(2), rank), old
        )
    s3.seed(bucket, object_key(PREFIX, undescribed, key(3), 0), sound(undescribed, key(3), 0), old)

    rc, out = run_json(capsys, s3, bucket, "gc")
    assert rc == 0, out
    res = out["result"]
    where = SimpleNamespace(bucket=bucket)
    assert manifest_of(s3, where, described.id) == {fingerprint(key(1))}
    assert manifest_of(s3, where, undescribed) == set()
    assert (res["orphan_chunks_published"], res["orphan_chunks_skipped"]) == (1, 1)
