"""A fleet's signed bucket for the ops tests with the fleet secret
(test_verify_signed.py, test_gc_signed.py): its secret, namespace and
chunks, and the CLI run in this process against it. The bucket itself is
the ``fleet`` fixture (tests/ops/conftest.py)."""

from __future__ import annotations

import json

import numpy as np

from s3kv import codec
from s3kv.auth import FleetKeys
from s3kv.cli import main

SECRET = "ops-test-fleet-secret-0123456789abcdef"
PREFIX = "authops"
NS = "5a" * 16
BASE = f"{PREFIX}/{NS}/manifest/"
LAYERS = 2


def key(i: int) -> bytes:
    return bytes([i]) * 16


def chunk(i: int, keys: FleetKeys | None) -> bytes:
    rng = np.random.default_rng(i)
    return codec.encode_chunk(
        namespace=NS,
        key=key(i).hex(),
        rank=0,
        tokens=32,
        layers=[rng.integers(0, 255, 4096, dtype=np.uint8) for _ in range(LAYERS)],
        dtype="bfloat16",
        itemsize=2,
        page_shape=(1, 32, 64),
        keys=keys,
    )


def bucket_args(s3_server, bucket):
    """The CLI's arguments naming ``bucket`` on the loopback server, under PREFIX."""
    return ["--bucket", bucket, "--endpoint-url", s3_server.endpoint_url, "--region", "us-east-1"] + [
        "--prefix",
        PREFIX,
    ]


def cli(capsys, s3_server, bucket, *args):
    capsys.readouterr()
    rc = main([args[0], *bucket_args(s3_server, bucket), "--json", *args[1:]])
    cap = capsys.readouterr()
    return rc, (json.loads(cap.out) if cap.out.strip() else None), cap.err
