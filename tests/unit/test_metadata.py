"""Worker reports summed over TP ranks: a chunk counts as stored only when
every rank reports its shard."""

import pytest

pytest.importorskip("vllm")

from s3kv.connector.metadata import S3KVWorkerMetadata  # noqa: E402
from s3kv.index import ChunkIndex  # noqa: E402
from s3kv.keys import Namespace  # noqa: E402
from s3kv.tiering.planner import Planner  # noqa: E402

K1, K2 = b"1" * 16, b"2" * 16


def test_aggregate_over_ranks_then_index():
    rank0 = S3KVWorkerMetadata(stored={K1: 1, K2: 1}, load_failed={"r"}, loaded=2)
    rank1 = S3KVWorkerMetadata(stored={K1: 1}, missing={K2}, unavailable=1)
    total = rank0.aggregate(rank1)
    assert total.stored == {K1: 2, K2: 1}
    assert total.missing == {K2} and total.load_failed == {"r"}
    assert (total.loaded, total.unavailable) == (2, 1)
    index = ChunkIndex()
    planner = Planner(
        namespace=Namespace.from_fields({}), chunk_tokens=64, block_size=32, index=index, world_size=2
    )
    planner.on_stored(total.stored)
    assert K1 in index and K2 not in index
    assert S3KVWorkerMetadata().is_empty() and not total.is_empty()
