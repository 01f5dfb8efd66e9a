"""Store metrics: plain counters, read as a dict, exported as Prometheus collectors.

Counters are per (tier, group): chunks hit (loaded), misses (a load that found nothing or a bad
payload), bytes and seconds of loads and saves; plus store-wide lookups, hit tokens, corrupt
payloads dropped, failed saves, promotions, demotions and evictions. Everything is a counter,
so a scrape can compute rates; nothing here is on the hot path beyond an integer add.

`prometheus_client` is optional: `register_prometheus(store)` imports it and registers one
custom collector that reads `store.metrics()` at scrape time (no background thread, no
duplicate bookkeeping), so prometheus_client is no dependency of the data plane.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

PER_TIER_GROUP = (
    "load_chunks", "load_misses", "load_bytes", "load_seconds",
    "save_chunks", "save_failures", "save_bytes", "save_seconds",
)
STORE_WIDE = (
    "lookups", "hit_lookups", "lookup_tokens", "hit_tokens", "restored_tokens",
    "corrupt_dropped", "failed_saves", "skipped_saves", "not_admitted", "promotions",
    "demotions", "shared_exists_queries", "rebuild_refused",
)


@dataclass
class StoreMetrics:
    """Mutable counters owned by one Store (guarded by the store's lock)."""

    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STORE_WIDE, 0))
    per: dict[tuple[str, int], dict[str, float]] = field(default_factory=dict)

    def tg(self, tier: str, group: int) -> dict[str, float]:
        d = self.per.get((tier, group))
        if d is None:
            d = self.per[(tier, group)] = dict.fromkeys(PER_TIER_GROUP, 0)
        return d

    def add(self, name: str, value: float = 1) -> None:
        self.totals[name] += value


def metrics_dict(
    m: StoreMetrics, group_names: list[str], evictions: dict[tuple[str, int], int]
) -> dict[str, object]:
    """{..store-wide counters.., "tiers": {tier: {group name: {..counters.., "evictions"}}}}."""
    tiers: dict[str, dict[str, dict[str, float]]] = {}
    keys = set(m.per) | set(evictions)
    for tier, g in sorted(keys):
        d = dict(m.per.get((tier, g)) or dict.fromkeys(PER_TIER_GROUP, 0))
        d["evictions"] = evictions.get((tier, g), 0)
        tiers.setdefault(tier, {})[group_names[g]] = d
    out: dict[str, object] = dict(m.totals)
    out["miss_lookups"] = m.totals["lookups"] - m.totals["hit_lookups"]
    out["evictions"] = sum(evictions.values())
    out["tiers"] = tiers
    return out


def prometheus_families(snapshot: Callable[[], dict[str, object]], prefix: str = "kvtier") -> Iterator[object]:
    """Prometheus metric families of a store snapshot (needs prometheus_client)."""
    from prometheus_client.core import CounterMetricFamily

    snap = snapshot()
    for name, value in snap.items():
        if name == "tiers" or not isinstance(value, (int, float)):
            continue
        fam = CounterMetricFamily(f"{prefix}_{name}", f"kvtier store: {name.replace('_', ' ')}")
        fam.add_metric([], float(value))
        yield fam
    tiers = snap.get("tiers", {})
    assert isinstance(tiers, dict)
    for name in (*PER_TIER_GROUP, "evictions"):
        fam = CounterMetricFamily(
            f"{prefix}_{name}", f"kvtier store: {name.replace('_', ' ')} per tier and group",
            labels=["tier", "group"],
        )
        for tier, groups in tiers.items():
            for group, d in groups.items():
                fam.add_metric([tier, group], float(d.get(name, 0)))
        yield fam


class PrometheusCollector:
    """A prometheus_client custom collector reading a store's metrics at scrape time."""

    def __init__(self, snapshot: Callable[[], dict[str, object]], prefix: str = "kvtier") -> None:
        self._snapshot = snapshot
        self._prefix = prefix

    def collect(self) -> Iterator[object]:
        return prometheus_families(self._snapshot, self._prefix)

    def describe(self) -> list[object]:
        return []  # unchecked collector: names come from the snapshot


def register_prometheus(snapshot: Callable[[], dict[str, object]], registry: object | None = None,
                        prefix: str = "kvtier") -> PrometheusCollector:
    """Register a collector for `snapshot` (e.g. `store.metrics`) in `registry` (default: the
    global one). Raises ImportError with the install hint when prometheus_client is missing."""
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        raise ImportError("prometheus_client is not installed; `pip install kvtier[metrics]`") from None
    collector = PrometheusCollector(snapshot, prefix)
    (registry or REGISTRY).register(collector)  # type: ignore[attr-defined]
    return collector
