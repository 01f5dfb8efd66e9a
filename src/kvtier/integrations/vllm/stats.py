"""kvtier's counters on vLLM's own stats path, so `vllm serve`'s /metrics shows them.

How vLLM 0.32 and 0.33 move a connector's stats (the same in both):
- every step, each worker's model runner asks its connector `get_kv_connector_stats()`; vLLM
  merges the workers' answers with `aggregate()` and hands them to the scheduler, which merges
  its own connector's answer (`aggregate()` again) and ships `to_dict()` to the front end;
- the front end rebuilds the object with the connector class's `build_kv_connector_stats(data)`,
  logs `reduce()` of what it gathered each logging interval, and passes the dict to the
  `KVConnectorPromMetrics` that the connector class's `build_prom_metrics()` made.
vLLM's OffloadingConnector already uses this: its payload (`OffloadingConnectorStats`) is a dict
of named counters, gauges and histograms, each keyed by a tuple of label values; its scheduler
half reports transfer bytes and times (`vllm:kv_offload_*`, from the workers' job results), the
manager's `get_stats()`, and on 0.33 the manager's `config_info()` once
(`vllm:kv_offload_config_info`). Its workers report nothing themselves.

kvtier adds its counters (Metrics.add in the scheduler-side and worker-side modules) to that same payload as
labelled counters named `vllm:kvtier_<counter>`, where a counter named per tier
(`loaded_chunks_cpu`) becomes one metric with a `tier` label, and `group` (kvtier's plan group
index) labels what belongs to one group. The worker's counts travel in the worker's
`get_kv_connector_stats()`, the manager's in the scheduler's, each merged into what vLLM's
OffloadingConnector reports there (`KvtierConnector`). `KvtierPromMetrics` registers kvtier's
metrics beside vLLM's `OffloadPromMetrics`, which still handles every `vllm:kv_offload_*` key.

Rejected: declaring kvtier's metrics through the spec's `build_metric_definitions()` and
reporting them from the manager's `get_stats()`, vLLM's route for a spec's own metrics: the
worker's counts (loads, bytes, tier misses) have no such route, and under the stock
OffloadingConnector the manager alone would report half of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
    OffloadPromMetrics,
)

from kvtier.index.index import Index

from .common import SpecContext
from .config import TIERS

PREFIX = "vllm:kvtier_"
TIER_AND_GROUP = ("tier", "group")
CONFIG_INFO_KEYS = ("kvtier_namespace", "kvtier_chunk_tokens", "kvtier_tiers", "kvtier_group_slots",
                    "kvtier_chunk_bytes")


def config_info(ctx: SpecContext, index: Index) -> list[dict[str, str | int]]:
    """vLLM 0.33's kv_offload config info series (the manager's `config_info`): the plan and each
    slot tier's slots per group, labelled by CONFIG_INFO_KEYS."""
    slots = ";".join(
        f"{tier}:" + ",".join(f"g{gp.index}={index.slots(gp.index, tier) if gp.cacheable else 0}"
                              for gp in ctx.plan.groups)
        for tier in ctx.config.tiers if tier != "redis")
    return [{"kvtier_namespace": ctx.namespace.id,
             "kvtier_chunk_tokens": ctx.plan.chunk_tokens,
             "kvtier_tiers": ",".join(ctx.config.tiers),
             "kvtier_group_slots": slots,
             "kvtier_chunk_bytes": ",".join(str(gp.chunk_bytes) for gp in ctx.plan.groups)}]


@dataclass(frozen=True, slots=True)
class Family:
    """One of kvtier's counters as a Prometheus counter: `counter` is its name in the metrics
    file, with `{tier}` where the file has one counter per tier."""

    counter: str
    labels: tuple[str, ...]
    doc: str

    @property
    def metric(self) -> str:
        return PREFIX + self.counter.replace("_{tier}", "")


