"""benchmarks/hybrid.py: the goal on bytes per hit, and the verdict and
rows its report makes of engines' turns (written here, no engine)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from benchmarks.hybrid import FAMILIES, report, window_bound

SLIDING, FULL, SSM = FAMILIES
N = 8192
MIB = 1 << 20


def _turn(
    ttft_s: float, cached: int = N, outputs: tuple[int, ...] = (5, 6), **workers: float
) -> dict[str, Any]:
    return {"ttft_s": ttft_s, "outputs": list(outputs), "cached": cached, "workers": workers}


def _family(parts: int, nbytes: int, recompute: bool) -> dict[str, Any]:
    """A family's turns at one length: its hits load ``parts`` parts of
    ``nbytes`` from each tier; a prompt's store is 192 parts, 48 MiB."""
    stored = {"store_raw_bytes": 48 * MIB, "store_bytes_disk": 48 * MIB + 4096, "store_bytes_s3": 33 * MIB}
    compute = {"store": {N: _turn(20.0, cached=0, store_chunks_s3=192, **stored)}}
    hits = {
        "store": {N: [_turn(0.05, load_chunks_cpu=parts, load_bytes_cpu=nbytes)] * 2},
        "nvme": {N: [_turn(0.08, load_chunks_disk=parts, load_bytes_disk=nbytes + 4096)] * 2},
        "s3": {N: [_turn(0.2, load_chunks_s3=parts, load_bytes_s3=nbytes * 2 // 3)] * 2},
    }
    if recompute:
        compute["vllm"] = {N: _turn(19.0, cached=0)}
        hits["vllm"] = {N: [_turn(0.03)] * 2}
    return {"compute": compute, "hits": hits, "evicted": 300, "startup_s": {"store": 30.0}}


@pytest.fixture
def got() -> dict[str, dict[str, Any]]:
    return {"sliding": _family(52, 13 * MIB, True), "full": _family(32, 48 * MIB, False)}


def _report(got: dict[str, dict[str, Any]]) -> Any:
    return report(got, (N,), 2, False, 0.0, ((1.0, 1.0, 1.0), (1.0, 1.0, 1.0)))


def _row(result: Any, model: str, path: str) -> list[Any]:
    (row,) = [r for r in result.rows if r[0] == model and r[2].startswith(path)]
    return row


def test_the_bound_is_full_layers_plus_the_window_rounded_up_plus_a_chunk():
    assert window_bound(SLIDING, 8192) == pytest.approx((32 + 5 * 5) / (6 * 32))
    assert window_bound(SLIDING, 32768) == pytest.approx((128 + 5 * 5) / (6 * 128))
    assert window_bound(SLIDING, 512) == 1.0  # a window longer than the hit: every chunk
    assert window_bound(FULL, 8192) == 1.0


def test_a_window_sized_hit_meets_the_goal_and_the_ssm_family_is_not_measured(got):
    r = _report(got)
    assert r.verdict == "met"
    cpu = _row(r, SLIDING.label, "s3kv hit: CPU")
    assert cpu[4] == pytest.approx(0.05 / 19.0, abs=1e-4)  # to vLLM's recompute
    assert cpu[6] == "CPU 52" and cpu[7] == 13.0 and cpu[8] == pytest.approx(13 / 48, abs=1e-3)
    stored = _row(r, SLIDING.label, "s3kv, empty tiers")
    assert stored[8].startswith("raw 1.000;")
    assert _row(r, FULL.label, "s3kv hit: S3")[4] == pytest.approx(0.2 / 20.0)  # to its own compute
    (ssm,) = {r[2] for r in r.rows if r[0] == SSM.label}
    assert ssm == "not measured: s3kv refuses Mamba groups (issue 28, next step)"


def test_a_hit_that_loads_every_layer_misses_the_bytes_goal(got):
    got["sliding"] = _family(192, 48 * MIB, True)
    r = _report(got)
    assert r.verdict.startswith("missed:")
    assert "CPU hit loads 1.000x the Llama's bytes (goal 0.297x)" in r.verdict
    assert "NVMe hit loads 1.000x" in r.verdict


def test_a_row_loaded_from_another_tier_is_invalid(got):
    nvme = got["sliding"]["hits"]["nvme"][N]
    nvme[1] = copy.deepcopy(nvme[1])
    nvme[1]["workers"]["load_chunks_s3"] = 3
    r = _report(got)
    assert "invalid: " + SLIDING.label + " 8k NVMe hit loaded NVMe 52, S3 3 parts" in r.verdict


def test_wrong_outputs_and_a_slow_hit_are_misses(got):
    got["sliding"]["hits"]["s3"][N] = [
        _turn(9.0, outputs=(7, 7), load_chunks_s3=52, load_bytes_s3=9 * MIB)
    ] * 2
    r = _report(got)
    assert "8k S3 hit: outputs differ from recompute and vllm_hit" in r.verdict
    assert "8k S3 hit 0.474x recompute (goal 0.3x)" in r.verdict
    assert _row(r, SLIDING.label, "s3kv hit: S3")[9].startswith("WRONG")
