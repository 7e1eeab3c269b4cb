"""A synthetic fleet bucket: namespaces of chunk objects with known write
and access times, manifest segments and access records as replicas write
them, and the facts a test needs to say what each gc policy must delete."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import numpy as np

from s3kv import codec, descriptor
from s3kv.keys import Namespace, fingerprint, namespace_prefix, object_key
from s3kv.manifest import format as mf
from s3kv.manifest import protocol as mp

HOUR, DAY = 3600, 86400
PREFIX = "fleet"

# Age classes of a chunk (seconds since written), and how often each occurs.
AGES = {
    "fresh": (60, 20 * 60),
    "week": (3 * DAY, 6 * DAY),
    "month": (20 * DAY, 40 * DAY),
    "old": (60 * DAY, 90 * DAY),
}


@dataclass
class ChunkFact:
    ns: str
    key: bytes
    objects: dict[str, int]
    """Object name -> size."""
    written: int
    accessed: int | None

    @property
    def last_used(self) -> int:
        return max(self.written, self.accessed or 0)

    @property
    def size(self) -> int:
        return sum(self.objects.values())


@dataclass
class Dataset:
    bucket: str
    now: int
    namespaces: dict[str, int]
    """Namespace id -> TP size."""
    chunks: list[ChunkFact] = field(default_factory=list)
    other: dict[str, int] = field(default_factory=dict)
    """Manifest objects and descriptors: name -> size."""

    def objects(self, chunks=None) -> set[str]:
        return {o for c in (self.chunks if chunks is None else chunks) for o in c.objects}

    def of(self, ns: str) -> list[ChunkFact]:
        return [c for c in self.chunks if c.ns == ns]


def _blob(ns: str, key: bytes, rank: int, rng: random.Random) -> bytes:
    layers = 2
    n = rng.choice([96, 384, 1536, 6144])  # bytes per layer: a spread of object sizes
    zeros = rng.random() < 0.5  # half compress well, half do not
    pages = [bytes(n) if zeros else rng.randbytes(n) for _ in range(layers)]
    return codec.encode_chunk(
        namespace=ns,
        key=key.hex(),
        rank=rank,
        tokens=64,
        layers=pages,
        dtype="bfloat16",
        itemsize=2,
        page_shape=[n // 2],
        codec="zstd",
    )


def build(
    s3, *, sizes=(2600, 2600, 1800, 1200, 700), tp=(1, 1, 2, 1, 2), seed: int = 0, directory: bool = False
) -> Dataset:
    """Seed a new bucket; ``sizes[i]`` chunks in namespace i, each with
    ``tp[i]`` rank objects (the defaults make 12,400 chunk objects). With
    ``directory`` its segments are named as on a directory bucket."""
    rng = random.Random(seed)
    now = int(time.time())
    # Traffic comes in bursts: accesses fall in a few busy hours.
    busy = sorted(now - HOUR * rng.randint(2, 80 * 24) for _ in range(30))
    ds = Dataset(s3.new_bucket(), now, {})
    for i, (n, ranks) in enumerate(zip(sizes, tp)):
        namespace = Namespace.from_fields({"model": f"model-{i}", "tp_size": ranks, "num_layers": 2})
        ns = namespace.id
        ds.namespaces[ns] = ranks
        base = namespace_prefix(PREFIX, ns)
        desc = descriptor.encode(namespace, f"model-{i}", 64)  # as a replica writes it
        s3.seed(ds.bucket, base + "namespace.json", desc, now - 100 * DAY)
        ds.other[base + "namespace.json"] = len(desc)
        for _j in range(n):
            key = rng.randbytes(16)
            cls = rng.choices(list(AGES), weights=[1, 3, 3, 3])[0]
            written = now - rng.randint(*AGES[cls])
            # A third of the chunks were used since: some of them recently.
            accessed = None
            if cls != "fresh" and rng.random() < 1 / 3:
                later = [b for b in busy if b > written + 10]
                if later:
                    accessed = rng.choice(later) + rng.randint(0, HOUR - 120)
            objs, times = {}, []
            for r in range(ranks):
                name = object_key(PREFIX, ns, key, r)
                body = _blob(ns, key, r, rng)
                times.append(written + rng.randint(0, 5))  # ranks land a few seconds apart
                s3.seed(ds.bucket, name, body, times[-1])
                objs[name] = len(body)
            ds.chunks.append(ChunkFact(ns, key, objs, max(times), accessed))
        _seed_manifest(s3, ds, ns, rng, directory)
    return ds


def _seed_manifest(s3, ds: Dataset, ns: str, rng: random.Random, directory: bool = False) -> None:
    """Segments (every key, in groups) and access records (several per hour),
    named with the times they describe, like replicas write them."""
    base = namespace_prefix(PREFIX, ns) + "manifest/"
    chunks = ds.of(ns)
    for seq, i in enumerate(range(0, len(chunks), 200)):
        group = chunks[i : i + 200]
        ts = ds.now - 30 * DAY + seq  # old enough to be merged into a snapshot
        fps = np.array(sorted({fingerprint(c.key) for c in group}), dtype=np.uint64)
        body = mf.encode(mf.ManifestObject("segment", fps))
        name = mp.segment_name(base, ts * 1000, f"w{seq % 3}", seq, directory=directory)
        s3.seed(ds.bucket, name, body, ts)
        ds.other[name] = len(body)
    # A snapshot a replica wrote 25 days ago, covering those segments.
    snap_ts = ds.now - 25 * DAY
    last = mp.segment_name(base, (ds.now - 30 * DAY + seq) * 1000, f"w{seq % 3}", seq, directory=directory)
    fps = np.array(sorted({fingerprint(c.key) for c in chunks}), dtype=np.uint64)
    body = mf.encode(
        mf.ManifestObject("snapshot", fps, meta={"horizon": last, "recent": [last], "writer": "w0"})
    )
    name = mp.snapshot_name(base, snap_ts * 1000, "w0")
    s3.seed(ds.bucket, name, body, snap_ts)
    ds.other[name] = len(body)
    hours: dict[int, list[ChunkFact]] = {}
    for c in chunks:
        if c.accessed is not None:
            hours.setdefault(c.accessed // HOUR, []).append(c)
    for seq, (_hour, used) in enumerate(sorted(hours.items())):
        # Up to 3 records per hour (from different writers), each stamped with
        # its newest access: that stamp is the access gc can know of.
        used.sort(key=lambda c: c.accessed)
        for w in range(3):
            part = used[w::3]
            if not part:
                continue
            ts = max(c.accessed for c in part)
            for c in part:  # a record of hour H stands for use until H ends
                c.accessed = (ts // HOUR + 1) * HOUR
            fps = np.array(sorted({fingerprint(c.key) for c in part}), dtype=np.uint64)
            name = mp.access_name(base, ts * 1000, f"w{w}", seq)
            body = mf.encode(mf.ManifestObject("access", fps))
            s3.seed(ds.bucket, name, body, ts)
            ds.other[name] = len(body)
