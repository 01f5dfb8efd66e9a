"""Eviction by worth in vLLM's manager (`kvtier.policy` "auto", issue 39 item 3) through vLLM's real
scheduler and both connector halves (vllm_engineless/harness.py), on vLLM 0.32 and 0.33: sessions of
Mooncake's conversation trace through a Qwen3-Next-like engine (one full-attention group, three
state groups, align mode, placement "hits") with a fixed cpu tier, every loaded position of every
group checked. Three runs in the same bytes: `kvtier.policy: lru`, the default ("auto", which is
worth with its tuner for this model), and worth with a short tuning period, so the tuner's child
process scores windows during the run; after each worth run, vLLM's connector reset (the tuner and
its w stay). A one-group model and placement "every" resolve "auto" to lru.

Run as a script (the test does, once per vLLM version): `python test_vllm_worth.py JSON`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from vllm_versions import fixtures, start

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TRACE = REPO / "src" / "kvtier" / "data" / "mooncake_conversation_head.jsonl"
STATE_HYBRID = ["full", {"kind": "state"}, {"kind": "state"}, {"kind": "state"}]
PERIOD = 256  # chunks between tunings in the "tuned" run (the default, 32768, is longer than the run)
SCENARIO = {"trace": str(TRACE), "sessions": 48, "layers": STATE_HYBRID,
            "extra": {"kvtier.cpu_bytes": "1536KiB", "kvtier.placement": "hits"}}
MODES = {"lru": "lru", "auto": None, "tuned": f"worth:period={PERIOD}"}  # None: the key left out


# -- the driver (run in a subprocess per vLLM version) ---------------------------------------------

def _policy_names(manager) -> list[str]:  # noqa: ANN001 - KvtierManager
    """The eviction policy of every pool of the manager's index."""
    index = manager.index
    return sorted({index.policy_of(g, t).name for (t, g) in index._pools})


def resolved(sc: dict, layers: list, placement: str) -> dict:
    """What "auto" resolves to for an engine of these layers and placement (no requests run)."""
    import harness

    h = harness.Harness(dict(sc, layers=layers, extra={**sc["extra"], "kvtier.placement": placement}))
    manager = h.sched.connector.scheduler.manager
    try:
        return {"policy": manager.ctx.policy, "pools": _policy_names(manager), "tuner": manager.tuner is not None}
    finally:
        h.sched.shutdown()


