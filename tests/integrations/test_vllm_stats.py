"""kvtier's counters on vLLM's stats path (integrations/vllm/stats.py), called the way vLLM 0.32 and
0.33 call a connector's stats: workers' payloads merged with `aggregate()`, the scheduler's merged
into them, `to_dict()` across the process hop, `build_kv_connector_stats(data)` in the front end,
`reduce()` for the log line, `observe()` into Prometheus; and the counter file's write throttle
(counters.Metrics). The whole path through vLLM's real scheduler runs in test_vllm_engineless.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats  # noqa: E402

from kvtier.integrations.vllm import counters  # noqa: E402
from kvtier.integrations.vllm.counters import Metrics, read_metrics  # noqa: E402
from kvtier.integrations.vllm.connector import KvtierConnector  # noqa: E402
from kvtier.integrations.vllm.stats import (  # noqa: E402
    FAMILIES,
    FILE_ONLY_PREFIXES,
    SERIES,
    KvtierConnectorStats,
    KvtierPromMetrics,
    merge,
)

SRC = Path(__file__).parents[2] / "src" / "kvtier" / "integrations" / "vllm"


def worker_stats(**counts: int) -> KvtierConnectorStats:
    """A payload as one worker's get_kv_connector_stats builds it: counts by (name, group)."""
    delta = {}
    for key, n in counts.items():
        name, _, group = key.partition("__g")
        delta[(name, group)] = n
    return KvtierConnectorStats().add_counts(delta)


def values(stats: OffloadingConnectorStats, metric: str) -> dict:
    return dict(stats.data["data"].get(metric, {}))


def test_counts_become_labelled_counters() -> None:
    s = worker_stats(loaded_chunks_cpu__g0=3, loaded_chunks_disk__g2=1, loaded_bytes_cpu__g0=300,
                     evicted_cpu_dead__g1=2, evicted_cpu__g1=5, load_jobs=1, loaded_chunks_group0=3)
    assert values(s, "vllm:kvtier_loaded_chunks") == {("cpu", "0"): 3, ("disk", "2"): 1}
    assert values(s, "vllm:kvtier_loaded_bytes") == {("cpu", "0"): 300}
    assert values(s, "vllm:kvtier_evicted") == {("cpu", "1"): 5}
    assert values(s, "vllm:kvtier_evicted_dead") == {("cpu", "1"): 2}
    assert values(s, "vllm:kvtier_load_jobs") == {(): 1}
    assert s.data["types"]["vllm:kvtier_loaded_chunks"] == "counter"
    # the file's per-group copy is not a second metric (the group label carries it)
    assert not any("group0" in k for k in s.data["data"])


def test_aggregate_sums_workers_and_steps_per_label_and_keeps_vllms_own() -> None:
    """KVOutputAggregator folds worker 1 into worker 0; the scheduler then folds its own payload
    (vLLM's transfer stats plus the manager's counts) into that; the front end folds every step's."""
    w0 = worker_stats(loaded_chunks_cpu__g0=3, load_jobs=1)
    w1 = worker_stats(loaded_chunks_cpu__g0=2, loaded_chunks_cpu__g1=4, load_jobs=1)
    merged = w0.aggregate(w1)
    sched = OffloadingConnectorStats()  # what vLLM's OffloadingConnector reports on its own
    sched.increase_counter("vllm:kv_offload_load_bytes", 4096)
    sched.observe_histogram("vllm:kv_offload_load_size", 4096)
    sched = merge(sched, {("lookup_hit_keys", "0"): 5, ("lookup_hit_keys", "1"): 4})
    assert isinstance(sched, KvtierConnectorStats)
    merged = merged.aggregate(sched)
    assert values(merged, "vllm:kvtier_loaded_chunks") == {("cpu", "0"): 5, ("cpu", "1"): 4}
    assert values(merged, "vllm:kvtier_load_jobs") == {(): 2}
    assert values(merged, "vllm:kvtier_lookup_hit_keys") == {("0",): 5, ("1",): 4}
    assert values(merged, "vllm:kv_offload_load_bytes") == {(): 4096}
    assert values(merged, "vllm:kv_offload_load_size") == {(): [4096]}
    # the front end: to_dict() crosses the process, build_kv_connector_stats rebuilds it
    again = KvtierConnector.build_kv_connector_stats(json.loads(json.dumps(_tuples_out(merged.to_dict()))))
    again.data = _tuples_in(again.data)
    total = KvtierConnector.build_kv_connector_stats().aggregate(again).aggregate(again)
    assert values(total, "vllm:kvtier_loaded_chunks") == {("cpu", "0"): 10, ("cpu", "1"): 8}


def _tuples_out(d: dict) -> dict:  # JSON cannot key by tuple; vLLM's msgpack can
    return {**d, "data": {m: [[list(k), v] for k, v in s.items()] for m, s in d["data"].items()}}


def _tuples_in(d: dict) -> dict:
    return {**d, "data": {m: {tuple(k): v for k, v in s} for m, s in d["data"].items()}}


