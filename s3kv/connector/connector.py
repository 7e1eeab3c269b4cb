"""``S3KVConnector``: the class vLLM instantiates, once per role.

It builds the side its role needs and delegates each vLLM hook to it in a
line or two; the logic lives in :mod:`scheduler`, :mod:`worker` and the
vLLM-free core.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from s3kv.auth import load_keys
from s3kv.config import parse_config
from s3kv.connector.compat import check_vllm_version
from s3kv.connector.hashing import choose as choose_hashing
from s3kv.connector.layout import engine_layout
from s3kv.connector.metadata import S3KVMetadata
from s3kv.connector.stats import S3KVPromMetrics, S3KVStats
from s3kv.tiering.plan import TierEvent
from s3kv.tiering.tiers.registry import TIERS
from s3kv.tiering.tiers.spec import TierSpec

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from s3kv.connector.scheduler import SchedulerSide
    from s3kv.connector.worker import WorkerSide

log = logging.getLogger("s3kv")

_worker_stop_deadline: float | None = None
"""When this process's worker side began to stop: the scheduler side's
stop, which vLLM runs next in the same process, ends by the same deadline."""

MEDIUMS = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE)
"""vLLM's KV event media: a spec's ``medium`` is one of them."""


def event_medium(spec: TierSpec) -> tuple[str, str]:
    """(medium, locality) of a chunk in ``spec``'s tier, as vLLM's KV events name them."""
    if spec.medium not in MEDIUMS:
        raise ValueError(f"{spec.tier.value}: medium {spec.medium!r} is none of vLLM's {MEDIUMS}")
    return spec.medium, spec.locality


EVENT_MEDIUM = {spec.tier: event_medium(spec) for spec in TIERS}
"""Each tier's vLLM KV event medium and locality, as its spec names them."""


def kv_events(events: list[TierEvent], chunk_tokens: int) -> list[KVCacheEvent]:
    """s3kv's tier changes as vLLM KV cache events: one "block" is one chunk,
    its hash the chunk key, its medium CPU (host pool) or STORAGE (NVMe, LOCAL;
    S3, REMOTE), ``ownership`` naming the s3kv tier."""
    out: list[KVCacheEvent] = []
    for e in events:
        medium, locality = EVENT_MEDIUM[e.tier]
        block_hash = maybe_convert_block_hash(e.key)
        if e.stored:
            out.append(
                BlockStored(
                    block_hashes=[block_hash],
                    parent_block_hash=maybe_convert_block_hash(e.parent) if e.parent else None,
                    token_ids=list(e.token_ids),
                    block_size=chunk_tokens,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                    locality=locality,
                    ownership=f"s3kv:{e.tier.value}",
                )
            )
        else:
            out.append(
                BlockRemoved(
                    block_hashes=[block_hash],
                    medium=medium,
                    locality=locality,
                    ownership=f"s3kv:{e.tier.value}",
                )
            )
    return out


HIT_SOURCES = {spec.tier: CacheHitSource(spec.hit_source) for spec in TIERS}
"""Each tier's vLLM cache hit source, as its spec names it."""


def _log_through_vllm() -> None:
    """Send s3kv's log records to vLLM's handlers, so they appear beside vLLM's own."""
    vllm_logger = logging.getLogger("vllm")
    if not log.handlers and vllm_logger.handlers:
        for handler in vllm_logger.handlers:
            log.addHandler(handler)
        log.setLevel(vllm_logger.level or logging.INFO)
        log.propagate = False


