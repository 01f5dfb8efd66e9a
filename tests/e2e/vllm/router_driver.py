"""Engines one after another in this process, vLLM's KV events on ZMQ, and one kvtier.router
(`PrefixIndex` + `Subscriber`) that follows them all, fed only from their events.

Each phase starts one engine (a name, a model, a kv_transfer_config; an engine name keeps its
ports, so a phase that names an engine again is that engine restarted), records what the router
holds for it once its start-up events settled, runs its steps, and stops it:
- `["run", NAME]`: the router predicts (from the events so far) how many tokens of prompt NAME
  the engine restores from kvtier; vLLM's GPU prefix cache is reset (what is reused comes from
  kvtier alone), the prompt runs, and vLLM's count of the request's cached tokens is recorded;
- `["reset"]`: `reset_prefix_cache(reset_connector=True)`, then, with no engine step, how long
  until the router holds nothing of the engine (at most RESET_WAIT_S).
Prints `RESULT {...}`: per phase its rows, what the router held at its start, kvtier's counters.

    argv[1]: {"scenario_file": FILE}, FILE: {"prompts": {NAME: [ids]}, "shared_tiers": {...},
     "engines": {ENGINE: {"port": P, "replay_port": R}}, "phases": [{"engine": ENGINE, "model":
     DIR, "kv": {...}, "directory": DIR, "max_model_len": N, "steps": [...]}]}
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

from driver import engine_env, start_engine  # this script's directory is on sys.path

RESET_WAIT_S = 3.0


def _settle(sub, quiet_s: float = 0.6, limit_s: float = 20.0) -> None:  # noqa: ANN001
    """Wait until no event batch arrived for `quiet_s` (vLLM publishes per engine step)."""
    deadline = time.monotonic() + limit_s
    last, since = sub.batches, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if sub.batches != last:
            last, since = sub.batches, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return


def _held(index, engine: str) -> dict[str, int]:  # noqa: ANN001
    """Chunks the router holds for `engine`, per tier (every group)."""
    out: dict[str, int] = {}
    for g in index.summary().get(engine, {}).get("groups", {}).values():
        for tier, n in g["chunks"].items():
            out[tier] = out.get(tier, 0) + n
    return out


def main() -> int:
    sc = json.loads(Path(json.loads(sys.argv[1])["scenario_file"]).read_text())
    engine_env()
    from vllm.config import KVEventsConfig

    from kvtier.integrations.vllm.counters import read_metrics
    from kvtier.router import PrefixIndex, Subscriber

    prompts = sc["prompts"]
    engines = sc["engines"]
    index = PrefixIndex(shared_tiers=sc.get("shared_tiers"))
    sub = Subscriber(index, {e: f"tcp://127.0.0.1:{p['port']}" for e, p in engines.items()}, topic="kv",
                     replay={e: f"tcp://127.0.0.1:{p['replay_port']}" for e, p in engines.items()})
    phases = []
    for ph in sc["phases"]:
        name, ports = ph["engine"], engines[ph["engine"]]
        events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{ports['port']}",
                                replay_endpoint=f"tcp://*:{ports['replay_port']}", topic="kv")
        t0 = time.monotonic()
        llm, sp = start_engine(ph, max_model_len=2560, max_tokens=2, dtype="float32", kv_events_config=events)
        start_s = time.monotonic() - t0
        _settle(sub)
        out = {"engine": name, "start_s": round(start_s, 1), "held_at_start": _held(index, name), "rows": []}
        for step in ph["steps"]:
            if step[0] == "reset":
                assert llm.reset_prefix_cache(reset_connector=True)
                t = time.monotonic()
                while _held(index, name) and time.monotonic() - t < RESET_WAIT_S:
                    time.sleep(0.02)
                out["rows"].append({"step": "reset", "held_after_reset": _held(index, name),
                                    "seconds": round(time.monotonic() - t, 2)})
                continue
            prompt = prompts[step[1]]
            _settle(sub)
            predicted = index.longest_prefix(prompt, name)[0]
            blind = index.longest_prefix(prompt, name, group_blind=True)[0].tokens
            assert llm.reset_prefix_cache()  # vLLM's GPU cache only: what is reused comes from kvtier
            (res,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
            out["rows"].append({"step": "run", "prompt": step[1], "prompt_tokens": len(prompt),
                                "predicted": predicted.tokens, "tiers": list(predicted.tiers), "blind": blind,
                                "restored": res.num_cached_tokens or 0})
        _settle(sub)
        out["summary"] = index.summary().get(name, {})
        llm.llm_engine.engine_core.shutdown()  # the engine core process exits: kvtier's counters flushed
        del llm
        gc.collect()
        out["metrics"] = read_metrics(Path(ph["directory"]))
        out["seconds"] = round(time.monotonic() - t0, 1)
        phases.append(out)
        print(f"phase {name}: {out['seconds']} s", file=sys.stderr, flush=True)
    sub.close()
    print("RESULT " + json.dumps({"phases": phases, "summary": index.summary()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
