"""One engine with kvtier and vLLM's KV events on ZMQ, and kvtier.router fed only from them.

For each prompt of the scenario, in order: the router predicts (from the events received so
far) how many tokens the engine will restore from kvtier, vLLM's GPU prefix cache is reset (so
what the engine reuses comes from kvtier alone), the prompt runs, and vLLM's own count of the
request's cached tokens is recorded. Prints `RESULT {...}` with, per request, the prediction, the
group-blind prediction and what the engine restored, plus kvtier's counters at the end.

    {"model": DIR, "kv": {...kv_transfer_config...}, "prompts_file": FILE (a JSON list of token
     id lists), "directory": DIR,
     "port": 5557, "max_model_len": 2560}
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


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


def main() -> int:
    sc = json.loads(sys.argv[1])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig

    from kvtier.commands.bench_serve import settled
    from kvtier.integrations.vllm.counters import read_metrics
    from kvtier.router import PrefixIndex, Subscriber

    port = int(sc["port"])
    index = PrefixIndex()
    sub = Subscriber(index, {"engine": f"tcp://127.0.0.1:{port}"}, topic="kv")
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}", topic="kv")
    llm = LLM(model=sc["model"], max_model_len=sc.get("max_model_len", 2560), enforce_eager=True,
              dtype=sc.get("dtype", "float32"), seed=0, enable_prefix_caching=True,
              kv_transfer_config=sc["kv"], kv_events_config=events)
    sp = SamplingParams(temperature=0.0, max_tokens=sc.get("max_tokens", 4))
    rows = []
    prompts = json.loads(Path(sc["prompts_file"]).read_text())
    for i, prompt in enumerate(prompts):
        _settle(sub)
        predicted = index.longest_prefix(prompt, "engine")[0]
        blind = index.longest_prefix(prompt, "engine", group_blind=True)[0].tokens
        assert llm.reset_prefix_cache()  # vLLM's GPU cache only: what is reused comes from kvtier
        (res,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        rows.append({"i": i, "prompt_tokens": len(prompt), "predicted": predicted.tokens,
                     "tiers": list(predicted.tiers), "blind": blind, "restored": res.num_cached_tokens or 0})
    _settle(sub)
    out = {"rows": rows, "summary": index.summary(), "batches": sub.batches,
           "metrics": settled(read_metrics, Path(sc["directory"]))}
    sub.close()
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
