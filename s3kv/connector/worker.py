"""s3kv's worker side, in each vLLM worker process: executes the
scheduler's plans against this rank's KV cache."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from s3kv.config import S3KVConfig
from s3kv.connector.layout import EngineLayout
from s3kv.connector.metadata import S3KVMetadata, S3KVWorkerMetadata
from s3kv.connector.pages import PageIO
from s3kv.stats import Counters
from s3kv.stores.factory import make_store
from s3kv.tiering.chunks import PageFormat
from s3kv.tiering.planner import LoadChunk
from s3kv.tiering.transfer import EngineSettings, LoadRequest, TransferEngine

if TYPE_CHECKING:
    import numpy as np
    import torch

log = logging.getLogger("s3kv.worker")

SHUTDOWN_FLUSH_S = 10.0


class WorkerSide:
    def __init__(self, config: S3KVConfig, layout: EngineLayout, rank: int, num_blocks: int) -> None:
        self.config = config
        self.layout = layout
        self.rank = rank
        self.num_blocks = num_blocks
        self.counters = Counters()
        self.engine = TransferEngine(
            make_store(config),
            EngineSettings(
                namespace=layout.namespace.id,
                prefix=config.prefix,
                rank=rank,
                num_layers=len(layout.layer_names),
                codec=config.codec,
                zstd_level=config.zstd_level,
                range_bytes=config.range_bytes,
                max_inflight_bytes=config.max_inflight_bytes,
                load_timeout_s=config.load_timeout_s,
            ),
            self.counters,
        )
        self.pages: PageIO | None = None
        self._load_errors: set[int] = set()
        self._report = S3KVWorkerMetadata()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.pages = PageIO(kv_caches, self.layout.layer_names, self.num_blocks)
        first = self.pages.layers[0]
        self.engine.page_format = PageFormat(
            dtype=first.dtype,
            itemsize=first.itemsize,
            page_shape=first.shape_for(self.config.chunk_tokens // self.layout.block_size),
            tokens=self.config.chunk_tokens,
        )

    def _write(self, chunk: LoadChunk, layer: int, data: np.ndarray) -> None:
        assert self.pages is not None
        self.pages.write(layer, chunk.block_ids, chunk.first_block, data)

    def start_load(self, meta: S3KVMetadata) -> None:
        for plan in meta.loads:
            self.engine.submit_load(plan.req_id, [LoadRequest(c.key, c) for c in plan.chunks], self._write)

    def save(self, meta: S3KVMetadata) -> None:
        if not meta.stores or self.pages is None:
            return
        for chunk in meta.stores:
            self.engine.submit_store(chunk.key, self.pages.read(chunk.block_ids))

    def get_finished(self) -> set[str] | None:
        result = self.engine.poll()
        if result.finished_loads and self.pages is not None:
            self.pages.synchronize()
        for req_id, failed in result.finished_loads.items():
            if failed:
                self._report.load_failed.add(req_id)
            for chunk in failed:
                self._load_errors.update(chunk.block_ids[chunk.first_block :])
        self._report.loaded += result.loaded
        self._report.unavailable += result.unavailable
        for key in result.stored:
            self._report.stored[key] = self._report.stored.get(key, 0) + 1
        self._report.missing.update(result.missing)
        self._report.store_failed.update(result.store_failed)
        return set(result.finished_loads) or None

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_report(self) -> S3KVWorkerMetadata | None:
        if self._report.is_empty():
            return None
        report, self._report = self._report, S3KVWorkerMetadata()
        return report

    def shutdown(self) -> None:
        self.engine.close(SHUTDOWN_FLUSH_S)
