"""What the scheduler side runs besides vLLM's hooks: the background loop,
the bucket's store and the manifest kept in step with the fleet, the tiers'
managers, their start-up and their shutdown.

Start-up checks the config, credentials and the bucket at once; the model's
identity (a digest of its weights), then the tiers' set-up for its
namespace (the NVMe tier scans its directory) and the manifest are done in
the background (waited for a few seconds), so serving starts at once: until
the namespace is known there is no :attr:`SchedulerRuntime.planner`, and
the replica offers no hits and stores nothing. The tiers are built from
their specs (:mod:`s3kv.tiering.tiers.registry`), each set up, cleaned up
and shut down by its own manager: none is named here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

from s3kv import descriptor
from s3kv.auth import FleetKeys
from s3kv.config import DEFAULTS, S3KVConfig
from s3kv.errors import AlreadyExists, ConfigError
from s3kv.identity import DigestCache, ModelSource, resolve_identity
from s3kv.keys import Namespace, namespace_prefix
from s3kv.kvgroups import GroupLayout
from s3kv.manifest import Manifest, ManifestSync, SyncSettings
from s3kv.manifest.protocol import manifest_prefix
from s3kv.shards import Slicing
from s3kv.stats import SERIES, Counters
from s3kv.stores.base import PutMode
from s3kv.stores.factory import make_store
from s3kv.tiering.loop import BackgroundLoop
from s3kv.tiering.scheduler.keychain import HashScheme
from s3kv.tiering.scheduler.planner import Planner
from s3kv.tiering.tiers.manager import TierManager
from s3kv.tiering.tiers.registry import TIERS
from s3kv.tiering.tiers.spec import ManagerEnv, TierSpec
from s3kv.units import format_size

log = logging.getLogger("s3kv.scheduler")

STARTUP_WAIT_S = 5.0
"""At start-up, wait this long for the model's identity and the manifest, so
that a fresh replica's first requests already hit; what takes longer (a
first start hashing a large model's weights) goes on in the background
while vLLM serves without the cache."""


class ModelShape(Protocol):
    """What the runtime needs to know of the engine's model and KV cache
    (the connector's :class:`~s3kv.connector.layout.EngineLayout`)."""

    @property
    def model(self) -> ModelSource: ...

    @property
    def block_size(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def namespace(self, identity: Mapping[str, Any]) -> Namespace: ...

    def shard_bytes(self, chunk_tokens: int) -> int: ...

    @property
    def slicing(self) -> Slicing: ...

    @property
    def shards_per_part(self) -> int: ...

    def object_bytes(self, chunk_tokens: int) -> int: ...

    @property
    def hash_scheme(self) -> HashScheme | None:
        """Chunk keys from vLLM's block hashes (None: from the tokens)."""
        ...

    @property
    def kv_groups(self) -> GroupLayout: ...


def check_prefetch(config: S3KVConfig, shard_bytes: int) -> S3KVConfig:
    """``config`` with a prefetch budget that holds a chunk shard: a smaller
    one set by hand is refused (prefetching would silently never start);
    the default, for a model whose chunks are larger, becomes one shard."""
    n = config.prefetch_bytes
    if n == 0 or n >= shard_bytes:
        return config
    if n != DEFAULTS.prefetch_bytes:
        raise ConfigError(
            f"prefetch_bytes: {format_size(n)} holds no chunk of this model (one chunk takes "
            f"{format_size(shard_bytes)} per worker); use at least {shard_bytes} or 0 to turn prefetching off"
        )
    log.warning(
        "s3kv: prefetch_bytes' default (%s) holds no chunk of this model (%s per worker): "
        "prefetching one chunk at a time (prefetch_bytes: %d)",
        format_size(n),
        format_size(shard_bytes),
        shard_bytes,
    )
    return dataclasses.replace(config, prefetch_bytes=shard_bytes)


class SchedulerRuntime:
    """The scheduler side's life outside vLLM: built and started at once (a
    config a tier refuses raises ConfigError, nothing left running), the
    namespace's planner made in the background, shut down within a budget."""

    def __init__(
        self,
        config: S3KVConfig,
        shape: ModelShape,
        *,
        model_name: str,
        counters: Counters,
        digests: DigestCache,
        emit_events: bool = False,
        keys: FleetKeys | None = None,
    ) -> None:
        shard_bytes = shape.shard_bytes(config.chunk_tokens)
        config = check_prefetch(config, shard_bytes)
        self.config, self.shape, self.keys, self.counters = config, shape, keys, counters
        self._model_name, self._emit_events, self._digests = model_name, emit_events, digests
        self.index = Manifest() if config.uses_s3 else None
        self.namespace: Namespace | None = None
        self.planner: Planner | None = None
        """Made once the model's identity is known (:meth:`_activate`)."""
        self.loop = BackgroundLoop("s3kv-scheduler")
        self.store = make_store(config, counters) if config.uses_s3 else None
        self.sync: ManifestSync | None = None
        """The manifest kept in step with the fleet, once the namespace is known."""
        env = ManagerEnv(
            config,
            shape.world_size,
            shard_bytes,
            counters,
            self.index,
            self.store,
            lambda coro, timeout_s: self.loop.run(coro, timeout=timeout_s),
            shards=shape.shards_per_part,
            object_bytes=shape.object_bytes(config.chunk_tokens),
        )
        try:
            self._managers: dict[TierSpec, TierManager] = {
                spec: m for spec in TIERS if (m := spec.manager(env)) is not None
            }
            """Every tier on in the config, nearest first (each opened for the namespace in :meth:`_activate`)."""
        except BaseException:  # a config a tier cannot work with: start-up fails, nothing left running
            self.loop.stop(timeout=5)
            raise
        self.ready = threading.Event()
        """Set once start-up is over: the manifest loaded, or nothing left to wait for."""
        self.start_task: concurrent.futures.Future[None] = self.loop.submit(self._start())
        if not self.ready.wait(STARTUP_WAIT_S):
            log.info("s3kv: the model's identity or the manifest goes on loading in the background")

    async def _start(self) -> None:
        """Resolve the model's identity (hashing its weights on a first
        start), set the tiers up for its namespace, then keep the manifest in
        step with the fleet until cancelled."""
        started = time.monotonic()
        what = "the model's identity cannot be established"
        try:
            identity = await asyncio.to_thread(resolve_identity, self.shape.model, self._digests)
            what = "setting the tiers up failed"
            await asyncio.to_thread(self._activate, identity, time.monotonic() - started)
        except Exception as e:
            log.error("s3kv: %s (%s); this replica serves without the KV cache", what, e)
            self.ready.set()  # nothing to wait for
            return
        if self.sync is None:
            self.ready.set()
            return

        def on_loaded() -> None:
            for m in self._managers.values():
                m.resume()
            self.ready.set()

        await self.sync.run(on_loaded)

    def _activate(self, identity: dict[str, Any], identity_s: float) -> None:
        """The identity is known: build the namespace's tiers and planner."""
        config, shape = self.config, self.shape
        namespace = shape.namespace(identity)
        tiers = {spec: m for spec, m in self._managers.items() if m.activate(namespace.id)}  # nearest first
        if self.store is not None:
            assert self.index is not None
            self.sync = ManifestSync(
                self.store,
                manifest_prefix(config.prefix, namespace.id),
                self.index,
                SyncSettings.from_config(config),
                counters=self.counters,
                keys=self.keys,
            )
            self.loop.submit(self._describe_namespace(namespace))
        planner = Planner.from_config(
            config,
            namespace=namespace,
            block_size=shape.block_size,
            tiers=list(tiers.values()),
            world_size=shape.world_size,
            emit_events=self._emit_events,
            counters=self.counters,
            chunk_bytes=shape.shard_bytes(config.chunk_tokens),
            groups=shape.kv_groups,
            hash_scheme=shape.hash_scheme,
        )
        self.namespace = namespace
        self.planner = planner  # last: the scheduling loop starts using it now
        log.info(
            "s3kv: namespace %s (identity in %.2f s); tiers: %s (chunk_tokens=%d, block_size=%d, ranks=%d, "
            "shards=%d)",
            namespace.id,
            identity_s,
            ", ".join(f"{s.tier.value} {tiers[s].describe() if s in tiers else 'off'}" for s in TIERS),
            config.chunk_tokens,
            shape.block_size,
            shape.world_size,
            shape.shards_per_part,
        )

    async def _describe_namespace(self, namespace: Namespace) -> None:
        """Leave a small descriptor so operators can tell namespaces apart (and
        the ops commands know what its chunks hold: :mod:`s3kv.descriptor`)."""
        assert self.store is not None
        key = namespace_prefix(self.config.prefix, namespace.id) + descriptor.NAME
        body = descriptor.encode(namespace, self._model_name, self.config.chunk_tokens)
        try:
            await self.store.put(key, body, mode=PutMode.CREATE)
        except AlreadyExists:
            pass
        except Exception as e:
            log.debug("s3kv: namespace descriptor not written: %s", e)

    def gauges(self) -> None:
        """Set the gauges only the scheduler side knows in :attr:`counters`:
        the manifest's size and staleness, the tiers' and the cost model's."""
        c = self.counters
        if self.index is not None:
            c.set("manifest_keys", len(self.index))
        if self.sync is not None and self.sync.refreshed_at is not None:
            c.set("manifest_staleness_seconds", round(max(0.0, time.time() - self.sync.refreshed_at)))
        p = self.planner
        if p is not None:
            c.set("kv_cache_groups", len(p.parts.layout.groups) if p.parts is not None else 1)
            for name in SERIES:  # a tier that is off has no breaker, and it is not open
                if name.startswith("breaker_open_"):
                    c.set(name, 0)
            for name, value in p.stack.gauges().items():
                c.set(name, value)
            if p.cost is not None:
                for name, value in p.cost.gauges().items():
                    c.set(name, value)

    def shutdown(self, budget_s: float | None = None) -> None:
        """Publish what only the scheduler side knows (keys found stored by
        a 412, bad objects, uses) and let go, all within ``budget_s``
        (``shutdown_flush_s``): the workers publish their own stores."""
        budget = self.config.shutdown_flush_s if budget_s is None else budget_s
        deadline = time.monotonic() + budget

        def left() -> float:
            return max(0.1, deadline - time.monotonic())

        self.start_task.cancel()  # a publish it was making puts its keys back
        with contextlib.suppress(Exception):
            concurrent.futures.wait([self.start_task], timeout=left())
        if self.sync is not None and self.sync.loaded:
            try:  # what this replica learnt since the last publish
                self.loop.run(self.sync.publish(), timeout=left())
            except Exception as e:
                log.warning("s3kv: could not publish the manifest at shutdown: %r", e)
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.loop.run(self.store.close(), timeout=left())
        self.loop.stop(timeout=left())
        for m in self._managers.values():
            m.close()
