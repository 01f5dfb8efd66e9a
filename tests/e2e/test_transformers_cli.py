"""`kvtier demo` and `kvtier bench ttft` end to end, on a tiny model directory (--model PATH).

The real Gemma 3 270M run (`make demo`) takes minutes; its figures are in docs/transformers.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtier.local_models import tiny_random_dir

ENV = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")


def kvtier(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier", *args], capture_output=True, text=True,
                          env=ENV, timeout=timeout)


def test_demo_json_on_a_tiny_gemma3() -> None:
    done = kvtier("demo", "--model", str(tiny_random_dir("gemma3")), "--json", "--max-new-tokens", "4",
                  "--threads", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert set(out) == {"model", "turns"}
    turns = out["turns"]
    assert len(turns) == 8
    for t in turns:
        assert {"prompt_tokens", "restored_tokens", "ttft_s", "ttft_uncached_s", "speedup",
                "identical"} <= set(t)
        assert t["identical"] is True
        assert 0 <= t["restored_tokens"] < t["prompt_tokens"]
        assert t["speedup"] == pytest.approx(t["ttft_uncached_s"] / t["ttft_s"], rel=0.05, abs=0.006)  # printed to 2 places
    assert turns[0]["restored_tokens"] == 0  # nothing stored yet
    assert all(t["restored_tokens"] >= 1024 for t in turns[1:])  # the shared 1k+ document
    assert turns[-1]["restored_by_tier"] == {"disk": turns[-1]["restored_tokens"]}  # after restart
    assert "loading model" in done.stderr or "turns" in done.stderr  # progress bars on stderr


def test_bench_ttft_json_on_a_tiny_llama() -> None:
    done = kvtier("bench", "ttft", "--model", str(tiny_random_dir("llama")), "--json",
                  "--prefixes", "64,128", "--rounds", "1", "--threads", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout)["rows"]
    assert [r["prefix_tokens"] for r in rows] == [64, 128]
    for r in rows:
        assert set(r) == {"prefix_tokens", "recompute_s", "cpu_s", "disk_s", "ideal_s"}
        assert all(r[k] > 0 for k in ("recompute_s", "cpu_s", "disk_s", "ideal_s"))


@pytest.mark.parametrize("args", [
    ("demo", "--model", "/nonexistent/model"),
    ("demo", "--max-new-tokens", "0"),
    ("bench", "ttft", "--prefixes", "100"),
    ("bench", "ttft", "--prefixes", "a,b"),
    ("demo", "--threads", "x"),
])
def test_bad_input_is_one_error_line_and_exit_2(args: tuple[str, ...]) -> None:
    if args[0] == "bench" and args[2] == "100":
        args = (*args, "--model", str(tiny_random_dir("llama")))
    done = kvtier(*args)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in done.stderr
