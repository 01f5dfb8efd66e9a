"""`kvtier bench vllm --json`: one JSON object with exactly the documented keys, from a real
engine (a short prefix here to keep `make test` fast; the documented run uses 2048 tokens)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "vllm"))
from vllm_e2e import ENGINE_TIMEOUT_S, tiny_llama_dir  # noqa: E402

pytestmark = pytest.mark.slow


def test_bench_vllm_json() -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("kvtier")), "bench", "vllm", "--json", "--model", str(tiny_llama_dir()),
         "--dtype", "float32", "--rounds", "1", "--prompts", "1", "--prefix-tokens", "512"],
        env=env, capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout[-2000:]  # --json: one object on stdout, logs on stderr
    result = json.loads(lines[0])
    assert set(result) == {"first_s", "second_s", "loaded_blocks", "identical"}
    assert result["identical"] is True
    assert result["loaded_blocks"] == 4  # 512 + 16 tokens: 4 full chunks of 128, all reloaded
    assert result["first_s"] > 0 and result["second_s"] > 0
