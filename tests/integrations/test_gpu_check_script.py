"""scripts/gpu-check.py, the GPU bandwidth check of issue 15, run here on CPU tensors: kvtier's
half round-trips every byte through vLLM's real connector factory and OffloadingWorker calls, and
vLLM's native CPU offloading is reported with its own refusal (it needs a GPU). The GB/s figures
it prints here are CPU memcpy figures, not GPU ones; nothing asserts on them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "scripts" / "gpu-check.py"


@pytest.mark.parametrize("emulate", [False, True])
def test_gpu_check_runs_kvtier_half_on_cpu(emulate: bool) -> None:
    """Also with --emulate-gpu: kvtier's worker takes its GPU path, vLLM's own copy handler."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR")
    cmd = [sys.executable, str(SCRIPT), "--chunks", "2", "--layers", "2", "--reps", "2", "--json"]
    proc = subprocess.run(cmd + (["--emulate-gpu"] if emulate else []),
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["device"] == "cpu"
    k = out["kvtier"]
    assert k["round_trip_exact"] is True, k
    assert k["copy_path"] == ("vLLM handler" if emulate else "index_copy"), k
    assert k["store_gbps"] > 0 and k["load_gbps"] > 0
    assert k["bytes_per_rep"] == 2 * 16 * 2 * (2 * 16 * 8 * 128 * 4)  # chunks x blocks x layers x page
    assert "CUDA" in out["native"]["error"]  # vLLM's native CPU tier refuses a CPU platform
