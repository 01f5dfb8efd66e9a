"""`KvtierConnector`: vLLM's OffloadingConnector plus failed loads reported as failed.

vLLM 0.32's OffloadingConnector asserts that every transfer succeeds. A tier can miss (a disk
slot overwritten by another process, a corrupt payload, an I/O error), and a KV cache must
never restore wrong bytes, so this subclass changes these things:
- worker side: a load job that finished with `success=False` is reported through vLLM's
  `failed_recving` (with `kv_load_failure_policy: "recompute"` the scheduler recomputes the
  request; the engine keeps serving) instead of tripping the assert;
- scheduler side: the manager forgets the chunks of that load, so the next request is not
  offered the same bad hit.
- the handshake: the worker's page layout goes to the scheduler once
  (`get_handshake_metadata` / `set_xfer_handshake_metadata` -> `manager.adopt_worker_layout`);
- KV events: every tier's commits, evictions and removals reach vLLM's event stream
  (`take_events`, events.py), every group's chunks described (tokens, parent, tokens per block,
  kind and window); a reset is published at once, a restart announces the disk chunks it adopted.
It also hands kvtier's counters to vLLM's stats path (stats.py): each side's
`get_kv_connector_stats()` is what the stock connector reports plus kvtier's counts since the
last step, and `build_prom_metrics()` registers kvtier's Prometheus counters beside vLLM's.
Everything else (scheduling, chunking, hybrid groups) is the stock OffloadingConnector.
A failed load is reported as a failed receive, not as `invalid_block_ids`: vLLM refuses
block-level failures for models with several KV-cache groups, which are the models kvtier is for.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.outputs import KVConnectorOutput

from kvtier.errors import ConfigError

from .common import KvtierConnectorMetadata, KvtierHandshake
from .compat import (engine_id_of, event_group_rules, event_lacks_group_rule, events_tracker, kv_cache_config_for_spec,
                     manager_lock, offloading_group_ids, worker_load_jobs, worker_transfer_meta)
from .counters import Metrics
from .events import DiskJournal, announce_adopted, describe_every_group, publish_now
from .manager import KvtierManager
from .rebuild import mark_reset
from .spec import KvtierOffloadingSpec, chunk_tokens_to_blocks
from .stats import KvtierConnectorStats, KvtierPromMetrics, merge


class KvtierConnector(OffloadingConnector):
    def __init__(self, vllm_config, role, kv_cache_config) -> None:  # noqa: ANN001 - vLLM's types
        _translate_chunk_tokens(vllm_config, kv_cache_config)
        # the spec reads its groups' KV-cache specs from vLLM's own config (compat's hand-over)
        with kv_cache_config_for_spec(engine_id_of(vllm_config), kv_cache_config):
            super().__init__(vllm_config, role, kv_cache_config)  # builds the spec
        w = self.connector_worker
        if w is not None and isinstance(w.spec, KvtierOffloadingSpec):
            w.spec.reports_failures = True
        self._group_rules = event_group_rules(kv_cache_config)
        self._block_tokens = {g: int(grp.kv_cache_spec.block_size)
                              for g, grp in enumerate(getattr(kv_cache_config, "kv_cache_groups", ()))}
        self._early: list = []  # reset removals no publisher was reached for
        self._journal = self._describe_events()

    # -- KV events: every group described on every event (events.py) ------------------------

    def _describe_events(self) -> DiskJournal | None:
        """Every group's chunks self-describing; with a disk tier, its chunks journaled and the
        ones adopted at start announced."""
        s = self.connector_scheduler
        manager = getattr(s, "manager", None)
        if not isinstance(manager, KvtierManager) or not manager.events.enabled or not describe_every_group(s):
            return None
        root = manager.ctx.disk_root
        if root is None or not root.is_dir():
            return None
        tracker = events_tracker(s)
        tracker.kvtier_journal = journal = DiskJournal(root)
        with manager_lock(manager):
            announce_adopted(manager, tracker, journal)
        return journal

    def take_events(self):  # noqa: ANN201 - Iterable[KVCacheEvent]
        """vLLM's events, each BlockStored with its group's kind, sliding window and tokens per
        block filled in where vLLM left them empty (0.32 leaves them empty on every placeholder;
        0.33 too unless self-describing events are on): a router needs them to know what a group
        can restore."""
        rules = self._group_rules
        early, self._early = self._early, []
        yield from early
        for ev in super().take_events():
            if rules and event_lacks_group_rule(ev) and ev.group_idx in rules:
                ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window = rules[ev.group_idx]
            if getattr(ev, "block_size", None) == 0 and ev.group_idx in self._block_tokens:
                ev.block_size = self._block_tokens[ev.group_idx]
            yield ev

    def reset_cache(self) -> bool | None:
        """vLLM's reset, its removals published at once (vLLM would publish them with the next
        step, so a router kept the old view until then) and translated before vLLM's tracker
        forgets the chunks (drained later, a removal deleted the record of the same chunk stored
        again after the reset, whose store then went out without token ids); and made durable:
        the disk chunks it drops are not adopted at the next start."""
        s = self.connector_scheduler
        manager = getattr(s, "manager", None)
        early: list = []
        if isinstance(manager, KvtierManager) and manager.events.enabled:
            with manager_lock(manager):
                manager.events.reset(manager.held.key_of)  # every announced chunk, removed
            early = list(self.take_events())
        self._early = early  # kept until published: with the next step's events if vLLM's reset raises
        result = super().reset_cache()
        if isinstance(manager, KvtierManager):
            mark_reset(manager.ctx.disk_root)  # marked again when the reset's jobs are flushed (manager)
        if early and publish_now(self, early):
            self._early = []  # else no publisher reached: with the next step's events
        return result

    # -- the learned share's ops reach the workers (manager.py `_observe`) --------------------

    def build_connector_meta(self, scheduler_output):  # noqa: ANN001, ANN201 - vLLM's types
        """vLLM's metadata of the step, plus the share ops the manager queued while vLLM built it
        (its finished requests' `on_request_finished`): every worker gets them with this step."""
        meta = super().build_connector_meta(scheduler_output)
        manager = getattr(self.connector_scheduler, "manager", None)
        if not isinstance(manager, KvtierManager):
            return meta
        with manager_lock(manager):
            batch, ops = manager.take_share_ops()
        if not ops:
            return meta
        from dataclasses import fields

        return KvtierConnectorMetadata(**{f.name: getattr(meta, f.name) for f in fields(meta)},
                                       share_ops=ops, share_batch=batch)

    def handle_preemptions(self, kv_connector_metadata) -> None:  # noqa: ANN001 - vLLM's type
        """The step's share ops first: before vLLM submits the previous step's deferred stores
        and this step's loads."""
        self._apply_share_ops(kv_connector_metadata)
        super().handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs) -> None:  # noqa: ANN001 - vLLM's type
        self._apply_share_ops(self._get_connector_metadata())  # once: a no-op after handle_preemptions
        super().start_load_kv(forward_context, **kwargs)

    def _apply_share_ops(self, meta) -> None:  # noqa: ANN001 - vLLM's metadata
        ops = getattr(meta, "share_ops", ())
        worker = getattr(self.connector_worker, "worker", None)
        if ops and worker is not None and hasattr(worker, "apply_share_ops"):
            worker.apply_share_ops(meta.share_batch, ops)

    # -- the workers' layout reaches the scheduler -------------------------------------------
    # vLLM hands the scheduler one representative KV-cache spec per group (it flattens a group
    # of layers with different pages, DeepSeek V4's), the workers the real ones. Slots must be
    # sized alike on both sides, so each worker reports its exact bytes per block through vLLM's
    # handshake (collected after the KV caches are registered, before any request), and the
    # name of the host region its cpu tier lives in, which the scheduler maps then (promotion.py:
    # LookupPromoter).

    def get_handshake_metadata(self):  # noqa: ANN201 - vLLM's type
        w = self.connector_worker
        if w is None or not isinstance(w.spec, KvtierOffloadingSpec):
            return None
        ctx = w.spec.ctx
        cpu = getattr(w.worker, "tiers", {}).get("cpu")  # the worker side's KvtierWorker, once built
        region = getattr(cpu, "region", None)
        if ctx.page_bytes is None and region is None:
            return None
        return KvtierHandshake(page_bytes=tuple(ctx.page_bytes or ()),  # () when the worker saw none
                               geometry_fingerprint=ctx.namespace.geometry_fingerprint,
                               kv_dtype=ctx.namespace.dtype,
                               host_region=region.name if region is not None else "",
                               rank=ctx.namespace.rank)

    def set_xfer_handshake_metadata(self, metadata) -> None:  # noqa: ANN001 - vLLM's type
        s = self.connector_scheduler
        if s is None:
            return
        layouts = {(m.page_bytes, m.geometry_fingerprint, m.kv_dtype)
                   for m in metadata.values() if isinstance(m, KvtierHandshake) and m.page_bytes}
        if len(layouts) > 1:
            raise ConfigError(f"kvtier: the workers report different layouts {sorted(layouts)}")
        manager = s.manager
        if not isinstance(manager, KvtierManager):
            return
        if layouts:
            with manager_lock(manager):
                relaid = manager.adopt_worker_layout(*layouts.pop())
                if relaid and self._journal is not None:  # a new index: its adopted chunks announced again
                    announce_adopted(manager, events_tracker(s), self._journal)
        # every worker (one per tensor-parallel rank) with its cpu tier in a host region: map
        # them now, before any request; if one has none, no promotion at lookup
        regions = {m.rank: m.host_region for m in metadata.values() if isinstance(m, KvtierHandshake) and m.host_region}
        world = manager.ctx.namespace.world_size
        if len(metadata) == world and set(regions) == set(range(world)):
            with manager_lock(manager):
                manager.adopt_region([regions[r] for r in range(world)])
        if self._journal is not None:  # the disk chunks adopted at start, published before any request
            publish_now(self, self.take_events())

    # -- kvtier's counters on vLLM's stats path (stats.py) -----------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Every step, on each side: what vLLM's OffloadingConnector reports there (the
        scheduler's transfer stats and config info; None on a worker) plus kvtier's counts of
        that side since the last call."""
        metrics = self._kvtier_metrics()
        return merge(super().get_kv_connector_stats(), metrics.take_delta() if metrics is not None else {})

    def _kvtier_metrics(self) -> Metrics | None:
        s = self.connector_scheduler
        if s is not None:
            metrics = s.manager.metrics if isinstance(s.manager, KvtierManager) else None
        else:  # a worker's spec builds its KvtierWorker when vLLM registers the KV caches
            metrics = getattr(getattr(self.connector_worker, "worker", None), "metrics", None)
        return metrics if isinstance(metrics, Metrics) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> KVConnectorStats | None:
        return KvtierConnectorStats(data=data) if data is not None else KvtierConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):  # noqa: ANN001, ANN206
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        w = self.connector_worker
        assert w is not None and w.worker is not None
        recving: set[str] = set()
        failed: set[str] = set()
        meta, load_jobs = worker_transfer_meta(w), worker_load_jobs(w)
        for result in w.worker.get_finished():
            is_load = result.job_id in load_jobs
            if result.success and result.transfer_time is not None and result.transfer_size is not None:
                stats = meta.transfer_stats.load if is_load else meta.transfer_stats.store
                stats.record(result.transfer_size, result.transfer_time)
            meta.mark_completed(result.job_id)
            req_id = load_jobs.pop(result.job_id, None)
            if req_id is not None:
                recving.add(req_id)
                if not result.success:
                    failed.add(req_id)
        return KVConnectorTransferResults(finished_recving=recving, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        manager = self.scheduler.manager
        failed = connector_output.failed_recving or ()
        if not failed or not isinstance(manager, KvtierManager):
            super().update_connector_output(connector_output)
            return
        # vLLM completes a failed load like any other (complete_load) before kvtier hears that it
        # failed: the manager learns it first, so it never commits a slot the load did not fill
        # (vLLM 0.33: every manager call is made under manager.lock; 0.32 has no lock)
        with manager_lock(manager):
            manager.mark_failed(failed)
        try:
            super().update_connector_output(connector_output)
        finally:
            with manager_lock(manager):
                manager.clear_failed()
                for req_id in failed:
                    manager.load_failed(req_id)


def _translate_chunk_tokens(vllm_config, kv_cache_config) -> None:  # noqa: ANN001 - vLLM's types
    """`kvtier.chunk_tokens` becomes vLLM's own `blocks_per_chunk` before vLLM reads it."""
    from .engine_groups import EngineGroup

    ktc = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(ktc, "kv_connector_extra_config", None)
    if not isinstance(extra, dict) or "kvtier.chunk_tokens" not in extra or kv_cache_config is None:
        return
    ids = offloading_group_ids(kv_cache_config)  # the groups vLLM offloads
    groups = [EngineGroup(i, int(kv_cache_config.kv_cache_groups[i].kv_cache_spec.block_size),
                          tuple(kv_cache_config.kv_cache_groups[i].layer_names)) for i in ids]
    chunk_tokens_to_blocks(extra, groups)
