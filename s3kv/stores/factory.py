"""Build the configured object store."""

from __future__ import annotations

from s3kv.config import S3KVConfig
from s3kv.stats import Counters
from s3kv.stores.native import NativeS3Store
from s3kv.stores.s3 import S3Options, S3Store


def make_store(config: S3KVConfig, counters: Counters | None = None) -> S3Store:
    """The configured bucket's store; with ``counters``, every HTTP request
    it sends is counted (``s3_requests_get``, ``_put``, ``_list``, ...).
    ``s3_client`` picks who sends chunk GETs and PUTs (:mod:`s3kv.stores.native`)."""
    if not config.bucket:
        raise ValueError("a bucket is required")
    on_request = (lambda kind: counters.add(f"s3_requests_{kind}")) if counters is not None else None
    cls = NativeS3Store if config.s3_client == "obstore" else S3Store
    return cls(config.bucket, S3Options.from_config(config), on_request)
