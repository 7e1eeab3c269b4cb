"""s3kv's figures on vLLM's connector-stats path: the periodic log line
("KV Transfer metrics: ...") and Prometheus (``/metrics`` of ``vllm serve``,
``LLM.get_metrics()``).

Each step the workers' and the scheduler's payloads (``s3kv.stats``) are
aggregated into one :class:`S3KVStats`; :class:`S3KVPromMetrics` turns a
payload into one Prometheus family per :data:`s3kv.stats.FAMILIES` entry,
named ``vllm:s3kv_<family>`` (counters get ``_total``), the family's label
(``tier``, ``kind``, ``reason``, ``op``) after vLLM's own labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from s3kv.stats import FAMILIES, LATENCY_BUCKETS, SERIES, gauge_values, merge_payload, summarize

PROM_PREFIX = "vllm:s3kv_"


@dataclass
class S3KVStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = merge_payload(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return summarize(self.data)

    def is_empty(self) -> bool:
        return not self.data


class S3KVPromMetrics(KVConnectorPromMetrics):
    """``vllm:s3kv_hit_tokens_total{tier="s3"}``,
    ``vllm:s3kv_load_seconds_bucket{tier="disk",le="0.01"}``,
    ``vllm:s3kv_manifest_keys``, ... and the derived gauge
    ``vllm:s3kv_compression_ratio`` (raw over encoded bytes since start)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        for fam in FAMILIES:
            names = labelnames + ([fam.label] if fam.label else [])
            kwargs: dict[str, Any] = {
                "name": PROM_PREFIX + fam.name,
                "documentation": fam.doc,
                "labelnames": names,
            }
            if fam.kind == "counter":
                self._metrics[fam.name] = self._counter_cls(**kwargs)
            elif fam.kind == "histogram":
                self._metrics[fam.name] = self._histogram_cls(**kwargs, buckets=list(LATENCY_BUCKETS))
            else:
                self._metrics[fam.name] = self._gauge_cls(**kwargs, multiprocess_mode="mostrecent")
        self._ratio = self._gauge_cls(
            name=PROM_PREFIX + "compression_ratio",
            documentation="KV bytes over encoded bytes of the chunks stored since start",
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        self._gauges: dict[int, dict[str, dict[str, float]]] = {}
        """engine -> source -> its gauges as last reported (a source reports
        only what changed, so the sums need the others' last values)."""
        self._raw: dict[int, float] = {}
        self._encoded: dict[int, float] = {}

    def _series(self, flat: str, engine_idx: int) -> Any:
        fam, value = SERIES[flat]
        labels = list(self.per_engine_labelvalues[engine_idx])
        if value is not None:
            labels.append(value)
        return self._metrics[fam.name].labels(*labels)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.get("counters", {}).items():
            if name in SERIES and value:
                self._series(name, engine_idx).inc(value)
        for name, values in transfer_stats_data.get("observed", {}).items():
            if name in SERIES:
                series = self._series(name, engine_idx)
                for v in values:
                    series.observe(v)
        remembered = self._gauges.setdefault(engine_idx, {})
        changed = set()
        for source, gauges in transfer_stats_data.get("gauges", {}).items():
            remembered.setdefault(source, {}).update(gauges)
            changed.update(gauges)
        totals = gauge_values({"gauges": remembered})
        for name in changed:
            if name in SERIES:
                self._series(name, engine_idx).set(totals[name])
        counters = transfer_stats_data.get("counters", {})
        if counters.get("store_encoded_bytes"):
            raw = self._raw[engine_idx] = self._raw.get(engine_idx, 0) + counters.get("store_raw_bytes", 0)
            enc = self._encoded[engine_idx] = (
                self._encoded.get(engine_idx, 0) + counters["store_encoded_bytes"]
            )
            self._ratio.labels(*self.per_engine_labelvalues[engine_idx]).set(raw / enc)
