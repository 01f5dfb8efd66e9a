"""Runs one vLLM engine through rounds of prompts (a multi-turn workload) in its own process and
prints one JSON line (`RESULT {...}`), like driver.py:

    {"model": DIR, "dtype": "float32", "kv": {...kv_transfer_config...} | null,
     "turns": [[prompt token ids, ...], ...], "max_tokens": 4, "directory": DIR | null,
     (or "turns_file": a JSON file of those turns),
     "max_model_len": 2048, "engine_args": {...}}

vLLM's prefix cache is reset before every round, so every reused token comes from kvtier. Per
round: each request's output and vLLM's cached tokens; at the end kvtier's counters and info.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main() -> int:
    sc = json.loads(sys.argv[1])
    if "turns_file" in sc:  # long workloads: one argument is limited to 128 KiB
        sc["turns"] = json.loads(Path(sc["turns_file"]).read_text())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(sc.get("kv_space_gib", 1)))
    from vllm import LLM, SamplingParams

    from kvtier.commands.bench_serve import settled
    from kvtier.integrations.vllm.counters import read_info, read_metrics

    kw = dict(model=sc["model"], max_model_len=sc.get("max_model_len", 2048), enforce_eager=True,
              dtype=sc.get("dtype", "auto"), seed=0, enable_prefix_caching=True)
    kw.update(sc.get("engine_args", {}))
    if sc.get("kv") is not None:
        kw["kv_transfer_config"] = sc["kv"]
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0.0, max_tokens=sc.get("max_tokens", 4))
    out: dict[str, object] = {"outputs": [], "cached_tokens": [], "seconds": []}
    for turn in sc["turns"]:
        assert llm.reset_prefix_cache()
        t0 = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": p} for p in turn], sp, use_tqdm=False)
        out["seconds"].append(time.perf_counter() - t0)  # type: ignore[union-attr]
        out["outputs"].append([list(r.outputs[0].token_ids) for r in res])  # type: ignore[union-attr]
        out["cached_tokens"].append([r.num_cached_tokens or 0 for r in res])  # type: ignore[union-attr]
    if sc.get("directory"):
        out["metrics"] = settled(read_metrics, Path(sc["directory"]))
        out["info"] = read_info(sc["directory"])
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