def test_merge_keeps_what_vllm_reports_and_adds_nothing_empty() -> None:
    assert merge(None, {}) is None  # nothing this step: no payload, as vLLM's own connector
    assert merge(None, {("load_jobs", ""): 0}) is None
    base = OffloadingConnectorStats()
    base.increase_counter("vllm:kv_offload_store_bytes", 10)
    out = merge(base, {})
    assert values(out, "vllm:kv_offload_store_bytes") == {(): 10}
    out = merge(base, {("stored_chunks_disk", "1"): 2})
    assert values(out, "vllm:kv_offload_store_bytes") == {(): 10}
    assert values(out, "vllm:kvtier_stored_chunks") == {("disk", "1"): 2}
    if "info" in base.data:  # vLLM 0.33: the manager's config info rides along unchanged
        base.set_info([{"kvtier_tiers": "cpu"}])
        assert merge(base, {("load_jobs", ""): 1}).data["info"] == [{"kvtier_tiers": "cpu"}]


def test_is_empty_and_reset_as_vllm_uses_them() -> None:
    s = KvtierConnectorStats()
    assert s.is_empty()
    s.add_counts({("loaded_chunks_group0", ""): 4, ("load_jobs", ""): 0})  # file-only and zero
    assert s.is_empty()  # vLLM drops an empty payload instead of sending it
    s.add_counts({("load_jobs", ""): 1})
    assert not s.is_empty()
    s.reset()  # KVConnectorLogging resets after each logged interval
    assert s.is_empty() and values(s, "vllm:kvtier_load_jobs") == {}
    # an empty payload folded in changes nothing (vLLM's aggregate returns early)
    t = worker_stats(load_jobs=2)
    assert values(t.aggregate(KvtierConnectorStats()), "vllm:kvtier_load_jobs") == {(): 2}


def test_reduce_names_kvtier_series_by_their_labels() -> None:
    s = worker_stats(loaded_chunks_disk__g3=9, load_jobs=1)
    s.increase_counter("vllm:kv_offload_load_bytes", 7)
    out = s.reduce()
    assert out["vllm:kvtier_loaded_chunks{tier=disk,group=3}"] == 9
    assert out["vllm:kvtier_load_jobs"] == 1
    assert out["vllm:kv_offload_load_bytes"] == 7  # vLLM's own keys as vLLM writes them


def _registry_types(reg: CollectorRegistry) -> dict:
    def bind(cls):  # type: ignore[no-untyped-def]
        class Bound(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *a, **k):  # type: ignore[no-untyped-def]
                super().__init__(*a, registry=reg, **k)
        return Bound
    return {Gauge: bind(Gauge), Counter: bind(Counter), Histogram: bind(Histogram)}


def _vllm_config() -> SimpleNamespace:
    extra = {"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm.spec"}
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))


def test_prometheus_counters_per_tier_and_group_beside_vllms() -> None:
    reg = CollectorRegistry()
    prom = KvtierConnector.build_prom_metrics(_vllm_config(), _registry_types(reg), ["model_name", "engine"],
                                              {0: ["m", "0"], 1: ["m", "1"]})
    assert isinstance(prom, KvtierPromMetrics)
    # unlabelled families read 0 before anything happens; per-tier ones appear with their first count
    assert reg.get_sample_value("vllm:kvtier_load_jobs_total", {"model_name": "m", "engine": "1"}) == 0
    s = worker_stats(loaded_chunks_cpu__g0=3, loaded_chunks_disk__g0=1, lookup_hit_keys__g0=4, load_jobs=1)
    s.increase_counter("vllm:kv_offload_load_bytes", 512)
    prom.observe(s.to_dict(), 0)
    prom.observe(worker_stats(loaded_chunks_cpu__g0=2).to_dict(), 0)
    prom.observe(worker_stats(loaded_chunks_cpu__g0=7).to_dict(), 1)

    def get(name: str, engine: str = "0", **labels: str) -> float | None:
        return reg.get_sample_value(name, {"model_name": "m", "engine": engine, **labels})

    assert get("vllm:kvtier_loaded_chunks_total", tier="cpu", group="0") == 5
    assert get("vllm:kvtier_loaded_chunks_total", tier="disk", group="0") == 1
    assert get("vllm:kvtier_loaded_chunks_total", "1", tier="cpu", group="0") == 7
    assert get("vllm:kvtier_lookup_hit_keys_total", group="0") == 4
    assert get("vllm:kvtier_load_jobs_total") == 1
    assert get("vllm:kv_offload_load_bytes_total") == 512  # vLLM's OffloadPromMetrics still does its part


def test_every_counter_the_integration_adds_has_a_metric() -> None:
    """A counter added in any module of the integration (manager.py, promotion.py,
    redis_lookup.py, worker.py, ...) without a family would stay in the file only."""
    names: set[str] = set()
    for path in sorted(SRC.glob("*.py")):
        names.update(re.findall(r'metrics\.add\(\s*f?"([^"]+)"', path.read_text()))
    assert len(names) > 25, names
    concrete: set[str] = set()
    for name in names:
        for tier in ("cpu", "disk", "redis"):
            for kind in ("load", "store"):
                concrete.add(name.format(tier=tier, kind=kind, g=0))
    # the names built beside the literal: f"evicted_{tier}" + "_dead", f"{kind}_jobs_failed"
    concrete.update({"evicted_cpu_dead", "load_jobs_failed", "store_jobs_failed"})
    missing = sorted(c for c in concrete if c not in SERIES and not c.startswith(FILE_ONLY_PREFIXES))
    assert not missing, missing
    assert len({f.metric for f in FAMILIES}) == len(FAMILIES)  # no two families share a name


