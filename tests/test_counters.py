"""One counter registry (kvtier.core.counters): every name a call site counts is declared there,
counting an undeclared name raises, and every declared counter is exported, by the Store's
Prometheus collector (STORE, TIER) or on vLLM's stats path (VLLM).

The call sites are read from the source with `ast` (every literal, even on a path no test runs):
`metrics.add(...)` in the vLLM integration, `m.add(...)` and per (tier, group) subscripts in the
Store, `_count` / `_count_all` / the breaker's skip names in the redis tier.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from kvtier.core import counters
from kvtier.core.counters import STORE, TIER, TIER_BASE, TIERS, VLLM, UndeclaredCounter

SRC = Path(__file__).resolve().parents[1] / "src" / "kvtier"
PLACEHOLDERS = {"tier": TIERS, "kind": ("load", "store"), "g": ("0", "3")}


def _values(node: ast.expr) -> list[str] | None:
    """The strings an expression can be: constants, f-strings over PLACEHOLDERS, `a + b`,
    `a if c else b`; None when it is not built from literals (a variable: checked at run time)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        a, b = _values(node.body), _values(node.orelse)
        return None if a is None or b is None else a + b
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        a, b = _values(node.left), _values(node.right)
        return None if a is None or b is None else [x + y for x, y in itertools.product(a, b)]
    if isinstance(node, ast.JoinedStr):
        parts: list[list[str]] = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append([str(v.value)])
            elif isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Name):
                if v.value.id not in PLACEHOLDERS:
                    return None
                parts.append(list(PLACEHOLDERS[v.value.id]))
            elif isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Attribute) \
                    and v.value.attr == "g":  # f"..{f.g}"
                parts.append(list(PLACEHOLDERS["g"]))
            else:
                return None
        return ["".join(p) for p in itertools.product(*parts)]
    return None


def _receiver(call: ast.Call) -> str:
    """`metrics` for self.metrics.add / metrics.add / journal.metrics.add, `m` for self.m.add."""
    f = call.func
    if isinstance(f, ast.Attribute):
        v = f.value
        if isinstance(v, ast.Attribute):
            return v.attr
        if isinstance(v, ast.Name):
            return v.id
    return ""


def call_site_names(extra: dict[str, str] | None = None) -> dict[str, set[tuple[str, str]]]:
    """scope -> {(counter name, where)} of every literal counted in src/kvtier, plus `extra`
    (module path under src/kvtier -> source: a probe, never written into the tree, which
    tests/test_layers.py scans in parallel)."""
    out: dict[str, set[tuple[str, str]]] = {"vllm": set(), "store": set(), "tier": set()}
    sources: dict[str, str] = {}
    for path in sorted(SRC.rglob("*.py")):
        try:
            sources[str(path.relative_to(SRC))] = path.read_text()
        except FileNotFoundError:  # another test's probe, removed meanwhile
            continue
    sources.update(extra or {})
    for rel, text in sources.items():
        tree = ast.parse(text)
        for node in ast.walk(tree):
            where = f"{rel}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
                name, recv = node.func.attr, _receiver(node)
                scope = None
                if name == "add" and recv in ("metrics", "_metrics") and rel.startswith("integrations/vllm/"):
                    scope = "vllm"
                elif name == "add" and recv == "m" and rel.startswith("store/"):
                    scope = "store"
                elif name == "_count" and rel.startswith("store/tiers/"):
                    scope = "tier"
                if scope is not None:
                    for v in _values(node.args[0]) or ():
                        out[scope].add((v, where))
                if name == "_count_all" and isinstance(node.args[0], ast.Dict):
                    out["tier"].update((k.value, where) for k in node.args[0].keys
                                       if isinstance(k, ast.Constant))
                if name in ("_run", "_call") and rel == "store/tiers/redis.py" and len(node.args) > 1:
                    for v in _values(node.args[1]) or ():  # the counter of what the breaker skips
                        out["tier"].add((v, where))
                if name == "fromkeys" and rel == "store/tiers/redis.py" and isinstance(node.args[0], ast.Tuple):
                    out["tier"].update((e.value, where) for e in node.args[0].elts if isinstance(e, ast.Constant)
                                       and isinstance(e.value, str) and not e.value.startswith("_"))
            # per (tier, group) counters: d = self.m.tg(...); d["load_chunks"] += 1, or tg(...)["x"]
            if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Subscript) \
                    and rel.startswith("store/") and isinstance(node.target.slice, ast.Constant):
                target = node.target.value
                is_tg = isinstance(target, ast.Call) and isinstance(target.func, ast.Attribute) \
                    and target.func.attr == "tg"
                if is_tg or (isinstance(target, ast.Name) and target.id == "d"):
                    out["store"].add((node.target.slice.value, where))
                if rel == "store/tiers/redis.py" and isinstance(target, ast.Name) and target.id == "counts":
                    out["tier"].add((node.target.slice.value, where))
    return out


