"""`kvtier replay TRACE --geometry G`: hit rates, bytes moved and prefill time saved on a trace."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvtier.errors import ConfigError

HELP = "replay a request trace through the tiered index: hit rates, bytes, time saved, vs MIN"

DEFAULT_SWEEP = "1%,2%,5%,10%,25%,50%,100%"

EPILOG = """\
conventions:
  Trace: JSON Lines, one request a line. Mooncake traces: {"timestamp", "input_length",
  "output_length", "hash_ids"}; each hash id names one 512-token block (--trace-block-tokens)
  and its whole prefix; the last id of a request counts as a full chunk. Generic traces: the
  same with "hash_ids", or "token_ids" (hashed with kvtier's own chained keys; only full chunks
  count, a hit is at most prompt length - 1). "timestamp" and "input_length" are optional.
  Blocks to chunks: with chunk_tokens a multiple k of the block size, chunk i is named by block
  (i+1)k-1 and a trailing partial chunk is dropped; with the block size a multiple m of
  chunk_tokens, each block is m chunks.
  Requests replay in timestamp order (ties in file order). A request's hit is the longest
  prefix of its chunks that every cacheable group can restore (the plan's hybrid rules) before
  any of its own chunks are stored; then its chunks are stored or touched in prefix order
  (full/mla groups first, only what plan.store_chunks says a hit can read); a new chunk goes
  to every tier (write-through; a cold one to the tiers after the first), an evicted one is
  dropped, lower-tier hits are promoted to the first tier.
  Hit rate = hit chunks / all chunks. Token hit rate = hit tokens (capped at input_length) /
  input tokens. MIN (Belady: evict the farthest next use, never store a chunk without one) is
  always added as the reference row.
  SIZE: bytes, plain or with K/M/G/T (powers of 1000) or KiB/MiB/GiB/TiB, or N% of the trace's
  footprint (every unique chunk of every cacheable group).
  Compute saved = prefill FLOPs the hits skip / prefill FLOPs of every prompt (a hit of T
  tokens skips F(T): linear terms, attention's quadratic term capped by windows, state
  recurrences; read from a config.json, else estimated from the geometry and --active-params).
  Prefill time saved = FLOPs saved / FLOP/s - loaded bytes / tier bandwidth.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument("trace", metavar="TRACE", help="a Mooncake or generic JSONL trace")
    p.add_argument("--geometry", required=True, metavar="G",
                   help="geometry JSON, Hugging Face config.json, or a shipped name "
                        "(e.g. gpt-oss-120b-fp8kv, gemma-3-27b)")
    p.add_argument("--tier", action="append", metavar="NAME=SIZE",
                   help="a tier and its capacity, fastest first (repeat); default cpu=10%%")
    p.add_argument("--policy", action="append", metavar="P",
                   help="eviction policy (repeat): lru, fifo, arc, s3fifo; worth (LRU + the compute an "
                        "entry saves, weight tuned online; worth:w=W fixes it; docs/admission.md); or marconi "
                        "(the Marconi baseline, MLSys'25: its admission and eviction, alpha tuned "
                        "online; marconi:alpha=A fixes alpha; docs/replay.md). Default: worth where "
                        "placement hits places a group that is not full/MLA attention, else lru "
                        "(kvtier.index.tuning.default_policy, the Store's and vLLM's too)")
    p.add_argument("--admission", action="append", metavar="A",
                   help="admission policy (repeat): all (default), nth[:N], tinylfu, prefix, adaptive; "
                        "oracle[:D] is an offline bound (store only chunks used again [within D "
                        "requests]; oracle:chunks=D: within D chunks requested); see docs/admission.md")
    p.add_argument("--online-bound", action="append", metavar="FEATURES",
                   help="add the upper bound on any online cache that knows these features of a chunk "
                        "(repeat): 'none' or a comma list of sightings, position, length, depth, "
                        "popular, fill, arrival; in-sample and cross-fitted, for a cache of the first tier's "
                        "capacity in anchor-group chunks (docs/admission.md, 'A bound for online rules')")
    p.add_argument("--chunk-tokens", type=int, metavar="N",
                   help="tokens per chunk (default: the trace's block size when the plan allows)")
    p.add_argument("--trace-block-tokens", type=int, default=512, metavar="N",
                   help="tokens per trace hash id (default 512, Mooncake)")
    p.add_argument("--share", default="learned", metavar="RULE",
                   help="how a tier's bytes are shared among groups: learned (default: moved online "
                        "toward equal lifetimes of each group's warm entries, kvtier.index.share), "
                        "proportional (every group the same number of chunks; the rule before issue "
                        "39), equal, or NAME=FRACTION,...")
    p.add_argument("--tail-endpoints", type=int, metavar="K",
                   help="sliding/chunked/state groups store only what hits ending at the prompt's "
                        "last K chunk boundaries read (full/MLA groups store every chunk); pair "
                        "with --share to give the bytes saved to the full groups")
    p.add_argument("--placement", choices=("every", "hits"),
                   help="where sliding/chunked/state groups store warm: hits (default: where hits "
                        "land, learned online: branch points, request ends; the rest cold; "
                        "kvtier.index.placement, docs/admission.md) or every chunk (the rule before "
                        "issue 39; the default with --tail-endpoints)")
    p.add_argument("--compare-accounting", action="store_true",
                   help="also replay with row-per-key accounting (every key reserves all groups' "
                        "bytes; vLLM 0.32 itself sizes a row by its largest group, docs/vllm.md)")
    p.add_argument("--sweep", nargs="?", const=DEFAULT_SWEEP, metavar="SIZES",
                   help="capacities of the first tier, comma-separated (default "
                        + DEFAULT_SWEEP.replace("%", "%%") + ")")
    p.add_argument("--plot", metavar="OUT.png", help="write the hit-rate curve (implies --sweep)")
    p.add_argument("--limit", type=int, metavar="N", help="replay only the first N requests")
    p.add_argument("--active-params", type=float, default=8e9, metavar="N",
                   help="active parameters per token, for a geometry JSON (a config.json states "
                        "its own; default 8e9)")
    p.add_argument("--prefill-tflops", type=float, default=400.0, metavar="F",
                   help="sustained prefill TFLOP/s (default 400)")
    p.add_argument("--bandwidth", action="append", metavar="TIER=RATE",
                   help="load bandwidth of a tier in bytes/s, e.g. disk=3GB (defaults: cpu=25GB, "
                        "disk=5GB, redis=1.25GB)")
    p.add_argument("--dtype", help="KV dtype for a config.json")
    p.add_argument("--block-size", type=int, metavar="N", help="engine tokens per block for a config.json")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def resolve_geometry(text: str) -> Path:
    path = Path(text)
    if path.exists():
        return path
    data = Path(__file__).resolve().parent.parent / "data"
    for folder in ("geometries", "configs"):
        for name in (text, f"{text}.json"):
            candidate = data / folder / name
            if candidate.is_file():
                return candidate
    shipped = sorted(p.stem for folder in ("geometries", "configs") for p in (data / folder).glob("*.json"))
    raise ConfigError(
        f"geometry {text!r} is neither a file nor a shipped geometry; shipped: {', '.join(shipped)}"
    )


def read_config(path: Path) -> dict[str, object] | None:
    """The JSON object at `path` (a model directory's config.json), or None."""
    try:
        data = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _pairs(values: list[str] | None, what: str) -> list[tuple[str, str]]:
    out = []
    for v in values or []:
        name, sep, rest = v.partition("=")
        if not sep or not name.strip() or not rest.strip():
            raise ConfigError(f"{what} {v!r} is not NAME=VALUE")
        out.append((name.strip(), rest.strip()))
    return out


def run(args: argparse.Namespace) -> int:
    from kvtier.core.cost import compute_model
    from kvtier.core.load import load_geometry
    from kvtier.core.plan import make_plan
    from kvtier.index.policies import POLICIES
    from kvtier.replay.run import (DEFAULT_BANDWIDTH, CostModel, admission_horizon, footprint_bytes,
                               parse_size, run_all)
    from kvtier.replay.marconi import run_marconi
    from kvtier.replay.oracle import next_uses
    from kvtier.replay.trace import load_trace

    geometry = load_geometry(resolve_geometry(args.geometry), dtype=args.dtype, block_size=args.block_size)
    chunk_tokens = args.chunk_tokens
    if chunk_tokens is None:
        try:
            plan = make_plan(geometry, chunk_tokens=args.trace_block_tokens)
        except ConfigError:
            plan = make_plan(geometry)
    else:
        plan = make_plan(geometry, chunk_tokens=chunk_tokens)
    placement = args.placement or ("every" if args.tail_endpoints else "hits")
    from kvtier.index.tuning import default_policy

    policies = args.policy or [default_policy(plan, placement)]  # "auto": worth where it applies
    for pol in policies:
        if pol.partition(":")[0] == "worth":
            from kvtier.index.tuning import worth_options

            worth_options(pol)  # bad options fail before any replay
        elif pol.partition(":")[0] == "marconi":
            from kvtier.replay.marconi import marconi_options

            marconi_options(pol)  # bad options fail before any replay
        elif pol not in POLICIES:
            raise ConfigError(f"unknown eviction policy {pol!r}; use one of: {', '.join(POLICIES)}, "
                              "marconi")
    if args.limit is not None and args.limit <= 0:
        raise ConfigError(f"--limit {args.limit} must be a positive number of requests")
    trace = load_trace(args.trace, plan, block_tokens=args.trace_block_tokens, limit=args.limit)
    footprint = footprint_bytes(plan, trace)
    tiers = _pairs(args.tier, "--tier") or [("cpu", "10%")]
    names = [t for t, _ in tiers]
    if len(set(names)) != len(names):
        raise ConfigError(f"--tier names {names} repeat; give each tier once")
    bandwidth = dict(DEFAULT_BANDWIDTH)
    for tier, rate in _pairs(args.bandwidth, "--bandwidth"):
        bandwidth[tier] = float(parse_size(rate.removesuffix("/s")))
    cost = CostModel(active_params=args.active_params, flops=args.prefill_tflops * 1e12,
                     bandwidth=bandwidth, compute=compute_model(read_config(resolve_geometry(args.geometry)),
                                                                geometry, args.active_params))
    base = {t: parse_size(s, footprint) for t, s in tiers}
    sweep = args.sweep or (DEFAULT_SWEEP if args.plot else None)
    points = [dict(base)]
    if sweep:
        points = [{**base, names[0]: parse_size(s, footprint)} for s in sweep.split(",") if s.strip()]
    shares = [_share(args.share)] + (["row-per-key"] if args.compare_accounting else [])
    _admissions(args.admission, 1)  # bad names fail before any replay
    from kvtier.replay.bound import accesses as bound_accesses
    from kvtier.replay.bound import online_bound, parse_features

    bound_features = [parse_features(f) for f in args.online_bound or []]
    runs = len(points) * len(shares) * (len(policies) * len(args.admission or ["all"]) + 1)
    bar = _progress(runs * len(trace.requests), args.json)
    future = next_uses(trace)
    rows = []
    # the first tier's capacity in chunks of the anchor group under the (first) share: the
    # admission's learning horizon, `adaptive`'s miniature cache size and the online bound's cache
    horizons = [admission_horizon(plan, names[0], caps[names[0]], shares[0]) for caps in points]
    try:
        for caps, horizon in zip(points, horizons):
            admissions = [(n, f if not n.startswith("oracle") else _oracle(n, future))
                          for n, f in _admissions(args.admission, horizon)]
            for res in run_all(plan, trace, caps, policies, admissions, shares, cost,
                               bar.update if bar else None, future, args.tail_endpoints,
                               _placement(placement, plan), {"marconi": run_marconi}):
                rows.append((caps, res))
    finally:
        if bar:
            bar.close()
    # the bound is for one cache: the first tier (on a one-group geometry, its capacity in chunks)
    acc = bound_accesses(trace, plan.chunk_tokens, future) if bound_features else None
    bounds = []
    for caps, cap in zip(points, horizons):
        for f in bound_features:
            b = online_bound(trace, cap, f, plan.chunk_tokens, acc)
            bounds.append({"tiers": caps, "capacity_chunks": cap, **b.to_dict()})
    doc = {
        "trace": trace.name,
        "requests": len(trace.requests),
        "unique_chunks": trace.unique_chunks,
        "total_chunks": trace.total_chunks,
        "footprint_bytes": footprint,
        "geometry": geometry.name or str(args.geometry),
        "chunk_tokens": plan.chunk_tokens,
        "groups": {gp.name: gp.chunk_bytes for gp in plan.cacheable_groups},
        "cost_model": {"compute": cost.model.source, "flops_per_token": cost.model.linear_flops_per_token,
                       "flops": cost.flops, "bandwidth": dict(cost.bandwidth)},
        "policies": [{"tiers": caps, **res.to_dict()} for caps, res in rows],
    }
    if bounds:
        doc["online_bounds"] = bounds
    if args.plot:
        from kvtier.replay.plot import plot_sweep

        plot_sweep(rows, names[0], footprint, args.plot,
                   title=f"{trace.name} on {geometry.name or args.geometry} (chunk {plan.chunk_tokens})")
        doc["plot"] = args.plot
    if args.json:
        print(json.dumps(doc))
    else:
        from kvtier.replay.plot import render_table

        print(render_table(doc, plan, rows))
        for b in bounds:
            feats = ",".join(b["features"])  # type: ignore[arg-type]
            print(f"online bound, {names[0]} {b['capacity_chunks']} chunks, features {feats} "
                  f"({b['classes']} classes): {b['in_sample_pct']:.2f}% (cross-fitted rule: "
                  f"{b['cross_fitted_pct']:.2f}%)")
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def _admissions(values: list[str] | None, horizon_chunks: int) -> list[tuple[str, object]]:
    """(name, factory). Sized from the first tier's capacity in chunks unless given: `prefix`
    learns over one turnover, `tinylfu` ages every 10 x capacity sightings (TinyLFU's W),
    `adaptive` simulates caches of that capacity."""
    names = values or ["all"]
    out: list[tuple[str, object]] = []
    for name in names:
        if name in ("all", "none"):
            out.append(("all", None))
            continue
        if name == "oracle" or name.startswith("oracle:"):
            out.append((name, None))  # offline bound: built with the trace's future in run()
            continue
        from kvtier.index.admission import sized_admission

        sized_admission(name, horizon_chunks)  # unknown names fail before any replay
        out.append((name, lambda name=name: sized_admission(name, horizon_chunks)))
    return out


def _placement(name: str, plan):
    if name == "every":
        return None
    from kvtier.index.placement import HitsLand

    return lambda: HitsLand(plan)


def _share(text: str) -> str | dict[str, float]:
    if text in ("proportional", "equal", "learned"):
        return text
    if "=" not in text:
        raise ConfigError(f"--share {text!r}: use learned, proportional, equal, or NAME=FRACTION,...")
    out: dict[str, float] = {}
    for name, value in _pairs(text.split(","), "--share entry"):
        try:
            out[name] = float(value)
        except ValueError:
            raise ConfigError(f"--share entry {name}={value!r}: the fraction is not a number") from None
    return out


def _oracle(name: str, future: list[list[float]]):
    from kvtier.replay.oracle import OracleAdmission

    _, _, rest = name.partition(":")
    if rest.startswith("chunks="):
        d = rest[len("chunks="):]
        if not d.isdigit() or int(d) <= 0:
            raise ConfigError(f"admission {name!r}: oracle:chunks=D needs D, a positive number of chunks")
        return lambda: OracleAdmission(future, chunk_horizon=int(d))
    if rest and (not rest.isdigit() or int(rest) <= 0):
        raise ConfigError(f"admission {name!r}: oracle:D needs D, a positive number of requests "
                          "(or oracle:chunks=D, D chunks requested)")
    horizon = int(rest) if rest else None
    return lambda: OracleAdmission(future, horizon)


def _progress(total: int, quiet: bool):
    if quiet or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, file=sys.stderr, unit="req", unit_scale=True, leave=False,
                desc="replay")