FAMILIES: tuple[Family, ...] = (
    # scheduler (KvtierManager)
    Family("lookup_keys", ("group",), "Offload keys vLLM looked up in kvtier's index (scheduler)."),
    Family("lookup_hit_keys", ("group",), "Lookups kvtier answered as a hit."),
    Family("lookup_keys_offload_off", (), "Lookups answered as a miss because offloading is off "
           "for this engine (a state model outside mamba_cache_mode=align)."),
    Family("redis_lookups_queued", (), "Keys the scheduler asked Redis about off the engine thread."),
    Family("redis_lookup_timeouts", (), "Redis existence checks without an answer in time (a miss)."),
    Family("adopted_from_redis", ("group",), "Chunks another engine stored in Redis that this "
           "index adopted."),
    Family("load_jobs_scheduled", (), "Load jobs the scheduler planned."),
    Family("load_chunks_{tier}", TIER_AND_GROUP, "Chunks the scheduler planned to load, by the "
           "tier they are read from."),
    Family("load_keys_vanished", ("group",), "Chunks evicted between lookup and load (that load "
           "fails and vLLM recomputes)."),
    Family("store_chunks", ("group",), "Chunks the scheduler reserved slots for."),
    Family("promote_chunks", ("group",), "Chunks loaded from disk or Redis that the scheduler "
           "gave a cpu slot to be promoted into."),
    Family("promote_aborted", ("group",), "Promotion slots released because their load failed."),
    Family("promote_at_lookup", ("group",), "Promotions started by a lookup (through the worker's "
           "host region): the lookup answered pending until the chunk was in host memory."),
    Family("promote_read_failed", ("group",), "Promotions started by a lookup whose read failed (a "
           "miss, a corrupt payload, a chunk stored in part): the chunk is served as before."),
    Family("lookup_pending_keys", ("group",), "Lookups answered pending while their chunk was "
           "promoted into host memory (vLLM asks again next step)."),
    Family("lookup_not_in_host", ("group",), "Lookups answered as a miss because the chunk was "
           "only on disk or in Redis and could not be promoted (host-only loads: "
           "sync_load_budget_bytes)."),
    Family("promote_skipped_full", ("group",), "Promotions skipped because every cpu slot of the "
           "group was pinned or reserved (the load still reads the slower tier)."),
    Family("promote_dropped", ("group",), "Promotions at lookup not started because the reads "
           "out would pass kvtier.io_queue_bytes: the chunk is served as before (its load reads the "
           "slower tier; a miss with host-only loads)."),
    Family("store_skipped_full_{tier}", TIER_AND_GROUP, "Stores skipped because every slot of the "
           "tier was pinned by transfers in flight."),
    Family("store_skipped_placement", ("group",), "Chunks not stored because no hit is likely to end "
           "where they serve (kvtier.placement hits, one tier: a state checkpoint or sliding window away "
           "from the request's ends and branch points)."),
    Family("store_cold", ("group",), "Chunks stored only in the tiers after the first (kvtier.placement "
           "hits: unlikely to be read)."),
    Family("store_calls_refused", (), "prepare_store calls answered None because no tier could "
           "take every new key (vLLM offers the keys again later)."),
    Family("store_keys_offload_off", (), "Stores skipped because offloading is off for this engine."),
    Family("kv_events_stored", (), "KV events announcing a chunk restorable from a tier (with vLLM's KV events on)."),
    Family("kv_events_removed", (), "KV events announcing a chunk no longer restorable from a tier."),
    Family("kv_events_dropped", (), "KV events dropped because nothing drained them (memory bound)."),
    Family("evicted_{tier}", TIER_AND_GROUP, "Chunks evicted from a tier to make room."),
    Family("evicted_{tier}_dead", TIER_AND_GROUP, "Chunks evicted first because no hit could read "
           "them any more."),
    Family("load_failures", (), "Loads the workers could not restore (vLLM recomputed them)."),
    Family("removed_after_failure", (), "Chunks forgotten after a failed load."),
    Family("resets", (), "Cache resets (vLLM's reset_prefix_cache)."),
    Family("resets_flushed", (), "Resets whose in-flight jobs the workers reported (vLLM 0.33)."),
    Family("rebuilt_chunks", (), "Chunks adopted from the disk tier at start."),
    Family("disk_journal_errors", (), "Disk event journal writes or compactions that failed: journaling "
           "stopped for this process (a restart announces fewer disk chunks to a router: misses only)."),
    Family("disk_journal_full", (), "Times the disk event journal stopped at its size cap (DiskJournal.MAX_BYTES of live records)."),
    Family("disk_journal_bad_records", (), "Disk event journal records of the wrong field types, skipped at start."),
    Family("layout_from_workers", (), "Index rebuilds from the workers' exact layout at start."),
    # workers (KvtierWorker)
    Family("load_jobs", (), "Load jobs the workers finished."),
    Family("load_jobs_failed", (), "Load jobs the workers failed (vLLM recomputes the request)."),
    Family("sync_load_jobs", (), "Synchronous loads (vLLM 0.33's sync_load_budget_bytes) the "
           "workers restored from host memory."),
    Family("sync_load_jobs_failed", (), "Synchronous loads that failed: the engine stopped rather "
           "than run a request on KV never restored (none expected; report it)."),
    Family("store_jobs", (), "Store jobs the workers finished."),
    Family("store_jobs_failed", (), "Store jobs the workers failed."),
    Family("jobs_noncontiguous", (), "Jobs refused because a group's blocks were not contiguous."),
    Family("loaded_chunks_{tier}", TIER_AND_GROUP, "Chunks read from a tier and restored."),
    Family("loaded_bytes_{tier}", TIER_AND_GROUP, "Bytes read from a tier and restored."),
    Family("loaded_blocks", ("group",), "vLLM KV blocks written by loads."),
    Family("promoted_chunks_{tier}", TIER_AND_GROUP, "Chunks read and verified from a slower tier "
           "(the label) and copied into the cpu tier by their load."),
    Family("promote_skipped_partial", ("group",), "Promotions skipped because the load needed "
           "only part of the chunk."),
    Family("load_miss_{tier}", TIER_AND_GROUP, "Chunk reads a tier could not serve (missing, "
           "overwritten or corrupt: the load fails and vLLM recomputes)."),
    Family("load_miss_vanished", ("group",), "Chunk reads with no place (evicted before the load)."),
    Family("stored_chunks_{tier}", TIER_AND_GROUP, "Chunks written into a tier."),
    Family("stored_bytes_{tier}", TIER_AND_GROUP, "Bytes written into a tier."),
    Family("store_failed_{tier}", TIER_AND_GROUP, "Chunk writes a tier refused or failed."),
    Family("store_dropped_{tier}", TIER_AND_GROUP, "Chunk writes dropped because the background "
           "I/O queue was full (kvtier.io_queue_bytes)."),
    Family("store_failed_unreported", ("group",), "Chunks of store jobs a worker failed, which "
           "vLLM reported as stored: their cpu slot did not hold them, so no tier commits them."),
    Family("store_overwritten_{tier}", TIER_AND_GROUP, "Disk/Redis writes skipped because the cpu "
           "slot they were copied from was taken by another chunk first."),
)
# counters kept in the metrics file only: `loaded_chunks_group<g>` is `loaded_chunks` by group
FILE_ONLY_PREFIXES = ("loaded_chunks_group",)


