import pytest

from s3kv.config import KNOWN_KEYS, S3KVConfig, field_docs, parse_config
from s3kv.errors import ConfigError
from s3kv.units import parse_duration, parse_size


def test_defaults_and_sizes():
    c = parse_config({"bucket": "my-bucket", "max_inflight_bytes": "2GiB", "range_bytes": "512 KiB"})
    assert c.bucket == "my-bucket" and c.prefix == "s3kv" and c.chunk_tokens == 256
    assert c.codec == "zstd" and c.max_inflight_bytes == 2 << 30 and c.range_bytes == 512 << 10


def test_every_key_is_documented():
    docs = field_docs()
    assert set(docs) == set(KNOWN_KEYS)
    assert all(docs[k] for k in KNOWN_KEYS)


@pytest.mark.parametrize(
    ("raw", "names"),
    [
        ({}, "bucket"),
        ({"bucket": "b1x", "chunk_token": 64}, "'chunk_token' (did you mean 'chunk_tokens'?)"),
        ({"bucket": "Bad_Bucket"}, "bucket"),
        ({"bucket": "ok-bucket", "codec": "lz4"}, "codec"),
        ({"bucket": "ok-bucket", "zstd_level": 40}, "zstd_level"),
        ({"bucket": "ok-bucket", "chunk_tokens": 0}, "chunk_tokens"),
        ({"bucket": "ok-bucket", "chunk_tokens": "many"}, "chunk_tokens"),
        ({"bucket": "ok-bucket", "max_inflight_bytes": "8 gigs"}, "max_inflight_bytes"),
        ({"bucket": "ok-bucket", "cpu_bytes": -1}, "cpu_bytes"),
        ({"bucket": "ok-bucket", "endpoint_url": "localhost:9000"}, "endpoint_url"),
        ({"bucket": "ok-bucket", "prefix": "a/../b"}, "prefix"),
        ({"bucket": "ok-bucket", "load_timeout_s": 0}, "load_timeout_s"),
        ({"bucket": "ok-bucket", "addressing_style": "sideways"}, "addressing_style"),
        ({"bucket": "ok-bucket", "disk_bytes": 0}, "disk_bytes"),
        ({"bucket": "ok-bucket", "disk_fsync": "sometimes"}, "disk_fsync"),
        ({"bucket": "ok-bucket", "write_policy": "write_back"}, "write_policy"),
        ({"bucket": "ok-bucket", "promote": "yes"}, "promote"),
        ({"write_policy": "local_only"}, "needs a local tier"),
    ],
)
def test_bad_input_names_the_key(raw, names):
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert names in str(info.value)


def test_tier_keys():
    c = parse_config(
        {"bucket": "ok-bucket", "cpu_bytes": "8GiB", "disk_path": "/nvme/kv", "disk_bytes": "1TiB"}
    )
    assert c.cpu_bytes == 8 << 30 and c.disk_path == "/nvme/kv" and c.disk_bytes == 1 << 40
    assert c.write_policy == "write_through" and c.promote and c.save_generated and c.uses_s3
    assert c.disk_fsync == "never"
    local = parse_config({"write_policy": "local_only", "disk_path": "/nvme/kv", "save_generated": "false"})
    assert local.bucket is None and not local.uses_s3 and not local.save_generated
    assert parse_config({"bucket": "ok-bucket"}).cpu_bytes == 0  # off unless asked for


def test_prefix_normalised_and_vllm_keys_ignored():
    c = parse_config({"bucket": "ok-bucket", "prefix": "/fleet/a/", "vllm.something": 1})
    assert c.prefix == "fleet/a"


def test_chunk_tokens_must_be_whole_blocks():
    S3KVConfig(chunk_tokens=256).validate_block_size(128)
    with pytest.raises(ConfigError, match="multiple of vLLM's block_size 128"):
        S3KVConfig(chunk_tokens=200).validate_block_size(128)


def test_units():
    assert parse_size("8GiB") == 8 << 30
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size(4096) == 4096
    assert parse_duration("250ms") == 0.25 and parse_duration("7d") == 7 * 86400 and parse_duration(3) == 3
    for bad in ("8 gigs", "-1", True, [1]):
        with pytest.raises(ConfigError):
            parse_size(bad)
    with pytest.raises(ConfigError):
        parse_duration("soon")
