import dataclasses
import json

import pytest

from s3kv.config import KNOWN_KEYS, S3KVConfig, field_docs, parse_config
from s3kv.errors import ConfigError
from s3kv.units import parse_duration, parse_size


def test_defaults_and_sizes():
    c = parse_config({"bucket": "my-bucket", "max_inflight_bytes": "2GiB", "range_bytes": "512 KiB"})
    assert c.bucket == "my-bucket" and c.prefix == "s3kv" and c.chunk_tokens == 256
    assert (
        c.codec == "blosc2"
        and c.s3_client == "obstore"
        and c.disk_codec == "none"
        and c.max_inflight_bytes == 2 << 30
        and c.range_bytes == 512 << 10
    )


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


DURATION_KEYS = (
    "load_timeout_s",
    "s3_connect_timeout_s",
    "s3_read_timeout_s",
    "disk_timeout_s",
    "shutdown_flush_s",
    "manifest_publish_s",
    "manifest_refresh_s",
    "manifest_clock_skew_s",
)
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("key", DURATION_KEYS)
@pytest.mark.parametrize("bad", [NAN, INF, -INF, 0, -1, -0.5, "2d", 86400.5, 10**12, "1w"])
def test_bad_durations_fail_naming_the_key_and_range(key, bad):
    with pytest.raises(ConfigError) as info:
        parse_config({"bucket": "ok-bucket", key: bad})
    msg = str(info.value)
    assert msg.startswith(f"{key}: must be ") and "at most 1 day" in msg


@pytest.mark.parametrize(
    "text",
    [
        '{"bucket": "ok-bucket", "load_timeout_s": NaN}',
        '{"bucket": "ok-bucket", "manifest_refresh_s": Infinity}',
    ],
)
def test_json_nan_and_infinity_are_refused(text):
    with pytest.raises(ConfigError, match=r"^(load_timeout_s|manifest_refresh_s): must be (more|at least) "):
        parse_config(json.loads(text))  # Python's json reads these literals as floats


@pytest.mark.parametrize(
    ("key", "bad", "allowed"),
    [
        ("manifest_clock_skew_s", 0, "at least 1 s"),  # a zero margin: replicas PUT segments nonstop
        ("manifest_clock_skew_s", 0.5, "at least 1 s"),
        ("manifest_publish_s", 0.001, "at least 50 ms"),
        ("manifest_refresh_s", "10ms", "at least 50 ms"),
        ("range_bytes", "4KiB", "at least 64 KiB and at most 1 GiB"),
        ("range_bytes", "2GiB", "at least 64 KiB and at most 1 GiB"),
        ("range_bytes", 0, "at least 64 KiB"),
        ("max_inflight_bytes", 0, "more than 0 and at most 1 TiB"),
        ("max_inflight_bytes", "2TiB", "at most 1 TiB"),
        ("cpu_bytes", "65TiB", "at most 64 TiB (or 0 to turn it off)"),
        ("cpu_bytes", -1, "cpu_bytes"),
        ("disk_bytes", 0, "more than 0 and at most 1 PiB"),
        ("disk_bytes", "2PiB", "at most 1 PiB"),
        ("manifest_max_bytes", "512KiB", "at least 1 MiB and at most 64 GiB"),
        ("manifest_max_bytes", "65GiB", "at least 1 MiB and at most 64 GiB"),
        ("manifest_max_bytes", 0, "at least 1 MiB"),
    ],
)
def test_out_of_range_values_name_the_key_and_range(key, bad, allowed):
    with pytest.raises(ConfigError) as info:
        parse_config({"bucket": "ok-bucket", key: bad})
    assert str(info.value).startswith(f"{key}: ") and allowed in str(info.value)


SIZE_KEYS = ("max_inflight_bytes", "range_bytes", "cpu_bytes", "disk_bytes", "manifest_max_bytes")


