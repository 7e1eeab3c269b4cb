"""s3kv's worker side, in each vLLM worker process: executes the
scheduler's plans against this rank's KV cache and tiers.

Per step: synchronous loads (CPU tier) start before the forward and are
waited for layer by layer; asynchronous loads (NVMe, S3) start after it and
finish in the background. Stores are copied out of the KV cache as each
layer is saved (into their CPU slot, or a private buffer without a CPU
tier) and written through in the background.

With several KV cache groups each load and store is one group's part of a
chunk: its frames are that group's layers (:class:`PageIO` maps them), its
block ids that group's, and every part has as many frames as the largest
group has layers (padding frames are stored as zeros and never loaded).

Where a part is cut into shards by KV head (:mod:`s3kv.shards`), a rank
holds several: one transfer engine moves each (siblings on one loop), each
with the shard's CPU slots, its heads of every page, and its objects; their
reports are combined into the rank's (:class:`ShardReports`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from s3kv.auth import FleetKeys
from s3kv.config import S3KVConfig
from s3kv.connector.layerwise import LayerwiseLoad
from s3kv.connector.layout import EngineLayout
from s3kv.connector.metadata import S3KVMetadata, S3KVWorkerMetadata
from s3kv.connector.pages import PageIO
from s3kv.connector.rank_shards import Shard, configure, rank_shards
from s3kv.errors import ConfigError
from s3kv.manifest.publish import Published, ShardPublisher
from s3kv.stats import Counters
from s3kv.tiering.plan import LoadChunk, Place, StoreChunk, TierReport
from s3kv.tiering.worker.hostpool import HostPool
from s3kv.tiering.worker.publisher import start_publisher
from s3kv.tiering.worker.refusal import Refusal
from s3kv.tiering.worker.sending import FinishedSending
from s3kv.tiering.worker.shard_reports import PublishedShards, ShardReports
from s3kv.tiering.worker.steps import StepTimer
from s3kv.tiering.worker.stores import StoreJob
from s3kv.tiering.worker.sync_loads import SyncLoads
from s3kv.tiering.worker.transfer import TransferEngine

if TYPE_CHECKING:
    import numpy as np
    import torch

log = logging.getLogger("s3kv.worker")


class _StepStores:
    """This step's stores and the host buffers their pages go to (each shard's frames)."""

    def __init__(self, meta: S3KVMetadata, buffers: list[tuple[StoreChunk, list[list[np.ndarray]]]]) -> None:
        self.meta = meta
        self.buffers = buffers
        self.copied: set[int] = set()


class WorkerSide:
    def __init__(
        self,
        config: S3KVConfig,
        layout: EngineLayout,
        rank: int,
        num_blocks: int,
        keys: FleetKeys | None = None,
    ) -> None:
        self.config = config
        self.layout = layout
        self.rank = rank
        """This worker's TP rank in its pipeline stage."""
        self.worker = layout.pp_rank * layout.tp_size + rank
        """This worker among all of the engine's (stage by stage)."""
        self.num_blocks = num_blocks
        self.keys = keys
        self.counters = Counters(f"rank{self.worker}")
        self.shards = rank_shards(config, layout, rank, self.counters, keys)
        """The shards this rank holds (one, unless parts are cut by KV head)."""
        self._combined = ShardReports(len(self.shards))
        writers = layout.writers
        self._publishes = (writers.index(self.worker), len(writers)) if self.worker in writers else None
        """(Its index, how many) among the workers that write shards and publish them; None: it writes none."""
        self.pages: PageIO | None = None
        self._pool_tensor: torch.Tensor | None = None
        self._sync: LayerwiseLoad | None = None
        self._sync_loads = SyncLoads(self.worker, self.counters)
        """This step's synchronous loads (their requests and chunks), reported once copied."""
        self._stores: _StepStores | None = None
        self._load_errors: set[int] = set()
        self._failed_loads: set[str] = set()
        """Requests whose asynchronous load failed in part, until vLLM hears they finished."""
        self._sending = FinishedSending()
        """Held requests whose copies are done, reported as finished sending once vLLM passed them."""
        self._report = TierReport()
        self.refusal: Refusal | None = None
        """This rank refuses every transfer (its fleet key is not the scheduler side's)."""
        self.publisher: ShardPublisher | None = None
        """This rank's publisher of the chunk objects it creates (with S3; journaled where asked)."""
        self._steps = StepTimer(layout.pp_size)
        """Rank 0: the forwards timed, for the scheduler side's cost model."""

    @property
    def engine(self) -> TransferEngine:
        """The engine of this rank's first shard (the one with the loop, the store and the publisher)."""
        return self.shards[0].engine

    @property
    def pool(self) -> HostPool | None:
        """The CPU slots of this rank's first shard."""
        return self.shards[0].pool

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.pages = PageIO(
            kv_caches,
            self.layout.layer_names,
            self.num_blocks,
            self.layout.kv_groups,
            head_axis=self.layout.head_axis,
            frames=self.layout.frames,
        )
        first = self.pages.layers[0]
        expected = self.layout.page_size_bytes
        if expected and any(layer.page_bytes != expected for layer in self.pages.layers):
            raise ConfigError(
                f"KV cache pages are {first.page_bytes} bytes a block, vLLM's spec says {expected}: "
                "this attention backend's layout is not supported"
            )
        local = self.layout.local_kv_heads
        if self.layout.head_axis is not None and any(layer.num_heads != local for layer in self.pages.layers):
            raise ConfigError(
                f"KV cache shape {tuple(first.u8.shape)} does not hold this rank's {local} KV heads on "
                f"axis {self.layout.head_axis}: this attention backend's layout cannot be cut by head"
            )

        pages = self.pages

        def host_buffer(nbytes: int) -> np.ndarray:
            self._pool_tensor = pages.host_buffer(nbytes, pinned=True, resident=True)
            return self._pool_tensor.numpy()

        configure(self.shards, first, pages.frames, self.config, self.layout.block_size, host_buffer)

    def bind(self, meta: S3KVMetadata) -> None:
        """A step's plans: the first that names the namespace sets it (the
        scheduler side plans nothing before it knows the model's identity),
        and checks that this rank holds the scheduler side's fleet key; this
        rank's publisher starts with it."""
        namespace = meta.namespace
        if namespace is not None:
            fresh = namespace != self.engine.namespace
            if fresh:
                own = self.keys.signing_kid if self.keys is not None else None
                refusal = Refusal.check(own, meta.signing_kid, self.rank)
                if refusal is not None:
                    self.refusal = refusal
                    self.counters.add("key_mismatch")
            if self.publisher is None and meta.writer is not None and self._publishes is not None:
                self.publisher = start_publisher(
                    self.engine,
                    self.config,
                    namespace,
                    meta.writer,
                    rank=self._publishes[0],
                    ranks=self._publishes[1],
                    shards=[shard.role.index for shard in self.shards],
                    counters=self.counters,
                )
                fresh = fresh or self.publisher is not None
            if fresh:  # the handlers are built for it, S3's with the publisher it tells of its PUTs
                published: Published | None = self.publisher
                if published is not None and len(self.shards) > 1:  # a chunk once all its shards are
                    published = PublishedShards(published, len(self.shards))
                for shard in self.shards:
                    shard.engine.set_namespace(namespace, published)
        if self.publisher is not None and meta.clock_ms:
            self.publisher.observe(meta.clock_ms)
        if self.publisher is not None and meta.published:
            self.publisher.acked(meta.published)

    def begin_step(self, meta: S3KVMetadata) -> None:
        """vLLM bound this step's plans, before its forward: rank 0 times a
        prefill's forward, for the scheduler side's cost model."""
        pages = self.pages if self.worker == 0 and meta.step is not None else None
        self._steps.begin(pages.step_clock() if pages is not None else None, meta.step)

    # -- loads ---------------------------------------------------------------------
    def start_load(self, meta: S3KVMetadata) -> None:
        assert self.pages is not None
        if self.refusal is not None:
            errors, reqs = self.refusal.loads(meta.loads, meta.prefetch, self._report)
            self._sync_loads.start(reqs)
            self._load_errors |= errors
            self._failed_loads.update(plan.req_id for plan in meta.loads if not plan.sync)
            return
        for plan in meta.prefetch:
            for shard in self.shards:
                shard.engine.submit_prefetch(plan.chunks)
        pages = self.pages
        # Async writes wait for the forward's use of the blocks (a device event: only when needed).
        after = pages.forward_mark() if any(not plan.sync for plan in meta.loads) else None
        into = [pages.load_pages(after, shard.heads) for shard in self.shards]

        sync: list[tuple[LoadChunk, list[np.ndarray]]] = []
        heads: list[tuple[int, int] | None] = []
        self._sync_loads.start()
        for plan in meta.loads:
            if plan.failed:  # parts no tier holds: vLLM recomputes from there
                self._load_errors.update(plan.failed)
                self._failed_loads.add(plan.req_id)
            if not plan.sync:
                for shard, sink in zip(self.shards, into, strict=True):
                    shard.engine.submit_load(plan.req_id, plan.chunks, sink)
                continue
            self._sync_loads.reqs.append(plan.req_id)
            for c in plan.chunks:
                src = c.sources[0]  # a synchronous load reads a tier that holds pages (a CPU slot)
                held = [self._slot_pages(shard, src, c.key) for shard in self.shards]
                if any(views is None for views in held):
                    log.warning(
                        "s3kv: %s slot %s does not hold chunk %s", src.tier.value, src.slot, c.key.hex()
                    )
                    self._load_errors.update(c.write_ids)
                    self._report.missing.add((src.tier, c.key))
                    continue
                for shard, views in zip(self.shards, held, strict=True):
                    sync.append((c, views))  # type: ignore[arg-type]
                    heads.append(shard.heads)
                self._sync_loads.chunks.append(c)
        if sync:
            self._sync = LayerwiseLoad(pages, sync, heads)

    @staticmethod
    def _slot_pages(shard: Shard, src: Place, key: bytes) -> list[np.ndarray] | None:
        """``shard``'s frames of ``key`` in the tier at ``src`` that holds pages; None if not there."""
        tier = shard.engine.page_tier(src)
        return tier.pages(src, key) if tier is not None else None

    def wait_for_layer(self, layer_name: str) -> None:
        if self._sync is not None and self.pages is not None:
            i = self.pages.index_of.get(layer_name)
            if i is not None:
                self._sync.wait_layer(i)

    def _finish_sync_load(self) -> None:
        """The step's synchronous load is over: wait for its copies (on the
        host too, so the scheduler may reuse its CPU slots) and report it."""
        load, self._sync = self._sync, None
        if load is not None:
            load.wait_all()
            if self.pages is not None:
                self.pages.synchronize()
        self._sync_loads.over(self._report, self._load_errors, load)

    # -- stores --------------------------------------------------------------------
    def _step_stores(self, meta: S3KVMetadata) -> _StepStores | None:
        """This step's store buffers, made on first use."""
        if self._stores is not None and self._stores.meta is meta:
            return self._stores
        self._stores = None
        if not meta.stores or self.pages is None or self.refusal is not None:
            return None
        buffers = []
        for s in meta.stores:
            bufs = [self._store_buffers(shard, s) for shard in self.shards]
            if any(b is None for b in bufs):  # over the byte budget: not even copied
                for shard in self.shards:
                    shard.engine.drop(s)
                continue
            buffers.append((s, bufs))
        self._stores = _StepStores(meta, buffers)  # type: ignore[arg-type]
        return self._stores

    def _store_buffers(self, shard: Shard, s: StoreChunk) -> list[np.ndarray] | None:
        """Where ``shard``'s frames of the store ``s`` are copied: its CPU
        slot, or private host memory (None: over the byte budget)."""
        assert self.pages is not None
        engine, frames = shard.engine, self.pages.frames
        place = next((p for p in s.targets if engine.takes_pages(p)), None)
        tier = engine.page_tier(place) if place is not None else None
        if tier is not None and place is not None and place.slot is not None:  # copied into its slot
            bufs = tier.stage(place)
        else:
            nbytes = self.pages.layers[0].frame_bytes(len(s.block_ids), shard.heads)
            if not engine.accepts(nbytes * frames):
                return None
            flat = self.pages.host_buffer(nbytes * frames, pinned=True).numpy()
            bufs = [flat[i * nbytes : (i + 1) * nbytes] for i in range(frames)]
        for pad in bufs[len(self.pages.layers_of(s.group)) :]:  # frames past the group's layers: zeros
            pad.fill(0)
        return bufs

    def save_layer(self, meta: S3KVMetadata, layer_name: str) -> None:
        """The forward has written this layer's KV for the step: copy it out."""
        assert self.pages is not None
        i = self.pages.index_of.get(layer_name)
        step = self._step_stores(meta)
        if step is not None and i is not None:
            self._copy_out(step, i)

    def _copy_out(self, step: _StepStores, layer: int) -> None:
        """Copy one layer out into the frame its group gives it, in each
        store of that group: pages from the store's ``first_block`` on, zeros before."""
        assert self.pages is not None
        if layer in step.copied:
            return
        group, frame = self.pages.frame_of[layer]
        for s, per_shard in step.buffers:
            if s.group == group:
                for shard, bufs in zip(self.shards, per_shard, strict=True):
                    self.pages.read_into(layer, s.block_ids, bufs[frame], s.first_block, shard.heads)
        step.copied.add(layer)

    def save(self, meta: S3KVMetadata) -> None:
        """End of the step: copy the layers not saved yet (a step without a
        forward saves none), then hand the stores to the background."""
        self._report.step_timings += self._steps.end()
        self._finish_sync_load()
        if self.pages is None:
            return
        if self.refusal is not None:
            self.refusal.stores(meta.stores, self._report)
            self._sending.copied(meta.held)  # nothing was copied out of their blocks
            return
        step = self._step_stores(meta)
        if step is not None:
            for i in range(len(self.pages.layers)):
                self._copy_out(step, i)
            ready = self.pages.fence()
            for s, per_shard in step.buffers:
                for shard, bufs in zip(self.shards, per_shard, strict=True):
                    shard.engine.submit_store(
                        StoreJob(s.key, bufs, s.targets, ready if self.pages.on_device else None, s.pinned)
                    )
            if meta.held:
                ready()  # the blocks of finished requests go back to vLLM next
        self._stores = None
        self._sending.copied(meta.held)

    def handle_preemptions(self, meta: S3KVMetadata) -> None:
        """Preempted requests' blocks may be reused by this step's forward:
        no copy out of them may still be pending."""
        if meta.preempted and self.pages is not None:
            self.pages.synchronize()

    # -- reports -------------------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        polled = self._combined.combine([shard.engine.poll() for shard in self.shards])
        if polled.finished_loads and self.pages is not None:
            self.pages.synchronize()
        for req_id, failed in polled.finished_loads.items():
            for chunk in failed:
                self._load_errors.update(chunk.write_ids)
            if failed:
                self._failed_loads.add(req_id)
        self._report = self._report.aggregate(polled.report)
        # vLLM accepts only ids it has passed here as finished: held requests
        # are, in the same step that asks for their copies.
        sent = self._sending.take(finished_req_ids)
        refused = self.refusal.take_finished() if self.refusal is not None else set()
        return sent or None, (set(polled.finished_loads) | refused) or None

    def take_load_errors(self) -> set[int]:
        """Blocks whose load failed, for vLLM to recompute from the first;
        none with several KV cache groups (a block id names no group: vLLM
        takes whole failed requests instead, :meth:`take_failed_loads`)."""
        errors, self._load_errors = self._load_errors, set()
        return errors if self.layout.groups is None else set()

    def take_failed_loads(self, finished: set[str]) -> set[str]:
        """Requests among ``finished`` (their asynchronous loads over) that
        failed in part: with several KV cache groups vLLM recomputes them whole."""
        failed = self._failed_loads & finished
        self._failed_loads -= failed
        return failed if self.layout.groups is not None else set()

    def take_report(self) -> S3KVWorkerMetadata | None:
        if self._report.is_empty():
            return None
        report, self._report = self._report, TierReport()
        return S3KVWorkerMetadata(report)

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for this rank's queued loads and stores
        (uploads included); True if all of them finished."""
        return self.engine.drain(timeout_s)

    def shutdown(self, budget_s: float | None = None) -> None:
        """Stop taking stores, let the uploads under way finish and publish
        them, within ``budget_s`` (``shutdown_flush_s``); the rest is abandoned."""
        self._finish_sync_load()
        budget = self.config.shutdown_flush_s if budget_s is None else budget_s
        publisher = self.publisher
        self.engine.close(
            budget, publisher.publish if publisher is not None else None
        )  # the loop: every shard's
        for shard in self.shards[1:]:
            shard.engine.close()
        left = publisher.close() if publisher is not None else 0
        if left:
            self.counters.add("manifest_unpublished", left)
            log.warning(
                "s3kv: %d stored chunks not published at shutdown "
                "(the front end's journal replay, or else gc's compaction, publishes them)",
                left,
            )
        for shard in self.shards:
            shard.pool = None
        self._pool_tensor = None
