"""Fixtures shared by the whole suite: a real S3 server on loopback, and a
bounded wait for a condition."""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from s3kv.testing.loopback_s3 import LoopbackS3, free_port  # noqa: F401 (tests import free_port from here)

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
# The weight-digest cache of every engine the tests start (they inherit it):
# not the user's own.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="s3kv-test-cache-")


class S3Server(LoopbackS3):
    """The loopback S3 server, in its own process so that a test can stop it,
    with a fresh bucket per test."""

    def new_bucket(self) -> str:
        return self.create_bucket(f"s3kv-test-{uuid.uuid4().hex[:12]}")

    def new_directory_bucket(self, name: str | None = None) -> str:
        """A fresh bucket named as an S3 Express One Zone directory bucket
        (``base--zone--x-s3``), by default a random one. moto itself is a
        general-purpose server: the directory behaviour comes from
        :class:`LatencyProxy` in its ``directory`` mode, in front of it."""
        name = name or f"s3kv-{uuid.uuid4().hex[:12]}--use1-az4--x-s3"
        self.directory_client().create_bucket(Bucket=name)
        return name

    def directory_client(self) -> Any:
        """A boto3 client for directory buckets on this server, without
        session auth (moto answers no CreateSession)."""
        import boto3
        from botocore.config import Config

        config = Config(s3={"disable_s3_express_session_auth": True})
        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name=self.region, config=config)


def wait_until(
    what: str, condition: Callable[[], Any], timeout_s: float = 180.0, every_s: float = 0.02
) -> None:
    """Poll ``condition()`` until it holds; fail naming ``what`` after
    ``timeout_s`` (a bound for a busy machine, not a time the test expects
    to take)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every_s)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = S3Server()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def bucket(s3_server: S3Server) -> str:
    return s3_server.new_bucket()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Run ``async def`` tests in a fresh event loop (no plugin needed); a
    ``store`` argument is closed inside that loop afterwards."""
    import asyncio
    import inspect

    func = pyfuncitem.obj
    if not inspect.iscoroutinefunction(func):
        return None
    args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}

    async def run():
        try:
            await func(**args)
        finally:
            store = args.get("store")
            if store is not None:
                await store.close()

    asyncio.run(run())
    return True


def load_manifest(endpoint_url: str, bucket: str, base: str, *, directory: bool = False) -> set[int]:
    """The fingerprints a replica starting now loads from the manifest under
    ``base`` (``{prefix}/{namespace}/manifest/``) of ``bucket`` (a directory
    bucket's with ``directory``)."""
    import asyncio

    from s3kv.manifest.keyset import Manifest
    from s3kv.manifest.sync import ManifestSync
    from s3kv.stores.s3 import S3Options, S3Store

    async def load() -> set[int]:
        store = S3Store(bucket, S3Options(region="us-east-1", endpoint_url=endpoint_url, directory=directory))
        m = Manifest()
        try:
            await ManifestSync(store, base, m).load()
        finally:
            await store.close()
        return set(m.fps.array().tolist())

    return asyncio.run(load())
