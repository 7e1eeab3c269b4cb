"""s3kv's configuration, parsed once from vLLM's ``kv_connector_extra_config``.

Every key a user may set is a field of :class:`S3KVConfig`; :func:`parse_config`
rejects unknown keys and bad values with a :class:`ConfigError` that names the
key and what it accepts. Credentials are not configuration: they come from the
standard AWS chain (environment, shared profile, instance or pod role).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from s3kv.errors import ConfigError
from s3kv.units import parse_duration, parse_size, value_text

Codec = Literal["blosc2", "zstd", "none"]
CODECS: tuple[str, ...] = ("blosc2", "zstd", "none")
CODEC_CHOICES: tuple[str, ...] = (*CODECS, "auto")
"""What ``codec`` and ``disk_codec`` accept: a codec, or ``auto`` (:mod:`s3kv.tiering.codec_choice`)."""
ADDRESSING_STYLES: tuple[str, ...] = ("auto", "path", "virtual")
S3_CLIENTS: tuple[str, ...] = ("obstore", "aiobotocore")
BUCKET_KINDS: tuple[str, ...] = ("auto", "general", "directory")
MANIFEST_PROTOCOLS: tuple[str, ...] = ("epochs", "segments")
DIRECTORY_SUFFIX = "--x-s3"
"""How every S3 Express One Zone bucket's name ends (``base--azid--x-s3``)."""
WRITE_POLICIES: tuple[str, ...] = ("write_through", "local_only")
DISK_FSYNC: tuple[str, ...] = ("never", "always")
LOAD_POLICIES: tuple[str, ...] = ("cost", "always")
CHUNK_KEYS: tuple[str, ...] = ("auto", "tokens")

_DIGEST_RE = re.compile(r"^[A-Za-z0-9:._\-+/=]{8,256}$")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_PREFIX_SEGMENT_RE = re.compile(r"^[A-Za-z0-9._\-=]+$")