@pytest.mark.parametrize("key", SIZE_KEYS)
@pytest.mark.parametrize("bad", [NAN, INF, -INF, -1, 1.5, 10**30, "10**30", "9" * 40 + "PiB", "1e9"])
def test_bad_sizes_fail_naming_the_key(key, bad):
    with pytest.raises(ConfigError) as info:
        parse_config({"bucket": "ok-bucket", key: bad})
    assert str(info.value).startswith(f"{key}: ")


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("load_timeout_s", "1d", 86400.0),  # the bounds themselves are allowed
        ("load_timeout_s", 0.3, 0.3),
        ("s3_connect_timeout_s", 1, 1.0),
        ("s3_read_timeout_s", "24h", 86400.0),
        ("manifest_publish_s", "50ms", 0.05),
        ("manifest_refresh_s", 3600, 3600.0),
        ("manifest_clock_skew_s", 1, 1.0),
        ("manifest_clock_skew_s", "1d", 86400.0),
        ("range_bytes", "64KiB", 64 << 10),
        ("range_bytes", "1GiB", 1 << 30),
        ("max_inflight_bytes", "1TiB", 1 << 40),
        ("cpu_bytes", 0, 0),
        ("cpu_bytes", "64TiB", 64 << 40),
        ("disk_bytes", "1PiB", 1 << 50),
        ("disk_bytes", 1.0, 1),
        ("manifest_max_bytes", "1MiB", 1 << 20),
        ("manifest_max_bytes", "64GiB", 64 << 30),
    ],
)
def test_values_at_the_bounds_are_accepted(key, value, expected):
    assert getattr(parse_config({"bucket": "ok-bucket", key: value}), key) == expected


def test_every_default_parses_back_to_itself():
    defaults = S3KVConfig()
    for key in KNOWN_KEYS:
        value = getattr(defaults, key)
        if value is None or key == "bucket":
            continue
        raw = {"bucket": "ok-bucket", key: value}
        assert getattr(parse_config(raw), key) == value, key


def test_configs_the_tests_and_benchmarks_use_still_parse():
    """The extra configs under tests/ and benchmarks/ (e2e harness, fleet, gc,
    tiers, outage, scheduler start-up, ttft, store_path, codec)."""
    base = {"bucket": "ok-bucket", "endpoint_url": "http://127.0.0.1:9000", "region": "us-east-1"}
    for extra in (
        {"chunk_tokens": 16, "cpu_bytes": "32MiB"},
        {"cpu_bytes": "8MiB", "disk_path": "/tmp/d", "s3_connect_timeout_s": 1},
        {"cpu_bytes": "400KiB", "disk_bytes": 3 * 200_000},
        {"cpu_bytes": "8MiB", "disk_bytes": "1GiB"},
        {"load_timeout_s": 20, "s3_connect_timeout_s": 1, "s3_max_attempts": 2},
        {"manifest_refresh_s": 3600},
        {"manifest_refresh_s": 1.0, "manifest_publish_s": 1.0},
        {"cpu_bytes": "1GiB", "disk_path": "/tmp/d", "save_generated": True},
        {"write_policy": "local_only", "disk_path": "/tmp/d", "codec": "none"},
        {"max_inflight_bytes": "2GiB", "range_bytes": "512 KiB"},
    ):
        parse_config({**base, **extra})


def test_units_refuse_nan_infinities_and_absurd_sizes():
    for bad in (NAN, INF, -INF, "9" * 400, "1" * 100 + "s"):
        with pytest.raises(ConfigError, match="^wait: "):
            parse_duration(bad, name="wait")
    for bad in (NAN, INF, -INF, 2**63, "8 EiB", "9" * 30 + "PiB", -1.0):
        with pytest.raises(ConfigError, match="^max: "):
            parse_size(bad, name="max")
    assert parse_size("1PiB") == 1 << 50 and parse_size("2PB") == 2 * 10**15
    assert parse_size(2**63 - 1) == 2**63 - 1 and parse_size("0.5KiB") == 512
    assert parse_duration(1e9) == 1e9  # large but finite: bounds are the caller's (a config key's)


INT_KEYS = ("chunk_tokens", "zstd_level", "max_connections", "s3_max_attempts")


@pytest.mark.parametrize("key", DURATION_KEYS + SIZE_KEYS + INT_KEYS)
@pytest.mark.parametrize(
    "huge",
    [10**400, -(10**400), 10**5000, json.loads("1e400"), -json.loads("1e400")],
    ids=["1e400-int", "minus-1e400-int", "1e5000-int", "json-1e400", "json-minus-1e400"],
)
def test_numbers_too_large_for_a_float_fail_naming_the_key(key, huge):
    """10**400 overflows a float (OverflowError) and 1e400 is read as inf;
    either is a config error naming the key, its value shown short (Python
    cannot even print an int of over 4300 digits)."""
    with pytest.raises(ConfigError) as info:
        parse_config({"bucket": "ok-bucket", key: huge})
    msg = str(info.value)
    assert msg.startswith(f"{key}: ") and len(msg) < 300, msg
    if isinstance(huge, int):
        assert f"{huge.bit_length()}-bit number" in msg


@pytest.mark.parametrize("bad", ["9" * 5000, "²", "-" + "9" * 4400])
def test_integer_strings_int_cannot_read_fail_naming_the_key(bad):
    with pytest.raises(ConfigError, match=r"^chunk_tokens: expected an integer, got ") as info:
        parse_config({"bucket": "ok-bucket", "chunk_tokens": bad})
    assert len(str(info.value)) < 300


