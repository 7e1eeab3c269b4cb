"""s3kv's scheduler side, in vLLM's engine-core process: vLLM's scheduler
hooks, read and answered by the :class:`Planner`.

It answers vLLM's lookups from memory (the local tiers' indexes and the
bucket's hot :class:`Manifest`), plans loads and stores, and learns from the
workers' reports. What it runs besides the hooks (the tiers' managers, the
manifest, start-up in the background and shutdown) is the core's
:class:`~s3kv.tiering.scheduler.runtime.SchedulerRuntime`; until the model's
identity is known the replica offers no hits and stores nothing.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from s3kv.auth import FleetKeys
from s3kv.config import S3KVConfig
from s3kv.connector.hashing import VllmHashing
from s3kv.connector.layout import EngineLayout
from s3kv.connector.metadata import S3KVMetadata, S3KVWorkerMetadata
from s3kv.connector.requests import Keying, RequestReader
from s3kv.identity import DigestCache
from s3kv.keys import Namespace
from s3kv.manifest import Manifest
from s3kv.stats import Counters
from s3kv.tiering.placement import Tier
from s3kv.tiering.plan import ScheduledRequest, TierEvent
from s3kv.tiering.scheduler.planner import Planner
from s3kv.tiering.scheduler.runtime import SchedulerRuntime

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("s3kv.scheduler")


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
        hashing: VllmHashing | None = None,
    ) -> None:
        self.keys = keys
        self.counters = Counters("scheduler")
        if failure_policy != "recompute":
            log.warning(
                "s3kv: kv_load_failure_policy is %r: a chunk that fails to load (deleted, "
                'corrupt, S3 down) fails the request. Set "kv_load_failure_policy": "recompute" '
                "in --kv-transfer-config so vLLM recomputes instead.",
                failure_policy,
            )
        digests = digest_cache if digest_cache is not None else DigestCache()
        self.runtime = SchedulerRuntime(
            config,
            layout,
            model_name=model,
            counters=self.counters,
            digests=digests,
            emit_events=emit_events,
            keys=keys,
        )
        """The tiers, the manifest and the planner, started (a config a tier refuses raised here)."""
        self.config = self.runtime.config
        """The config, its prefetch budget checked against the model's chunks."""
        self.requests = RequestReader(
            layout.block_size, self.config.chunk_tokens, digests, self.counters, hashing
        )
        """Reads each request's keying and load policy."""
        self.kv_cache_manager: KVCacheManager | None = None

    @property
    def planner(self) -> Planner | None:
        """None until the model's identity is known: no hits, no stores."""
        return self.runtime.planner

    @property
    def namespace(self) -> Namespace | None:
        return self.runtime.namespace

    @property
    def index(self) -> Manifest | None:
        """The bucket's manifest (None without S3)."""
        return self.runtime.index

    # -- vLLM hooks -------------------------------------------------------------
    def lookup(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if request.prompt_token_ids is None:  # prompt embeddings only: nothing to key on
            return 0, False
        planner = self.planner
        keying = self.requests.keying(request) if planner is not None else "model"
        if not isinstance(keying, Keying):  # no hits, and (the planner not knowing it) no stores
            self.requests.unkeyed(request, keying)
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
            block_hashes=keying.block_hashes,
        )

    def on_arrival(self, request: Request) -> None:
        """A request entered vLLM's queue: prefetch what only S3 holds of its hit."""
        planner = self.planner
        if planner is None or not planner.prefetcher.enabled or request.prompt_token_ids is None:
            return
        keying = self.requests.keying(request)
        if not isinstance(keying, Keying):
            return
        planner.prefetch(
            request.request_id,
            request.all_token_ids,
            request.num_tokens,
            keying.extras,
            num_prompt_tokens=request.num_prompt_tokens,
            prefix_ids=keying.prefix_ids,
            block_hashes=keying.block_hashes,
        )

    def on_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0 or self.planner is None:
            return
        self.planner.on_alloc(request.request_id, blocks.get_block_ids(), num_external_tokens)

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
                    lambda ids=new.block_ids: ids,
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
                    lambda r=req_id: manager.get_block_ids(r),
                )
            )
        plan = planner.plan_step(scheduled)
        sync = self.runtime.sync
        return S3KVMetadata(
            loads=plan.loads,
            stores=plan.stores,
            held=plan.held,
            preempted=bool(out.preempted_req_ids),
            namespace=planner.namespace.id,
            signing_kid=kid,
            writer=sync.writer if sync is not None else None,
            clock_ms=sync.clock_ms if sync is not None else 0,
            published=sync.take_published() if sync is not None else [],
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

    def request_finished(self, request: Request, block_ids: list[int] | tuple[list[int], ...]) -> bool:
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
        self.runtime.gauges()
        return self.counters.take()

    def shutdown(self, budget_s: float | None = None) -> None:
        """Stop reading requests, then publish what only the scheduler side
        knows and let go within ``budget_s`` (:meth:`SchedulerRuntime.shutdown`)."""
        self.requests.close()
        self.runtime.shutdown(budget_s)
