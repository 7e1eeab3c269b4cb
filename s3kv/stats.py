"""What s3kv measures: counters, latency histograms and gauges.

Code records figures under flat names (``hit_tokens_cpu``,
``load_seconds_s3``, ``manifest_keys``); :data:`FAMILIES` groups them into
Prometheus-style families with one label (``hit_tokens{tier="cpu"}``).
:meth:`Recorder.take` returns what accumulated since the last take as a
plain, serializable payload (vLLM ships it from workers to the scheduler and
on to the front end once per step); :func:`merge_payload` adds two payloads
and :func:`summarize` reduces one to the figures of the periodic log line.
Nothing here imports vLLM or Prometheus: ``s3kv.connector.stats`` adapts.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from s3kv.tiering.placement import Tier

TIERS = tuple(t.value for t in Tier)
"""The ``tier`` label's values: the tiers' names (an interface: dashboards select by them)."""
CONTEXT_BUCKETS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
"""Upper bounds, in tokens of context, of the cost model's prefill-rate
buckets (``s3kv.tiering.scheduler.cost``); longer contexts share the last one."""


@dataclass(frozen=True)
class Family:
    """A metric and the flat names that record into it: ``name`` itself when
    ``label`` is None, else ``{name}_{value}`` for each label value."""

    name: str
    kind: str
    """"counter", "histogram" or "gauge"."""
    doc: str
    label: str | None = None
    values: tuple[str, ...] = ()

    def flat_names(self) -> dict[str, str | None]:
        if self.label is None:
            return {self.name: None}
        return {f"{self.name}_{v}": v for v in self.values}


def _c(name: str, doc: str, label: str | None = None, values: tuple[str, ...] = ()) -> Family:
    return Family(name, "counter", doc, label, values)


FAMILIES: tuple[Family, ...] = (
    _c("lookup_requests", "Requests whose prompt was looked up in the cache"),
    _c("lookup_tokens", "Prompt tokens looked up in the cache"),
    _c("hit_tokens", "Prompt tokens offered to vLLM as loadable, by the tier they load from", "tier", TIERS),
    _c(
        "load_policy_tokens",
        "Prompt tokens the tiers held, by what the load policy did with them: offered to vLLM, or "
        "declined (the cost model estimated computing them to be faster than loading them)",
        "decision",
        ("offered", "declined"),
    ),
    _c(
        "load_policy_explored",
        "Hits offered whole against the cost model's estimate, to measure again a tier whose "
        "estimate had not been refreshed for a minute",
    ),
    _c(
        "prefetch_chunks",
        "Chunks of arriving requests that only S3 held, fetched into the nearer tiers while the requests "
        "waited: started; queued for the prefetch byte budget first; skipped, the request being scheduled "
        "before their turn (it loaded them itself)",
        "outcome",
        ("started", "queued", "skipped"),
    ),
    _c(
        "prefetch_waits",
        "Requests whose scheduling waited for their prefetch to finish (its chunks then load from the CPU "
        "or NVMe tier)",
    ),
    _c(
        "load_chunks",
        "Chunk shards loaded into the KV cache (with several KV cache groups, each group's part), by source tier",
        "tier",
        TIERS,
    ),
    _c("load_bytes", "Bytes read for loads (object bytes; CPU: page bytes), by source tier", "tier", TIERS),
    _c(
        "load_errors",
        "Chunk loads that failed (the tokens are recomputed), by kind: the object absent, corrupt or "
        "refused (a 403 on it); the tier too slow, throttling or unavailable; given up (another transfer "
        "found the tier failing, no disk thread was free, or no time was left)",
        "kind",
        ("missing", "corrupt", "denied", "timeout", "throttled", "unavailable", "gave_up", "other"),
    ),
    _c("promote_chunks", "Chunk shards loaded from below and kept in a tier above", "tier", ("cpu",)),
    _c("store_chunks", "Chunk shards written into a tier (stores and promotions)", "tier", TIERS),
    _c("store_chunks_existing", "Chunk shards another replica had already stored in S3 (a 412)"),
    _c("store_bytes", "Bytes written into a tier", "tier", ("disk", "s3")),
    _c("store_raw_bytes", "KV bytes of the chunk shards encoded for NVMe and S3 (before compression)"),
    _c("store_encoded_bytes", "Bytes of the encoded chunk objects (after compression)"),
    _c(
        "store_dropped",
        "Stores not done, by reason: the in-flight byte budget, no free CPU slot, the disk full",
        "reason",
        ("backpressure", "no_slot", "disk_full"),
    ),
    _c(
        "store_errors",
        "Writes that failed otherwise (the chunk is just not cached there)",
        "tier",
        ("disk", "s3"),
    ),
    _c("evict_chunks", "Chunks evicted (least recently used)", "tier", ("cpu", "disk")),
    _c("manifest_segments_published", "Manifest segments this replica wrote"),
    _c("manifest_segments_loaded", "Manifest segments of the fleet applied"),
    _c("manifest_snapshots_written", "Manifest snapshots this replica wrote"),
    _c(
        "manifest_prune_denied",
        "Prunes of old manifest snapshots the store refused (no s3:DeleteObject: left to gc)",
    ),
    _c("manifest_epochs_read", "Manifest epochs (protocol epochs) of the fleet read"),
    _c("manifest_epochs_written", "Manifest epochs this replica aggregated and wrote"),
    _c("manifest_epochs_missing", "Asks for a manifest epoch not written yet (asked again shortly)"),
    _c(
        "manifest_epochs_early",
        "Manifest epochs found written before this replica expected them (its clock is behind: it reads them sooner now)",
    ),
    _c(
        "manifest_epochs_skipped",
        "Manifest epochs that did not read (corrupt, unsigned or forged, in the future): their segments read instead",
    ),
    _c(
        "manifest_epochs_covered",
        "Manifest epochs this replica covered from the segments alone, writing nothing (skipped, refused)",
    ),
    _c(
        "manifest_epochs_refused",
        "Manifest epochs not aggregated because this replica's clock looks far ahead of the fleet's",
    ),
    _c("manifest_errors", "Manifest reads or writes that failed (retried later)"),
    _c("manifest_dropped", "Keys dropped from the manifest: their object was missing or corrupt"),
    _c(
        "manifest_skipped",
        "Objects under the manifest prefix skipped, by reason: folder markers, names that are no "
        "manifest object's, garbage, access denied, stamps in the future, too large, unsigned or badly signed",
        "reason",
        ("marker", "foreign", "garbage", "denied", "future", "oversize", "unsigned"),
    ),
    _c(
        "quarantined_chunks",
        "Corrupt chunk objects this replica could not delete, reported to the fleet as bad (gc removes them)",
    ),
    _c(
        "key_mismatch",
        "Worker ranks whose fleet secret (S3KV_AUTH_KEY, auth_key_file) is not the scheduler side's: "
        "each refuses every load and store (see its log)",
    ),
    _c(
        "unkeyed_requests",
        "Requests served without the cache while the model's (or a LoRA adapter's) content digest was "
        "being computed, or (chunks keyed by vLLM's block hashes) without block hashes of the engine's "
        "granularity, or with vLLM's hash seed not the namespace's: no hits offered, nothing stored",
        "reason",
        ("model", "adapter", "hashes", "hash_seed"),
    ),
    _c(
        "breaker_trips",
        "Times a tier's circuit breaker opened (the tier is not used until a probe succeeds)",
        "tier",
        ("disk", "s3"),
    ),
    _c(
        "disk_scan_skipped",
        "Entries of the NVMe directory skipped at start-up: foreign, unreadable or oddly named",
    ),
    _c(
        "codec_switches",
        "Times a tier's writer under codec auto switched between storing uncompressed and compressed",
        "tier",
        ("disk", "s3"),
    ),
    _c(
        "s3_requests",
        "HTTP requests sent to S3 (retries included), by operation",
        "op",
        ("get", "put", "list", "head", "delete", "other"),
    ),
    Family(
        "load_seconds",
        "histogram",
        "Time to load one chunk shard into the KV cache (fetch, checks, decode, copy), by source tier; "
        "CPU-tier chunks of one step are copied together and each observes the step's copy time",
        "tier",
        TIERS,
    ),
    Family(
        "request_load_seconds",
        "histogram",
        "Time from the start of a request's load to its last chunk in the KV cache",
    ),
    Family(
        "store_seconds",
        "histogram",
        "Time from the copy out of the KV cache to the chunk shard written in a tier (encoding included)",
        "tier",
        ("disk", "s3"),
    ),
    Family("manifest_keys", "gauge", "Chunk keys in this replica's view of the fleet manifest"),
    Family(
        "manifest_staleness_seconds",
        "gauge",
        "Seconds since the manifest was last brought up to date from S3 (as of the last engine step)",
    ),
    Family(
        "breaker_open",
        "gauge",
        "1 while a tier's circuit breaker is open (or probing), else 0",
        "tier",
        ("disk", "s3"),
    ),
    Family(
        "cost_first_chunk_seconds",
        "gauge",
        "The cost model's estimate of a load's first chunk from a tier when it has the tier to itself "
        "(first-byte latency, one chunk's transfer and checks): the median of recent loads, or a "
        "start-up value",
        "tier",
        TIERS,
    ),
    Family(
        "cost_bandwidth_bytes_per_second",
        "gauge",
        "The cost model's estimate of a tier's bandwidth, shared by the loads in flight on it, raw KV "
        "bytes a second",
        "tier",
        TIERS,
    ),
    Family(
        "cost_round_trip_seconds",
        "gauge",
        "The cost model's estimate of what an asynchronous load adds to its own time (the steps a "
        "waiting request sits out before vLLM hears the load finished)",
    ),
    Family(
        "cost_step_seconds",
        "gauge",
        "The cost model's estimate of a forward step's fixed cost (the median of recent steps of a few "
        "tokens), which it takes off a prefill step's time before dividing by its tokens",
    ),
    Family(
        "cost_prefill_tokens_per_second",
        "gauge",
        "The cost model's estimate of the engine's prefill rate, by the context length reached "
        "(tokens, upper bound of the bucket); only buckets measured",
        "context",
        tuple(str(b) for b in CONTEXT_BUCKETS),
    ),
    Family(
        "codec_compressed",
        "gauge",
        "Worker ranks whose writer under codec auto stores a tier's chunks compressed (blosc2) now "
        "(0: every rank stores them uncompressed)",
        "tier",
        ("disk", "s3"),
    ),
    Family(
        "codec_none_seconds_per_gb",
        "gauge",
        "codec auto's estimate (rank 0's) of the seconds a GB of KV takes to load from a tier stored "
        "uncompressed",
        "tier",
        ("disk", "s3"),
    ),
    Family(
        "codec_compressed_seconds_per_gb",
        "gauge",
        "codec auto's estimate (rank 0's) of the seconds a GB of KV takes to load from a tier stored "
        "compressed",
        "tier",
        ("disk", "s3"),
    ),
    Family(
        "codec_link_bytes_per_second",
        "gauge",
        "codec auto's measure (rank 0's) of a tier's link: stored bytes a second over the time a "
        "transfer was in flight",
        "tier",
        ("disk", "s3"),
    ),
    Family("inflight_bytes", "gauge", "KV bytes copied out and waiting to be written to NVMe or S3"),
    Family(
        "kv_cache_groups",
        "gauge",
        "The model's KV cache groups (vLLM's hybrid KV cache manager): each chunk is one object per group",
    ),
    Family("tier_used_bytes", "gauge", "Bytes held in a local tier", "tier", ("cpu", "disk")),
    Family("tier_capacity_bytes", "gauge", "Capacity of a local tier", "tier", ("cpu", "disk")),
)

SERIES: dict[str, tuple[Family, str | None]] = {
    flat: (fam, value) for fam in FAMILIES for flat, value in fam.flat_names().items()
}
"""Flat name -> (its family, its label value or None)."""

COUNTERS = {k: f.doc for k, (f, _) in SERIES.items() if f.kind == "counter"}
HISTOGRAMS = {k: f.doc for k, (f, _) in SERIES.items() if f.kind == "histogram"}
GAUGES = {k: f.doc for k, (f, _) in SERIES.items() if f.kind == "gauge"}

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Seconds; a CPU-tier copy takes ~1 ms, an S3 GET of a few MiB tens of ms."""