REGISTRY = {"vllm": VLLM, "store": STORE, "tier": TIER}


def undeclared(extra: dict[str, str] | None = None) -> list[str]:
    return sorted(f"{where}: {scope} counter {name!r}" for scope, names in call_site_names(extra).items()
                  for name, where in names if name not in REGISTRY[scope])


def test_every_name_counted_at_a_call_site_is_declared() -> None:
    found = call_site_names()
    # the scan sees the call sites (a scan that finds nothing would pass vacuously)
    assert len({n for n, _ in found["vllm"]}) > 50, found["vllm"]
    assert len({n for n, _ in found["store"]}) > 20, found["store"]
    assert len({n for n, _ in found["tier"]}) > 10, found["tier"]
    assert undeclared() == []


@pytest.mark.parametrize("rel, source, name", [
    ("integrations/vllm/_probe.py", 'def f(metrics):\n    metrics.add(f"loaded_chunk_{tier}", group=0)\n',
     "loaded_chunk_disk"),
    ("store/_probe.py", 'def f(self):\n    self.m.add("lookup")\n', "lookup"),
    ("store/_probe.py", 'def f(self, d):\n    d["load_chunk"] += 1\n', "load_chunk"),
    ("store/tiers/redis.py", 'def f(self):\n    self._count_all({"vanish": 1})\n', "vanish"),
])
def test_a_typo_at_a_call_site_is_found(rel: str, source: str, name: str) -> None:
    """The scan bites: a probe module counting an undeclared name is reported."""
    assert any(f"{rel}:2:" in v and f"{name!r}" in v for v in undeclared({rel: source}))


def test_counting_an_undeclared_name_raises() -> None:
    from kvtier.store.metrics import StoreMetrics
    from kvtier.store.tiers.redis import RedisTier

    m = StoreMetrics()
    m.add("lookups")
    with pytest.raises(UndeclaredCounter, match="lookup'"):
        m.add("lookup")
    with pytest.raises(KeyError):
        m.tg("cpu", 0)["load_chunk"] += 1
    tier = RedisTier()  # no connection until its first call
    tier._count("vanished")
    tier._count_all({"writes": 2, "budget_skipped": 1})
    with pytest.raises(UndeclaredCounter):
        tier._count("vanish")
    with pytest.raises(UndeclaredCounter):
        tier._count_all({"last_error": 1})  # an attribute of the tier, not a counter
    assert (tier.metrics()["vanished"], tier.writes) == (1, 2)
    with pytest.raises(UndeclaredCounter):
        VLLM.check("loaded_chunks_gpu")


def test_vllm_counter_file_refuses_an_undeclared_name() -> None:
    pytest.importorskip("vllm")
    from kvtier.integrations.vllm.counters import Metrics

    m = Metrics("worker0", None)
    m.add("loaded_chunks_group7")  # a file-only counter, by pattern
    m.add("evicted_redis_dead", group=1)
    with pytest.raises(UndeclaredCounter):
        m.add("evicted_gpu", group=1)
    assert m.counts == {"loaded_chunks_group7": 1, "evicted_redis_dead": 1}


def test_the_tier_names_and_tier_stats_are_declared_once() -> None:
    from dataclasses import fields

    from kvtier.store.tiers import TIER_NAMES
    from kvtier.store.tiers.base import TierStats

    assert TIER_NAMES is TIERS
    assert tuple(f.name for f in fields(TierStats)) == TIER_BASE
    assert set(TIER_BASE) <= set(TIER.names())
    with pytest.raises(ValueError, match="declared twice"):
        counters.Registry("x", (counters.Counter("a", "."), counters.Counter("a", ".")))


def _families(collector: object) -> dict[str, object]:
    return {f.name: f for f in collector.collect()}  # type: ignore[attr-defined]