def run_mode(sc: dict, policy: str | None) -> dict:
    import harness

    workload = harness.conversation_sessions(sc["trace"], int(sc["sessions"]))
    extra = dict(sc["extra"])
    if policy is not None:
        extra["kvtier.policy"] = policy
    h = harness.Harness(dict(sc, extra=extra))
    manager = h.sched.connector.scheduler.manager
    out = {"resolved": manager.ctx.policy, "pools": _policy_names(manager), "tuner": manager.tuner is not None}
    restored = checked = bad = hits = 0
    weights: set[float] = set()
    for n, req in enumerate(workload):
        prompt = harness.trace_prompt(req, h.bs)
        assert harness._fresh_gpu_cache(h), "vLLM refused reset_prefix_cache"
        r = harness._load_and_check(h, f"r{n}", prompt)
        assert r["external_tokens"] >= 0, r
        restored += r["external_tokens"]
        hits += int(r["external_tokens"] > 0)
        checked += r["checked"]
        bad += r["mismatches"]
        for _ in harness._steps(10.0):
            if not h.sched.requests:
                break
            h.step()
        h.drain()
        tuner = manager.tuner
        if tuner is not None:  # the run waits for each tuning, so which window each scores is fixed
            deadline = time.monotonic() + 30
            while tuner.busy and time.monotonic() < deadline:
                time.sleep(0.005)
            assert not tuner.busy, f"request {n}: a tuning still ran after 30s (the run would not repeat)"
            weights.add(tuner.weight.w)
    tuner = manager.tuner
    pid = tuner.pid if tuner is not None else None
    evictions = sum(manager.index.counters(gp.index, "cpu")["evictions"] for gp in manager.ctx.plan.cacheable_groups)
    out["reset"] = _reset(h, manager) if tuner is not None else None
    h.sched.shutdown()  # vLLM's path: scheduler -> connector -> manager.shutdown
    child_alive = None
    if pid is not None:  # shutdown never waits for the child: the tuner's thread reaps it soon after
        deadline = time.monotonic() + 10
        while (child_alive := _alive(pid)) and time.monotonic() < deadline:
            time.sleep(0.01)
    counts = manager.metrics.counts
    out.update({"requests": len(workload), "restored_tokens": restored, "hit_requests": hits,
                "checked": checked, "mismatches": bad, "failed": sorted(h.failed), "evictions": evictions,
                "weights": sorted(weights), "child_pid": pid, "child_alive": child_alive,
                "tuner_after_shutdown": manager.tuner is not None,
                "worth": {k: v for k, v in counts.items() if k.startswith("worth_")}})
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _reset(h, manager) -> dict:  # noqa: ANN001 - harness.Harness, KvtierManager
    """vLLM's connector reset after the run: what the tuner kept (its weight, its child) and
    whether the new index's pools evict by that same weight."""
    tuner, w, pid = manager.tuner, manager.tuner.weight.w, manager.tuner.pid
    assert h.sched.reset_connector_cache(), "vLLM refused reset_connector_cache"
    after = manager.tuner
    index = manager.index
    shared = after is not None and all(index.policy_of(g, t).weight is after.weight for (t, g) in index._pools)
    alive = pid is not None and _alive(pid)
    return {"same_tuner": after is tuner, "w_before": w, "w_after": after.weight.w if after else None,
            "pid_before": pid, "pid_after": after.pid if after else None, "alive": alive,
            "pools_share_w": shared, "window_after": len(after.window) if after else None,
            "resets": manager.metrics.counts.get("resets", 0)}


def main() -> None:
    import traceback

    sys.path.insert(0, str(HERE / "vllm_engineless"))
    import vllm

    sc = json.loads(sys.argv[1])
    out: dict = {"vllm_version": vllm.__version__}
    jobs = {f"run_{m}": (run_mode, (sc, p)) for m, p in MODES.items()}
    jobs["one_group"] = (resolved, (sc, ["full"], "hits"))
    jobs["every"] = (resolved, (sc, STATE_HYBRID, "every"))
    for name, (fn, args) in jobs.items():
        t0 = time.monotonic()
        try:
            out[name] = fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        out[name]["seconds"] = round(time.monotonic() - t0, 1)
    print("RESULT " + json.dumps(out), flush=True)


# -- the test ------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["auto", "worth", "worth:w=2", "worth:period=64,max_chunks=4096", "lru", "s3fifo"])
def test_the_policy_names_accepted(policy: str) -> None:
    from kvtier.integrations.vllm.config import parse_config

    assert parse_config({"kvtier.cpu_bytes": 4096, "kvtier.policy": policy}).policy == policy
    assert parse_config({"kvtier.cpu_bytes": 4096}).policy == "auto"


@pytest.mark.parametrize(("policy", "needle"), [
    ("random", "kvtier.policy='random' is unknown; use one of: auto, lru, fifo, arc, s3fifo, worth, worth:w=W"),
    ("worthy", "kvtier.policy='worthy' is unknown"),
    (3, "kvtier.policy=3 is unknown"),
    ("worth:x=1", "kvtier.policy 'worth:x=1': option 'x=1'; worth takes w=W"),
    ("worth:w=-1", "kvtier.policy 'worth:w=-1': w=-1 must be positive"),
])
def test_an_unknown_policy_is_one_line_naming_the_value_and_the_names(policy: object, needle: str) -> None:
    from kvtier.errors import ConfigError
    from kvtier.integrations.vllm.config import parse_config

    with pytest.raises(ConfigError) as err:
        parse_config({"kvtier.cpu_bytes": 4096, "kvtier.policy": policy})
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


results, _no_driver_left = fixtures(lambda v: start([__file__, json.dumps(SCENARIO)], v), timeout=900)


