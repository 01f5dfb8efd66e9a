"""Median time of the vLLM worker's submit_store / submit_load with cpu, disk and Redis tiers,
kvtier's background I/O against the same jobs done inline, side by side in one run (vLLM's real
connector halves on CPU tensors, tests/integrations/vllm_engineless/harness.py).

    .venv/bin/python scripts/vllm-submit-timing.py [0.32|0.33] [JOBS] [handler]

`handler`: the worker's GPU path, chunks moved through vLLM's own copy handler (its descriptor
code runs; the copy itself is emulated on this CPU machine, tests/integrations/vllm_engineless/
fake_cuda.py): what `submit_*` costs the engine thread there, not a GPU figure.

Starts its own redis-server on a free loopback port (scripts/ensure-redis.sh installs it). For
0.33, vLLM 0.33's Python code must be in .vllm033 (scripts/setup-vllm033.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from redis_servers import redis_server  # noqa: E402


def main() -> int:
    version = sys.argv[1] if len(sys.argv) > 1 else "0.32"
    jobs = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
    handler = len(sys.argv) > 3 and sys.argv[3] == "handler"
    with redis_server() as srv:
        sc = [{"name": "t", "submit_timing": True, "jobs": jobs,
               "extra": {"kvtier.tiers": "cpu,disk,redis", "kvtier.disk_bytes": "64MiB",
                         "kvtier.redis_bytes": "64MiB", "kvtier.redis_url": srv.url}, "fake_cuda": handler}]
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR")
        if version == "0.33":
            env["PYTHONPATH"] = str(REPO / ".vllm033")
        proc = subprocess.run([sys.executable, str(REPO / "tests/integrations/vllm_engineless/harness.py"),
                               json.dumps(sc)], env=env, capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        print(proc.stderr[-3000:], file=sys.stderr)
        return 1
    out = json.loads(lines[0][len("RESULT "):])
    r = out["t"]
    if "error" in r:
        print(r["error"], file=sys.stderr)
        return 1
    path = "GPU path: vLLM's copy handler, copy emulated" if handler else "CPU path"
    print(f"vLLM {out['vllm_version']}, {r['jobs']} one-chunk jobs, tiers {','.join(r['tiers'])}, {path}")
    for mode in ("background", "inline"):
        print(f"  {mode:10s} submit_store median {r[mode]['store_median_ms']:.3f} ms, "
              f"submit_load (from Redis) median {r[mode]['load_median_ms']:.3f} ms")
    print(f"  inline / background: store {r['store_ratio_inline_over_background']:.2f}x, "
          f"load {r['load_ratio_inline_over_background']:.1f}x")
    p = r.get("promote")
    if p:
        print(f"  a load job until it finishes: from disk (promoted) median {p['disk_then_promoted_ms']:.3f} ms, "
              f"the same chunk again from the cpu slot {p['again_from_cpu_ms']:.3f} ms "
              f"({p['disk_over_cpu']:.1f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
