"""The tier hierarchy inside real vLLM engines (CPU build): hits from the
CPU tier, the NVMe tier and S3, each reported under its own source; a
restart on the same disk with S3 unreachable; a chat's next turn hitting
generated tokens; eviction under small capacities; a full file system.

vLLM's own prefix cache is off in these engines, so every hit is s3kv's.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
from pathlib import Path

import pytest

from s3kv.chunk_reader import decode_chunk
from s3kv.keys import parse_object_key
from s3kv.tiering.tiers.nvme import files as disk_tier
from tests.conftest import free_port
from tests.e2e.conftest import PROMPTS
from tests.e2e.harness import CHUNK_TOKENS, chunk_objects, kv_config, metric, run_replica, worker_total

pytestmark = pytest.mark.engine

CT = CHUNK_TOKENS
SHARED = 320  # the family's shared prefix (5 chunks)
_rng = random.Random(11)
CHAT1 = [_rng.randrange(3, 2048) for _ in range(120)]  # 1 chunk; with 12 answer tokens, 2
# 0-4: the replica workload; 5: prompt 0 again; 6, 7: a chat's two turns.
TIER_PROMPTS = [
    *PROMPTS,
    PROMPTS[0],
    CHAT1,
    {"after": 6, "append": [_rng.randrange(3, 2048) for _ in range(40)]},
]
NO_PREFIX_CACHE = {"enable_prefix_caching": False}
CHUNK_FILE_BYTES = 200 << 10  # a chunk of the test model on disk (codec none) is ~193 KiB


def source(result, name: str) -> float:
    return result["metrics"].get(f"vllm:prompt_tokens_cached_by_source{{source={name}}}", 0)


def chunk_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.r[0-9]*") if not p.name.endswith(".partial")]


@pytest.fixture(scope="module")
def baseline_tiers(workdir, model):
    """No connector, vLLM's prefix cache on (it reuses turn 1's decoded KV
    for turn 2, as the tiers do)."""
    return run_replica(workdir, "baseline-tiers", model, TIER_PROMPTS, None)


@pytest.fixture(scope="module")
def tier_bucket(s3_server):
    return s3_server.new_bucket()


@pytest.fixture(scope="module")
def disk1(tmp_path_factory):
    return tmp_path_factory.mktemp("disk1")


@pytest.fixture(scope="module")
def tier_a(workdir, model, s3_server, tier_bucket, disk1):
    config = kv_config(s3_server.endpoint_url, tier_bucket, cpu_bytes="8MiB", disk_path=str(disk1))
    return run_replica(workdir, "tier-A", model, TIER_PROMPTS, config, engine_args=NO_PREFIX_CACHE)


def test_cpu_tier_serves_repeats_within_an_engine(tier_a, baseline_tiers, s3_server, tier_bucket, disk1):
    assert tier_a["outputs"] == baseline_tiers["outputs"]
    cached = tier_a["num_cached_tokens"]
    assert cached[1] >= SHARED and cached[5] >= SHARED  # the family's prefix, from host memory
    assert metric(tier_a, "hit_tokens") == metric(tier_a, "hit_tokens_cpu") > 0
    assert source(tier_a, "host") == metric(tier_a, "hit_tokens_cpu")
    assert source(tier_a, "disk") == source(tier_a, "external_unspecified") == 0
    # Every new chunk was written through to the NVMe tier and to S3.
    stored = worker_total(tier_a, "store_chunks_cpu")
    assert stored >= 12
    assert worker_total(tier_a, "store_chunks_disk") == worker_total(tier_a, "store_chunks_s3") == stored
    assert len(chunk_files(disk1)) == stored == len(chunk_objects(s3_server.client(), tier_bucket))


def test_next_chat_turn_hits_chunks_with_generated_tokens(tier_a, baseline_tiers):
    assert tier_a["outputs"][7] == baseline_tiers["outputs"][7]
    # Turn 1's prompt fills one chunk; its answer completes the second. Turn 2
    # loads both: the hit reaches past turn 1's prompt, into its answer.
    assert tier_a["num_cached_tokens"][7] >= 2 * CT > len(CHAT1)


def test_restart_on_same_disk_hits_nvme_with_s3_unreachable(tier_a, baseline_tiers, workdir, model, disk1):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    config = kv_config(
        dead,
        "unreachable-bucket",
        cpu_bytes="8MiB",
        disk_path=str(disk1),
        s3_connect_timeout_s=1,
        s3_max_attempts=1,
    )
    r = run_replica(workdir, "tier-disk", model, TIER_PROMPTS, config, engine_args=NO_PREFIX_CACHE)
    assert r["outputs"] == baseline_tiers["outputs"]
    assert r["num_cached_tokens"][0] >= SHARED  # a cold engine, warm from its own disk
    assert source(r, "disk") == metric(r, "hit_tokens_disk") >= SHARED
    assert worker_total(r, "load_chunks_disk") >= SHARED // CT
    # Loaded chunks were promoted: later prompts of the family hit host memory.
    assert worker_total(r, "promote_chunks_cpu") >= SHARED // CT
    assert source(r, "host") >= SHARED
    assert source(r, "external_unspecified") == 0 and worker_total(r, "load_chunks_s3") == 0
    assert "S3 is unreachable at start-up" in Path(r["log"]).read_text()


def _faults(**env: str) -> dict[str, str]:
    return {
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parent / "faults"), os.environ.get("PYTHONPATH", "")]
        ),
        **env,
    }


@pytest.mark.parametrize("where", ["read", "frame"])
def test_a_slow_disk_pauses_only_the_disk(
    tier_a, baseline_tiers, workdir, model, s3_server, tier_bucket, disk1, where
):
    # The NVMe tier holds every chunk, but each read takes 3 s, past the
    # disk's 0.5 s bound: loads fall back to S3, the disk's breaker opens,
    # and S3 keeps serving (its breaker never trips). The 3 s come before
    # the read, or inside it, in each frame's read (the load's way into
    # the pages entered).
    config = kv_config(
        s3_server.endpoint_url, tier_bucket, cpu_bytes="8MiB", disk_path=str(disk1), disk_timeout_s=0.5
    )
    env = _faults(S3KV_FAULT_DISK_READ_DELAY_S="3", S3KV_FAULT_DISK_READ_DELAY_AT=where)
    r = run_replica(
        workdir, f"tier-slow-disk-{where}", model, TIER_PROMPTS, config, engine_args=NO_PREFIX_CACHE, env=env
    )
    assert r["outputs"] == baseline_tiers["outputs"]
    assert metric(r, "breaker_trips_disk") >= 1 and metric(r, "breaker_trips_s3") == 0
    # Every chunk came from S3 instead: the family's prefix (then promoted
    # to host memory) and the whole-chunk prompt's three, at least.
    assert worker_total(r, "load_chunks_s3") >= SHARED // CT + 3
    assert worker_total(r, "load_chunks_disk") == 0 and worker_total(r, "load_errors_timeout") >= 1
    assert metric(r, "breaker_open_disk") == 1  # the disk is still slow: still open (or probing)


def test_fresh_disk_hits_s3_and_promotes(
    tier_a, baseline_tiers, workdir, model, s3_server, tier_bucket, tmp_path
):
    config = kv_config(s3_server.endpoint_url, tier_bucket, cpu_bytes="8MiB", disk_path=str(tmp_path))
    r = run_replica(workdir, "tier-s3", model, TIER_PROMPTS, config, engine_args=NO_PREFIX_CACHE)
    assert r["outputs"] == baseline_tiers["outputs"]
    assert r["num_cached_tokens"][0] >= SHARED
    assert source(r, "external_unspecified") == metric(r, "hit_tokens_s3") >= SHARED
    assert source(r, "disk") == 0  # the disk started empty
    assert source(r, "host") >= SHARED  # promoted on the way up
    assert worker_total(r, "store_chunks_s3") == 0  # S3 had everything already
    # Promoted to the NVMe tier: the very pages of the S3 objects, in the
    # disk's codec (none by default; S3's is blosc2).
    objects = chunk_objects(s3_server.client(), tier_bucket)
    files = chunk_files(tmp_path)
    assert len(files) >= SHARED // CT
    for f in files:
        ns, key, rank = parse_object_key(str(f.relative_to(tmp_path)))
        file_header, file_pages = decode_chunk(f.read_bytes(), namespace=ns, key=key.hex(), rank=rank)
        s3_header, s3_pages = decode_chunk(
            objects[f"s3kv/{f.relative_to(tmp_path)}"], namespace=ns, key=key.hex(), rank=rank
        )
        assert (file_header.codec, s3_header.codec) == ("none", "blosc2")
        assert [a.tobytes() for a in file_pages] == [a.tobytes() for a in s3_pages]


def test_small_tiers_evict_and_stay_correct(baseline_tiers, workdir, model, tmp_path):
    disk_bytes = 3 * CHUNK_FILE_BYTES
    config = kv_config(
        "http://unused.invalid",
        "unused-bucket",
        write_policy="local_only",  # S3 untouched
        cpu_bytes="400KiB",  # two chunk slots
        disk_bytes=disk_bytes,
        disk_path=str(tmp_path),
    )
    r = run_replica(workdir, "tier-small", model, TIER_PROMPTS, config, engine_args=NO_PREFIX_CACHE)
    assert r["outputs"] == baseline_tiers["outputs"]
    assert metric(r, "evict_chunks_cpu") > 0 and metric(r, "evict_chunks_disk") > 0
    assert metric(r, "hit_tokens") > 0  # what is still held is used
    assert disk_tier.directory_bytes(tmp_path) <= disk_bytes
    assert len(chunk_files(tmp_path)) > 0
    assert worker_total(r, "store_chunks_s3") == 0 and worker_total(r, "store_errors_s3") == 0


@contextlib.contextmanager
def tiny_filesystem(path: Path, size: str):
    """A tmpfs of ``size`` at ``path``; None where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", str(path)], check=False)