def _ok(results: dict, name: str) -> dict:
    r = results[name]
    assert "error" not in r, f"{name}: {r.get('error')}\n{r.get('traceback', '')}"
    return r


def _run(results: dict, mode: str) -> dict:
    r = _ok(results, f"run_{mode}")
    assert r["requests"] == 202, r
    assert r["checked"] > 1000 and r["mismatches"] == 0 and r["failed"] == [], r
    return r


def test_auto_is_worth_where_a_placed_group_differs_in_worth_else_lru(results: dict) -> None:
    auto, lru = _run(results, "auto"), _run(results, "lru")
    assert (auto["resolved"], auto["pools"], auto["tuner"]) == ("worth", ["worth"], True), auto
    assert (lru["resolved"], lru["pools"], lru["tuner"]) == ("lru", ["lru"], False), lru
    # one group (nothing but anchors) and every chunk warm: nothing to weigh, LRU as before
    for name in ("one_group", "every"):
        r = _ok(results, name)
        assert (r["policy"], r["pools"], r["tuner"]) == ("lru", ["lru"], False), (name, r)


def test_the_default_is_worth_and_evicts_as_lru_while_w_is_0(results: dict) -> None:
    """The default ("auto": worth, tuned every 32768 chunks) never tunes within this run, so its
    weight stays 0, where worth is LRU exactly: the same restored tokens, hits and evictions in
    the same bytes. What tuning gains is the tuned run's (next test)."""
    auto, lru = _run(results, "auto"), _run(results, "lru")
    print(json.dumps({"vllm": results["vllm_version"], "lru": lru, "auto": auto,
                      "tuned": results.get("run_tuned")}))
    assert lru["evictions"] > 0, lru  # the tier is too small for the run: the policy picks victims
    assert auto["resolved"] == "worth" and auto["worth"].get("worth_tunings", 0) == 0, auto
    assert auto["weights"] == [0.0], auto
    same = ("restored_tokens", "hit_requests", "checked", "evictions")
    assert {k: auto[k] for k in same} == {k: lru[k] for k in same}, (lru, auto)
    assert lru["restored_tokens"] > 0, lru


def test_the_tuner_scores_windows_in_a_child_that_is_gone_after_shutdown(results: dict) -> None:
    """A short period: the child scores windows during the run (each waited for, and the run
    checks none was still in flight after its wait, so the run repeats), w moves off 0 and the
    same bytes restore more than LRU; shutdown stops the child and nothing tuned is left."""
    tuned = _run(results, "tuned")
    assert tuned["resolved"] == f"worth:period={PERIOD}" and tuned["tuner"], tuned
    assert tuned["evictions"] > 0, tuned
    assert tuned["worth"].get("worth_tunings", 0) >= 2, tuned  # counted by the manager's metrics
    assert tuned["worth"].get("worth_tunings_failed", 0) == 0, tuned
    assert tuned["worth"].get("worth_tunings_skipped", 0) == 0, tuned  # each tuning waited for
    assert tuned["child_pid"] is not None and tuned["child_alive"] is False, tuned
    assert not tuned["tuner_after_shutdown"], tuned
    assert max(tuned["weights"]) > 0, tuned
    assert tuned["restored_tokens"] > _run(results, "lru")["restored_tokens"], tuned


def test_a_reset_keeps_the_learned_weight_and_the_child(results: dict) -> None:
    """vLLM's reset_cache after the tuned run: the tuner, its w and its child stay (w is what the
    traffic taught, not what the dropped index held), the new index's pools evict by that same
    weight, and only the tuner's window is cleared."""
    r = _run(results, "tuned")["reset"]
    assert r is not None and r["resets"] == 1, r
    assert r["same_tuner"] and r["w_before"] > 0 and r["w_after"] == r["w_before"], r
    assert r["pools_share_w"], r
    assert r["pid_before"] is not None and r["pid_after"] == r["pid_before"] and r["alive"], r
    assert r["window_after"] == 0, r


if __name__ == "__main__":
    main()
