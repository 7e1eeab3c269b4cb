"""The one chunk reader, as the ops commands and tools read (no engine's pages:
``decode_chunk``) and as the engine reads (``ChunkCodec.decode``, a reader
set to its pages)."""

import asyncio
import dataclasses

import numpy as np
import pytest

from s3kv import codec
from s3kv.auth import FleetKeys
from s3kv.chunk_reader import BufferGet, ChunkReader, PageFormat, check_chunk_head, decode_chunk
from s3kv.errors import CorruptChunk, Precondition, UnsupportedFormat
from s3kv.frame_sinks import SinkFailed
from s3kv.keys import object_key
from s3kv.stores.base import GetResult
from s3kv.stores.memory import MemoryStore
from s3kv.tiering.chunks import ChunkCodec
from tests.unit.test_codec import KEY, NS, OTHER, SECRET, _encode, _layers, _small, _with_version

READERS = ["tools", "engine"]
FMT = PageFormat("bfloat16", 2, (2, 2, 32, 128), 64, 4096)
"""The pages ``_encode`` writes (3 layers)."""
SMALL_FMT = PageFormat("bfloat16", 2, (1, 4, 2), 4, 16)
"""The pages ``_small`` writes (2 layers)."""


def _read(pages, blob, *, namespace=NS, key=KEY, rank=0, keys=None, layers=3, fmt=FMT):
    """(header, layers) of ``blob``, read by the ops' reader (``decode_chunk``)
    or, through the engine's own call, by an engine of ``layers`` x ``fmt`` pages."""
    if pages == "tools":
        return decode_chunk(blob, namespace=namespace, key=key, rank=rank, keys=keys)
    engine = ChunkCodec(namespace, rank, layers, fmt, keys=keys)
    out: dict[int, np.ndarray] = {}
    engine.decode(bytes.fromhex(key), blob, out.__setitem__, "chunk")
    return engine.parse_header(blob), [out[i] for i in range(len(out))]


@pytest.mark.parametrize("pages", READERS)
@pytest.mark.parametrize("codec_name", ["blosc2", "zstd", "none"])
def test_roundtrip(codec_name, pages):
    layers = _layers()
    blob = _encode(codec_name, layers)
    header, out = _read(pages, blob)
    assert header.codec == codec_name and header.tokens == 64 and header.page_shape == (2, 2, 32, 128)
    assert len(out) == 3 and all((a == b).all() for a, b in zip(out, layers))
    assert header.object_length == len(blob)


@pytest.mark.parametrize("pages", READERS)
def test_truncated_raises(pages):
    blob = _encode()
    for cut in (0, 10, codec.PREFIX_LEN + 5, len(blob) - 1):
        with pytest.raises(CorruptChunk):
            _read(pages, blob[:cut])