@pytest.mark.parametrize("key", DURATION_KEYS + SIZE_KEYS + INT_KEYS)
@pytest.mark.parametrize(
    "digits", ["５", "٥", "৫", "𝟓"], ids=["fullwidth", "arabic-indic", "bengali", "math-bold"]
)
def test_digits_other_than_ascii_fail_naming_the_key(key, digits):
    """Python's int(), float() and the regex \\d read other scripts' digits
    ("５MiB" was 5 MiB, "６４" connections 64): a config holds ASCII digits."""
    unit = "MiB" if key in SIZE_KEYS else "s" if key in DURATION_KEYS else ""
    with pytest.raises(ConfigError) as info:
        parse_config({"bucket": "ok-bucket", key: digits + unit})
    assert str(info.value).startswith(f"{key}: "), info.value
    assert getattr(parse_config({"bucket": "ok-bucket", key: "5" + unit}), key) in (5, 5.0, 5 << 20)


def test_units_name_ascii_when_a_value_has_other_digits():
    for parse, text in ((parse_size, "５GiB"), (parse_duration, "９０s")):
        with pytest.raises(ConfigError, match=r"^v: cannot read .* in ASCII digits and letters"):
            parse(text, name="v")


def test_disk_path_expands_the_home_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    config = parse_config({"write_policy": "local_only", "disk_path": "~/kv"})
    assert config.disk_path == str(tmp_path / "kv")
    assert parse_config({"write_policy": "local_only", "disk_path": "/nvme/kv"}).disk_path == "/nvme/kv"


def test_units_refuse_ints_beyond_any_float():
    with pytest.raises(
        ConfigError, match="^wait: a duration must be a finite number of seconds, got a 1329-bit"
    ):
        parse_duration(10**400, name="wait")
    with pytest.raises(ConfigError, match="^max: a 1329-bit number is more bytes than any store holds"):
        parse_size(10**400, name="max")
    with pytest.raises(ConfigError, match="^max: a size cannot be negative, got a negative 16610-bit number"):
        parse_size(-(10**5000), name="max")


def _not_defaults() -> S3KVConfig:
    """A config where every key the settings objects carry differs from its default."""
    return parse_config(
        {
            "bucket": "ok-bucket",
            "prefix": "other",
            "region": "eu-west-1",
            "endpoint_url": "http://127.0.0.1:9000",
            "addressing_style": "virtual",
            "codec": "none",
            "zstd_level": 3,
            "max_inflight_bytes": "2GiB",
            "load_timeout_s": 12,
            "range_bytes": "1MiB",
            "max_connections": 9,
            "s3_max_attempts": 7,
            "s3_connect_timeout_s": 2,
            "s3_read_timeout_s": 11,
            "disk_path": "/tmp/d",
            "disk_fsync": "always",
            "disk_timeout_s": 3,
            "promote": False,
            "save_generated": False,
            "chunk_tokens": 64,
            "manifest_publish_s": 2,
            "manifest_refresh_s": 3,
            "manifest_clock_skew_s": 30,
            "manifest_max_bytes": "2MiB",
            "manifest_protocol": "segments",
        }
    )


def test_settings_objects_are_cut_from_the_config():
    from s3kv.keys import Namespace
    from s3kv.manifest import Manifest
    from s3kv.manifest.sync import SyncSettings
    from s3kv.stores.s3 import S3Options
    from s3kv.tiering.placement import Tier, TierIndex
    from s3kv.tiering.scheduler.planner import Planner
    from s3kv.tiering.tiers.nvme.manager import NvmeTierManager
    from s3kv.tiering.tiers.nvme.settings import NvmeSettings
    from s3kv.tiering.tiers.s3.manager import S3TierManager
    from s3kv.tiering.tiers.s3.settings import S3Settings
    from s3kv.tiering.tiers.settings import EngineSettings

    c = _not_defaults()
    assert S3Options.from_config(c) == S3Options(
        region="eu-west-1",
        endpoint_url="http://127.0.0.1:9000",
        addressing_style="virtual",
        max_attempts=7,
        connect_timeout_s=2,
        read_timeout_s=11,
        max_connections=9,
    )
    assert EngineSettings.from_config(c, rank=1, num_layers=4) == EngineSettings(
        namespace=None,
        prefix="other",
        rank=1,
        num_layers=4,
        codec="none",
        zstd_level=3,
        max_inflight_bytes=2 << 30,
        load_timeout_s=12,
        wings={
            Tier.DISK: NvmeSettings(path="/tmp/d", fsync=True, timeout_s=3),
            Tier.S3: S3Settings(range_bytes=1 << 20),
        },
    )
    assert SyncSettings.from_config(c) == SyncSettings(
        publish_s=2, refresh_s=3, skew_s=30, max_object_bytes=2 << 20, protocol="segments"
    )
    assert SyncSettings.from_config(S3KVConfig()).protocol == "epochs"
    ns = Namespace.from_fields({"model": "m"})
    p = Planner.from_config(c, namespace=ns, block_size=16)
    assert (p.chunk_tokens, p.promote, p.save_generated) == (64, False, False)
    nvme = NvmeTierManager.from_config(TierIndex("disk", 1 << 20), c, shards=1, object_bytes=1)
    s3 = S3TierManager.from_config(Manifest(), c)
    for m in (nvme, s3):  # a probe never reported fails once its load would have timed out
        assert m.breaker._probe_timeout_s == c.load_timeout_s + 10


