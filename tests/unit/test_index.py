import asyncio

from s3kv.index import ChunkIndex, load_listing
from s3kv.keys import object_key
from s3kv.stores.memory import MemoryStore

NS, OTHER = "1" * 32, "2" * 32


def test_listing_adds_chunks_with_every_rank():
    store = MemoryStore()
    k_full, k_half, k_other = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16

    async def fill():
        for r in range(2):
            await store.put(object_key("pfx", NS, k_full, r), b"x")
        await store.put(object_key("pfx", NS, k_half, 0), b"x")  # rank 1 missing
        await store.put(object_key("pfx", OTHER, k_other, 0), b"x")
        await store.put(object_key("pfx", OTHER, k_other, 1), b"x")
        await store.put(f"pfx/{NS}/namespace.json", b"{}")
        await store.put(f"pfx/{NS}/manifest/x", b"")
        return await load_listing(index, store, "pfx", NS, world_size=2)

    index = ChunkIndex()
    assert asyncio.run(fill()) == 1
    assert k_full in index and k_half not in index and k_other not in index
