"""s3kv's figures: the recorder, payload merging (TP ranks, steps), the log
line's summary, and their Prometheus families (a private registry)."""

from __future__ import annotations

import functools
import json
import threading

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from s3kv.stats import FAMILIES, SERIES, Recorder, gauge_values, merge_payload, summarize


def test_recorder_takes_what_accumulated_and_keeps_totals():
    r = Recorder("rank0")
    r.add("hit_tokens_s3", 256)
    r.add("hit_tokens_s3", 64)
    r.observe("load_seconds_s3", 0.02)
    r.set("inflight_bytes", 4096)
    p = r.take()
    assert p == {
        "counters": {"hit_tokens_s3": 320},
        "observed": {"load_seconds_s3": [0.02]},
        "gauges": {"rank0": {"inflight_bytes": 4096}},
    }
    assert r.take() == {}  # nothing new; an unchanged gauge is not sent again
    r.set("inflight_bytes", 0)
    assert r.take() == {"gauges": {"rank0": {"inflight_bytes": 0}}}
    assert r.totals() == {
        "hit_tokens_s3": 320,
        "load_seconds_s3_count": 1,
        "load_seconds_s3_sum": 0.02,
        "inflight_bytes": 0,
    }
    json.dumps(p)  # it crosses processes


@pytest.mark.parametrize(
    "call", [("add", "hit_tokens"), ("observe", "hit_tokens_s3"), ("set", "load_seconds_s3")]
)
def test_unknown_or_mistyped_names_are_refused(call):
    method, name = call
    with pytest.raises(KeyError, match=name):
        getattr(Recorder(), method)(name, 1)


def test_recorder_is_thread_safe():
    r = Recorder()

    def work():
        for _ in range(5000):
            r.add("lookup_requests")
            r.observe("request_load_seconds", 0.001)

    threads = [threading.Thread(target=work) for _ in range(4)]
    taken = []
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        taken.append(r.take())
    for t in threads:
        t.join()
    taken.append(r.take())
    assert sum(p.get("counters", {}).get("lookup_requests", 0) for p in taken) == 20000
    assert sum(len(p.get("observed", {}).get("request_load_seconds", [])) for p in taken) == 20000


def test_merge_sums_counters_joins_observations_and_keeps_latest_gauges():
    a = {
        "counters": {"load_chunks_s3": 2},
        "observed": {"load_seconds_s3": [0.1]},
        "gauges": {"rank0": {"inflight_bytes": 10}, "scheduler": {"manifest_keys": 5}},
    }
    b = {
        "counters": {"load_chunks_s3": 3, "load_chunks_cpu": 1},
        "observed": {"load_seconds_s3": [0.2]},
        "gauges": {"rank0": {"inflight_bytes": 0}, "rank1": {"inflight_bytes": 7}},
    }
    m = merge_payload(a, b)
    assert m["counters"] == {"load_chunks_s3": 5, "load_chunks_cpu": 1}
    assert m["observed"] == {"load_seconds_s3": [0.1, 0.2]}
    # rank0's later value replaces its earlier one; ranks add up.
    assert gauge_values(m) == {"inflight_bytes": 7, "manifest_keys": 5}
    assert a["counters"] == {"load_chunks_s3": 2}  # inputs untouched
    assert merge_payload({}, {}) == {}


def test_summary_for_the_log_line():
    p = {
        "counters": {
            "lookup_tokens": 1000,
            "hit_tokens_s3": 512,
            "hit_tokens_cpu": 238,
            "store_raw_bytes": 300,
            "store_encoded_bytes": 200,
            "store_dropped_backpressure": 0,
        },
        "observed": {"load_seconds_s3": [0.01, 0.02, 0.03, 0.5], "request_load_seconds": [0.2]},
        "gauges": {"scheduler": {"manifest_keys": 42}},
    }
    s = summarize(p)
    assert s["hit_rate"] == 0.75
    assert s["compression_ratio"] == 1.5
    assert s["hit_tokens_s3"] == 512 and "store_dropped_backpressure" not in s
    assert s["load_s3_ms_p50"] == 20.0 and s["load_s3_ms_p99"] == 500.0
    assert s["request_load_ms_p50"] == 200.0
    assert s["manifest_keys"] == 42


def test_families_cover_what_the_issue_asks_for():
    names = {f.name: f for f in FAMILIES}
    assert names["hit_tokens"].values == ("cpu", "disk", "s3")
    assert {"missing", "corrupt", "timeout", "throttled"} <= set(names["load_errors"].values)
    assert {"backpressure", "disk_full"} <= set(names["store_dropped"].values)
    assert names["load_seconds"].kind == names["store_seconds"].kind == "histogram"
    for gauge in ("manifest_keys", "manifest_staleness_seconds", "inflight_bytes"):
        assert names[gauge].kind == "gauge"
    assert SERIES["load_errors_throttled"] == (names["load_errors"], "throttled")


def test_prometheus_families_from_a_payload():
    pytest.importorskip("vllm")
    from s3kv.connector.stats import S3KVPromMetrics, S3KVStats

    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}

    class Cfg:
        kv_transfer_config = None

    prom = S3KVPromMetrics(Cfg(), types, ["model_name", "engine"], {0: ["m", "0"]})
    stats = S3KVStats(data={})
    stats.aggregate(
        S3KVStats(
            data={
                "counters": {"hit_tokens_s3": 320, "load_errors_corrupt": 1, "store_raw_bytes": 300},
                "observed": {"load_seconds_s3": [0.004, 0.03]},
                "gauges": {"scheduler": {"manifest_keys": 12, "tier_used_bytes_cpu": 1024}},
            }
        )
    )
    stats.aggregate(S3KVStats(data={"counters": {"hit_tokens_s3": 64, "store_encoded_bytes": 100}}))
    assert not stats.is_empty() and S3KVStats(data={}).is_empty()
    prom.observe(stats.data, 0)
    v = functools.partial(reg.get_sample_value)
    base = {"model_name": "m", "engine": "0"}
    assert v("vllm:s3kv_hit_tokens_total", {**base, "tier": "s3"}) == 384
    assert v("vllm:s3kv_load_errors_total", {**base, "kind": "corrupt"}) == 1
    assert v("vllm:s3kv_load_seconds_count", {**base, "tier": "s3"}) == 2
    assert v("vllm:s3kv_load_seconds_bucket", {**base, "tier": "s3", "le": "0.005"}) == 1
    assert v("vllm:s3kv_manifest_keys", base) == 12
    assert v("vllm:s3kv_tier_used_bytes", {**base, "tier": "cpu"}) == 1024
    assert v("vllm:s3kv_compression_ratio", base) == 3.0
    # Ranks report a gauge only when it changed: the sum keeps the others' last values.
    prom.observe({"gauges": {"rank0": {"inflight_bytes": 64}, "rank1": {"inflight_bytes": 64}}}, 0)
    prom.observe({"gauges": {"rank0": {"inflight_bytes": 0}}}, 0)
    assert v("vllm:s3kv_inflight_bytes", base) == 64
    # Every family is registered, with HELP text.
    exported = {m.name for m in reg.collect()}
    for fam in FAMILIES:
        assert "vllm:s3kv_" + fam.name in exported, fam.name
