"""Fixtures shared by the whole suite: a real S3 server on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import boto3
import pytest

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
# The weight-digest cache of every engine the tests start (they inherit it):
# not the user's own.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="s3kv-test-cache-")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class S3Server:
    """A moto S3 server in its own process, so a test can stop it."""

    port: int
    proc: subprocess.Popen | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("moto server exited at start-up") from None
                time.sleep(0.1)
        raise RuntimeError("moto server did not start within 30 s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None

    def client(self):
        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name="us-east-1")

    def new_bucket(self) -> str:
        name = f"s3kv-test-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = S3Server(free_port())
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


def load_manifest(endpoint_url: str, bucket: str, base: str) -> set[int]:
    """The fingerprints a replica starting now loads from the manifest under
    ``base`` (``{prefix}/{namespace}/manifest/``) of ``bucket``."""
    import asyncio

    from s3kv.manifest.keyset import Manifest
    from s3kv.manifest.sync import ManifestSync
    from s3kv.stores.s3 import S3Options, S3Store

    async def load() -> set[int]:
        store = S3Store(bucket, S3Options(region="us-east-1", endpoint_url=endpoint_url))
        m = Manifest()
        try:
            await ManifestSync(store, base, m).load()
        finally:
            await store.close()
        return set(m.fps.array().tolist())

    return asyncio.run(load())
