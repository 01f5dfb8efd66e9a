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

from kvtier.core.counters import VLLM
from kvtier.index.index import Index

from .common import SpecContext

PREFIX = "vllm:kvtier_"
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


# kvtier's vLLM counters, declared once in kvtier.core.counters (VLLM): one family each, but the
# file-only ones (`loaded_chunks_group<g>` is `loaded_chunks` by its group label)
FAMILIES: tuple[Family, ...] = tuple(Family(c.name, c.labels, c.help) for c in VLLM if not c.file_only)
FILE_ONLY_PREFIXES = tuple(c.name.partition("{")[0] for c in VLLM if c.file_only)


def _series_of() -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """counter name in the file -> (metric, tier label value, label names)."""
    return {name: (f.metric, VLLM.tier_of(name), f.labels)
            for f in FAMILIES for name in VLLM.counter(f.counter.replace("{tier}", "cpu")).names()}


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
