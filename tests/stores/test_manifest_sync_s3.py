"""The manifest against a real S3 server (moto, on loopback) whose bucket
holds what real buckets hold besides s3kv's objects: folder markers,
garbage segments and snapshots, names that are no manifest object's,
far-future stamps, an object too large, and objects this role may not read
(the wrapper denies them, as a bucket policy or a KMS key would). A new
replica starts warm, replicas share new chunks, each skip is counted once
by its reason, and no floor or clock moves into the future."""

from __future__ import annotations

import time

from s3kv.manifest import protocol as mp
from s3kv.manifest.keyset import Manifest
from s3kv.manifest.sync import ManifestSync, SyncSettings
from s3kv.stores.s3 import S3Options, S3Store
from tests.stores.manifest_junk import MAX_BYTES, junk, key, named_keys, reasons
from tests.stores.wrappers import WrappedStore

BASE = "fleet/" + "cd" * 16 + "/manifest/"
SKEW_S = 60


def replica(store, clock, writer, **kw) -> ManifestSync:
    settings = SyncSettings(publish_s=1, refresh_s=1, skew_s=SKEW_S, max_object_bytes=MAX_BYTES, **kw)
    return ManifestSync(store, BASE, Manifest(), settings, writer=writer, clock=lambda: clock[0])


def skipped(sync: ManifestSync) -> dict[str, float]:
    prefix = "manifest_skipped_"
    return {k[len(prefix) :]: v for k, v in sync.counters.totals().items() if k.startswith(prefix) and v}


async def test_junk_in_a_real_bucket_neither_stops_a_warm_start_nor_sharing(s3_server, bucket):
    options = S3Options(endpoint_url=s3_server.endpoint_url, region="us-east-1")
    store = WrappedStore(S3Store(bucket, options))
    clock = [time.time()]
    try:
        # A replica's history: keys 1 and 2, a snapshot of them, then key 3.
        a = replica(store, clock, "aaaa", snapshot_every=1, snapshot_interval_s=0)
        await a.load()
        for i in (1, 2):
            a.manifest.add(key(i))
            await a.publish()
            clock[0] += 0.1
        await a.refresh()
        assert await a.maybe_snapshot()
        clock[0] += 1
        a.manifest.add(key(3))
        await a.publish()
        clock[0] += 5
        # Junk, written as anyone with access to the bucket could.
        objects = junk(BASE, int(clock[0] * 1000))
        client = s3_server.client()
        for j in objects:
            client.put_object(Bucket=bucket, Key=j.name, Body=j.body)
        store.denied = {j.name for j in objects if j.reason == "denied"}
        listed = {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=BASE)["Contents"]}
        assert {BASE + "seg/", BASE + "snap/"} <= listed  # the markers are real objects here

        b = ManifestSync(
            store,
            BASE,
            Manifest(),
            SyncSettings(skew_s=SKEW_S, max_object_bytes=MAX_BYTES),
            writer="bbbb",
            clock=lambda: clock[0],
        )
        await b.load()
        assert all(key(i) in b.manifest for i in (1, 2, 3))
        assert not any(k in b.manifest for k in named_keys(objects))
        expect = reasons(objects)
        expect["marker"] -= 1  # 'seg/' sorts below the floor the real snapshot sets
        assert skipped(b) == expect and set(expect) == {
            "marker",
            "foreign",
            "garbage",
            "denied",
            "future",
            "oversize",
        }
        assert not store.gets_of(BASE + "seg/") and not store.gets_of(BASE + "snap/")

        c = replica(store, clock, "cccc")
        await c.load()
        b.manifest.add(key(10))
        await b.publish()
        clock[0] += 1
        c.manifest.add(key(11))
        await c.publish()
        for _ in range(3):
            await b.refresh()
            await c.refresh()
        assert key(11) in b.manifest and key(10) in c.manifest
        assert skipped(b) == expect  # counted once, however many refreshes list them

        limit = int(clock[0] * 1000) + SKEW_S * 1000
        for r in (b, c):
            assert r.clock_ms <= limit and mp.name_ts(r._segment_floor()) <= limit
        ours = [n async for n in store.inner.list(BASE + "seg/") if "-bbbb-" in n.key or "-cccc-" in n.key]
        assert len(ours) == 2 and all(mp.name_ts(m.key) <= int(clock[0] * 1000) for m in ours)
    finally:
        await store.close()


async def test_replicas_share_through_epochs_on_a_real_bucket(s3_server, bucket):
    """Protocol "epochs" against a real S3 server: the create-only PUT of an
    epoch (If-None-Match), two replicas sharing through epoch objects, a
    third starting from the snapshot and the epochs after it."""
    options = S3Options(endpoint_url=s3_server.endpoint_url, region="us-east-1")
    store = WrappedStore(S3Store(bucket, options))
    clock = [time.time()]
    try:
        settings = SyncSettings(protocol="epochs", publish_s=1, refresh_s=1, skew_s=SKEW_S, snapshot_epochs=3)

        def epochs_replica(writer):
            return ManifestSync(store, BASE, Manifest(), settings, writer=writer, clock=lambda: clock[0])

        a, b = epochs_replica("aaaa"), epochs_replica("bbbb")
        for r in (a, b):
            await r.load()
        for i in range(6):
            a.manifest.add(key(i))
            b.manifest.add(key(100 + i))
            for _ in range(10):
                clock[0] += 0.1
                for r in (a, b):
                    if clock[0] >= r.next_due():
                        await r.tick()
        for _ in range(40):
            clock[0] += 0.1
            for r in (a, b):
                if clock[0] >= r.next_due():
                    await r.tick()
        every = [key(i) for i in range(6)] + [key(100 + i) for i in range(6)]
        assert all(k in a.manifest and k in b.manifest for k in every)
        epochs = [m.key async for m in store.list(BASE + "ep/")]
        assert len(epochs) >= 6 and all(mp.parse_name(BASE, n).kind == "epoch" for n in epochs)
        assert [m.key async for m in store.list(BASE + "snap/")]
        store.gets.clear()
        c = epochs_replica("cccc")
        await c.load()
        assert all(k in c.manifest for k in every)
        assert not [g for g in store.gets if "/seg/" in g.key]  # a snapshot and epochs, no segment
    finally:
        await store.close()
