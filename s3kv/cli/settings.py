"""Where the CLI finds the bucket: flags, environment, or the connector's JSON.

Each setting is taken from, in order: its flag (``--bucket``), its
environment variable (``S3KV_BUCKET``), the ``--config`` file (or
``S3KV_CONFIG``), then s3kv's default. The config file is the JSON the
connector uses: either ``kv_connector_extra_config`` itself or a whole
``--kv-transfer-config`` holding it. It is validated like the connector
validates it, so a typo in a key fails here too.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import click

from s3kv.auth import FleetKeys, load_keys
from s3kv.config import S3KVConfig, parse_config
from s3kv.errors import ConfigError
from s3kv.units import parse_duration, parse_size

EXIT_OK = 0
EXIT_PROBLEMS = 1
"""verify found problems: corrupt, unsigned, unsupported, oversized, unreadable or foreign objects."""
EXIT_USAGE = 2
"""Bad input: an unknown option, namespace, duration or size; a bad config."""
EXIT_STORAGE = 3
"""No credentials, no such bucket, access denied (to the bucket, not one object), or S3 unreachable."""
EXIT_BUSY = 4
"""Another gc held the lease for longer than --wait."""
EXIT_PARTIAL = 5
"""Some deletes failed; the run can be repeated."""
EXIT_INTERNAL = 70
"""A bug in s3kv (EX_SOFTWARE)."""

EXIT_CODES_HELP = (
    "Exit codes: 0 success; 1 verify found problem objects (corrupt, unreadable, foreign...); 2 bad input; "
    "3 no credentials, no bucket, access denied or S3 unreachable; 4 another gc holds "
    "the lease; 5 some deletes failed (run again); 70 internal error."
)


class Parsed(click.ParamType):
    """A flag value read by one of s3kv's own parsers (``parse_duration``,
    ``parse_size``), so the CLI accepts exactly what the config accepts."""

    def __init__(self, name: str, parse: Callable[..., Any]) -> None:
        self.name, self._parse = name, parse

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        try:  # numbers too (a default, a caller's value): NaN and infinities are refused
            return self._parse(value, name="value")
        except ConfigError as e:
            self.fail(str(e).removeprefix("value: "), param, ctx)


DURATION, SIZE = Parsed("DURATION", parse_duration), Parsed("SIZE", parse_size)


class Settings:
    """What a command was told; the bucket config is resolved on first use
    (``inspect`` of a local file needs none)."""

    def __init__(self, sources: tuple[Any, ...], as_json: bool, concurrency: int, progress: bool) -> None:
        self._sources = sources
        self._config: S3KVConfig | None = None
        self._keys: tuple[FleetKeys | None] | None = None
        self.as_json, self.concurrency, self.progress = as_json, concurrency, progress

    @property
    def config(self) -> S3KVConfig:
        if self._config is None:
            self._config = resolve(*self._sources)
        return self._config

    @property
    def keys(self) -> FleetKeys | None:
        """The fleet secret, as the replicas get it (``S3KV_AUTH_KEY``, else
        ``--auth-key-file`` / the config's ``auth_key_file``); None if unset."""
        if self._keys is None:
            self._keys = (load_keys(self.config.auth_key_file),)
        return self._keys[0]


def load_config_file(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            raw = json.load(f)
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror}") from e
    except ValueError as e:
        raise ConfigError(f"--config {path}: not valid JSON: {e}") from e
    if isinstance(raw, dict) and "kv_connector_extra_config" in raw:
        raw = raw["kv_connector_extra_config"]
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected a JSON object")
    return dict(raw)


def resolve(
    config_path: str | None,
    bucket: str | None,
    prefix: str | None,
    endpoint_url: str | None,
    region: str | None,
    auth_key_file: str | None = None,
) -> S3KVConfig:
    raw = load_config_file(config_path) if config_path else {}
    for key, value in (
        ("bucket", bucket),
        ("prefix", prefix),
        ("endpoint_url", endpoint_url),
        ("region", region),
        ("auth_key_file", auth_key_file),
    ):
        if value is not None:
            raw[key] = value
    raw.pop("write_policy", None)  # the CLI always talks to the bucket
    if not raw.get("bucket"):
        raise ConfigError("no bucket: pass --bucket, set S3KV_BUCKET, or --config a file that names one")
    return parse_config(raw)


def store_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """The options every command that reads the bucket takes."""

    @click.option(
        "--config",
        "config_path",
        envvar="S3KV_CONFIG",
        metavar="FILE",
        help="The connector's JSON (kv_connector_extra_config, or a whole kv-transfer-config). [env: S3KV_CONFIG]",
    )
    @click.option("--bucket", envvar="S3KV_BUCKET", help="S3 bucket. [env: S3KV_BUCKET]")
    @click.option(
        "--prefix", envvar="S3KV_PREFIX", help="Key prefix in the bucket (default: s3kv). [env: S3KV_PREFIX]"
    )
    @click.option(
        "--endpoint-url",
        envvar="S3KV_ENDPOINT_URL",
        help="S3-compatible endpoint (MinIO, R2, a test server). [env: S3KV_ENDPOINT_URL]",
    )
    @click.option("--region", envvar="S3KV_REGION", help="AWS region of the bucket. [env: S3KV_REGION]")
    @click.option(
        "--auth-key-file",
        envvar="S3KV_AUTH_KEY_FILE",
        metavar="FILE",
        help="The fleet secret's file, as the replicas' auth_key_file; S3KV_AUTH_KEY (the secret itself) "
        "takes precedence. With a secret, objects without a valid MAC are reported, and gc signs what it "
        "writes. [env: S3KV_AUTH_KEY_FILE]",
    )
    @click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of tables.")
    @click.option(
        "--concurrency",
        type=click.IntRange(1, 256),
        default=16,
        show_default=True,
        help="S3 requests in flight at once.",
    )
    @click.option(
        "--progress/--no-progress",
        default=None,
        help="Progress bars on stderr (default: when stderr is a terminal and not --json).",
    )
    @functools.wraps(func)
    def wrapper(
        config_path, bucket, prefix, endpoint_url, region, auth_key_file, as_json, concurrency, progress, **kw
    ):
        import sys

        if progress is None:
            progress = sys.stderr.isatty() and not as_json
        settings = Settings(
            (config_path, bucket, prefix, endpoint_url, region, auth_key_file), as_json, concurrency, progress
        )
        if func.__name__ != "inspect_cmd":
            settings.config  # noqa: B018 (fail on a bad config before any work)
            settings.keys  # noqa: B018 (and on a bad secret)
        return func(settings, **kw)

    return wrapper