def test_full_disk_drops_stores_and_serves_correctly(baseline_tiers, workdir, model, tmp_path):
    root = tmp_path / "tiny"
    with tiny_filesystem(root, "1m") as mounted:
        env = {}
        if not mounted:  # no mount permission: writes fail with ENOSPC past 1 MiB instead
            env = _faults(S3KV_FAULT_DISK_BYTES=str(1 << 20))
        config = kv_config(
            "http://unused.invalid",
            "unused-bucket",
            write_policy="local_only",
            cpu_bytes="8MiB",
            disk_bytes="1GiB",  # more than the file system has
            disk_path=str(root),
        )
        r = run_replica(
            workdir, "tier-enospc", model, TIER_PROMPTS, config, engine_args=NO_PREFIX_CACHE, env=env
        )
        assert r["outputs"] == baseline_tiers["outputs"]
        assert worker_total(r, "store_dropped_disk_full") >= 1
        assert worker_total(r, "store_chunks_disk") >= 1  # some fitted before it filled
        assert metric(r, "hit_tokens_cpu") >= SHARED  # and the CPU tier kept serving
        # What did get written is whole and valid; no partial file is left.
        files = chunk_files(root)
        assert files and not list(root.rglob("*.partial"))
        for f in files:
            ns, key, rank = parse_object_key(str(f.relative_to(root)))
            decode_chunk(f.read_bytes(), namespace=ns, key=key.hex(), rank=rank)