# -- the counter file: written at most every interval_s, off the counting thread -----------------


def _writes(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    times: list[float] = []
    real = counters.os.replace

    def replace(a, b, **kw):  # type: ignore[no-untyped-def]  (relative to the directory's fd)
        times.append(time.monotonic())
        return real(a, b, **kw)

    monkeypatch.setattr(counters.os, "replace", replace)
    return times


def _file(tmp_path: Path) -> dict:
    files = list((tmp_path / "metrics").glob("scheduler-*.json"))
    return json.loads(files[0].read_text())["counts"] if files else {}


def test_the_file_is_written_at_most_every_interval_and_catches_up(tmp_path: Path, monkeypatch) -> None:
    writes = _writes(monkeypatch)
    fired: list[float] = []  # when each timer write began: a late file write cannot move these
    real_on_timer = Metrics._on_timer

    def on_timer(self: Metrics) -> None:
        fired.append(time.monotonic())
        real_on_timer(self)

    monkeypatch.setattr(Metrics, "_on_timer", on_timer)
    m = Metrics("scheduler", str(tmp_path), interval_s=0.3)
    t0 = time.monotonic()
    # a busy engine: thousands of counts a second (at least 1 s and 1000 counts, however slowly
    # a loaded machine wakes the loop)
    while (elapsed := time.monotonic() - t0) < 1.0 or m.counts["lookup_keys"] < 1000:
        m.add("lookup_keys")
        m.flush()  # what every call site used to do: now only makes sure a write is due
        time.sleep(0.0005)
    n = m.counts["lookup_keys"]
    # one write per 0.3 s (the first at once), not one per count
    assert len(writes) <= 2 + elapsed / 0.3, (len(writes), elapsed)
    deadline = time.monotonic() + 10  # a second timer write is due 0.3 s after the first
    while len(fired) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    gaps = [b - a for a, b in zip(fired, fired[1:])]
    assert len(fired) >= 2 and min(gaps) >= 0.29, gaps
    # nothing counts any more: the last counts still land (within interval_s; polled up to 10 s
    # so that a loaded machine's late timer thread does not fail it)
    deadline = time.monotonic() + 10
    while _file(tmp_path).get("lookup_keys") != n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _file(tmp_path)["lookup_keys"] == n


def test_first_count_lands_soon_and_forced_flush_is_immediate(tmp_path: Path, monkeypatch) -> None:
    writes = _writes(monkeypatch)
    m = Metrics("scheduler", str(tmp_path), interval_s=5.0)
    m.add("resets")
    deadline = time.monotonic() + 2
    while not writes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _file(tmp_path) == {"resets": 1}  # an idle process's first count is not held back
    m.add("resets")
    time.sleep(0.2)
    assert _file(tmp_path) == {"resets": 1}  # within the interval: not yet
    m.flush(force=True)  # start, shutdown, the workers' layout: written now
    assert _file(tmp_path) == {"resets": 2}


def test_counting_from_threads_loses_nothing(tmp_path: Path) -> None:
    """The worker counts on the engine thread and on its background I/O thread; vLLM takes the
    deltas on the engine thread while the timer writes the file."""
    m = Metrics("scheduler", str(tmp_path), interval_s=0.01)
    taken: list[int] = []
    stop = threading.Event()

    def count() -> None:
        for i in range(5000):
            m.add("stored_chunks_disk", group=i % 3)

    def take() -> None:
        while not stop.is_set():
            taken.append(sum(m.take_delta().values()))
            m.flush(force=len(taken) % 7 == 0)

    threads = [threading.Thread(target=count) for _ in range(4)]
    taker = threading.Thread(target=take)
    taker.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    taker.join()
    taken.append(sum(m.take_delta().values()))
    assert sum(taken) == 20000
    m.flush(force=True)
    assert _file(tmp_path) == {"stored_chunks_disk": 20000}


def test_a_process_that_exits_writes_what_it_counted(tmp_path: Path) -> None:
    """Tests and `kvtier` commands read the file after the engine's processes exit: counts made
    after the last write land at exit, even with a long interval and no shutdown call."""
    code = (f"from kvtier.integrations.vllm.counters import Metrics\n"
            f"m = Metrics('scheduler', {str(tmp_path)!r}, interval_s=60)\n"
            "m.flush(force=True)\n"
            "for _ in range(7): m.add('load_jobs')\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert read_metrics(tmp_path) == {"load_jobs": 7}


def test_no_directory_no_file_no_timer(tmp_path: Path) -> None:
    m = Metrics("scheduler", None)
    m.add("lookup_keys")
    m.flush()
    m.flush(force=True)
    assert m._timer is None and m.take_delta() == {("lookup_keys", ""): 1}