@pytest.mark.parametrize("pages", READERS)
def test_every_flipped_byte_is_caught(pages):
    blob = _encode("none", _layers(size=256))
    step = max(1, len(blob) // 300)
    for at in range(0, len(blob), step):
        bad = bytearray(blob)
        bad[at] ^= 0x01
        with pytest.raises(CorruptChunk):
            _read(pages, bytes(bad), fmt=dataclasses.replace(FMT, layer_bytes=256))


@pytest.mark.parametrize("pages", READERS)
def test_wrong_identity_raises(pages):
    blob = _encode()
    with pytest.raises(CorruptChunk, match="namespace"):
        _read(pages, blob, namespace="c" * 32)
    with pytest.raises(CorruptChunk, match="chunk"):
        _read(pages, blob, key="d" * 32)
    with pytest.raises(CorruptChunk, match="rank"):
        _read(pages, blob, rank=1)


@pytest.mark.parametrize("pages", READERS)
@pytest.mark.parametrize("reader", ["no secret", "the secret", "another secret"])
@pytest.mark.parametrize(
    "written", ["v1", "v2 signed", "v2 unsigned", "v3", "v3 signed", "v4", "v0", "v1 flagged"]
)
def test_which_chunk_versions_each_reader_reads(written, reader, pages):
    """v1: unsigned (refused with a secret). v2: signed, read by its MACs with
    the secret and by its checksums without one (as before this change); a v2
    object without the flag, from the builds between, reads as unsigned. v3:
    blosc2 frames, signed (by the flag) or not, read as v1 and v2 are.
    Higher: UnsupportedFormat naming the version; v0 and a flagged v1: corrupt."""
    keys = {"no secret": None, "the secret": FleetKeys([SECRET]), "another secret": FleetKeys([OTHER])}
    blob = {
        "v1": _small(),
        "v2 signed": _small(FleetKeys([SECRET])),
        "v2 unsigned": _with_version(_small(), 2),
        "v3": _small(codec_name="blosc2"),
        "v3 signed": _small(FleetKeys([SECRET]), codec_name="blosc2"),
        "v4": _with_version(_small(FleetKeys([SECRET])), 4),
        "v0": _with_version(_small(), 0),
        "v1 flagged": _with_version(_small(FleetKeys([SECRET])), 1),
    }[written]
    k = keys[reader]
    readable = {
        "no secret": {"v1", "v2 signed", "v2 unsigned", "v3", "v3 signed"},
        "the secret": {"v2 signed", "v3 signed"},
        "another secret": set(),
    }[reader]
    if written in readable:
        header, out = _read(pages, blob, keys=k, layers=2, fmt=SMALL_FMT)
        assert header.signed == written.endswith(" signed")
        assert [a.tolist() for a in out] == [list(range(i, 16 + i)) for i in range(2)]
        return
    with pytest.raises(CorruptChunk) as e:
        _read(pages, blob, keys=k, layers=2, fmt=SMALL_FMT)
    if written == "v4":
        assert isinstance(e.value, UnsupportedFormat) and e.value.version == 4
        assert str(e.value) == "chunk format version 4; this s3kv reads versions 1, 2, 3"
    else:
        assert not isinstance(e.value, UnsupportedFormat)
        why = {
            "v0": "version 0",
            "v1 flagged": "unknown flags",
            "v1": "unsigned object",
            "v2 unsigned": "unsigned object",
            "v2 signed": "not one of the fleet's keys",
            "v3": "unsigned object",
            "v3 signed": "not one of the fleet's keys",
        }[written]
        assert why in str(e.value)


def test_a_reader_knows_its_pages_whole_or_not_at_all():
    assert ChunkReader().max_object is None and ChunkReader().max_header == codec.MAX_HEADER_LEN
    assert ChunkReader(num_layers=3, fmt=FMT).max_object > 3 * 4096
    with pytest.raises(ValueError):
        ChunkReader(num_layers=3)
    with pytest.raises(ValueError):
        ChunkReader().check_macs(_small())


def test_the_engine_refuses_frames_of_another_size_the_tools_bound_them():
    """The same object: the engine wants its own layer size, the tools read
    any size up to MAX_FRAME_RAW, and a head claiming more is refused unread."""
    blob = _encode()
    with pytest.raises(CorruptChunk, match="chunk: frame 0 holds 4096 bytes in"):
        _read("engine", blob, fmt=dataclasses.replace(FMT, layer_bytes=8192))
    assert len(_read("tools", blob)[1]) == 3
    header = codec.parse_header(blob)
    huge = codec.Frame(header.frames[0].offset, 10, codec.MAX_FRAME_RAW + 2, 0)
    claims = dataclasses.replace(header, frames=(huge,))
    with pytest.raises(CorruptChunk, match=f"frame 0: says it decodes to {codec.MAX_FRAME_RAW + 2} bytes"):
        ChunkReader().check(claims, NS, KEY, 0)
    name = object_key("fleet", NS, bytes.fromhex(KEY), 0)
    check_chunk_head(name, blob, len(blob))
    with pytest.raises(CorruptChunk, match="its header says"):
        check_chunk_head(name, blob, len(blob) + 1)
    with pytest.raises(CorruptChunk, match="not a chunk object name"):
        check_chunk_head("fleet/elsewhere", blob, len(blob))


class _Ranged:
    """Ranged GETs of ``blob`` (cut short past its end, as stores do), each recorded."""

    def __init__(self, blob: bytes) -> None:
        self.blob, self.gets = blob, []

    async def __call__(self, start: int, end: int) -> GetResult:
        self.gets.append((start, end))
        return GetResult(self.blob[start:end], "etag-1", len(self.blob))


def test_read_header_reads_a_header_in_one_get_or_two_and_no_more():
    """``read_header``: one GET where the first bytes hold the header, a
    second for the rest of a longer one; a header longer than the reader's
    bound is refused after the first GET, unread; with keys only a signed
    header passes. What the caller's GET raises passes as it is."""
    blob = _encode()
    need = codec.header_length(blob)
    short = _Ranged(blob)
    got = asyncio.run(ChunkReader().read_header(short, 1 << 20))
    assert short.gets == [(0, 1 << 20)] and got.data == blob and (got.etag, got.size) == ("etag-1", len(blob))
    assert got.header == codec.parse_header(blob)
    long = _Ranged(blob)
    got = asyncio.run(ChunkReader().read_header(long, 64))
    assert long.gets == [(0, 64), (64, need)] and got.data == blob[:need]
    assert got.header == codec.parse_header(blob)
    assert asyncio.run(ChunkReader().read_header(_Ranged(blob), 1)).header.key == KEY  # a whole prefix first
    engine = ChunkReader(num_layers=3, fmt=FMT)
    claims = bytearray(blob)
    claims[8:12] = (engine.max_header + 1).to_bytes(4, "little")  # the prefix's header length
    bounded = _Ranged(bytes(claims))
    with pytest.raises(
        CorruptChunk, match=f"header length {engine.max_header + 1} exceeds {engine.max_header}"
    ):
        asyncio.run(engine.read_header(bounded, 64, "chunk"))
    assert bounded.gets == [(0, 64)]
    keys = FleetKeys([SECRET])
    with pytest.raises(CorruptChunk, match="unsigned object"):
        asyncio.run(ChunkReader(keys).read_header(_Ranged(_small()), 1 << 10))
    assert asyncio.run(ChunkReader(keys).read_header(_Ranged(_small(keys)), 1 << 10)).header.signed

    async def refused(start: int, end: int) -> GetResult:
        if start:
            raise Precondition("x")
        return GetResult(blob[start:end])

    with pytest.raises(Precondition):
        asyncio.run(ChunkReader().read_header(refused, 64))


def test_buffer_get_keeps_the_etag_the_read_from_the_first_byte_saw():
    """:class:`BufferGet` (the engine's loads): ranged GETs through the
    store's ``get_buffer``; its ``etag`` is what the GET from byte 0 saw,
    for the caller to read after the header, also when the header is
    refused; a read from further in leaves it as it was."""
    store = MemoryStore()
    blob = _encode()
    etag = asyncio.run(store.put("obj", blob))
    get = BufferGet(store, "obj")
    assert asyncio.run(get(64, 128)).data == blob[64:128] and get.etag is None
    got = asyncio.run(ChunkReader().read_header(get, 64))  # two GETs: the header is longer
    assert got.header == codec.parse_header(blob) and got.data == blob[: codec.header_length(blob)]
    assert get.etag == got.etag == etag
    engine = ChunkReader(num_layers=3, fmt=FMT)
    claims = bytearray(blob)
    claims[8:12] = (engine.max_header + 1).to_bytes(4, "little")  # the prefix's header length
    bad_etag = asyncio.run(store.put("bad", bytes(claims)))
    refused = BufferGet(store, "bad")
    with pytest.raises(CorruptChunk, match="exceeds"):
        asyncio.run(engine.read_header(refused, 64, "bad"))
    assert refused.etag == bad_etag != etag


class _TargetSink:
    """A sink that names targets (as a Gate with the KV cache's does): each
    layer's frame in ``pieces`` buffers; records commits and plain calls."""

    def __init__(self, pieces: int) -> None:
        self.pieces = pieces
        self.buffers: dict[int, list[np.ndarray]] = {}
        self.calls: list[int] = []

    def write(self, i: int, data: np.ndarray) -> None:
        self.calls.append(i)

    def read_into(self, i: int, nbytes: int, read, *, may_stall: bool = False) -> None:
        step = -(-nbytes // self.pieces)
        bufs = [np.zeros(min(step, nbytes - a), np.uint8) for a in range(0, nbytes, step)]
        self.buffers[i] = bufs
        read(bufs)

    def frame(self, i: int) -> bytes:
        return b"".join(b.tobytes() for b in self.buffers[i])


@pytest.mark.parametrize("pieces", [1, 3])
@pytest.mark.parametrize("codec_name", ["blosc2", "zstd", "none"])
def test_frames_decode_straight_into_a_sinks_target(codec_name, pieces):
    """With scratch decoding (the worker's S3 loads), a sink that names a
    target gets each layer decoded into it (one buffer: in one pass; more:
    scattered), and is not called with a copy."""
    layers = _layers()
    blob = _encode(codec_name, layers)
    engine = ChunkCodec(NS, 0, 3, FMT)
    sink = _TargetSink(pieces)
    engine.decode_into(bytes.fromhex(KEY), blob, sink, "chunk")
    assert sink.calls == [] and [sink.frame(i) for i in range(3)] == [a.tobytes() for a in layers]


@pytest.mark.parametrize("codec_name", ["blosc2", "none"])
def test_a_bad_frame_writes_nothing_into_its_target(codec_name):
    """From S3 the stored bytes are checked before anything is decoded or
    copied: a frame that fails leaves its target untouched."""
    blob = bytearray(_encode(codec_name, _layers()))
    f = codec.parse_header(bytes(blob)).frames[1]
    blob[f.offset + 3] ^= 0x10
    sink = _TargetSink(2)
    with pytest.raises(CorruptChunk, match="frame 1: checksum mismatch"):
        ChunkCodec(NS, 0, 3, FMT).decode_into(bytes.fromhex(KEY), bytes(blob), sink, "chunk")
    assert sink.frame(0) == _layers()[0].tobytes()
    assert not any(b.any() for b in sink.buffers[1]) and 2 not in sink.buffers


class _FailingSink(_TargetSink):
    """A sink whose destination fails once frame ``at`` was read into it."""

    def __init__(self, at: int, fault: Exception) -> None:
        super().__init__(1)
        self.at, self.fault = at, fault

    def read_into(self, i: int, nbytes: int, read, *, may_stall: bool = False) -> None:
        super().read_into(i, nbytes, read)
        if i == self.at:
            raise self.fault


@pytest.mark.parametrize("fault", [RuntimeError("the pages"), MemoryError(), CorruptChunk("the pages' own")])
def test_what_a_sink_raises_is_marked_as_its_own_and_a_frame_check_is_not(fault):
    """What the destination raises (even a CorruptChunk or a MemoryError,
    which a reader would take for the object's) comes out as SinkFailed,
    with the fault as its cause, from the frame where it failed; a frame
    that fails its own check raises CorruptChunk as it is (as in
    test_a_bad_frame_writes_nothing_into_its_target)."""
    blob = _encode("zstd", _layers())
    sink = _FailingSink(1, fault)
    with pytest.raises(SinkFailed) as got:
        ChunkCodec(NS, 0, 3, FMT).decode_into(bytes.fromhex(KEY), blob, sink, "chunk")
    assert got.value.__cause__ is fault and sorted(sink.buffers) == [0, 1]
