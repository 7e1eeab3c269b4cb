"""A worker rank's publisher of the chunk objects it creates, with the crash
journal of its stores where the front end asked for one
(:data:`~s3kv.manifest.journal.ENV_VAR`)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from s3kv.config import S3KVConfig
from s3kv.manifest.journal import ENV_VAR as JOURNAL_ENV
from s3kv.manifest.journal import RankJournal, recorded_config
from s3kv.manifest.protocol import manifest_prefix, rank_writer
from s3kv.manifest.publish import ShardPublisher, hold_s
from s3kv.stats import Counters
from s3kv.tiering.worker.transfer import TransferEngine

log = logging.getLogger("s3kv.worker")


def start_publisher(
    engine: TransferEngine,
    config: S3KVConfig,
    namespace: str,
    writer: str,
    *,
    rank: int,
    ranks: int,
    counters: Counters,
    shards: list[int] | None = None,
) -> ShardPublisher | None:
    """Rank ``rank``'s publisher (None without S3): it publishes the chunk
    objects this rank creates from ``engine``'s loop, as their PUTs return,
    so whatever stops the replica later, they are in the fleet's manifest
    within ``manifest_publish_s`` (see :mod:`s3kv.manifest.publish`), and
    journals each PUT first."""
    if engine.s3 is None:
        return None
    c = config
    base = manifest_prefix(c.prefix, namespace)
    journal = None
    directory = os.environ.get(JOURNAL_ENV)
    if directory and os.path.isdir(directory):
        try:
            journal = RankJournal(
                Path(directory),
                rank_writer(writer, rank),
                {
                    "config": recorded_config(c, engine.s.keys),
                    "base": base,
                    "namespace": namespace,
                    "rank": rank,
                    "ranks": ranks,
                    "shards": shards if shards is not None else [rank],
                },
            )
        except OSError as e:
            log.warning("s3kv: no journal of this rank's stores (%s)", e)
    publisher = ShardPublisher(
        engine.s3,
        base,
        writer,
        rank=rank,
        ranks=ranks,
        keys=engine.s.keys,
        publish_s=c.manifest_publish_s,
        skew_s=c.manifest_clock_skew_s,
        counters=counters,
        journal=journal,
        hold_s=hold_s(c),
    )
    engine.spawn(publisher.run())
    return publisher
