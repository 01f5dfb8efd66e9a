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
    from kvtier.integrations.models import gemma3_270m_dir

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
