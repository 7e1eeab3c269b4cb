"""benchmarks/load_concurrent.py's pure parts: the percentile, the per-side
summary and pair ratio, per-chunk times, and the page sink wrapper that
notes when a chunk's last layer is in place (no engine, no server)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from benchmarks.load_concurrent import Run, TimedPages, chunk_times, pair_ratio, percentile, summarize
from s3kv.frame_sinks import PageTarget


def test_p99_is_a_sample_from_the_tail() -> None:
    xs = [float(i) for i in range(1, 101)]  # 1..100
    assert percentile(xs, 99) == 99.0
    assert percentile(xs, 50) == 50.0
    # One slow chunk among 200: p99 sits at the 198th of 200, not interpolated toward the outlier.
    assert percentile([1.0] * 199 + [50.0], 99) == 1.0
    assert percentile([1.0] * 197 + [50.0] * 3, 99) == 50.0
    with pytest.raises(ValueError):
        percentile([], 99)


def test_summary_pools_chunks_and_takes_the_median_rate() -> None:
    runs = [Run(1.0, [0.1, 0.2], 3.0), Run(2.0, [0.3, 0.4], 1.0), Run(4.0, [0.5, 0.6], 2.0)]
    s = summarize(runs, nbytes=4_000_000_000, chunks=2)
    assert s.gbps == 2.0  # rates 4, 2, 1 GB/s
    assert s.p50_ms == pytest.approx(300.0)  # nearest rank: the third of six
    assert s.p99_ms == pytest.approx(600.0)
    assert s.cpu_s_per_gb == pytest.approx(0.5)  # CPU 1, 2, 3 s for 4 GB: the median 2 s
    with pytest.raises(ValueError):
        summarize(runs, nbytes=1, chunks=3)  # a run that timed fewer chunks than it loaded


def test_pair_ratio_is_plain_over_s3kv_per_pair() -> None:
    s3kv = [Run(1.0, []), Run(2.0, []), Run(1.0, [])]
    plain = [Run(0.5, []), Run(2.0, []), Run(0.8, [])]
    assert pair_ratio(s3kv, plain) == 0.8  # pairs 0.5, 1.0, 0.8
    with pytest.raises(ValueError):
        pair_ratio(s3kv, plain[:2])


def test_chunk_times_from_their_requests_submit() -> None:
    assert sorted(chunk_times({b"a": 1.0, b"b": 2.0}, {b"a": 1.5, b"b": 2.25})) == [0.25, 0.5]
    with pytest.raises(RuntimeError):
        chunk_times({b"a": 1.0, b"b": 2.0}, {b"a": 1.5})


@dataclass
class _Chunk:
    key: bytes


@dataclass
class _Pages:
    """A page sink: layer 0 takes a target, the others a write."""

    committed: list[tuple[bytes, int]] = field(default_factory=list)
    written: list[tuple[bytes, int]] = field(default_factory=list)
    extra: str = "passed through"

    def write(self, chunk: Any, layer: int, data: np.ndarray) -> None:
        self.written.append((chunk.key, layer))

    def target(self, chunk: Any, layer: int) -> PageTarget | None:
        if layer != 0:
            return None
        return PageTarget([np.zeros(4, np.uint8)], lambda: self.committed.append((chunk.key, layer)))


def test_timed_pages_mark_a_chunk_done_at_its_last_layer() -> None:
    now = [0.0]
    inner = _Pages()
    sink = TimedPages(inner, layers=3, clock=lambda: now[0])
    a, b = _Chunk(b"a"), _Chunk(b"b")
    t = sink.target(a, 0)
    assert t is not None and sink.target(a, 1) is None
    now[0] = 1.0
    t.commit()
    assert inner.committed == [(b"a", 0)] and sink.done == {}
    now[0] = 2.0
    sink.write(a, 1, np.zeros(4, np.uint8))
    sink.write(b, 1, np.zeros(4, np.uint8))
    assert sink.done == {}
    now[0] = 3.0
    sink.write(a, 2, np.zeros(4, np.uint8))
    assert sink.done == {b"a": 3.0}  # b has one layer of three
    assert inner.written == [(b"a", 1), (b"b", 1), (b"a", 2)]
    assert sink.extra == "passed through"
    sink.reset()
    assert sink.done == {}
