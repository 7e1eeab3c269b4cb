"""The shards one rank holds (:mod:`s3kv.shards`), each moved by a transfer
engine of its own: the first engine has the loop, its threads and the
store, the others are its siblings on them. Each shard has its KV heads
of the rank's pages (all of them, unless parts are cut by head), its own
CPU slots and its own objects."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from s3kv.chunk_reader import PageFormat
from s3kv.config import S3KVConfig
from s3kv.connector.layout import EngineLayout
from s3kv.shards import ShardRole
from s3kv.stats import Counters
from s3kv.stores.factory import make_store
from s3kv.tiering.worker.hostpool import HostPool, slots_for
from s3kv.tiering.worker.transfer import EngineSettings, TransferEngine

if TYPE_CHECKING:
    import numpy as np

    from s3kv.auth import FleetKeys
    from s3kv.connector.layer_pages import LayerPages


class Shard:
    """One shard this rank holds: its role, its engine, and its CPU slots."""

    def __init__(self, role: ShardRole, engine: TransferEngine, local_heads: int | None) -> None:
        self.role = role
        self.engine = engine
        self.pool: HostPool | None = None
        self.heads: tuple[int, int] | None = None
        """Its KV heads in the rank's pages (None: whole pages)."""
        if role.heads and role.heads != local_heads:
            self.heads = (role.head_offset, role.heads)


def rank_shards(
    config: S3KVConfig, layout: EngineLayout, rank: int, counters: Counters, keys: FleetKeys | None
) -> list[Shard]:
    """Rank ``rank``'s shards, each with its engine (not configured yet):
    only the first engine of rank 0 times its loads for the cost model, and
    an engine whose shard another rank writes writes nothing to the tiers
    replicas share."""
    roles = layout.roles(rank)
    # Every object, CPU slot and NVMe file holds one group's part: frames, not layers.
    base = EngineSettings.from_config(config, rank=rank, num_layers=layout.frames, keys=keys)

    def settings(i: int, role: ShardRole) -> EngineSettings:
        first = rank == 0 and layout.pp_rank == 0 and i == 0  # one engine of the replica times its loads
        return dataclasses.replace(base, rank=role.index, writes=role.writer, observes=first)

    first = TransferEngine(
        make_store(config, counters) if config.uses_s3 else None, settings(0, roles[0]), counters
    )
    local = layout.local_kv_heads
    return [Shard(roles[0], first, local)] + [
        Shard(role, first.sibling(settings(i, role)), local) for i, role in enumerate(roles) if i
    ]


def configure(
    shards: Sequence[Shard],
    layer: LayerPages,
    frames: int,
    config: S3KVConfig,
    block_size: int,
    host_buffer: Callable[[int], np.ndarray],
) -> None:
    """Set each shard's engine to its pages (``layer``'s, cut to its heads;
    ``frames`` a part) and give it its CPU slots: ``cpu_bytes`` hold as many
    slots as a chunk's part of all the rank's shards fits, one buffer
    (``host_buffer(nbytes)``) cut into one pool a shard."""
    bpc = config.chunk_tokens // block_size
    shapes = [layer.shape_for(bpc, shard.heads) for shard in shards]
    layer_bytes = [layer.frame_bytes(bpc, shard.heads) for shard in shards]
    num_slots = slots_for(config.cpu_bytes, sum(layer_bytes) * frames)
    if num_slots:
        buffer, at = host_buffer(num_slots * sum(layer_bytes) * frames), 0
        for shard, nbytes in zip(shards, layer_bytes, strict=True):
            size = num_slots * nbytes * frames
            shard.pool = HostPool(num_slots, nbytes, frames, buffer=buffer[at : at + size])
            at += size
    for shard, shape, nbytes in zip(shards, shapes, layer_bytes, strict=True):
        shard.engine.configure(
            PageFormat(
                dtype=layer.dtype,
                itemsize=layer.itemsize,
                page_shape=shape,
                tokens=config.chunk_tokens,
                layer_bytes=nbytes,
            ),
            shard.pool,
        )
