"""The S3 tier's worker side: this rank's chunk objects, GETs and create-only PUTs through the store."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING

from s3kv.config import DEFAULTS
from s3kv.errors import AlreadyExists, CorruptChunk, NotFound, PermissionDenied, Precondition
from s3kv.frame_sinks import FrameInto
from s3kv.keys import namespace_prefix, object_key
from s3kv.manifest.publish import Published
from s3kv.stats import Counters
from s3kv.stores.base import ObjectStore, PutMode
from s3kv.tiering.chunks import ChunkCodec, ChunkData, ChunkId, load_chunk, read_header
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import Place
from s3kv.tiering.tiers.handler import TierHandler
from s3kv.tiering.tiers.report import RankReport
from s3kv.tiering.tiers.s3.report import S3Report

if TYPE_CHECKING:
    from s3kv.tiering.codec_choice import TierChoice

log = logging.getLogger("s3kv.transfer")

UNREADABLE_SIZE = 1 << 16
"""Keys remembered whose S3 object this rank may not read (~100 bytes each)."""


class S3Handler(TierHandler):
    """This rank's chunk objects in the bucket, through ``store`` (async, on
    the engine's loop; frames decode on ``executor``). Stores are
    create-only (If-None-Match): an object already there (a 412) counts as
    stored only if it is ours to publish (:meth:`_existing_is_ours`). A
    corrupt object is deleted if it is still the version read (If-Match on
    its ETag), else reported bad. A 403 on one object is that object's (the
    key is dropped, S3 is not blamed); refused credentials are the tier's."""

    tier = Tier.S3
    label = "S3"

    def __init__(
        self,
        store: ObjectStore,
        chunk_codec: ChunkCodec,
        prefix: str,
        *,
        range_bytes: int = DEFAULTS.range_bytes,
        executor: concurrent.futures.Executor | None = None,
        published: Published | None = None,
        choice: TierChoice | None = None,
        report: RankReport | None = None,
        counters: Counters | None = None,
    ) -> None:
        super().__init__(report, counters)
        self.store = store
        self.codec = chunk_codec
        self.prefix = prefix
        self.range_bytes = range_bytes
        self._executor = executor
        self.published = published
        """Told of each chunk PUT as it starts and as it is answered (the
        rank's publisher: its journal, then a created object's publication;
        a 412'd object is not published from here, being another's, maybe
        one the fleet was told is bad)."""
        self.choice = choice
        """``codec: auto``'s choice: objects are written in the codec it picks."""
        self._unreadable: dict[bytes, None] = {}
        """Keys whose S3 object refused this rank (a 403 on that object): a
        store that finds it in the way (a 412) does not publish it."""

    def store_codec(self) -> ChunkCodec:
        return self.choice.chunk_codec(self.codec) if self.choice is not None else self.codec

    def chunk_id(self, key: bytes) -> ChunkId:
        c = self.codec
        return ChunkId(object_key(self.prefix, c.namespace, key, c.rank), c.namespace, key.hex(), c.rank)

    def trouble(self, e: BaseException) -> bool:
        if isinstance(e, PermissionDenied):
            # A 403 on one object (a bucket policy, a KMS key for its
            # prefix) is that object's; refused credentials are the tier's.
            return e.credentials
        return super().trouble(e)

    async def read(
        self,
        place: Place,
        key: bytes,
        sink: FrameInto,
        *,
        deadline: float | None = None,
        keep_blob: bool = False,
    ) -> tuple[int, bytes | None]:
        left = deadline - self.clock() if deadline is not None else None
        load = load_chunk(
            self.store,
            self.chunk_id(key),
            sink,
            chunk_codec=self.codec,
            range_bytes=self.range_bytes,
            executor=self._executor,
            keep_blob=keep_blob,
        )
        try:
            fetched, blob = await self.guard(load, left, load=True)
        except PermissionDenied as e:
            if not e.credentials:
                self._unreadable[key] = None
                if len(self._unreadable) > UNREADABLE_SIZE:
                    self._unreadable.clear()
            raise
        except CorruptChunk as e:
            await self._delete_corrupt(key, e.etag)
            raise
        self._unreadable.pop(key, None)
        return fetched, blob

    async def write(self, place: Place, chunk: ChunkData, start: float | None = None) -> int | None:
        cid = self.chunk_id(chunk.key)
        blob = chunk.blob_for(chunk.picked.get(self.tier) or self.store_codec())
        if await self._create(chunk.key, cid, blob):
            self.counters.add("store_bytes_s3", len(blob))
            if start is not None:
                self.counters.observe("store_seconds_s3", time.perf_counter() - start)
            return len(blob)
        self.counters.add("store_chunks_existing")
        if chunk.key in self._unreadable or not await self._existing_is_ours(chunk.key, cid, blob):
            self.report.tier_ok(self.tier)  # S3 answered; the object in the way is not one to publish
            return None
        with self.report.section(self.tier, S3Report) as r:
            r.existing.add(chunk.key)
        return len(blob)

    async def _create(self, key: bytes, cid: ChunkId, blob: bytes) -> bool:
        """A create-only PUT of ``key``'s object: True if it created it
        (counted), False on a 412. :attr:`published` hears of it as it
        starts and as it is answered, either way."""
        if self.published is not None:
            self.published.putting(key)
        try:
            await self.store.put(cid.object_key, blob, mode=PutMode.CREATE)
        except AlreadyExists:
            created = False
        else:
            created = True
            self.counters.add("store_chunks_s3")
        if self.published is not None:
            self.published.answered(key, created=created)
        return created

    async def delete(self, place: Place, key: bytes) -> None:
        await self.store.delete(self.chunk_id(key).object_key)

    async def bytes_used(self) -> int:
        """This rank's objects of the namespace (listed: meant for tests and tools)."""
        mine = f".r{self.codec.rank}"
        listing = self.store.list(namespace_prefix(self.prefix, self.codec.namespace))
        return sum([m.size async for m in listing if m.key.endswith(mine)])

    async def _delete_corrupt(self, key: bytes, etag: str | None) -> None:
        """The object is ours (our namespace and key) and unusable: remove it
        so that a later store can write a good one, but only the version that
        was read (If-Match), never a good one written since. Without the
        permission (or a conditional delete), report it bad to the fleet."""
        cid = self.chunk_id(key)
        reason = "no ETag was read"
        if etag is not None:
            try:
                await self.store.delete_if(cid.object_key, etag)
                return
            except (NotFound, Precondition):
                return  # gone, or rewritten since: nothing of ours to remove
            except PermissionDenied as e:
                reason = f"no permission to delete it ({e})"
            except NotImplementedError:
                reason = "the store has no conditional delete"
            except Exception as e:
                log.warning("s3kv: could not delete corrupt %s: %s", cid.object_key, e)
                return
        log.warning("s3kv: corrupt %s is reported to the fleet as bad: %s", cid.object_key, reason)
        self.counters.add("quarantined_chunks")
        with self.report.section(self.tier, S3Report) as r:
            r.bad[(key, self.codec.rank)] = etag

    async def _existing_is_ours(self, key: bytes, cid: ChunkId, blob: bytes) -> bool:
        """A create-only store found ``key``'s object ``cid`` there. Without a fleet secret any
        object counts (its frames are checked when loaded). With one, only an
        object whose header carries a valid MAC does: one that fails is
        deleted (if it was not rewritten since) and ours written instead, or,
        without the permission to delete it, reported bad. The key is never
        published from an object that could not be verified."""
        if self.codec.keys is None:
            return True
        try:
            await read_header(self.store, cid, chunk_codec=self.codec, prefetch=self.codec.max_header + 64)
            return True
        except NotFound:
            pass  # deleted meanwhile (or of a newer format: the create-only PUT below finds it)
        except PermissionDenied as e:
            if e.credentials:
                raise
            log.warning("s3kv: %s exists but is not ours to read (%s): not published", cid.object_key, e)
            return False
        except CorruptChunk as e:  # only the object's own bytes: a network fault raises Transient
            log.warning("s3kv: %s exists but does not verify (%s)", cid.object_key, e)
            self.report.missing(self.tier, key)
            await self._delete_corrupt(key, e.etag)
        # False: someone wrote it again first (not verified, not published by us).
        return await self._create(key, cid, blob)
