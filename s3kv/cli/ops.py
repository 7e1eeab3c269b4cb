"""What the commands that look after a shared bucket (``s3kv ls``, ``stats``,
``inspect``, ``verify``, ``gc``: :mod:`s3kv.cli.report`, :mod:`~s3kv.cli.inspection`,
:mod:`~s3kv.cli.verify`, :mod:`~s3kv.cli.gc`) share: opening the bucket, and
listing it with a progress bar."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from s3kv.cli import output as out
from s3kv.cli.settings import Settings
from s3kv.errors import ConfigError, S3KVError, StorageProblem
from s3kv.ops.inventory import Inventory, scan
from s3kv.stores.base import ObjectStore
from s3kv.stores.factory import make_store

T = TypeVar("T")


def run(settings: Settings, body: Callable[[ObjectStore], Awaitable[T]]) -> T:
    """Open the configured bucket (checking credentials and access first), run ``body``."""

    async def main() -> T:
        store = make_store(settings.config)
        try:
            try:
                await store.check_access()
            except (ConfigError, S3KVError) as e:
                raise StorageProblem(f"s3://{settings.config.bucket}: {e}") from e
            return await body(store)
        finally:
            await store.close()

    return asyncio.run(main())


async def scan_bucket(
    store: ObjectStore, s: Settings, namespaces: tuple[str, ...] = (), read_access: bool = True
) -> Inventory:
    with out.bar(s.progress, "listing") as b:
        return await scan(
            store,
            s.config.prefix,
            namespaces=namespaces or None,
            concurrency=s.concurrency,
            progress=b.advance,
            read_access=read_access,
            keys=s.keys,
            manifest_max_bytes=s.config.manifest_max_bytes,
        )