class Recorder:
    """Thread-safe figures of one process side (a worker rank or the
    scheduler). Counters and observations accumulate until :meth:`take`;
    gauges hold their latest value and are sent when they changed."""

    def __init__(self, source: str = "") -> None:
        self.source = source
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}
        self._totals: dict[str, float] = {}
        self._observed: dict[str, list[float]] = {}
        self._gauges: dict[str, float] = {}
        self._sent_gauges: dict[str, float] = {}

    def add(self, name: str, value: float = 1) -> None:
        if name not in COUNTERS:
            raise KeyError(f"unknown counter {name!r}")
        with self._lock:
            self._values[name] = self._values.get(name, 0) + value
            self._totals[name] = self._totals.get(name, 0) + value

    def observe(self, name: str, seconds: float) -> None:
        if name not in HISTOGRAMS:
            raise KeyError(f"unknown histogram {name!r}")
        with self._lock:
            self._observed.setdefault(name, []).append(seconds)
            self._totals[f"{name}_count"] = self._totals.get(f"{name}_count", 0) + 1
            self._totals[f"{name}_sum"] = self._totals.get(f"{name}_sum", 0) + seconds

    def set(self, name: str, value: float) -> None:
        if name not in GAUGES:
            raise KeyError(f"unknown gauge {name!r}")
        with self._lock:
            self._gauges[name] = value

    def totals(self) -> dict[str, float]:
        """Every counter since start (histograms as ``_count``/``_sum``), and
        the gauges' current values."""
        with self._lock:
            return {**self._totals, **self._gauges}

    def take(self) -> dict[str, Any]:
        """What changed since the last take, as a payload (empty: nothing)."""
        with self._lock:
            values, self._values = self._values, {}
            observed, self._observed = self._observed, {}
            gauges = {k: v for k, v in self._gauges.items() if self._sent_gauges.get(k) != v}
            self._sent_gauges.update(gauges)
        payload: dict[str, Any] = {}
        if values:
            payload["counters"] = values
        if observed:
            payload["observed"] = observed
        if gauges:
            payload["gauges"] = {self.source: gauges}
        return payload


