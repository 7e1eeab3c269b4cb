"""The behaviour every ObjectStore backend must share.

A backend's test class subclasses :class:`StoreConformance` and provides the
``store`` fixture plus two backdoors, ``raw_get`` and ``raw_put``, that read
and write what is really stored without going through the store under test.
A backend without ETags sets ``etags = False``: the conditional-write and
conditional-delete tests then check that it refuses them (NotImplementedError)
and leaves the object as it was.
"""

from __future__ import annotations

import asyncio

import pytest

from s3kv.errors import AlreadyExists, NotFound, Precondition
from s3kv.stores.base import ByteRange, ObjectStore, PutMode, Update

NO_SUCH_ETAG = '"00000000000000000000000000000000"'


class StoreConformance:
    large_object_bytes = 3 << 20
    etags = True
    """Whether the store has ETags, and so conditional updates and deletes."""

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

    # list_dirs: one level of the tree under a prefix.

    async def _put_all(self, store: ObjectStore, keys: list[str]) -> None:
        await asyncio.gather(*(store.put(k, k.encode()) for k in keys))

    async def test_list_dirs_one_level(self, store: ObjectStore):
        keys = ["t/a/1", "t/a/b/c/deep", "t/a-b/2", "t/ab/3", "t/ab.x", "t/z", "t/zz/4", "u/elsewhere"]
        await self._put_all(store, keys)
        objects, dirs = await store.list_dirs("t/")
        # A folder is named once however deep or many its objects; names that
        # share a prefix ("a", "a-b", "ab", "ab.x") but not a folder stay apart.
        assert dirs == ["t/a-b/", "t/a/", "t/ab/", "t/zz/"]
        assert [m.key for m in objects] == ["t/ab.x", "t/z"]
        assert {m.key: m.size for m in objects} == {"t/ab.x": 6, "t/z": 3}
        assert all(m.last_modified > 0 for m in objects)
        # One level further down: the nested folder, the object beside it.
        objects, dirs = await store.list_dirs("t/a/")
        assert dirs == ["t/a/b/"] and [m.key for m in objects] == ["t/a/1"]
        objects, dirs = await store.list_dirs("t/a/b/")
        assert dirs == ["t/a/b/c/"] and objects == []
        objects, dirs = await store.list_dirs("t/a/b/c/")
        assert dirs == [] and [m.key for m in objects] == ["t/a/b/c/deep"]

    async def test_list_dirs_at_the_root(self, store: ObjectStore):
        await self._put_all(store, ["top", "t/a/1", "u/2"])
        objects, dirs = await store.list_dirs()
        assert dirs == ["t/", "u/"] and [m.key for m in objects] == ["top"]
        assert await store.list_dirs("") == (objects, dirs)

    async def test_list_dirs_empty(self, store: ObjectStore):
        assert await store.list_dirs() == ([], [])
        await self._put_all(store, ["t/a/1", "tx/2", "t-/3"])
        # A prefix nothing lies under, and one that only shares characters
        # with folders that exist ("t" is not "t/", "tx/" nor "t-/").
        assert await store.list_dirs("nothing/") == ([], [])
        assert await store.list_dirs("t/a/1/") == ([], [])
        objects, dirs = await store.list_dirs("t/")
        assert dirs == ["t/a/"] and objects == []

    async def test_list_dirs_forgets_a_folder_whose_objects_are_deleted(self, store: ObjectStore):
        await self._put_all(store, ["t/gone/x/1", "t/gone/2", "t/kept/3"])
        await store.delete_many(["t/gone/x/1", "t/gone/2"])
        assert await store.list_dirs("t/") == ([], ["t/kept/"])
        assert await store.list_dirs("t/gone/") == ([], [])

    async def test_list_dirs_many(self, store: ObjectStore):
        # More entries than one S3 listing page (1000 keys and prefixes together).
        folders = [f"m/d{i:04d}/" for i in range(600)]
        direct = [f"m/o{i:04d}" for i in range(450)]
        await self._put_all(store, [f + "x" for f in folders] + direct)
        await store.put("m/d0000/y", b"second in a folder")
        objects, dirs = await store.list_dirs("m/")
        assert dirs == folders
        assert [m.key for m in objects] == direct

    # Conditional update (If-Match): a lease's write.

    async def test_update_on_the_current_etag_replaces(self, store: ObjectStore):
        first = await store.put("c/k", b"one")
        if not self.etags:
            assert first is None and (await store.head("c/k")).etag is None
            with pytest.raises(NotImplementedError):
                await store.put("c/k", b"two", mode=Update(NO_SUCH_ETAG))
            assert self.raw_get("c/k") == b"one"
            return
        assert first is not None and (await store.head("c/k")).etag == first
        assert (await store.get_object("c/k")).etag == first
        second = await store.put("c/k", b"two", mode=Update(first))
        assert self.raw_get("c/k") == b"two"
        assert second is not None and second != first
        assert (await store.head("c/k")).etag == second
        # The ETag a head() tells works as well as the one a put() returned.
        third = await store.put("c/k", b"three", mode=Update((await store.head("c/k")).etag))
        assert self.raw_get("c/k") == b"three" and third not in (first, second)

    async def test_update_on_a_stale_etag_raises_precondition_and_keeps_the_object(self, store: ObjectStore):
        first = await store.put("c/k", b"one")
        if not self.etags:
            with pytest.raises(NotImplementedError):
                await store.put("c/k", b"two", mode=Update(NO_SUCH_ETAG))
            assert self.raw_get("c/k") == b"one"
            return
        current = await store.put("c/k", b"two")
        for stale in (first, NO_SUCH_ETAG):
            with pytest.raises(Precondition) as info:
                await store.put("c/k", b"three", mode=Update(stale))
            assert info.value.key == "c/k"
            assert not isinstance(info.value, (NotFound, AlreadyExists))
        assert self.raw_get("c/k") == b"two"
        assert (await store.head("c/k")).etag == current

    async def test_update_of_an_absent_object_raises_not_found(self, store: ObjectStore):
        etag = await store.put("c/gone", b"was here")
        await store.delete("c/gone")
        for key, tag in (("c/gone", etag or NO_SUCH_ETAG), ("c/never", NO_SUCH_ETAG)):
            with pytest.raises(NotImplementedError if not self.etags else NotFound):
                await store.put(key, b"revived", mode=Update(tag))
            assert self.raw_get(key) is None  # not created
        assert await store.list_keys("c/") == []

    async def test_update_of_a_large_object(self, store: ObjectStore):
        # At the S3 store's multipart size: the If-Match rides on the upload's completion.
        data = bytes(range(251)) * (self.large_object_bytes // 251 + 1)
        first = await store.put("c/big", data)
        if not self.etags:
            with pytest.raises(NotImplementedError):
                await store.put("c/big", data[::-1], mode=Update(NO_SUCH_ETAG))
            assert self.raw_get("c/big") == data
            return
        with pytest.raises(Precondition):
            await store.put("c/big", data[::-1], mode=Update(NO_SUCH_ETAG))
        assert self.raw_get("c/big") == data
        with pytest.raises(NotFound):
            await store.put("c/big-absent", data, mode=Update(NO_SUCH_ETAG))
        assert self.raw_get("c/big-absent") is None
        second = await store.put("c/big", data[::-1], mode=Update(first))
        assert self.raw_get("c/big") == data[::-1] and second != first
        assert await store.list_uploads("c/") == []

    # Conditional delete (If-Match): gc and the lease's release.

    async def test_delete_if_on_the_current_etag_deletes(self, store: ObjectStore):
        etag = await store.put("c/k", b"one")
        await store.put("c/other", b"stays")
        if not self.etags:
            with pytest.raises(NotImplementedError):
                await store.delete_if("c/k", NO_SUCH_ETAG)
            assert self.raw_get("c/k") == b"one"
            return
        await store.delete_if("c/k", etag)
        assert self.raw_get("c/k") is None and not await store.exists("c/k")
        await store.delete_if("c/other", (await store.head("c/other")).etag)
        assert await store.list_keys("c/") == []

    async def test_delete_if_on_a_stale_etag_raises_precondition_and_keeps_the_object(
        self, store: ObjectStore
    ):
        first = await store.put("c/k", b"one")
        if not self.etags:
            with pytest.raises(NotImplementedError):
                await store.delete_if("c/k", NO_SUCH_ETAG)
            assert self.raw_get("c/k") == b"one"
            return
        current = await store.put("c/k", b"rewritten")
        for stale in (first, NO_SUCH_ETAG):
            with pytest.raises(Precondition) as info:
                await store.delete_if("c/k", stale)
            assert info.value.key == "c/k"
        assert self.raw_get("c/k") == b"rewritten"
        assert (await store.head("c/k")).etag == current

    async def test_delete_if_of_an_absent_object_raises_not_found(self, store: ObjectStore):
        etag = await store.put("c/gone", b"was here")
        await store.delete("c/gone")
        for key, tag in (("c/gone", etag or NO_SUCH_ETAG), ("c/never", NO_SUCH_ETAG)):
            with pytest.raises(NotImplementedError if not self.etags else NotFound):
                await store.delete_if(key, tag)
