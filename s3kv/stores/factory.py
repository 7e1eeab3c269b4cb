"""Build the configured object store."""

from __future__ import annotations

from s3kv.config import S3KVConfig
from s3kv.stats import Counters
from s3kv.stores.s3 import S3Options, S3Store


def s3_options(config: S3KVConfig) -> S3Options:
    return S3Options(
        region=config.region,
        endpoint_url=config.endpoint_url,
        addressing_style=config.addressing_style,
        max_attempts=config.s3_max_attempts,
        connect_timeout_s=config.s3_connect_timeout_s,
        read_timeout_s=config.s3_read_timeout_s,
        max_connections=config.max_connections,
    )


def make_store(config: S3KVConfig, counters: Counters | None = None) -> S3Store:
    """The configured bucket's store; with ``counters``, every HTTP request
    it sends is counted (``s3_requests_get``, ``_put``, ``_list``, ...)."""
    if not config.bucket:
        raise ValueError("a bucket is required")
    on_request = (lambda kind: counters.add(f"s3_requests_{kind}")) if counters is not None else None
    return S3Store(config.bucket, s3_options(config), on_request)