def _key(default: Any, doc: str) -> Any:
    """A config field whose user-facing description travels with it."""
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class S3KVConfig:
    """What s3kv needs to know, with units in the names.

    Each field's ``metadata["doc"]`` is its user-facing description.
    """

    bucket: str | None = _key(None, "S3 bucket that holds the shared cache. Required.")
    prefix: str = _key("s3kv", "Key prefix inside the bucket; several fleets can share a bucket.")
    region: str | None = _key(None, "AWS region of the bucket; default from the AWS chain.")
    endpoint_url: str | None = _key(None, "S3-compatible endpoint (MinIO, R2, a loopback test server).")
    addressing_style: str = _key(
        "auto", '"path" or "virtual" host addressing; "auto" picks path with endpoint_url.'
    )
    bucket_kind: str = _key(
        "auto",
        '"general" (S3 general purpose), "directory" (S3 Express One Zone: listings in no order and'
        ' without StartAfter, so manifest segments go under minute prefixes) or "auto": directory'
        ' when the bucket\'s name ends with "--x-s3".',
    )
    chunk_tokens: int = _key(
        256,
        "Tokens per stored chunk; a multiple of vLLM's block size (by default, the fewest whole blocks "
        "that hold 256 tokens).",
    )
    codec: str = _key(
        "blosc2",
        'Chunk compression: "blosc2" (SIMD byte shuffle + zstd, decoded in one pass), "zstd" (numpy'
        ' byte shuffle + zstd: what older s3kv builds read), "none", or "auto": each worker stores '
        "uncompressed until its measurements (the link's throughput and CPU per byte, this machine's decode "
        "rate, the chunks' ratio) say blosc2 loads clearly faster, and back (see its INFO log line and the "
        "codec_* gauges).",
    )
    zstd_level: int = _key(1, "zstd level, -7 (fastest) to 22 (smallest); blosc2 clamps it to 1..9.")
    max_inflight_bytes: int = _key(
        1 << 30, "Bytes of KV waiting to be uploaded; beyond it new stores are dropped."
    )
    load_timeout_s: float = _key(30.0, "A chunk load slower than this fails and its tokens are recomputed.")
    range_bytes: int = _key(8 << 20, "Target size of one ranged GET; layers are grouped up to this size.")
    max_connections: int = _key(
        64, "HTTP connections per process to the store: requests beyond it wait for one to finish."
    )
    s3_client: str = _key(
        "obstore",
        'Client of chunk GETs and PUTs: "obstore" (native, off the GIL) or "aiobotocore";'
        " listings, deletes and multipart uploads always use aiobotocore.",
    )
    s3_max_attempts: int = _key(3, "Attempts per S3 request (retried with backoff on 5xx and throttling).")
    s3_connect_timeout_s: float = _key(5.0, "TCP connect timeout for S3.")
    s3_read_timeout_s: float = _key(
        30.0, "Socket read timeout for S3 (obstore: the bound on one attempt of a request as a whole)."
    )
    cpu_bytes: int = _key(0, "Size of the (pinned) host-memory tier per worker; 0 turns it off.")
    disk_path: str | None = _key(
        None, "Directory of the local NVMe tier (one per machine; ~ is expanded); unset turns it off."
    )
    disk_codec: str = _key(
        "none",
        'Codec of the NVMe tier\'s files: "none" (read with preadv into a reused buffer, checked there)'
        ', "blosc2", "zstd" or "auto" (as codec\'s, measured on the disk); independent of codec (S3\'s).',
    )
    disk_bytes: int | None = _key(
        None, "Size cap of the NVMe tier; default 80% of the free space of disk_path at start-up."
    )
    disk_fsync: str = _key(
        "never",
        '"always" fsyncs each chunk file before publishing it; "never" relies on checksums '
        "(a file torn by a power loss fails its checksum and is recomputed).",
    )
    disk_timeout_s: float = _key(
        5.0,
        "A chunk read or write on the NVMe tier slower than this is a disk failure: a read is "
        "fetched from S3 instead, and the disk's breaker pauses the tier.",
    )
    shutdown_flush_s: float = _key(
        5.0,
        "At shutdown, how long a replica may take to finish its uploads and publish them "
        "(what is still running then is abandoned; no incomplete object is left).",
    )
    write_policy: str = _key(
        "write_through",
        '"write_through" stores new chunks in every tier (CPU, NVMe, S3); "local_only" '
        "keeps S3 untouched (no bucket needed).",
    )
    promote: bool = _key(True, "Copy chunks loaded from NVMe or S3 into the tiers above them.")
    load_policy: str = _key(
        "cost",
        '"cost" offers vLLM only the prefix of a hit that loads sooner than it computes (live '
        "estimates of each tier's latency and bandwidth against the engine's prefill rate; until "
        'measured, hits load); "always" offers every hit.',
    )
    prefetch_bytes: int = _key(
        1 << 30,
        "Chunk shards (raw KV bytes per worker) in flight at once from S3 into the CPU and NVMe tiers "
        "for requests that wait in vLLM's queue (the others queue for it in arrival order); 0 turns "
        "prefetching off; less than one chunk shard is refused at start-up.",
    )
    save_generated: bool = _key(
        True, "Also store full chunks that contain generated tokens (the next chat turn hits them)."
    )
    manifest_publish_s: float = _key(
        5.0, "How often a replica publishes the chunks it stored (a small manifest segment in S3)."
    )
    manifest_refresh_s: float = _key(5.0, "How often a replica looks for other replicas' manifest segments.")
    manifest_clock_skew_s: float = _key(
        60.0, "Replicas whose clocks disagree by less than this never miss each other's segments."
    )
    manifest_max_bytes: int = _key(
        1 << 30, "A manifest segment or snapshot larger than this is refused without being read."
    )
    manifest_protocol: str = _key(
        "epochs",
        "How replicas read each other's segments: \"epochs\" (one replica merges each publish interval's "
        "segments into one epoch object, the others read that: requests per replica do not grow with the "
        'fleet) or "segments" (every replica reads every segment, as s3kv did before; a mixed fleet '
        "shares every chunk).",
    )
    model_digest: str | None = _key(
        None,
        "The weights' digest as a model registry knows it (e.g. sha256:...); skips hashing every "
        "weight file at start-up. It must change whenever the weights do.",
    )
    namespace_salt: str | None = _key(
        None, "Any string: replicas with different salts never share KV (per tenant, per deployment)."
    )
    chunk_keys: str = _key(
        "auto",
        '"auto" keys chunks by vLLM\'s block hashes where every replica computes the same ones '
        "(a cryptographic prefix_caching_hash_algo, chunk_tokens a multiple of the hash block "
        'size), else by their tokens; "tokens" always by their tokens (the namespace that '
        "replicas keying by tokens, and earlier s3kv versions, share).",
    )
    share_across_tp: bool = _key(
        False,
        "Replicas of every TP size share one cache: each part is stored as one object per KV head "
        "slice (up to 8), which ranks of any TP size write and read. Their KV differs from a "
        "replica's own in the low bits, so greedy tokens may too.",
    )
    auth_key_file: str | None = _key(
        None,
        "File holding the fleet secret (or several, comma-separated: the first signs, all verify); "
        "S3KV_AUTH_KEY in the environment takes precedence. Objects without a valid MAC are refused.",
    )

    def __repr__(self) -> str:
        """Every field, but ``auth_key_file``'s value is not shown: it may be
        the fleet secret itself, pasted in place of its file's path."""
        shown = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            shown.append(f"{f.name}={'(not shown)' if f.name == 'auth_key_file' and value else repr(value)}")
        return f"S3KVConfig({', '.join(shown)})"

    @property
    def uses_s3(self) -> bool:
        return self.write_policy != "local_only"

    @property
    def directory_bucket(self) -> bool:
        """Is the bucket an S3 Express One Zone directory bucket (``bucket_kind``)?"""
        if self.bucket_kind == "auto":
            return bool(self.bucket) and self.bucket.endswith(DIRECTORY_SUFFIX)  # type: ignore[union-attr]
        return self.bucket_kind == "directory"

    def fit_block_size(self, block_size: int, *, chunk_tokens_set: bool) -> S3KVConfig:
        """This config for vLLM's ``block_size``: a default ``chunk_tokens``
        that is no whole number of blocks (a hybrid model's blocks are its
        state's page: 640 tokens, say) becomes the fewest whole blocks that
        hold it; one set by hand must be whole blocks already
        (:meth:`validate_block_size`)."""
        if chunk_tokens_set or self.chunk_tokens % block_size == 0:
            self.validate_block_size(block_size)
            return self
        return dataclasses.replace(self, chunk_tokens=-(-self.chunk_tokens // block_size) * block_size)

    def validate_block_size(self, block_size: int) -> None:
        """Fail unless ``chunk_tokens`` is a whole number of vLLM blocks."""
        if self.chunk_tokens % block_size != 0:
            raise ConfigError(
                f"chunk_tokens: {self.chunk_tokens} is not a multiple of vLLM's "
                f"block_size {block_size}; use e.g. "
                f"{max(1, round(self.chunk_tokens / block_size)) * block_size}"
            )


DEFAULTS = S3KVConfig()
"""Every key's default, declared once (in the fields above). The settings
objects cut from a config (``S3Options``, ``EngineSettings``,
``SyncSettings``, the planner's and tier managers' arguments) are built by
their ``from_config``; where one is built by hand (tests, tools), its
defaults are these."""

_FIELDS = {f.name: f for f in dataclasses.fields(S3KVConfig)}
KNOWN_KEYS: tuple[str, ...] = tuple(_FIELDS)


def field_docs() -> dict[str, str]:
    """Key -> one-line description, for ``--help`` texts and the README."""
    return {name: f.metadata["doc"] for name, f in _FIELDS.items()}


def _int(key: str, value: Any, lo: int, hi: int | None = None) -> int:
    n = value if isinstance(value, int) and not isinstance(value, bool) else None
    digits = value.strip().lstrip("-") if isinstance(value, str) else ""
    if digits.isascii() and digits.isdigit():  # int() would read "６４" as 64
        with contextlib.suppress(ValueError):  # int() refuses over 4300 digits
            n = int(value)
    if n is None:
        raise ConfigError(f"{key}: expected an integer, got {value_text(value)}")
    if n < lo or (hi is not None and n > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise ConfigError(f"{key}: must be {rng}, got {value_text(n)}")
    return n


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value.lower() not in choices:
        raise ConfigError(f"{key}: must be one of {', '.join(choices)}; got {value!r}")
    return value.lower()


KiB, MiB, GiB, TiB, PiB = 2**10, 2**20, 2**30, 2**40, 2**50
DAY_S = 86400.0
"""No timeout or interval is longer: beyond it a value is a typo, not a setting."""
MANIFEST_TICK_S = 0.05
"""The manifest loop wakes at most this often; shorter intervals mean nothing."""
MIN_CLOCK_SKEW_S = 1.0
"""A replica publishes a segment again when its PUT took more than half the
skew margin (``ManifestSync._put_segment``); with a margin near zero every PUT
is too slow, and replicas would PUT segments nonstop."""


def _seconds_text(seconds: float) -> str:
    if seconds == DAY_S:
        return "1 day (86400 s)"
    return f"{seconds * 1000:g} ms" if 0 < seconds < 1 else f"{seconds:g} s"


def _bytes_text(n: int) -> str:
    for unit, suffix in ((PiB, "PiB"), (TiB, "TiB"), (GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {suffix}"
    return f"{n} bytes"


def _not_a_count(value: Any) -> bool:
    """A number no duration or size can be: NaN, an infinity (JSON's ``NaN``,
    ``Infinity`` are read as floats) or a negative one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, int):  # math.isfinite would overflow converting 10**400 to a float
        return value < 0
    return not (math.isfinite(value) and value >= 0)


def _duration(key: str, value: Any, lo: float, hi: float = DAY_S) -> float:
    """Seconds in ``[lo, hi]``; ``lo=0`` means more than zero (a zero timeout
    or interval means nothing)."""
    low = "more than 0 s" if lo == 0 else f"at least {_seconds_text(lo)}"
    allowed = f"{key}: must be {low} and at most {_seconds_text(hi)}, got {value_text(value)}"
    if _not_a_count(value):
        raise ConfigError(allowed)
    seconds = parse_duration(value, name=key)
    if (seconds <= 0 if lo == 0 else seconds < lo) or seconds > hi:
        raise ConfigError(allowed)
    return seconds


def _size(key: str, value: Any, lo: int, hi: int, *, zero_turns_off: bool = False) -> int:
    """Bytes in ``[lo, hi]``, or 0 where that turns the feature off."""
    low = "more than 0" if lo == 1 else f"at least {_bytes_text(lo)}"
    off = " (or 0 to turn it off)" if zero_turns_off else ""
    allowed = f"{key}: must be {low} and at most {_bytes_text(hi)}{off}, got {value_text(value)}"
    if _not_a_count(value):
        raise ConfigError(allowed)
    n = parse_size(value, name=key)
    if (n == 0 and zero_turns_off) or lo <= n <= hi:
        return n
    raise ConfigError(allowed)


def _bucket(value: Any) -> str:
    if not isinstance(value, str) or not _BUCKET_RE.match(value) or ".." in value:
        raise ConfigError(
            f"bucket: {value!r} is not a valid S3 bucket name (3-63 characters: "
            "lowercase letters, digits, dots and hyphens)"
        )
    return value


def _prefix(value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"prefix: expected a string, got {value!r}")
    stripped = value.strip("/")
    segments = stripped.split("/") if stripped else []
    for seg in segments:
        if not _PREFIX_SEGMENT_RE.match(seg) or seg in (".", ".."):
            raise ConfigError(
                f"prefix: {value!r} has an invalid segment {seg!r}; use letters, "
                "digits and . _ - = between slashes"
            )
    return "/".join(segments)


def _endpoint(value: Any) -> str:
    if not isinstance(value, str) or not re.match(r"^https?://[^\s/]+", value):
        raise ConfigError(f"endpoint_url: expected an http(s) URL, got {value!r}")
    return value.rstrip("/")


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def _str(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: expected a non-empty string, got {value!r}")
    return value


def _key_file(value: Any) -> str:
    if not isinstance(value, str) or not value:  # not echoed: it may be the secret, pasted by mistake
        raise ConfigError(
            "auth_key_file: expected the path of a file holding the fleet secret (value not shown)"
        )
    return value


def _digest(value: Any) -> str:
    if not isinstance(value, str) or not _DIGEST_RE.match(value):
        raise ConfigError(
            "model_digest: expected 8-256 characters of letters, digits and : . _ - + / = "
            f"(e.g. sha256:<hex>), got {value!r}"
        )
    return value


def _salt(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > 256 or not value.isprintable():
        raise ConfigError("namespace_salt: expected 1-256 printable characters")
    return value


_PARSERS = {
    "bucket": _bucket,
    "prefix": _prefix,
    "region": lambda v: _str("region", v),
    "endpoint_url": _endpoint,
    "addressing_style": lambda v: _choice("addressing_style", v, ADDRESSING_STYLES),
    "bucket_kind": lambda v: _choice("bucket_kind", v, BUCKET_KINDS),
    "chunk_tokens": lambda v: _int("chunk_tokens", v, 1, 1 << 20),
    "codec": lambda v: _choice("codec", v, CODEC_CHOICES),
    "zstd_level": lambda v: _int("zstd_level", v, -7, 22),
    "max_inflight_bytes": lambda v: _size("max_inflight_bytes", v, 1, TiB),
    "load_timeout_s": lambda v: _duration("load_timeout_s", v, 0),
    "range_bytes": lambda v: _size("range_bytes", v, 64 * KiB, GiB),
    "max_connections": lambda v: _int("max_connections", v, 1, 4096),
    "s3_client": lambda v: _choice("s3_client", v, S3_CLIENTS),
    "s3_max_attempts": lambda v: _int("s3_max_attempts", v, 1, 20),
    "s3_connect_timeout_s": lambda v: _duration("s3_connect_timeout_s", v, 0),
    "s3_read_timeout_s": lambda v: _duration("s3_read_timeout_s", v, 0),
    "disk_timeout_s": lambda v: _duration("disk_timeout_s", v, 0),
    "shutdown_flush_s": lambda v: _duration("shutdown_flush_s", v, 0),
    "cpu_bytes": lambda v: _size("cpu_bytes", v, 1, 64 * TiB, zero_turns_off=True),
    "disk_path": lambda v: os.path.expanduser(_str("disk_path", v)),  # "~/kv" as a shell reads it
    "disk_codec": lambda v: _choice("disk_codec", v, CODEC_CHOICES),
    "disk_bytes": lambda v: _size("disk_bytes", v, 1, PiB),
    "disk_fsync": lambda v: _choice("disk_fsync", v, DISK_FSYNC),
    "write_policy": lambda v: _choice("write_policy", v, WRITE_POLICIES),
    "promote": lambda v: _bool("promote", v),
    "save_generated": lambda v: _bool("save_generated", v),
    "load_policy": lambda v: _choice("load_policy", v, LOAD_POLICIES),
    "prefetch_bytes": lambda v: _size("prefetch_bytes", v, 1, TiB, zero_turns_off=True),
    "manifest_publish_s": lambda v: _duration("manifest_publish_s", v, MANIFEST_TICK_S),
    "manifest_refresh_s": lambda v: _duration("manifest_refresh_s", v, MANIFEST_TICK_S),
    "manifest_clock_skew_s": lambda v: _duration("manifest_clock_skew_s", v, MIN_CLOCK_SKEW_S),
    "manifest_max_bytes": lambda v: _size("manifest_max_bytes", v, MiB, 64 * GiB),
    "manifest_protocol": lambda v: _choice("manifest_protocol", v, MANIFEST_PROTOCOLS),
    "model_digest": _digest,
    "namespace_salt": _salt,
    "chunk_keys": lambda v: _choice("chunk_keys", v, CHUNK_KEYS),
    "share_across_tp": lambda v: _bool("share_across_tp", v),
    "auth_key_file": _key_file,
}
assert set(_PARSERS) == set(KNOWN_KEYS), set(_PARSERS) ^ set(KNOWN_KEYS)


def parse_config(raw: dict[str, Any] | None, *, require_bucket: bool = True) -> S3KVConfig:
    """Validate ``kv_connector_extra_config`` into an :class:`S3KVConfig`.

    Raises :class:`ConfigError` naming the first bad key. Keys of vLLM's own
    (those starting with ``vllm.``) are ignored, as vLLM may add some.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"kv_connector_extra_config must be a JSON object, got {raw!r}")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            raise ConfigError(f"config keys must be strings, got {key!r}")
        if key.startswith("vllm."):
            continue
        parser = _PARSERS.get(key)
        if parser is None:
            hint = difflib.get_close_matches(key, KNOWN_KEYS, n=1)
            did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(
                f"unknown s3kv config key {key!r}{did_you_mean}; known keys: " + ", ".join(KNOWN_KEYS)
            )
        if value is None:
            continue
        values[key] = parser(value)
    config = S3KVConfig(**values)
    if not config.uses_s3:
        if not config.cpu_bytes and not config.disk_path:
            raise ConfigError(
                'write_policy: "local_only" keeps S3 untouched, so it needs a local tier: '
                "set cpu_bytes or disk_path"
            )
    elif (
        config.bucket is not None
        and config.bucket_kind == "general"
        and config.bucket.endswith(DIRECTORY_SUFFIX)
    ):
        raise ConfigError(
            f'bucket_kind: "general", but bucket {config.bucket!r} is named like an S3 Express directory '
            f'bucket ("{DIRECTORY_SUFFIX}"), which lists in no order and without StartAfter; '
            'use "auto" or "directory"'
        )
    elif require_bucket and config.bucket is None:
        raise ConfigError(
            "bucket: missing; set kv_connector_extra_config.bucket to the S3 bucket "
            'that holds the shared cache (or write_policy: "local_only" for local tiers only)'
        )
    return config
