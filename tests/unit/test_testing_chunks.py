"""s3kv.testing.chunks: the name a test gives a transfer engine's chunk
object is the one the engine stores it under."""

from __future__ import annotations

import asyncio

from s3kv.keys import object_key
from s3kv.stores.memory import MemoryStore
from s3kv.testing.chunks import chunk_id
from s3kv.tiering.placement import Tier
from tests.unit.test_transfer import engine, job, layers, wait_for


def test_chunk_id_names_the_object_the_engine_stored():
    store = MemoryStore()
    e = engine(store, rank=3)
    key = b"k" * 16
    e.submit_store(job(key, layers(1), s3=True))
    wait_for(e, lambda a: key in a.written.get(Tier.S3, {}))
    cid = chunk_id(e, key)
    e.close()

    async def names():
        return [meta.key async for meta in store.list("")]

    assert asyncio.run(names()) == [cid.object_key]  # the one object the store holds
    assert (cid.namespace, cid.key_hex, cid.rank) == ("n" * 32, key.hex(), 3)
    assert cid.object_key == object_key("p", "n" * 32, key, 3)
