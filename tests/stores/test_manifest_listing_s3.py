"""The manifest on a directory bucket (S3 Express One Zone), against a real
S3 server (moto, on loopback) behind :class:`LatencyProxy` in its
``directory`` mode: listings come a page at a time in a random order,
StartAfter is ignored, and a prefix that does not end with '/' is refused,
as S3 Express does. Replicas share new chunks and a new one starts warm
without asking for StartAfter; the control shows that the proxy does what
a directory bucket does to a general-purpose client."""

from __future__ import annotations

import time

import pytest

from s3kv.errors import S3KVError
from s3kv.manifest import protocol as mp
from s3kv.manifest.keyset import Manifest
from s3kv.manifest.sync import ManifestSync, SyncSettings
from s3kv.stores.s3 import S3Options, S3Store
from s3kv.testing.latency_proxy import LatencyProxy

BASE = "fleet/" + "ef" * 16 + "/manifest/"
SKEW_S = 60


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") * 2


def replica(store, clock, writer, **kw) -> ManifestSync:
    settings = SyncSettings(publish_s=1, refresh_s=1, skew_s=SKEW_S, **kw)
    return ManifestSync(store, BASE, Manifest(), settings, writer=writer, clock=lambda: clock[0])


async def test_replicas_share_chunks_through_a_directory_bucket(s3_server, bucket):
    with LatencyProxy(s3_server.endpoint_url, directory=True) as proxy:
        store = S3Store(
            bucket, S3Options(endpoint_url=proxy.endpoint_url, region="us-east-1", directory=True)
        )
        clock = [time.time()]
        try:
            a = replica(store, clock, "aaaa", snapshot_every=2, snapshot_interval_s=0)
            b = replica(store, clock, "bbbb")
            await a.load()
            await b.load()
            for i in range(12):  # segments over two minutes, several to a listing
                (a if i % 2 else b).manifest.add(key(i))
                await (a if i % 2 else b).publish()
                clock[0] += 11
                await a.refresh()
                await b.refresh()
            assert all(key(i) in a.manifest and key(i) in b.manifest for i in range(12))
            assert await a.maybe_snapshot()
            a.manifest.add(key(99))
            await a.publish()
            fresh = replica(store, clock, "cccc")
            await fresh.load()
            assert all(key(i) in fresh.manifest for i in (*range(12), 99))
            names = await store.list_keys(BASE + "seg/")
            assert names and all(mp.parse_name(BASE, n).kind == "segment" for n in names)
            assert {n.count("/") for n in names} == {BASE.count("/") + 2}  # seg/{minute}/{name}
            assert len({n.rsplit("/", 1)[0] for n in names}) >= 2
        finally:
            await store.close()
        assert proxy.listings > 0 and proxy.shuffled > 0
        assert proxy.start_after_ignored == 0 and proxy.prefixes_refused == []


async def test_the_proxy_lists_as_a_directory_bucket_does(s3_server, bucket):
    """The control: a general-purpose client through the proxy is answered
    as S3 Express answers it, so the test above could fail."""
    with LatencyProxy(s3_server.endpoint_url, directory=True) as proxy:
        store = S3Store(bucket, S3Options(endpoint_url=proxy.endpoint_url, region="us-east-1"))
        try:
            names = [f"d/{i:03d}" for i in range(40)]
            for n in names:
                await store.put(n, b"x")
            got = [m.key async for m in store.list("d/", start_after="d/019")]
            assert sorted(got) == names  # StartAfter ignored ...
            assert got != names  # ... and the order is not the names'
            assert proxy.start_after_ignored == 1
            with pytest.raises(S3KVError):
                [m async for m in store.list("d/0")]
            assert proxy.prefixes_refused == ["d/0"]
        finally:
            await store.close()


async def test_a_store_opens_one_session_for_many_requests(s3_server):
    """S3 Express signs requests with the credentials of a CreateSession:
    the store opens one and signs every request with it, not a session per
    request. The control: a store per request opens a session each."""
    from s3kv.config import parse_config

    bucket = s3_server.new_directory_bucket()
    with LatencyProxy(s3_server.endpoint_url, directory=True) as proxy:
        config = parse_config({"bucket": bucket, "endpoint_url": proxy.endpoint_url, "region": "us-east-1"})
        assert config.directory_bucket  # told by the bucket's name
        store = S3Store(bucket, S3Options.from_config(config))
        try:
            for i in range(10):
                await store.put(f"s/{i:02d}", b"x" * i)
                assert await store.get(f"s/{i:02d}") == b"x" * i
                assert (await store.head(f"s/{i:02d}")).size == i
            assert len(await store.list_keys("s/")) == 10
            await store.delete_many([f"s/{i:02d}" for i in range(5)])
        finally:
            await store.close()
        assert proxy.sessions == 1
        assert proxy.session_signed >= 32  # 30 object requests, a listing, a delete
        for i in range(3):  # the control
            one = S3Store(bucket, S3Options.from_config(config))
            try:
                await one.head(f"s/{5 + i:02d}")
            finally:
                await one.close()
        assert proxy.sessions == 1 + 3
