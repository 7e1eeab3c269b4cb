"""A real S3 server (moto) in this process, with a backdoor to seed it.

The operations tools need buckets of ≥ 10,000 chunk objects of known ages.
Uploading that many objects over HTTP takes ~40 s per bucket here, and S3
sets LastModified itself; so the fixture runs moto's server in a thread of
the test process and seeds objects straight into its backend, with the
write times the test chooses. Everything the tools under test do goes over
HTTP to that server, like against S3.

And ``fleet``: a bucket as a fleet with the fleet secret leaves it, for the
ops tests with the secret (its names: tests/ops/signed.py).
"""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from collections.abc import Iterator

import boto3
import numpy as np
import pytest

from s3kv import codec
from s3kv.auth import ENV_VAR, FleetKeys
from s3kv.keys import fingerprint, object_key
from s3kv.manifest import format as mf
from s3kv.manifest import protocol as mp
from tests.conftest import free_port
from tests.ops.signed import BASE, NS, PREFIX, SECRET, chunk, key


class SeededS3:
    def __init__(self, port: int) -> None:
        self.port = port
        self.endpoint_url = f"http://127.0.0.1:{port}"

    def client(self):
        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name="us-east-1")

    def new_bucket(self) -> str:
        name = f"s3kv-ops-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    @staticmethod
    def _backend():
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends

        return s3_backends[DEFAULT_ACCOUNT_ID]["global"]

    def seed(self, bucket: str, key: str, body: bytes, written: float) -> None:
        """Store an object as if it had been written at ``written`` (epoch seconds)."""
        obj = self._backend().put_object(bucket, key, body)
        obj.last_modified = dt.datetime.fromtimestamp(int(written), dt.timezone.utc).replace(tzinfo=None)

    def listing(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """Every object's size, read from the server's own store (the
        backdoor: it does not trust the S3 API the tools under test use,
        and is much faster than listing 10,000 objects through it)."""
        keys = self._backend().get_bucket(bucket).keys
        return {name: key.size for name, key in keys.items() if name.startswith(prefix)}


@pytest.fixture(scope="session")
def seeded_s3() -> Iterator[SeededS3]:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield SeededS3(port)
    server.stop()


@pytest.fixture
def fleet(s3_server, monkeypatch):
    """A bucket as an authenticated fleet leaves it, plus what a forger and
    an unsigned replica added."""
    keys = FleetKeys([SECRET])
    client = s3_server.client()
    bucket = s3_server.new_bucket()
    names = {}
    for i, signer in (
        (1, keys),
        (2, keys),
        (3, None),
        (4, FleetKeys(["forger-secret-0123456789abcdef0123"])),
    ):
        names[i] = object_key(PREFIX, NS, key(i), 0)
        client.put_object(Bucket=bucket, Key=names[i], Body=chunk(i, signer))
    tampered = bytearray(chunk(5, keys))
    h = codec.parse_header(bytes(tampered))
    tampered[h.frames[1].offset] ^= 1  # a frame flipped, its xxh3 left stale: corrupt either way
    names[5] = object_key(PREFIX, NS, key(5), 0)
    client.put_object(Bucket=bucket, Key=names[5], Body=bytes(tampered))
    now = int(time.time() * 1000) - 3_600_000
    seg = mf.ManifestObject("segment", np.array(sorted(fingerprint(key(i)) for i in (1, 2)), np.uint64))
    client.put_object(Bucket=bucket, Key=mp.segment_name(BASE, now, "signed", 1), Body=mf.encode(seg, keys))
    names["forged segment"] = mp.segment_name(BASE, now + 1, "forger", 1)
    client.put_object(Bucket=bucket, Key=names["forged segment"], Body=mf.encode(seg))
    descriptor = {"namespace": NS, "model": "m", "fields": {"tp_size": 1}, "chunk_tokens": 32}
    client.put_object(
        Bucket=bucket, Key=f"{PREFIX}/{NS}/namespace.json", Body=json.dumps(descriptor).encode()
    )
    monkeypatch.delenv(ENV_VAR, raising=False)
    return bucket, names, keys
