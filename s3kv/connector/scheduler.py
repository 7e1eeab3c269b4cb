"""s3kv's scheduler side, in vLLM's engine-core process.

It answers vLLM's lookups from memory (the local tiers' indexes and the
bucket's hot :class:`Manifest`), plans loads and stores with the
:class:`Planner`, and learns from the workers' reports. Start-up checks
credentials and the bucket; the model's identity (a digest of its weights),
then the tiers' set-up for its namespace (the NVMe tier scans its
directory) and the manifest are done in the background (waited for a few
seconds), so serving starts at once: until the namespace is known the
replica offers no hits and stores nothing. The tiers are built from their
specs (:mod:`s3kv.tiering.tiers.registry`), each set up, cleaned up and
shut down by its own manager: none is named here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from s3kv import descriptor
from s3kv.auth import FleetKeys
from s3kv.config import DEFAULTS, S3KVConfig
from s3kv.connector.layout import EngineLayout
from s3kv.connector.metadata import S3KVMetadata, S3KVWorkerMetadata
from s3kv.connector.requests import RequestReader
from s3kv.errors import AlreadyExists, ConfigError
from s3kv.identity import DigestCache, resolve_identity
from s3kv.keys import Namespace, namespace_prefix
from s3kv.manifest import Manifest, ManifestSync, SyncSettings
from s3kv.manifest.protocol import manifest_prefix
from s3kv.stats import SERIES, Counters
from s3kv.stores.base import PutMode
from s3kv.stores.factory import make_store
from s3kv.tiering.loop import BackgroundLoop
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import ScheduledRequest, TierEvent
from s3kv.tiering.scheduler.planner import Planner
from s3kv.tiering.tiers.manager import TierManager
from s3kv.tiering.tiers.registry import TIERS
from s3kv.tiering.tiers.spec import ManagerEnv, TierSpec
from s3kv.units import format_size

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("s3kv.scheduler")


def _check_prefetch(config: S3KVConfig, shard_bytes: int) -> S3KVConfig:
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


STARTUP_WAIT_S = 5.0
"""At start-up, wait this long for the model's identity and the manifest, so
that a fresh replica's first requests already hit; what takes longer (a
first start hashing a large model's weights) goes on in the background
while vLLM serves without the cache."""


class SchedulerSide:
    def __init__(
        self,
        config: S3KVConfig,
        layout: EngineLayout,
        *,
        failure_policy: str,
        model: str,
        emit_events: bool = False,
        digest_cache: DigestCache | None = None,
        keys: FleetKeys | None = None,
    ) -> None:
        config = _check_prefetch(config, layout.shard_bytes(config.chunk_tokens))
        self.config = config
        self.keys = keys
        self.layout = layout
        self.counters = Counters("scheduler")
        self._model_name = model
        self._emit_events = emit_events
        self.index = Manifest() if config.uses_s3 else None
        self.namespace: Namespace | None = None
        self.planner: Planner | None = None
        """Made once the model's identity is known (:meth:`_activate`); until
        then the replica offers no hits and stores nothing."""
        self._digests = digest_cache if digest_cache is not None else DigestCache()
        self.requests = RequestReader(layout.block_size, config.chunk_tokens, self._digests, self.counters)
        """Reads each request's keying and load policy."""
        self.kv_cache_manager: KVCacheManager | None = None
        if failure_policy != "recompute":
            log.warning(
                "s3kv: kv_load_failure_policy is %r: a chunk that fails to load (deleted, "
                'corrupt, S3 down) fails the request. Set "kv_load_failure_policy": "recompute" '
                "in --kv-transfer-config so vLLM recomputes instead.",
                failure_policy,
            )
        self._loop = BackgroundLoop("s3kv-scheduler")
        self._store = make_store(config, self.counters) if config.uses_s3 else None
        self._sync: ManifestSync | None = None
        env = ManagerEnv(
            config,
            layout.world_size,
            layout.shard_bytes(config.chunk_tokens),
            self.counters,
            self.index,
            self._store,
            lambda coro, timeout_s: self._loop.run(coro, timeout=timeout_s),
        )
        try:
            self._managers: dict[TierSpec, TierManager] = {
                spec: m for spec in TIERS if (m := spec.manager(env)) is not None
            }
            """Every tier on in the config, nearest first (each opened for the namespace in :meth:`_activate`)."""
        except BaseException:  # a config a tier cannot work with: start-up fails, nothing left running
            self.requests.close()
            self._loop.stop(timeout=5)
            raise
        self._ready = threading.Event()
        self._start_task: concurrent.futures.Future[None] = self._loop.submit(self._start())
        if not self._ready.wait(STARTUP_WAIT_S):
            log.info("s3kv: the model's identity or the manifest goes on loading in the background")

    async def _start(self) -> None:
        """Resolve the model's identity (hashing its weights on a first
        start), set the tiers up for its namespace, then keep the manifest in
        step with the fleet until cancelled."""
        started = time.monotonic()
        what = "the model's identity cannot be established"
        try:
            identity = await asyncio.to_thread(resolve_identity, self.layout.model, self._digests)
            what = "setting the tiers up failed"
            await asyncio.to_thread(self._activate, identity, time.monotonic() - started)
        except Exception as e:
            log.error("s3kv: %s (%s); this replica serves without the KV cache", what, e)
            self._ready.set()  # nothing to wait for
            return
        if self._sync is None:
            self._ready.set()
            return

        def on_loaded() -> None:
            for m in self._managers.values():
                m.resume()
            self._ready.set()

        await self._sync.run(on_loaded)

    def _activate(self, identity: dict[str, Any], identity_s: float) -> None:
        """The identity is known: build the namespace's tiers and planner."""
        config, layout = self.config, self.layout
        namespace = layout.namespace(identity)
        tiers = {spec: m for spec, m in self._managers.items() if m.activate(namespace.id)}  # nearest first
        if self._store is not None:
            assert self.index is not None
            self._sync = ManifestSync(
                self._store,
                manifest_prefix(config.prefix, namespace.id),
                self.index,
                SyncSettings.from_config(config),
                counters=self.counters,
                keys=self.keys,
            )
            self._loop.submit(self._describe_namespace(namespace))
        planner = Planner.from_config(
            config,
            namespace=namespace,
            block_size=layout.block_size,
            tiers=list(tiers.values()),
            world_size=layout.world_size,
            emit_events=self._emit_events,
            counters=self.counters,
            chunk_bytes=layout.shard_bytes(config.chunk_tokens),
        )
        self.namespace = namespace
        self.planner = planner  # last: the scheduling loop starts using it now
        log.info(
            "s3kv: namespace %s (identity in %.2f s); tiers: %s (chunk_tokens=%d, block_size=%d, ranks=%d)",
            namespace.id,
            identity_s,
            ", ".join(f"{s.tier.value} {tiers[s].describe() if s in tiers else 'off'}" for s in TIERS),
            config.chunk_tokens,
            layout.block_size,
            layout.world_size,
        )

    # -- start-up -------------------------------------------------------------
    async def _describe_namespace(self, namespace: Namespace) -> None:
        """Leave a small descriptor so operators can tell namespaces apart (and
        the ops commands know what its chunks hold: :mod:`s3kv.descriptor`)."""
        key = namespace_prefix(self.config.prefix, namespace.id) + descriptor.NAME
        body = descriptor.encode(namespace, self._model_name, self.config.chunk_tokens)
        try:
            await self._store.put(key, body, mode=PutMode.CREATE)
        except AlreadyExists:
            pass
        except Exception as e:
            log.debug("s3kv: namespace descriptor not written: %s", e)

    # -- vLLM hooks -------------------------------------------------------------
    def lookup(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if request.prompt_token_ids is None:  # prompt embeddings only: nothing to key on
            return 0, False
        planner = self.planner
        keying = self.requests.keying(request) if planner is not None else None
        if keying is None:  # no hits, and (the planner not knowing it) no stores
            self.requests.unkeyed(request, "model" if planner is None else "adapter")
            return 0, False
        assert planner is not None
        if not planner.knows(request.request_id):
            self.counters.add("lookup_requests")
            self.counters.add("lookup_tokens", request.num_prompt_tokens)
        return planner.lookup(
            request.request_id,
            request.all_token_ids,
            request.num_tokens,
            num_computed_tokens,
            keying.extras,
            num_prompt_tokens=request.num_prompt_tokens,
            prefix_ids=keying.prefix_ids,
            policy=self.requests.policy(request),
        )

    def on_arrival(self, request: Request) -> None:
        """A request entered vLLM's queue: prefetch what only S3 holds of its hit."""
        planner = self.planner
        if planner is None or not planner.prefetcher.enabled or request.prompt_token_ids is None:
            return
        keying = self.requests.keying(request)
        if keying is None:
            return
        planner.prefetch(
            request.request_id,
            request.all_token_ids,
            request.num_tokens,
            keying.extras,
            num_prompt_tokens=request.num_prompt_tokens,
            prefix_ids=keying.prefix_ids,
        )

    def on_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0 or self.planner is None:
            return
        self.planner.on_alloc(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def hit_sources(self, request: Request) -> dict[Tier, int]:
        return self.planner.hit_sources(request.request_id) if self.planner is not None else {}

    def build_meta(self, out: SchedulerOutput) -> S3KVMetadata:
        planner = self.planner
        kid = self.keys.signing_kid if self.keys is not None else None
        if planner is None:
            return S3KVMetadata(signing_kid=kid)
        scheduled: list[ScheduledRequest] = []
        for new in out.scheduled_new_reqs:
            scheduled.append(
                ScheduledRequest(
                    new.req_id,
                    new.num_computed_tokens,
                    out.num_scheduled_tokens.get(new.req_id, 0),
                    lambda ids=new.block_ids: ids[0],
                )
            )
        cached = out.scheduled_cached_reqs
        manager = self.kv_cache_manager
        for i, req_id in enumerate(cached.req_ids):
            if manager is None:
                break
            scheduled.append(
                ScheduledRequest(
                    req_id,
                    cached.num_computed_tokens[i],
                    out.num_scheduled_tokens.get(req_id, 0),
                    lambda r=req_id: manager.get_block_ids(r)[0],
                )
            )
        plan = planner.plan_step(scheduled)
        return S3KVMetadata(
            loads=plan.loads,
            stores=plan.stores,
            held=plan.held,
            preempted=bool(out.preempted_req_ids),
            namespace=planner.namespace.id,
            signing_kid=kid,
            writer=self._sync.writer if self._sync is not None else None,
            clock_ms=self._sync.clock_ms if self._sync is not None else 0,
            step=plan.step,
            prefetch=plan.prefetch,
        )

    def on_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        p = self.planner
        if p is None:  # nothing was planned yet, so nothing to hear of
            return
        if isinstance(meta, S3KVWorkerMetadata):
            p.on_report(meta.report)
        p.on_recved(output.finished_recving or ())
        p.on_sent(output.finished_sending or ())

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """True: vLLM keeps the blocks until the workers copied the request's
        last chunks (those with generated tokens) out of them."""
        self.requests.finished(request.request_id)
        if self.planner is None:
            return False
        computed = max(0, request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0))
        return self.planner.request_finished(request.request_id, block_ids, computed)

    def take_events(self) -> list[TierEvent]:
        return self.planner.take_events() if self.planner is not None else []

    def take_stats(self) -> dict[str, Any]:
        """This step's figures, with the gauges only the scheduler knows."""
        c = self.counters
        if self.index is not None:
            c.set("manifest_keys", len(self.index))
        if self._sync is not None and self._sync.refreshed_at is not None:
            c.set("manifest_staleness_seconds", round(max(0.0, time.time() - self._sync.refreshed_at)))
        p = self.planner
        if p is not None:
            for name in SERIES:  # a tier that is off has no breaker, and it is not open
                if name.startswith("breaker_open_"):
                    c.set(name, 0)
            for name, value in p.stack.gauges().items():
                c.set(name, value)
            if p.cost is not None:
                for name, value in p.cost.gauges().items():
                    c.set(name, value)
        return c.take()

    def shutdown(self, budget_s: float | None = None) -> None:
        """Publish what only the scheduler side knows (keys found stored by
        a 412, bad objects, uses) and let go, all within ``budget_s``
        (``shutdown_flush_s``): the workers publish their own stores."""
        budget = self.config.shutdown_flush_s if budget_s is None else budget_s
        deadline = time.monotonic() + budget

        def left() -> float:
            return max(0.1, deadline - time.monotonic())

        self._start_task.cancel()  # a publish it was making puts its keys back
        with contextlib.suppress(Exception):
            concurrent.futures.wait([self._start_task], timeout=left())
        self.requests.close()
        if self._sync is not None and self._sync.loaded:
            try:  # what this replica learnt since the last publish
                self._loop.run(self._sync.publish(), timeout=left())
            except Exception as e:
                log.warning("s3kv: could not publish the manifest at shutdown: %r", e)
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._loop.run(self._store.close(), timeout=left())
        self._loop.stop(timeout=left())
        for m in self._managers.values():
            m.close()
