"""Every store backend passes the same conformance suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from s3kv.stores.local import LocalStore, partial_path
from s3kv.stores.memory import MemoryStore
from s3kv.stores.s3 import S3Options, S3Store
from tests.stores.conformance import StoreConformance


class TestMemoryStore(StoreConformance):
    @pytest.fixture
    def store(self) -> MemoryStore:
        self._store = MemoryStore()
        return self._store

    def raw_get(self, key: str) -> bytes | None:
        entry = self._store._objects.get(key)
        return None if entry is None else entry[0]

    def raw_put(self, key: str, data: bytes) -> None:
        import time

        self._store._objects[key] = (data, time.time())


class TestLocalStore(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path: Path) -> LocalStore:
        self.root = tmp_path / "store"
        return LocalStore(self.root, fsync=True)

    def raw_get(self, key: str) -> bytes | None:
        path = self.root / key
        return path.read_bytes() if path.is_file() else None

    def raw_put(self, key: str, data: bytes) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    async def test_no_partial_files_left(self, store: LocalStore):
        await store.put("a/b", b"x" * 1000)
        await store.put("a/b", b"y")
        leftovers = [n for _, _, files in os.walk(self.root) for n in files if n.endswith(".partial")]
        assert leftovers == []

    async def test_partial_files_are_not_listed(self, store: LocalStore):
        (self.root / "a").mkdir(parents=True)
        (self.root / "a" / ".b.123.partial").write_bytes(b"half")  # an old-style name
        partial_path(self.root / "a" / "d").write_bytes(b"half")
        await store.put("a/c", b"whole")
        assert await store.list_keys("a/") == ["a/c"]


class TestS3Store(StoreConformance):
    # Above the (lowered) multipart threshold: exercises multipart + If-None-Match.
    large_object_bytes = 12 << 20

    @pytest.fixture
    def store(self, s3_server, bucket) -> S3Store:
        self.client = s3_server.client()
        self.bucket = bucket
        options = S3Options(
            endpoint_url=s3_server.endpoint_url,
            region="us-east-1",
            multipart_threshold=6 << 20,
            part_size=5 << 20,
        )
        return S3Store(bucket, options)

    def raw_get(self, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def raw_put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        ("SlowDown", 503, "Throttled"),
        ("ThrottlingException", 400, "Throttled"),
        ("InternalError", 500, "Transient"),
        ("NoSuchKey", 404, "NotFound"),
        ("PreconditionFailed", 412, "AlreadyExists"),
    ],
)
def test_s3_errors_map_onto_s3kv_errors(code, status, kind):
    from botocore.exceptions import ClientError

    from s3kv.stores.s3 import _map_error

    e = ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")
    assert type(_map_error(e, "k")).__name__ == kind
