"""A real S3 server (moto) in this process, with a backdoor to seed it.

The operations tools need buckets of ≥ 10,000 chunk objects of known ages.
Uploading that many objects over HTTP takes ~40 s per bucket here, and S3
sets LastModified itself; so the fixture runs moto's server in a thread of
the test process and seeds objects straight into its backend, with the
write times the test chooses. Everything the tools under test do goes over
HTTP to that server, like against S3.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator

import boto3
import pytest

from tests.conftest import free_port


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