def test_every_store_and_tier_counter_is_exported_by_the_store_collector(tmp_path: Path) -> None:
    prom = pytest.importorskip("prometheus_client")
    import torch

    from kvtier.core.geometry import Geometry, Group
    from kvtier.core.keys import Namespace
    from kvtier.core.plan import make_plan
    from kvtier.store.metrics import PrometheusCollector, tier_counters
    from kvtier.store.store import Store
    from kvtier.store.tiers.redis import RedisTier

    geom = Geometry(groups=(Group("full", "full", num_layers=2, tokens_per_block=16, bytes_per_token_per_layer=64),),
                    tokens_per_hash=16)
    plan = make_plan(geom, chunk_tokens=16)
    ns = Namespace("m", geom.fingerprint(), "bfloat16")
    row = plan.groups[0].chunk_bytes
    store = Store(plan, ns, cpu_bytes=4 * row, disk_dir=tmp_path, disk_bytes=8 * row)
    toks = list(range(33))
    store.save_tokens(toks, {(0, i): torch.full((row,), i, dtype=torch.uint8) for i in range(2)})
    hit = store.lookup_tokens(toks)
    store.load_tokens(toks, {(0, i): torch.zeros(row, dtype=torch.uint8) for i in range(2)})
    redis = RedisTier()  # its own counters, without a server

    def snapshot() -> dict[str, object]:
        snap = store.metrics()
        snap["tier_counters"]["redis"] = tier_counters(redis)  # type: ignore[index]
        return snap

    fams = _families(PrometheusCollector(snapshot))
    want = {f"kvtier_{c.name}" for c in STORE} | {f"kvtier_tier_{c.name}" for c in TIER}
    assert set(fams) == want
    for c in STORE:  # every declared store counter has its series
        samples = fams[f"kvtier_{c.name}"].samples  # type: ignore[attr-defined]
        labels = {tuple(sorted(s.labels.items())) for s in samples}
        if c.labels:
            assert {(("group", "full"), ("tier", t)) for t in ("cpu", "disk")} <= labels, c.name
        else:
            assert labels == {()}, c.name
    for c in TIER:
        tiers = {s.labels["tier"] for s in fams[f"kvtier_tier_{c.name}"].samples}  # type: ignore[attr-defined]
        assert tiers == ({"cpu", "disk", "redis"} if c.name in TIER_BASE else {"redis"}), c.name
    assert hit.tokens == 32
    assert fams["kvtier_save_chunks"].samples[0].value == 2  # type: ignore[attr-defined]
    assert {s.labels["tier"]: s.value for s in fams["kvtier_tier_writes"].samples} == \
        {"cpu": 2, "disk": 2, "redis": 0}  # type: ignore[attr-defined]
    reg = prom.CollectorRegistry()  # one family per name: the registry and exposition accept it
    store.register_prometheus(reg)
    assert reg.get_sample_value("kvtier_tier_bytes_read_total", {"tier": "cpu"}) == 2 * row
    assert b"kvtier_evictions_total" in prom.generate_latest(reg)
    store.close()


def test_every_vllm_counter_is_exported_on_vllms_stats_path() -> None:
    pytest.importorskip("vllm")
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from types import SimpleNamespace

    from kvtier.integrations.vllm.connector import KvtierConnector
    from kvtier.integrations.vllm.counters import Metrics
    from kvtier.integrations.vllm.stats import FAMILIES, merge

    assert [f.counter for f in FAMILIES] == [c.name for c in VLLM if not c.file_only]
    m = Metrics("worker0", None)
    for name in VLLM.names():
        m.add(name, 2, group=1)
    m.add("loaded_chunks_group1", 2)
    stats = merge(None, m.take_delta())
    assert stats is not None
    reg = CollectorRegistry()

    def bind(cls):  # type: ignore[no-untyped-def]
        class Bound(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *a, **k):  # type: ignore[no-untyped-def]
                super().__init__(*a, registry=reg, **k)
        return Bound

    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={
        "spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm.spec"}))
    prom = KvtierConnector.build_prom_metrics(config, {Gauge: bind(Gauge), Counter: bind(Counter),
                                                       Histogram: bind(Histogram)}, ["engine"], {0: ["0"]})
    prom.observe(stats.to_dict(), 0)
    for c in VLLM:
        if c.file_only:  # carried by another declared, exported counter's labels
            assert VLLM.counter(c.exported_by.replace("{tier}", "cpu")).labels == ("tier", "group")
            continue
        metric = "vllm:kvtier_" + c.name.replace("_{tier}", "") + "_total"
        for name in c.names():
            labels = {"engine": "0"}
            if "tier" in c.labels:
                labels["tier"] = VLLM.tier_of(name)
            if "group" in c.labels:
                labels["group"] = "1"
            assert reg.get_sample_value(metric, labels) == 2, (name, metric, labels)
    # loaded_chunks_cpu/disk/redis plus nothing for the file-only copy
    assert sum(reg.get_sample_value("vllm:kvtier_loaded_chunks_total", {"engine": "0", "tier": t, "group": "1"})
               for t in TIERS) == 6
