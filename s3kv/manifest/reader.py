"""Reading a replica's manifest objects from a bucket that holds more than
s3kv wrote, and surviving it.

Listed objects are skipped, counted once each (``manifest_skipped`` by
reason) and never fatal:

- *marker*: a folder marker (a key ending in '/');
- *foreign*: a name that is no segment's or snapshot's (never fetched);
- *future*: stamped beyond now plus the skew margin; not applied (and so
  moving neither the listing floor nor this writer's clock) until time
  catches up with it;
- *oversize*: larger than ``max_object_bytes``, by the listing's size or
  by a GET bounded to one byte more;
- *garbage*: too short, or failing to decode;
- *denied*: the store refused the GET;
- *unsigned*: with the fleet secret set, no valid MAC (a forgery, or a
  replica without the secret).

A GET that fails otherwise is tried again at the next refreshes, at most
``get_attempts`` times in all, then skipped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Container, Sequence

from s3kv.auth import FleetKeys
from s3kv.config import DEFAULTS
from s3kv.errors import (
    CorruptManifest,
    NotFound,
    PermissionDenied,
    RangeNotSatisfiable,
    TooLarge,
    UnsignedManifest,
)
from s3kv.manifest import format as mf
from s3kv.manifest.protocol import SEGMENTS, SNAPSHOTS, parse_name
from s3kv.manifest.ranks import rank_fields
from s3kv.stats import Counters
from s3kv.stores.base import ByteRange, ObjectMeta, ObjectStore

log = logging.getLogger("s3kv.manifest")

RANGE_BYTES = DEFAULTS.range_bytes
"""A manifest object larger than twice this is read in ranged GETs of this
size: the chunks' default GET size, not the configured ``range_bytes``
(which tunes chunk loads)."""
SKIP_REASONS = ("marker", "foreign", "garbage", "denied", "future", "oversize", "unsigned")
"""The ``manifest_skipped`` reasons this module counts."""
_DIRS = {"segment": SEGMENTS, "snapshot": SNAPSHOTS}


class ObjectReader:
    """Segments and snapshots under one manifest prefix, as a replica reads
    them: sifted from listings, fetched (bounded), decoded and checked;
    what is skipped is counted once, what failed is retried."""

    def __init__(
        self,
        store: ObjectStore,
        base: str,
        *,
        keys: FleetKeys | None,
        counters: Counters,
        skew_s: float,
        max_object_bytes: int,
        get_attempts: int,
        fetch_concurrency: int,
    ) -> None:
        self.store = store
        self.base = base
        self.keys = keys
        self.counters = counters
        self.skew_s = skew_s
        self.max_object_bytes = max_object_bytes
        self.get_attempts = get_attempts
        self.fetch_concurrency = fetch_concurrency
        self.retry: dict[str, int | None] = {}
        """Segments listed whose GET failed, with their listed sizes: fetched
        by name next time, even once the listing floor has passed them."""
        self.failures: dict[str, int] = {}
        """GETs failed so far (not counting skips), by name."""
        self.skipped: dict[str, str] = {}
        """Names skipped for good, with the reason; forgotten once a listing
        of their directory no longer shows them."""
        self._future: set[str] = set()
        """Names stamped in the future at the last listings (counted once)."""

    def skip(self, name: str, reason: str, detail: object = "") -> None:
        """Skip ``name`` for good, counted once: as ``manifest_skipped`` for
        the :data:`SKIP_REASONS`, and as ``manifest_errors`` for a read that
        failed (garbage, denied, gone)."""
        self.retry.pop(name, None)
        self.failures.pop(name, None)
        if name in self.skipped:
            return
        self.skipped[name] = reason
        if reason in SKIP_REASONS:
            self.counters.add(f"manifest_skipped_{reason}")
        if reason in ("garbage", "denied", "gone", "unsigned"):
            self.counters.add("manifest_errors")
        (log.debug if reason == "marker" else log.warning)(
            "s3kv: skipping manifest object %s (%s)%s", name, reason, f": {detail}" if detail else ""
        )

    def sift(
        self, listed: list[ObjectMeta], kind: str, now_ms: int, seen: Container[str] = ()
    ) -> list[ObjectMeta]:
        """The listed objects worth a GET: new (not in ``seen``), named as a
        ``kind`` is, not stamped in the future, of a plausible size. The
        rest are skipped (the future ones only until time catches up with them)."""
        out: list[ObjectMeta] = []
        future: set[str] = set()
        limit = now_ms + int(self.skew_s * 1000)
        for meta in listed:
            name = meta.key
            if name in seen or name in self.skipped or name in self.retry:
                continue
            parsed = parse_name(self.base, name, directory=self.store.directory)
            if name.endswith("/"):
                self.skip(name, "marker")
            elif parsed is None or parsed.kind != kind:
                self.skip(name, "foreign")
            elif parsed.ts > limit:
                if name not in self._future:
                    self.counters.add("manifest_skipped_future")
                    log.warning("s3kv: manifest object %s is stamped in the future; not applied yet", name)
                future.add(name)
            elif meta.size > self.max_object_bytes:
                self.skip(name, "oversize", f"{meta.size} bytes listed")
            elif meta.size < mf.MIN_BYTES:
                self.skip(name, "garbage", f"{meta.size} bytes listed")
            else:
                out.append(meta)
        # Forget what this directory's listing no longer shows (below the
        # floor now, or deleted): memory stays bounded by what the bucket holds.
        directory = self.base + _DIRS[kind]
        shown = {m.key for m in listed}
        self._future = {n for n in self._future if not n.startswith(directory)} | future
        self.skipped = {n: r for n, r in self.skipped.items() if n in shown or not n.startswith(directory)}
        return out

    async def get(self, name: str, size: int | None = None) -> mf.ManifestObject:
        """Read and decode one object, never more than ``max_object_bytes``
        + 1 bytes of it, whatever it became since it was listed."""
        return mf.decode(await self.fetch(name, size), name=name, keys=self.keys)

    async def fetch(self, name: str, size: int | None = None) -> bytes:
        """One object's bytes, never more than ``max_object_bytes`` + 1 of
        them (TooLarge beyond ``max_object_bytes``)."""
        bound = self.max_object_bytes
        if size is not None and size > bound:
            raise TooLarge(f"{name}: {size} bytes, more than {bound}")
        if size is not None and size > 2 * RANGE_BYTES:
            parts = await asyncio.gather(
                *(
                    self.store.get(name, ByteRange(start, min(start + RANGE_BYTES, size)))
                    for start in range(0, size, RANGE_BYTES)
                )
            )
            data = b"".join(parts)
        else:
            data = await self.store.get(name, ByteRange(0, bound + 1))
        if len(data) > bound:
            raise TooLarge(f"{name}: more than {bound} bytes")
        return data

    async def read(self, name: str, size: int | None, kind: str) -> mf.ManifestObject | None:
        """One object, or None when it is skipped (counted) or left for a retry."""
        try:
            obj = await self.get(name, size)
            if obj.kind != kind:
                raise CorruptManifest(f"{name}: a {obj.kind}, not a {kind}")
            if kind == "segment":
                rank_fields(obj.meta)  # nonsense there is garbage
        except UnsignedManifest as e:
            self.skip(name, "unsigned", e)
        except (CorruptManifest, RangeNotSatisfiable) as e:  # a 416: emptied since it was listed
            self.skip(name, "garbage", e)
        except PermissionDenied as e:
            if e.credentials:  # S3 refuses this replica, not the object: retried with the listing
                raise
            self.skip(name, "denied", e)
        except TooLarge as e:
            self.skip(name, "oversize", e)
        except NotFound:  # removed by gc since it was listed
            self.skip(name, "gone")
        except Exception as e:
            self.counters.add("manifest_errors")
            failures = self.failures[name] = self.failures.get(name, 0) + 1
            if failures >= self.get_attempts:
                self.skip(name, "failed", f"{failures} GETs failed, the last: {e}")
            else:
                log.warning("s3kv: fetching manifest object %s failed (%s); retrying later", name, e)
                self.retry[name] = size
        else:
            self.retry.pop(name, None)
            self.failures.pop(name, None)
            return obj
        return None

    async def segments(self, items: Sequence[tuple[str, int | None]]) -> list[tuple[str, mf.ManifestObject]]:
        """Fetch segments (name, listed size): the ones that read, in name order."""
        sem = asyncio.Semaphore(self.fetch_concurrency)

        async def one(name: str, size: int | None) -> tuple[str, mf.ManifestObject] | None:
            async with sem:
                obj = await self.read(name, size, "segment")
            return None if obj is None else (name, obj)

        got = await asyncio.gather(*(one(n, s) for n, s in items))
        return sorted((g for g in got if g is not None), key=lambda g: g[0])
