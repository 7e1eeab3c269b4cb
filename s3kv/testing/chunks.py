"""Where a transfer engine's chunk lives in S3, for the tests and benchmarks
that read, replace or tamper with its object directly."""

from __future__ import annotations

from typing import TYPE_CHECKING

from s3kv.keys import object_key
from s3kv.tiering.chunks import ChunkId

if TYPE_CHECKING:
    from s3kv.tiering.worker.transfer import TransferEngine


def chunk_id(engine: TransferEngine, key: bytes) -> ChunkId:
    """The id of ``key``'s shard as ``engine`` (its prefix, namespace and
    rank) stores it in S3: its object name and the parts it is made of."""
    assert engine.namespace is not None, "no namespace yet"
    ns, rank = engine.namespace, engine.s.rank
    return ChunkId(object_key(engine.s.prefix, ns, key, rank), ns, key.hex(), rank)
