"""benchmarks/hybrid.py: the goals on bytes per hit, the parts a hit must
load, and the verdict and rows its report makes of engines' turns (written
here, no engine)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from benchmarks.hybrid import FAMILIES, expected_parts, hit_bound, hit_tokens, report

SLIDING, FULL, SSM = FAMILIES
N = 8192
H = 8320
"""The SSM model's hit at nominal length N: 13 chunks of 640 tokens."""
MIB = 1 << 20
KIB = 1 << 10


def _turn(
    ttft_s: float, cached: int = N, outputs: tuple[int, ...] = (5, 6), **workers: float
) -> dict[str, Any]:
    return {"ttft_s": ttft_s, "outputs": list(outputs), "cached": cached, "workers": workers}


def _family(parts: int, nbytes: int, recompute: bool, h: int = N, stored: int = 48 * MIB) -> dict[str, Any]:
    """A family's turns at one length: its hits of ``h`` tokens load
    ``parts`` parts of ``nbytes`` from each tier; a prompt stores ``stored``
    raw bytes."""
    written = {
        "store_raw_bytes": stored,
        "store_bytes_disk": stored + 4096,
        "store_bytes_s3": stored * 2 // 3,
    }
    compute = {"store": {h: _turn(20.0, cached=0, store_chunks_s3=parts, **written)}}
    hits = {
        "store": {h: [_turn(0.05, cached=h, load_chunks_cpu=parts, load_bytes_cpu=nbytes)] * 2},
        "nvme": {h: [_turn(0.08, cached=h, load_chunks_disk=parts, load_bytes_disk=nbytes + 4096)] * 2},
        "s3": {h: [_turn(0.2, cached=h, load_chunks_s3=parts, load_bytes_s3=nbytes * 2 // 3)] * 2},
    }
    if recompute:
        compute["vllm"] = {h: _turn(19.0, cached=0)}
        hits["vllm"] = {h: [_turn(0.03, cached=h)] * 2}
    return {"compute": compute, "hits": hits, "evicted": 300, "startup_s": {"store": 30.0}}


def _ssm(parts: int = 18) -> dict[str, Any]:
    """The SSM model's turns: 13 full-attention parts and 5 states, each part 640 tokens of one layer (640 KiB)."""
    return _family(parts, parts * 640 * KIB, True, h=H, stored=18 * 640 * KIB)


@pytest.fixture
def got() -> dict[str, dict[str, Any]]:
    return {"sliding": _family(52, 13 * MIB, True), "full": _family(32, 48 * MIB, False), "ssm": _ssm()}


def _report(got: dict[str, dict[str, Any]]) -> Any:
    return report(got, (N,), 2, False, 0.0, ((1.0, 1.0, 1.0), (1.0, 1.0, 1.0)))


def _row(result: Any, model: str, path: str) -> list[Any]:
    (row,) = [r for r in result.rows if r[0] == model and r[2].startswith(path)]
    return row


def test_the_bound_is_full_layers_plus_the_window_rounded_up_plus_a_chunk():
    assert hit_bound(SLIDING, 8192) == pytest.approx((32 + 5 * 5) / (6 * 32))
    assert hit_bound(SLIDING, 32768) == pytest.approx((128 + 5 * 5) / (6 * 128))
    assert hit_bound(SLIDING, 512) == 1.0  # a window longer than the hit: every chunk
    assert hit_bound(FULL, 8192) == 1.0


def test_the_ssm_bound_is_full_layers_plus_one_chunk_per_state_layer():
    assert hit_tokens(SSM, 8192) == H and hit_tokens(SSM, 32768) == 51 * 640
    assert hit_tokens(SLIDING, 8192) == 8192 and hit_tokens(FULL, 32768) == 32768
    assert hit_bound(SSM, H) == pytest.approx((13 + 5) / (6 * 13))
    assert hit_bound(SSM, 51 * 640) == pytest.approx((51 + 5) / (6 * 51))
    assert hit_bound(SSM, 640) == 1.0  # one chunk: its full part and its states, every layer's


def test_a_hit_loads_the_full_parts_and_the_window_or_the_states():
    assert expected_parts(SLIDING, 8192) == 32 + 5 * 4  # a 1024-token window reaches 4 chunks back
    assert expected_parts(SLIDING, 32768) == 128 + 5 * 4
    assert expected_parts(FULL, 8192) == 32  # one group: its chunks
    assert expected_parts(SSM, H) == 13 + 5
    assert expected_parts(SSM, 51 * 640) == 51 + 5


def test_window_and_state_sized_hits_meet_the_goal(got):
    r = _report(got)
    assert r.verdict == "met"
    cpu = _row(r, SLIDING.label, "s3kv hit: CPU")
    assert cpu[4] == pytest.approx(0.05 / 19.0, abs=1e-4)  # to vLLM's recompute
    assert cpu[6] == "CPU 52" and cpu[7] == 13.0 and cpu[8] == pytest.approx(13 / 48, abs=1e-3)
    stored = _row(r, SLIDING.label, "s3kv, empty tiers")
    assert stored[8].startswith("raw 1.000;")
    assert _row(r, FULL.label, "s3kv hit: S3")[4] == pytest.approx(0.2 / 20.0)  # to its own compute
    ssm = _row(r, SSM.label, "s3kv hit: CPU")
    assert ssm[1] == "8320" and ssm[5] == H and ssm[6] == "CPU 18"
    # Per token against the Llama's 8192-token hit: 18 parts of 640 KiB over 8320 tokens, 6 KiB a token.
    assert ssm[8] == pytest.approx(18 * 640 / 8320 / 6, abs=1e-3)
    assert ssm[10] == f"<= 0.1x; bytes <= {(13 + 5) / 78:.3f}x"
    assert _row(r, SSM.label, "s3kv, empty tiers")[8].startswith(f"raw {18 * 640 / 8320 / 6:.3f};")
    assert {b.label for b in r.bars} >= {"ssm 8320 cpu", "ssm 8320 nvme", "ssm 8320 s3", "ssm 8320 vLLM hit"}


def test_a_hit_that_loads_every_layer_misses_the_bytes_goal(got):
    got["sliding"] = _family(192, 48 * MIB, True)
    r = _report(got)
    assert r.verdict.startswith("missed:")
    assert "CPU hit loads 1.000x the Llama's bytes (goal 0.297x)" in r.verdict
    assert "NVMe hit loads 1.000x" in r.verdict


def test_an_ssm_hit_without_its_states_is_invalid(got):
    got["ssm"] = _ssm(parts=13)  # the full layer's chunks only: the states were not loaded
    r = _report(got)
    assert f"invalid: {SSM.label} 8320 CPU hit loaded 13 parts, not 18" in r.verdict
    assert f"invalid: {SSM.label} 8320 S3 hit loaded 13 parts, not 18" in r.verdict


def test_an_ssm_hit_of_every_chunks_state_misses_the_bytes_goal(got):
    got["ssm"] = _ssm(parts=13 * 6)  # a state part of every chunk, as a full layer's
    r = _report(got)
    assert f"invalid: {SSM.label} 8320 NVMe hit loaded 78 parts, not 18" in r.verdict
    assert f"{SSM.label} 8320 CPU hit loads 1.000x the Llama's bytes (goal 0.231x)" in r.verdict


def test_a_hit_short_of_its_chunks_is_invalid(got):
    s3 = got["ssm"]["hits"]["s3"][H]
    s3[0] = copy.deepcopy(s3[0])
    s3[0]["cached"] = 7680  # vLLM took 12 chunks: no state after 13
    r = _report(got)
    assert f"invalid: {SSM.label} 8320 S3 hit had 7680 tokens cached, not 8320" in r.verdict


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
