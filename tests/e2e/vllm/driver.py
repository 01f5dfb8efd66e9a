"""Runs one vLLM engine scenario in its own process and prints one JSON line (`RESULT {...}`).

Each engine gets a fresh process: vLLM engines do not shut down cleanly enough to start a
second one in the same process, and a subprocess is how a user runs vLLM anyway. The scenario
(argv[1], JSON) says which model, which kv_transfer_config and what to do between passes:

    {"model": DIR, "dtype": "float32", "kv": {...kv_transfer_config...},
     "prompts": [[token ids], ...], "max_tokens": 8, "passes": 2,
     "between": ["reset"] | [["reset", "corrupt_disk"], ["reset"]], "directory": DIR,
     "engine_args": {...more keyword arguments of vllm.LLM...}}
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def corrupt_disk(directory: str) -> int:
    """Flip payload bytes of every occupied slot of every slab under `directory`/disk."""
    from kvtier.store.tiers.disk_files import DATA_OFFSET, slot_stride
    from kvtier.store.tiers.disk_scan import scan_dir

    n = 0
    for rec in scan_dir(Path(directory) / "disk"):
        if rec.problem is not None:
            continue
        off = rec.slot * slot_stride(rec.slot_bytes) + DATA_OFFSET + 7
        with open(rec.path, "r+b") as f:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))
        n += 1
    return n


def main() -> int:
    sc = json.loads(sys.argv[1])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(sc.get("kv_space_gib", 1)))
    from vllm import LLM, SamplingParams

    from kvtier.commands.bench_serve import settled
    from kvtier.integrations.vllm.counters import FLUSH_INTERVAL_S, read_info, read_metrics

    kw = dict(model=sc["model"], max_model_len=sc.get("max_model_len", 1024), enforce_eager=True,
              dtype=sc.get("dtype", "auto"), seed=0, enable_prefix_caching=True)
    kw.update(sc.get("engine_args", {}))  # e.g. {"mamba_cache_mode": "align"}
    if sc.get("kv") is not None:
        kw["kv_transfer_config"] = sc["kv"]
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0.0, max_tokens=sc.get("max_tokens", 8))
    prompts = [{"prompt_token_ids": p} for p in sc["prompts"]]
    out: dict[str, object] = {"outputs": [], "seconds": [], "metrics": []}
    for i in range(sc.get("passes", 2)):
        if i:
            between = sc.get("between", ["reset"])
            if between and isinstance(between[0], list):  # one list of steps per later pass
                between = between[i - 1]
            for step in between:
                if step == "reset":
                    assert llm.reset_prefix_cache()
                elif step == "corrupt_disk":
                    out["corrupted"] = corrupt_disk(sc["directory"])
        t0 = time.perf_counter()
        res = llm.generate(prompts, sp, use_tqdm=False)
        out["seconds"].append(time.perf_counter() - t0)
        out["outputs"].append([list(r.outputs[0].token_ids) for r in res])
        # the last counts reach the metrics files: kvtier rewrites them at most once a second,
        # and disk writes end on the worker's I/O thread after generate() returns; read them
        # once they have not changed for 2.5 s (a fixed sleep raced a loaded machine)
        if sc.get("directory"):
            out["metrics"].append(settled(read_metrics, Path(sc["directory"])))
        else:
            time.sleep(FLUSH_INTERVAL_S + 0.3)
    if sc.get("directory"):
        out["info"] = read_info(sc["directory"])
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