def _series_of() -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """counter name in the file -> (metric, tier label value, label names)."""
    out: dict[str, tuple[str, str, tuple[str, ...]]] = {}
    for f in FAMILIES:
        if "{tier}" in f.counter:
            for tier in TIERS:
                out[f.counter.format(tier=tier)] = (f.metric, tier, f.labels)
        else:
            out[f.counter] = (f.metric, "", f.labels)
    return out


SERIES = _series_of()
METRICS = {f.metric: f for f in FAMILIES}


class KvtierConnectorStats(OffloadingConnectorStats):
    """vLLM's offloading stats payload with kvtier's counters in it: the same layout, so vLLM's
    own aggregate / reduce / is_empty / reset and its Prometheus code apply unchanged (counters
    sum per label tuple across workers and steps)."""

    def add_counts(self, delta: Mapping[tuple[str, str], int]) -> KvtierConnectorStats:
        """Add Metrics.take_delta()'s counts; counters kept in the file only are left out."""
        for (counter, group), n in delta.items():
            series = SERIES.get(counter)
            if series is None or not n:
                continue
            metric, tier, labels = series
            self.increase_counter(metric, n, tuple(tier if name == "tier" else group for name in labels))
        return self

    def reduce(self) -> dict[str, int | float]:
        """vLLM's log line: kvtier's series named by their labels (`{tier=cpu,group=0}`)."""
        values = self._values
        ours = {k: v for k, v in values.items() if k in METRICS}
        rest = OffloadingConnectorStats(data={**self.data, "data": {k: v for k, v in values.items()
                                                                    if k not in METRICS}})
        out = rest.reduce()
        for metric, series in ours.items():
            names = METRICS[metric].labels
            for labelvalues, n in series.items():
                labels = ",".join(f"{k}={v}" for k, v in zip(names, labelvalues))
                out[f"{metric}{{{labels}}}" if labels else metric] = n
        return out


def merge(base: KVConnectorStats | None, delta: Mapping[tuple[str, str], int]) -> KVConnectorStats | None:
    """What vLLM's OffloadingConnector reported (`base`, kept as it is) plus kvtier's counts."""
    if base is not None and not isinstance(base, OffloadingConnectorStats):
        return base  # not an offloading payload: nothing of kvtier's can ride along
    if base is None and not any(delta.values()):
        return None
    stats = KvtierConnectorStats(data=base.data) if base is not None else KvtierConnectorStats()
    return stats.add_counts(delta)


class KvtierPromMetrics(KVConnectorPromMetrics):
    """vLLM's `OffloadPromMetrics` (every `vllm:kv_offload_*` key, 0.33's config info) plus one
    Prometheus counter per kvtier family, labelled by vLLM's engine labels and the family's."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.offload = OffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter = metric_types[Counter]
        self._counters = {f.metric: counter(name=f.metric, documentation=f.doc,
                                            labelnames=list(labelnames) + list(f.labels))
                          for f in FAMILIES}
        self._bound: dict[tuple[int, str, tuple[str, ...]], Any] = {}
        for engine_idx in per_engine_labelvalues:  # unlabelled families read 0 from the start
            for f in FAMILIES:
                if not f.labels:
                    self._series(engine_idx, f.metric, ())

    def _series(self, engine_idx: int, metric: str, labelvalues: tuple[str, ...]) -> Any:
        key = (engine_idx, metric, labelvalues)
        bound = self._bound.get(key)
        if bound is None:
            engine = list(self.per_engine_labelvalues[engine_idx])
            bound = self._bound[key] = self._counters[metric].labels(*engine, *labelvalues)
        return bound

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = transfer_stats_data.get("data") or {}
        ours = {k: v for k, v in values.items() if k in self._counters}
        self.offload.observe({**transfer_stats_data,
                              "data": {k: v for k, v in values.items() if k not in self._counters}},
                             engine_idx)
        for metric, series in ours.items():
            for labelvalues, n in series.items():
                self._series(engine_idx, metric, tuple(labelvalues)).inc(n)