class S3KVConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        check_vllm_version()
        _log_through_vllm()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = parse_config(self._kv_transfer_config.kv_connector_extra_config)
        keys = load_keys(self.config.auth_key_file)  # each process reads its own: never pickled
        stage = 0  # the scheduler side sees the first pipeline stage's KV cache
        if role != KVConnectorRole.SCHEDULER and vllm_config.parallel_config.pipeline_parallel_size > 1:
            from vllm.distributed.parallel_state import get_pp_group

            stage = get_pp_group().rank_in_group
        layout = engine_layout(vllm_config, kv_cache_config, self.config, pp_rank=stage)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.config = self.config.fit_block_size(layout.block_size, chunk_tokens_set="chunk_tokens" in extra)
        hashing, why = choose_hashing(
            vllm_config, kv_cache_config, self.config.chunk_tokens, self.config.chunk_keys
        )
        layout = layout.keyed_by(hashing)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            from s3kv.connector.scheduler import SchedulerSide

            events = vllm_config.kv_events_config
            self._scheduler = SchedulerSide(
                self.config,
                layout,
                failure_policy=self._kv_transfer_config.kv_load_failure_policy,
                model=vllm_config.model_config.model,
                emit_events=bool(events is not None and events.enable_kv_cache_events),
                keys=keys,
                hashing=hashing,
            )
            log.info(
                "s3kv: chunks keyed by %s (%s)", "vLLM's block hashes" if hashing else "their tokens", why
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from s3kv.connector.worker import WorkerSide

            self._worker = WorkerSide(
                self.config, layout, get_tensor_model_parallel_rank(), kv_cache_config.num_blocks, keys
            )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    @property
    def scheduler(self) -> SchedulerSide:
        assert self._scheduler is not None, "scheduler-side call on a worker connector"
        return self._scheduler

    @property
    def worker(self) -> WorkerSide:
        assert self._worker is not None, "worker-side call on a scheduler connector"
        return self._worker

    # -- worker side -----------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register(kv_caches)

    def _meta(self) -> S3KVMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, S3KVMetadata)
        self.worker.bind(meta)
        return meta

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, S3KVMetadata):
            self._worker.begin_step(connector_metadata)  # before the forward: time it

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, S3KVMetadata)
        self.worker.bind(kv_connector_metadata)
        self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        self.worker.save_layer(self._meta(), layer_name)

    def wait_for_save(self) -> None:
        self.worker.save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """vLLM's finished transfers, with the loads that failed: a model
        with several KV cache groups has them recomputed whole (its block
        ids are per group, so a failed block cannot say which)."""
        sent, recved = self.worker.get_finished(finished_req_ids)
        recved = set(recved or ())
        return KVConnectorTransferResults(
            finished_sending=set(sent or ()),
            finished_recving=recved,
            failed_recving=self.worker.take_failed_loads(recved),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.take_report()

    def shutdown(self) -> None:
        """Both roles' stops share one ``shutdown_flush_s``: with one rank
        vLLM stops the worker, then the scheduler side, in one process."""
        global _worker_stop_deadline
        if self._worker is not None:
            _worker_stop_deadline = time.monotonic() + self._worker.config.shutdown_flush_s
            self._worker.shutdown()
        if self._scheduler is not None:
            deadline, _worker_stop_deadline = _worker_stop_deadline, None
            budget = self._scheduler.config.shutdown_flush_s
            if deadline is not None:  # this process's worker just stopped
                budget = max(0.0, min(budget, deadline - time.monotonic()))
            self._scheduler.shutdown(budget)

    def get_kv_connector_stats(self) -> S3KVStats | None:
        if self._worker is not None:
            data = self._worker.counters.take()
        elif self._scheduler is not None:
            data = self._scheduler.take_stats()
        else:
            data = {}
        return S3KVStats(data=data) if data else None

    # -- scheduler side --------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.lookup(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_arrival(request)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.on_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        by_tier = self.scheduler.hit_sources(request)
        out = {HIT_SOURCES[t]: n for t, n in by_tier.items() if n}
        if sum(out.values()) != num_external_tokens:  # vLLM trimmed the hit: keep its total
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return out

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.on_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids), None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid KV cache manager: each KV cache group's blocks."""
        return self.scheduler.request_finished(request, block_ids), None

    def take_events(self) -> Iterable[KVCacheEvent]:
        return kv_events(self.scheduler.take_events(), self.config.chunk_tokens)

    # -- stats -------------------------------------------------------------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> S3KVStats:
        return S3KVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> S3KVPromMetrics:
        return S3KVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
