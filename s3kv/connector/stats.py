"""s3kv's counters on vLLM's connector-stats path: the periodic log line and
Prometheus (``/metrics`` of ``vllm serve``, ``LLM.get_metrics()``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from s3kv.stats import COUNTERS, merge

PROM_PREFIX = "vllm:s3kv_"


@dataclass
class S3KVStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class S3KVPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per s3kv counter, e.g. ``vllm:s3kv_hit_tokens_total``."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=PROM_PREFIX + name, documentation=doc, labelnames=labelnames)
            for name, doc in COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            counter = self._counters.get(name)
            if counter is not None and value:
                counter.labels(*labels).inc(value)