def test_a_disk_file_corrupted_after_its_header_gives_the_baselines_tokens(
    tier_a, baseline_tiers, workdir, model, disk1, tmp_path
):
    """disk_codec none (the default): frames are read with preadv into a
    buffer and checked there. Files whose headers are sound and whose frames
    are not fail their loads; vLLM recomputes those blocks, and the answers
    are the baseline's (S3 unreachable: the disk is the only source)."""
    import shutil

    from s3kv import codec

    disk = tmp_path / "disk"
    shutil.copytree(disk1, disk)
    files = chunk_files(disk)
    assert files
    for path in files:
        data = bytearray(path.read_bytes())
        header = codec.parse_header(bytes(data))
        assert header.codec == "none"
        f = header.frames[len(header.frames) // 2]
        data[f.offset + f.length // 2] ^= 0x20  # past every check of the header
        path.write_bytes(bytes(data))
    dead = f"http://127.0.0.1:{free_port()}"
    config = kv_config(
        dead, "unreachable-bucket", disk_path=str(disk), s3_connect_timeout_s=1, s3_max_attempts=1
    )
    # Not the chat's second turn: its chunk of turn 1's generated tokens,
    # recomputed here, is a prefill's KV where the baseline reuses decode's
    # (their float sums differ, and a near-tied greedy token may flip).
    prompts = TIER_PROMPTS[:7]
    r = run_replica(workdir, "tier-disk-corrupt", model, prompts, config, engine_args=NO_PREFIX_CACHE)
    assert r["outputs"] == baseline_tiers["outputs"][:7]
    assert worker_total(r, "load_errors_corrupt") >= 1