def test_settings_built_by_hand_default_to_the_config_defaults():
    """Each default lives in S3KVConfig: a settings object built without a
    value has the one a default config would give it."""
    from s3kv.manifest.sync import SyncSettings
    from s3kv.stores.s3 import S3Options
    from s3kv.tiering.placement import Tier
    from s3kv.tiering.tiers.nvme.settings import NvmeSettings
    from s3kv.tiering.tiers.s3.settings import S3Settings
    from s3kv.tiering.tiers.settings import EngineSettings

    defaults = S3KVConfig()
    assert S3Options() == S3Options.from_config(defaults)
    # but the manifest protocol: a config reads epochs, a SyncSettings built
    # by hand (tests, tools) reads segments, as s3kv did before epochs.
    assert SyncSettings(protocol="epochs") == SyncSettings.from_config(defaults)
    assert EngineSettings(
        None, defaults.prefix, 0, 4, wings={Tier.S3: S3Settings()}
    ) == EngineSettings.from_config(defaults, rank=0, num_layers=4)
    assert S3Settings() == S3Settings.from_config(defaults)
    with_disk = dataclasses.replace(defaults, disk_path="/d")
    assert NvmeSettings("/d") == NvmeSettings.from_config(with_disk)
    assert NvmeSettings.from_config(defaults) is None  # no disk_path: no NVMe tier


def test_the_config_repr_never_shows_the_key_file():
    """auth_key_file may hold the secret itself, pasted in place of its path
    (a base64 secret has a "/" about half the time)."""
    pasted = "q8Zx/3vKmPz9Lq0Wr7TyUi2Op5AsDf8GhJk4LzXcVbN="
    config = parse_config({"bucket": "b-x1", "auth_key_file": pasted})
    assert config.auth_key_file == pasted
    for text in (repr(config), str(config), f"{config}", f"{config!r}", str([config])):
        assert pasted not in text and "q8Zx" not in text
        assert "auth_key_file=(not shown)" in text and "bucket='b-x1'" in text
    assert "auth_key_file=None" in repr(parse_config({"bucket": "b-x1"}))
    assert repr(config).startswith("S3KVConfig(") and "chunk_tokens=256" in repr(config)


def test_a_default_chunk_fits_a_hybrid_models_blocks_one_set_by_hand_must_be_whole():
    # A hybrid SSM model's blocks are its state's page: 640 tokens, say.
    assert S3KVConfig().fit_block_size(640, chunk_tokens_set=False).chunk_tokens == 640
    assert S3KVConfig().fit_block_size(128, chunk_tokens_set=False).chunk_tokens == 256
    assert S3KVConfig(chunk_tokens=1280).fit_block_size(640, chunk_tokens_set=True).chunk_tokens == 1280
    with pytest.raises(ConfigError, match="chunk_tokens: 256 is not a multiple of vLLM's block_size 640"):
        S3KVConfig().fit_block_size(640, chunk_tokens_set=True)


def test_codec_auto_is_accepted_for_s3_and_disk():
    c = parse_config({"bucket": "ok-bucket", "codec": "auto", "disk_codec": "AUTO", "disk_path": "/nvme/kv"})
    assert c.codec == "auto" and c.disk_codec == "auto"


@pytest.mark.parametrize("key", ["codec", "disk_codec"])
@pytest.mark.parametrize("value", ["automatic", "lz4", "", 1, True])
def test_a_bad_codec_names_the_key_and_every_choice(key, value):
    with pytest.raises(ConfigError) as info:
        parse_config({"bucket": "ok-bucket", key: value})
    assert str(info.value).startswith(f"{key}: must be one of blosc2, zstd, none, auto; got {value!r}")
