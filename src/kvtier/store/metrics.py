"""Store metrics: plain counters, read as a dict, exported as Prometheus collectors.

Every name is declared once in kvtier.core.counters: `STORE` (per (tier, group): chunks hit
(loaded), misses (a load that found nothing or a bad payload), bytes and seconds of loads and
saves; store-wide: lookups, hit tokens, corrupt payloads dropped, failed saves, promotions,
placement...) and `TIER` (each tier's own counters: `Tier` attributes, `TierStats`,
and the redis tier's extra ones). Counting an undeclared name raises (UndeclaredCounter, or a
KeyError from a per (tier, group) dict, which holds only declared names). Everything is a counter
(redis's `up` a gauge), so a scrape can compute rates; nothing here is on the hot path beyond an
integer add.

`prometheus_client` is optional: `register_prometheus(store)` imports it and registers one
custom collector that reads `store.metrics()` at scrape time (no background thread, no
duplicate bookkeeping) and yields one family per declared counter, so prometheus_client is no
dependency of the data plane.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvtier.core.counters import STORE, TIER, TIER_BASE

PER_TIER_GROUP = tuple(c.name for c in STORE if c.labels and not c.derived)
STORE_WIDE = tuple(c.name for c in STORE if not c.labels and not c.derived)


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
        """Count a store-wide counter (declared in kvtier.core.counters.STORE)."""
        try:
            self.totals[name] += value
        except KeyError:
            STORE.check(name)  # raises UndeclaredCounter for a name nobody declared
            raise KeyError(f"{name!r} is a per (tier, group) or derived store counter, not a store-wide one") from None


def tier_counters(tier: object) -> dict[str, float]:
    """One tier's declared counters (TIER): every tier's base ones, plus what its `metrics()` adds
    (the redis tier's extra counters, `up` as 0/1, `connection_failures`)."""
    out: dict[str, float] = {name: getattr(tier, name) for name in TIER_BASE}
    more = getattr(tier, "metrics", None)
    if callable(more):
        out.update({k: int(v) for k, v in more().items() if k in TIER})
    return out


def metrics_dict(
    m: StoreMetrics, group_names: list[str], evictions: dict[tuple[str, int], int],
    tiers_counters: dict[str, dict[str, float]] | None = None,
) -> dict[str, object]:
    """{..store-wide counters.., "tiers": {tier: {group name: {..counters.., "evictions"}}},
    "tier_counters": {tier: {..that tier's own counters..}}}."""
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
    out["tier_counters"] = dict(tiers_counters or {})
    return out


def prometheus_families(snapshot: Callable[[], dict[str, object]], prefix: str = "kvtier") -> Iterator[object]:
    """Prometheus metric families of a store snapshot (needs prometheus_client): one per declared
    counter, `<prefix>_<name>` for STORE (labels `tier`, `group` where it is per tier and group;
    the store-wide `evictions` of the snapshot is their sum, not a second family) and
    `<prefix>_tier_<name>` for TIER (label `tier`)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    snap = snapshot()
    tiers = snap.get("tiers", {})
    assert isinstance(tiers, dict)
    for c in STORE:
        fam = CounterMetricFamily(f"{prefix}_{c.name}", f"kvtier store: {c.help}", labels=list(c.labels))
        if c.labels:
            for tier, groups in tiers.items():
                for group, d in groups.items():
                    fam.add_metric([tier, group], float(d.get(c.name, 0)))
        else:
            fam.add_metric([], float(snap.get(c.name, 0)))  # type: ignore[arg-type]
        yield fam
    own = snap.get("tier_counters", {})
    assert isinstance(own, dict)
    for c in TIER:
        kind = GaugeMetricFamily if c.kind == "gauge" else CounterMetricFamily
        fam = kind(f"{prefix}_tier_{c.name}", f"kvtier tier: {c.help}", labels=["tier"])
        for tier, d in own.items():
            if c.name in d:  # the redis tier's own counters: its series only
                fam.add_metric([tier], float(d[c.name]))
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
