"""The behaviour every ObjectStore backend must share.

A backend's test class subclasses :class:`StoreConformance` and provides the
``store`` fixture plus two backdoors, ``raw_get`` and ``raw_put``, that read
and write what is really stored without going through the store under test.
"""

from __future__ import annotations

import asyncio

import pytest

from s3kv.errors import AlreadyExists, NotFound
from s3kv.stores.base import ByteRange, ObjectStore, PutMode


class StoreConformance:
    large_object_bytes = 3 << 20

    def raw_get(self, key: str) -> bytes | None:
        raise NotImplementedError

    def raw_put(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    async def test_put_get_roundtrip(self, store: ObjectStore):
        await store.put("a/b/c", b"hello")
        assert await store.get("a/b/c") == b"hello"
        assert self.raw_get("a/b/c") == b"hello"

    async def test_empty_object(self, store: ObjectStore):
        await store.put("empty", b"")
        assert await store.get("empty") == b""
        assert (await store.head("empty")).size == 0

    async def test_get_sees_backdoor_write(self, store: ObjectStore):
        self.raw_put("x/y", b"written behind the store's back")
        assert await store.get("x/y") == b"written behind the store's back"

    async def test_overwrite_replaces(self, store: ObjectStore):
        await store.put("k", b"one")
        await store.put("k", b"two", mode=PutMode.OVERWRITE)
        assert self.raw_get("k") == b"two"

    async def test_create_absent_writes(self, store: ObjectStore):
        await store.put("new", b"data", mode=PutMode.CREATE)
        assert self.raw_get("new") == b"data"

    async def test_create_existing_raises_and_keeps_original(self, store: ObjectStore):
        await store.put("k", b"first")
        with pytest.raises(AlreadyExists) as info:
            await store.put("k", b"second", mode=PutMode.CREATE)
        assert isinstance(info.value, FileExistsError)
        assert self.raw_get("k") == b"first"

    async def test_racing_creates_store_once(self, store: ObjectStore):
        async def attempt(i: int) -> bool:
            try:
                await store.put("race", f"writer {i}".encode(), mode=PutMode.CREATE)
                return True
            except AlreadyExists:
                return False

        wins = await asyncio.gather(*(attempt(i) for i in range(8)))
        assert sum(wins) == 1
        winner = wins.index(True)
        assert self.raw_get("race") == f"writer {winner}".encode()

    async def test_get_missing_raises_not_found(self, store: ObjectStore):
        with pytest.raises(NotFound) as info:
            await store.get("nope/missing")
        assert isinstance(info.value, FileNotFoundError)
        with pytest.raises(NotFound):
            await store.head("nope/missing")
        assert not await store.exists("nope/missing")

    async def test_ranged_get(self, store: ObjectStore):
        data = bytes(range(256)) * 4
        await store.put("r", data)
        assert await store.get("r", ByteRange(10, 20)) == data[10:20]
        assert await store.get("r", ByteRange(1000)) == data[1000:]
        assert await store.get("r", ByteRange(1020, 5000)) == data[1020:]
        assert await store.get("r", ByteRange(0, 1)) == data[:1]

    async def test_range_past_end_raises(self, store: ObjectStore):
        await store.put("r", b"0123456789")
        with pytest.raises(ValueError):
            await store.get("r", ByteRange(10, 20))

    async def test_head(self, store: ObjectStore):
        await store.put("h", b"12345")
        meta = await store.head("h")
        assert meta.key == "h" and meta.size == 5 and meta.last_modified > 0
        assert await store.exists("h")

    async def test_list_prefix_order_and_start_after(self, store: ObjectStore):
        keys = ["p/a-c", "p/a/b", "p/a/c/d", "p/b", "p/ab", "q/x", "pz"]
        for k in keys:
            await store.put(k, k.encode())
        listed = await store.list_keys("p/")
        assert listed == sorted(k for k in keys if k.startswith("p/"))
        assert await store.list_keys("p/a") == sorted(k for k in keys if k.startswith("p/a"))
        assert await store.list_keys("p/", start_after="p/a/b") == [k for k in listed if k > "p/a/b"]
        assert await store.list_keys("p/", start_after="p/zzz") == []
        assert await store.list_keys("nothing/") == []
        sizes = {m.key: m.size async for m in store.list("p/")}
        assert sizes == {k: len(k) for k in listed}

    async def test_list_many(self, store: ObjectStore):
        # More than one S3 listing page (1000 keys).
        keys = [f"many/{i:05d}" for i in range(1203)]
        await asyncio.gather(*(store.put(k, b"x") for k in keys))
        assert await store.list_keys("many/") == keys
        assert await store.list_keys("many/", start_after="many/01100") == keys[1101:]

    async def test_delete_many(self, store: ObjectStore):
        keys = [f"d/{i:05d}" for i in range(1005)]
        await asyncio.gather(*(store.put(k, b"x") for k in keys))
        await store.put("keep", b"k")
        await store.delete_many(keys + ["d/absent"])
        assert await store.list_keys("d/") == []
        assert self.raw_get("keep") == b"k"
        await store.delete("keep")
        assert self.raw_get("keep") is None

    async def test_large_object(self, store: ObjectStore):
        data = bytes(range(251)) * (self.large_object_bytes // 251 + 1)
        await store.put("big", data, mode=PutMode.CREATE)
        assert self.raw_get("big") == data
        assert await store.get("big", ByteRange(len(data) - 1000)) == data[-1000:]
        with pytest.raises(AlreadyExists):
            await store.put("big", data, mode=PutMode.CREATE)

    async def test_invalid_keys_rejected(self, store: ObjectStore):
        for bad in ["", "a//b", "../x", "a/./b", "/abs"]:
            with pytest.raises(ValueError):
                await store.put(bad, b"x")
