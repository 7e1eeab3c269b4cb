"""How parts are cut into shards and which ranks hold and write them."""

from __future__ import annotations

import pytest

from s3kv.shards import HEADS, RANKS, REPLICATED, ShardRole, choose, roles, writers


def _heads_of(slicing, tp, rank, total):
    """Global KV heads a rank's shards cover, from their indexes and local offsets."""
    q = slicing.heads_per_shard
    return [
        r.index * q + h for r in roles(slicing, tp_size=tp, rank=rank, total_heads=total) for h in range(q)
    ]


@pytest.mark.parametrize("total", [1, 2, 4, 8, 16, 32, 64])
def test_every_tp_size_holds_every_head_once_in_the_same_slices(total):
    """Whatever the TP size, the shards are the same objects: a TP 1
    replica's slices are exactly what the ranks of a TP 2/4/8 replica write."""
    slicings = {
        tp: choose(total_heads=total, tp_size=tp, replicated=False, sliceable=True) for tp in (1, 2, 4, 8)
    }
    assert {s for s in slicings.values()} == {slicings[1]}
    s = slicings[1]
    assert s.mode == HEADS and s.shards == min(total, 8) and s.shards * s.heads_per_shard == total
    for tp in (1, 2, 4, 8):
        written = [
            r.index
            for rank in range(tp)
            for r in roles(s, tp_size=tp, rank=rank, total_heads=total)
            if r.writer
        ]
        assert sorted(written) == list(range(s.shards))  # each shard once
        held = sorted(h for rank in range(tp) for h in _heads_of(s, tp, rank, total))
        assert held == sorted(
            list(range(total)) * max(1, tp // total)
        )  # every head, replicas where tp > heads


def test_local_offsets_follow_the_ranks_heads():
    s = choose(total_heads=8, tp_size=2, replicated=False, sliceable=True)
    assert roles(s, tp_size=2, rank=1, total_heads=8) == tuple(ShardRole(4 + i, i, 1) for i in range(4))
    wide = choose(total_heads=32, tp_size=2, replicated=False, sliceable=True)  # 8 slices of 4 heads
    assert roles(wide, tp_size=2, rank=1, total_heads=32) == tuple(
        ShardRole(4 + i, 4 * i, 4) for i in range(4)
    )


def test_fewer_heads_than_ranks_first_holder_writes():
    s = choose(total_heads=2, tp_size=4, replicated=False, sliceable=True)
    got = [roles(s, tp_size=4, rank=r, total_heads=2) for r in range(4)]
    assert got == [
        (ShardRole(0, 0, 1, True),),
        (ShardRole(0, 0, 1, False),),
        (ShardRole(1, 0, 1, True),),
        (ShardRole(1, 0, 1, False),),
    ]
    assert writers(s, 4, 2) == [0, 2]


def test_replicated_one_shard_rank_zero_writes():
    s = choose(total_heads=1, tp_size=8, replicated=True, sliceable=False)
    assert s.mode == REPLICATED and s.shards == 1 and not s.per_rank
    assert [roles(s, tp_size=8, rank=r) for r in (0, 5)] == [
        (ShardRole(0, writer=True),),
        (ShardRole(0, writer=False),),
    ]
    assert writers(s, 8) == [0]


def test_ranks_where_heads_cannot_be_cut():
    assert choose(total_heads=8, tp_size=2, replicated=False, sliceable=False) == choose(
        total_heads=None, tp_size=2, replicated=False, sliceable=True
    )
    s = choose(total_heads=8, tp_size=2, replicated=False, sliceable=False)
    assert s.mode == RANKS and s.shards == 2 and s.per_rank and s.field() is None
    assert roles(s, tp_size=2, rank=1) == (ShardRole(1),)
    # a rank holding part of a slice could not write it whole: 16 heads (8 slices of 2) at TP 16
    assert choose(total_heads=16, tp_size=16, replicated=False, sliceable=True).mode == RANKS
    # heads that do not spread evenly
    assert choose(total_heads=6, tp_size=4, replicated=False, sliceable=True).mode == RANKS


def test_namespace_field_names_the_cut():
    s = choose(total_heads=4, tp_size=1, replicated=False, sliceable=True)
    assert s.field() == {"mode": "heads", "shards": 4, "heads_per_shard": 1}


def test_bad_rank_refused():
    s = choose(total_heads=4, tp_size=2, replicated=False, sliceable=True)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        roles(s, tp_size=2, rank=2, total_heads=4)