Counters = Recorder  # the name most call sites know it by


def merge_payload(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """``a`` then ``b``: counters summed, observations joined, each source's
    gauges updated to ``b``'s values."""
    out: dict[str, Any] = {}
    counters = merge(a.get("counters", {}), b.get("counters", {}))
    if counters:
        out["counters"] = counters
    observed = {k: list(v) for k, v in a.get("observed", {}).items()}
    for k, v in b.get("observed", {}).items():
        observed.setdefault(k, []).extend(v)
    if observed:
        out["observed"] = observed
    gauges = {src: dict(g) for src, g in a.get("gauges", {}).items()}
    for src, g in b.get("gauges", {}).items():
        gauges.setdefault(src, {}).update(g)
    if gauges:
        out["gauges"] = gauges
    return out


def gauge_values(payload: Mapping[str, Any]) -> dict[str, float]:
    """Each gauge summed over the sources that report it (ranks' in-flight
    bytes add up; the scheduler alone reports the manifest's)."""
    out: dict[str, float] = {}
    for g in payload.get("gauges", {}).values():
        for k, v in g.items():
            out[k] = out.get(k, 0) + v
    return out


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summarize(payload: Mapping[str, Any]) -> dict[str, int | float]:
    """The figures of one interval for vLLM's log line: counters that moved,
    the hit rate and compression ratio, load/store latency p50 and p99 in
    ms, and the gauges."""
    c = payload.get("counters", {})
    out: dict[str, int | float] = {}
    hit = sum(c.get(f"hit_tokens_{t}", 0) for t in TIERS)
    if c.get("lookup_tokens"):
        out["hit_rate"] = round(hit / c["lookup_tokens"], 3)
    if c.get("store_encoded_bytes"):
        out["compression_ratio"] = round(c.get("store_raw_bytes", 0) / c["store_encoded_bytes"], 2)
    for k, v in sorted(c.items()):
        if v:
            out[k] = int(v) if float(v).is_integer() else round(v, 3)
    for k, xs in sorted(payload.get("observed", {}).items()):
        if xs:
            base = k.removesuffix("_seconds") if k.endswith("_seconds") else k.replace("_seconds_", "_")
            out[f"{base}_ms_p50"] = round(quantile(xs, 0.5) * 1000, 1)
            out[f"{base}_ms_p99"] = round(quantile(xs, 0.99) * 1000, 1)
    for k, v in sorted(gauge_values(payload).items()):
        out[k] = int(v) if float(v).is_integer() else round(v, 1)
    return out


K = TypeVar("K", bound=Hashable)


def merge(a: Mapping[K, float], b: Mapping[K, float]) -> dict[K, float]:
    """Sum two dicts of numbers key by key."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out
