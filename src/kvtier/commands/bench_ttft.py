"""`kvtier bench ttft`: time to first token on the real model, prefix + 64-token suffix.

For each prefix length L (512, 1k, 2k, 4k by default) the prompt is L tokens of real text plus a
64-token suffix, and four ways to reach the first token are timed side by side, round-robin
(the order rotates every round), medians over `--rounds`:
- recompute: a plain forward over all L+64 tokens (no cache);
- cpu: kvtier restores the L-token prefix from a cpu tier, computes the suffix;
- disk: the same from a disk tier; the slab files are dropped from the page cache
  (posix_fadvise DONTNEED) before every disk round, so it reads from the device;
- ideal: the suffix computed on a cache already in place (a copy made before the clock starts):
  no lookup, no load. cpu / ideal is kvtier's whole overhead.
Each time covers prefill + the first token (argmax of the last logits); the first tokens of the
four ways are checked to be equal.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HELP = "time to first token: full recompute vs restore from cpu / disk vs ideal, by prefix length"

MODES = ("recompute", "cpu", "disk", "ideal")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH", help="a local Hugging Face model directory (default: Gemma 3 270M)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--prefixes", default="512,1024,2048,4096", metavar="N,N,...", help="prefix lengths in tokens")
    p.add_argument("--suffix-tokens", type=int, default=64, metavar="N", help="suffix tokens after the prefix (64)")
    p.add_argument("--rounds", type=int, default=3, metavar="N", help="rounds per mode; medians are reported (3)")
    p.add_argument("--chunk-tokens", type=int, default=64, metavar="N", help="tokens per chunk (64)")
    p.add_argument("--dtype", default="float32", help="model dtype: float32 (default), bfloat16, float16")
    p.add_argument("--threads", default="auto", metavar="N|auto",
                   help="torch CPU threads; auto (default): the cores the 1-minute load average "
                        "leaves free, at least 1 (on a busy machine extra threads spin-wait)")


def _prefixes(text: str) -> list[int]:
    from kvtier.errors import ConfigError

    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--prefixes {text!r} is not a comma-separated list of token counts") from None
    if not out or any(n < 1 for n in out):
        raise ConfigError(f"--prefixes {text!r}: give positive token counts, e.g. 512,1024")
    return out


def _drop_page_cache(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)  # dirty pages are not dropped: write them back first
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run(args: argparse.Namespace) -> int:
    from kvtier.errors import ConfigError

    prefixes = _prefixes(args.prefixes)
    if args.rounds < 1 or args.suffix_tokens < 1:
        raise ConfigError("--rounds and --suffix-tokens must be >= 1")
    for n in prefixes:  # checked before the model loads (seconds): a whole prefix must be restorable
        if args.chunk_tokens < 1 or n % args.chunk_tokens:
            raise ConfigError(f"prefix {n} is not a multiple of --chunk-tokens {args.chunk_tokens}; "
                              "give prefixes that are, so the whole prefix is restorable")
    import copy

    import torch
    from tqdm import tqdm

    from kvtier.commands.demo import document
    from kvtier.integrations.hf.cache_fill import cache_kwarg
    from kvtier.integrations.hf.runner import load_model, warm_up
    from kvtier.integrations.transformers import PrefixCache, model_plan
    from kvtier.store.store import Store

    lm = load_model(args.model, args.dtype, threads=args.threads)
    model = lm.model
    plan, ns = model_plan(model, chunk_tokens=args.chunk_tokens, model_id=lm.model_id)
    longest = max(prefixes) + args.suffix_tokens
    base = lm.tokenizer(document(lm.tokenizer)).input_ids  # type: ignore[operator]
    stream = (base * (longest // len(base) + 1))[:longest]
    ids_all = torch.tensor([stream])
    tmp = tempfile.mkdtemp(prefix="kvtier-bench-ttft-")
    per_prefix = max(plan.chunk_bytes_all_groups * (longest // plan.chunk_tokens + 1), 1 << 20)
    cpu_store = Store(plan, ns, cpu_bytes=2 * per_prefix)
    disk_store = Store(plan, ns, disk_dir=tmp, disk_bytes=2 * per_prefix)
    pc_cpu = PrefixCache(model, cpu_store, model_id=lm.model_id)
    pc_disk = PrefixCache(model, disk_store, model_id=lm.model_id)
    warm_up(model)
    times: dict[int, dict[str, list[float]]] = {n: {m: [] for m in MODES} for n in prefixes}
    bar = tqdm(total=len(prefixes) * (1 + args.rounds * len(MODES)), desc="bench ttft", file=sys.stderr, leave=False)
    mismatch: list[str] = []
    try:
        for n in sorted(prefixes, reverse=True):  # the longest first: its chunks serve the others
            ids = ids_all[:, :n + args.suffix_tokens]
            p = ids.shape[1]
            pf = pc_cpu.prefill(ids, end=n, logits="none")  # the prefix, computed or restored
            pf.save(keep=True)
            pf.save(disk_store)
            ideal_cache = pf.cache
            bar.update(1)

            def first_token(mode: str) -> tuple[float, int]:
                if mode == "disk":
                    _drop_page_cache(tmp)
                with torch.inference_mode():
                    if mode == "ideal":
                        cache = copy.deepcopy(ideal_cache)
                        t0 = time.perf_counter()
                        out = model(input_ids=ids[:, n:], position_ids=torch.arange(n, p)[None],
                                    use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache}).logits
                    elif mode == "recompute":
                        t0 = time.perf_counter()
                        out = model(input_ids=ids, logits_to_keep=1).logits
                    else:
                        pc = pc_cpu if mode == "cpu" else pc_disk
                        t0 = time.perf_counter()
                        pre = pc.prefill(ids, end=p, logits="last")
                        out = pre.logits
                        if pre.stats.restored_tokens != n:
                            raise RuntimeError(f"{mode}: restored {pre.stats.restored_tokens} of {n} tokens")
                    tok = int(out[0, -1].argmax())
                return time.perf_counter() - t0, tok

            for r in range(args.rounds):
                order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
                firsts = {}
                for mode in order:
                    dt, firsts[mode] = first_token(mode)
                    times[n][mode].append(dt)
                    bar.update(1)
                if len(set(firsts.values())) != 1:
                    mismatch.append(f"prefix {n} round {r}: first tokens differ {firsts}")
    finally:
        bar.close()
        cpu_store.close()
        disk_store.close()
        shutil.rmtree(tmp, ignore_errors=True)
    rows = [{"prefix_tokens": n, **{f"{m}_s": round(statistics.median(times[n][m]), 4) for m in MODES}}
            for n in prefixes]
    if args.json:
        print(json.dumps({"rows": rows}))
    else:
        print(render(f"{lm.label}; {torch.get_num_threads()} torch threads", plan.chunk_tokens,
                     args.suffix_tokens, args.rounds, rows))
    for line in mismatch:
        print(f"error: {line}", file=sys.stderr)
    return 1 if mismatch else 0


def render(label: str, chunk: int, suffix: int, rounds: int, rows: list[dict[str, float]]) -> str:
    lines = [f"kvtier bench ttft: {label}; prefix + {suffix}-token suffix; chunk {chunk} tokens; "
             f"medians of {rounds} rounds (prefill + first token)", "",
             f"{'prefix':>6} {'recompute':>10} {'cpu':>8} {'disk':>8} {'ideal':>8} "
             f"{'recompute/cpu':>13} {'cpu/ideal':>9} {'disk/ideal':>10}"]
    for r in rows:
        lines.append(
            f"{r['prefix_tokens']:>6} {r['recompute_s']:>9.3f}s {r['cpu_s']:>7.3f}s {r['disk_s']:>7.3f}s "
            f"{r['ideal_s']:>7.3f}s {r['recompute_s'] / r['cpu_s']:>12.1f}x {r['cpu_s'] / r['ideal_s']:>8.2f}x "
            f"{r['disk_s'] / r['ideal_s']:>9.2f}x")
    return "\n".join(lines)
