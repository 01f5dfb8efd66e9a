"""`kvtier plan GEOMETRY`: the chunk plan of a model, before serving it."""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvtier.errors import ConfigError
from kvtier.core.cost import ComputeModel, compute_model
from kvtier.core.load import load_geometry
from kvtier.core.plan import Plan, make_plan
from kvtier.core.units import human_bytes

HELP = "show the chunk plan of a geometry JSON or a Hugging Face config.json"

SPEC_NAME = "KvtierOffloadingSpec"
SPEC_MODULE = "kvtier.integrations.vllm.spec"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("geometry", metavar="GEOMETRY",
                   help="a geometry JSON file, a Hugging Face config.json, or a model directory")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--chunk-tokens", type=int, metavar="N", help="tokens per chunk")
    size.add_argument("--blocks-per-chunk", metavar="N|NAME=N,...",
                      help="blocks per chunk, one count for all groups or NAME=N per group")
    p.add_argument("--hit-tokens", type=int, metavar="T",
                   help="show what a hit of T tokens restores (rounded down to a chunk)")
    p.add_argument("--dtype", help="KV dtype for a config.json (default: the config's, else bfloat16)")
    p.add_argument("--block-size", type=int, metavar="N",
                   help="the engine's tokens per block for a config.json (default 16)")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                   help="read groups as transformers sees them (hf) or as vLLM would build them")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def parse_blocks_per_chunk(text: str) -> int | dict[str, int]:
    """`16` or `global=16,local=8`."""
    text = text.strip()
    if "=" not in text:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(
                f"--blocks-per-chunk {text!r} is not a number; give N or NAME=N,NAME=N"
            ) from None
    out: dict[str, int] = {}
    for part in text.split(","):
        name, sep, count = part.partition("=")
        name = name.strip()
        try:
            out[name] = int(count)
        except ValueError:
            raise ConfigError(
                f"--blocks-per-chunk entry {part!r} is not NAME=N with N a number"
            ) from None
        if not name or not sep:
            raise ConfigError(f"--blocks-per-chunk entry {part!r} is not NAME=N")
    return out


def hit_lengths(plan: Plan, hit_tokens: int | None) -> list[int]:
    """The hit lengths the compute table shows: one chunk doubling up to --hit-tokens (the last
    five), or 1 chunk, ~4k and ~32k tokens."""
    c = plan.chunk_tokens
    if hit_tokens is None:
        return sorted({c, max(c, plan.round_hit(4096)), max(c, plan.round_hit(32768))})
    t = plan.round_hit(hit_tokens)
    out, n = [], c
    while n < t:
        out.append(n)
        n *= 2
    return [*out[-4:], t] if t else []


def compute_rows(plan: Plan, compute: ComputeModel, hit_tokens: int | None) -> list[dict[str, object]]:
    rows = []
    for t in hit_lengths(plan, hit_tokens):
        flops = compute.flops(t)
        read = plan.restore_bytes(t)
        rows.append({"hit_tokens": t, "flops_saved": flops,
                     "flops_by_group": {k or "other": v for k, v in compute.by_group(t).items()},
                     "restore_bytes": read, "flops_per_byte": flops / read if read else None})
    return rows


def plan_json(plan: Plan, hit_tokens: int | None, compute: ComputeModel | None = None) -> dict[str, object]:
    t = plan.round_hit(hit_tokens) if hit_tokens is not None else None
    doc = _plan_json(plan, t)
    if compute is not None:
        doc["compute"] = {"source": compute.source, "hits": compute_rows(plan, compute, hit_tokens)}
    return doc


def _plan_json(plan: Plan, t: int | None) -> dict[str, object]:
    return {
        "chunk_tokens": plan.chunk_tokens,
        "tokens_per_hash": plan.geometry.tokens_per_hash,
        "hit_tokens": t,
        "restore_bytes": plan.restore_bytes(t) if t is not None else None,
        "naive_restore_bytes": plan.naive_restore_bytes(t) if t is not None else None,
        "groups": [
            {
                "name": gp.name,
                "kind": gp.kind,
                "cacheable": gp.cacheable,
                "tokens_per_block": gp.group.tokens_per_block,
                "blocks_per_chunk": gp.blocks_per_chunk,
                "chunk_bytes": gp.chunk_bytes,
                "restore_chunks": (len(plan.chunks_for_hit(gp.index, t)) if t is not None else None)
                if gp.cacheable
                else None,
            }
            for gp in plan.groups
        ],
    }


def vllm_warnings(plan: Plan) -> list[str]:
    """Why vLLM's native offloading connector would refuse or mis-chunk this geometry.

    vLLM 0.32 (`kv_connector/v1/offloading/config.py`) asserts that every group's tokens per
    block is a multiple of the hash unit, turns a token `block_size` into blocks only when all
    groups share one tokens per block, and takes one `blocks_per_chunk` for every group.
    """
    geometry = plan.geometry
    out = []
    tpbs = sorted({g.tokens_per_block for g in geometry.groups})
    if len(tpbs) > 1:
        out.append(
            "vLLM's native offloading, given a token block_size, needs one tokens-per-block for "
            f"all groups; this geometry has {', '.join(map(str, tpbs))}: it would refuse it"
        )
    for g in geometry.groups:
        if g.tokens_per_block % geometry.tokens_per_hash:
            smaller = "fewer than" if g.tokens_per_block < geometry.tokens_per_hash else "not a multiple of"
            out.append(
                f"group {g.name!r} has {g.tokens_per_block} tokens per block, {smaller} the hash "
                f"unit ({geometry.tokens_per_hash}): vLLM's native offloading refuses such groups"
            )
    if native_blocks_per_chunk(plan) is None:
        counts = ", ".join(f"{gp.name}={gp.blocks_per_chunk}" for gp in plan.cacheable_groups
                           if not gp.group.is_state)
        out.append(
            f"the groups need different blocks per chunk ({counts}) for one chunk size; in vLLM "
            "one blocks_per_chunk applies to every group, so their chunks span different tokens "
            "(kvtier's spec sizes each group's slots for its own span)"
        )
    return out


def native_blocks_per_chunk(plan: Plan) -> int | None:
    """The one blocks_per_chunk vLLM's native setting would need, or None when groups differ."""
    counts = {gp.blocks_per_chunk for gp in plan.cacheable_groups if not gp.group.is_state}
    return counts.pop() if len(counts) == 1 else None


def vllm_extra_config(plan: Plan, *, engine_blocks: bool = True) -> dict[str, object]:
    """`kv_connector_extra_config` for kvtier's spec in vLLM, expressing this plan as closely as
    vLLM's chunking allows; the spec starts with every config this prints (a test feeds them).

    Where the attention groups share one tokens per block, `kvtier.chunk_tokens` is exactly this
    plan (KvtierConnector turns it into vLLM's `blocks_per_chunk`), and the count is printed too
    when the tokens per block are the engine's (`engine_blocks`; a config.json read with the
    default 16-token blocks would print a count that is wrong on CPU, whose blocks are 128).
    Where they differ (DeepSeek-V4-like), vLLM takes one `blocks_per_chunk` for every group, so
    each group's chunk spans that many of its own blocks; the count printed gives the group with
    the largest blocks this plan's chunk, and `kvtier.chunk_tokens` is left out (vLLM and the spec
    refuse a token chunk size for mixed blocks).
    """
    out: dict[str, object] = {"spec_name": SPEC_NAME, "spec_module_path": SPEC_MODULE}
    attention = [gp.group.tokens_per_block for gp in plan.cacheable_groups if not gp.group.is_state]
    if len(set(attention)) > 1:
        if engine_blocks:  # else vLLM's default (one block per chunk) is the safe count
            out["blocks_per_chunk"] = max(1, plan.chunk_tokens // max(attention))
    else:
        bpc = native_blocks_per_chunk(plan) if engine_blocks else None
        if bpc is not None:
            out["blocks_per_chunk"] = bpc
        out["kvtier.chunk_tokens"] = plan.chunk_tokens
    out["kvtier.tiers"] = "cpu"
    out["kvtier.cpu_bytes"] = "4GiB"
    return out


def vllm_transfer_config(plan: Plan, *, engine_blocks: bool = True) -> dict[str, object]:
    """The whole `--kv-transfer-config` (docs/vllm.md): kvtier's connector recomputes a failed
    load instead of stopping the engine, which vLLM 0.32's stock OffloadingConnector does."""
    return {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": vllm_extra_config(plan, engine_blocks=engine_blocks),
    }


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        cells = zip(r, widths)
        lines.append("  ".join(
            c.rjust(w) if 2 <= j < len(r) - 1 else c.ljust(w) for j, (c, w) in enumerate(cells)
        ).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_compute(plan: Plan, compute: ComputeModel, hit_tokens: int | None) -> list[str]:
    rows = compute_rows(plan, compute, hit_tokens)
    if not rows:
        return []
    groups = list(rows[0]["flops_by_group"])  # type: ignore[arg-type]
    table = [["hit tokens", "FLOPs saved", *(f"{g} FLOPs" for g in groups), "bytes read", "FLOPs/byte"]]
    for r in rows:
        by = r["flops_by_group"]
        per_byte = r["flops_per_byte"]
        table.append([str(r["hit_tokens"]), f"{r['flops_saved']:.3g}", *(f"{by[g]:.3g}" for g in groups),
                      human_bytes(int(r["restore_bytes"])), f"{per_byte:.3g}" if per_byte else "-"])
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return [f"prefill compute a hit saves ({compute.source}):", *lines, ""]


def render(plan: Plan, hit_tokens: int | None, *, engine_blocks: bool = True,
           compute: ComputeModel | None = None) -> str:
    g = plan.geometry
    t = plan.round_hit(hit_tokens) if hit_tokens is not None else None
    head = f"geometry {g.name or '(unnamed)'}"
    if g.source:
        head += f"  [{g.source}]"
    out = [head, f"fingerprint {g.fingerprint()}  tokens_per_hash {g.tokens_per_hash}  "
           f"chunk_tokens {plan.chunk_tokens}", ""]
    rows = [["group", "kind", "layers", "tok/block", "blocks/chunk", "chunk bytes"]]
    if t is not None:
        rows[0].append(f"restore@{t}")
    rows[0].append("note")
    for gp in plan.groups:
        kind = gp.kind
        if gp.group.window:
            kind += f"(W={gp.group.window})"
        if gp.group.attention_chunk:
            kind += f"(A={gp.group.attention_chunk})"
        row = [
            gp.name, kind, str(gp.group.num_layers), str(gp.group.tokens_per_block),
            str(gp.blocks_per_chunk) if gp.cacheable else "-", human_bytes(gp.chunk_bytes),
        ]
        if t is not None:
            row.append(str(len(plan.chunks_for_hit(gp.index, t))) if gp.cacheable else "-")
        if not gp.cacheable:
            row.append(f"not cached: {gp.reason}")
        elif gp.group.is_state and gp.blocks_per_chunk and gp.chunk_bytes != gp.group.state_bytes:
            row.append("vLLM: one state page per block; a hit reads the last")
        elif gp.group.is_state:
            row.append("one state checkpoint per chunk")
        else:
            row.append(gp.reason)
        rows.append(row)
    out.append(_table(rows))
    out.append("")
    out.append(f"bytes per cached token: {human_bytes(plan.bytes_per_cached_token)} "
               "(one chunk of every cacheable group / chunk_tokens)")
    if t is not None:
        r, n = plan.restore_bytes(t), plan.naive_restore_bytes(t)
        ratio = f", {n / r:.2f}x" if r else ""
        out.append(f"hit of {t} tokens restores {human_bytes(r)} ({r} B); restoring every chunk "
                   f"of every group would move {human_bytes(n)} ({n} B{ratio})")
    out.append("")
    if compute is not None:
        out += render_compute(plan, compute, hit_tokens)
    if any(x.compress_ratio > 1 for x in g.groups) and not g.source.startswith("vLLM"):
        # DeepSeek V4: vLLM packs these caches into groups of its own (other blocks, other
        # spans); a config from kvtier's grouping would not describe them
        out.append("vLLM groups DeepSeek V4's caches its own way: run `kvtier plan MODEL --engine vllm` "
                   "for its groups and the --kv-transfer-config to start it with")
        return "\n".join(out)
    out.append("vLLM --kv-transfer-config for this plan (set kvtier.cpu_bytes to the host memory "
               "it may use; more keys in docs/vllm.md):")
    out.append("  " + json.dumps(vllm_transfer_config(plan, engine_blocks=engine_blocks)))
    if not engine_blocks:
        out.append("note: tokens per block defaulted to 16; give --block-size (vLLM's: 16 on GPU, "
                   "128 on CPU) or --engine vllm to also get vLLM's blocks_per_chunk")
    for w in vllm_warnings(plan):
        out.append(f"warning: {w}")
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        # vLLM logs to stdout by default; stdout is this command's output (one object with --json)
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        try:
            from kvtier.integrations.vllm.engine_groups import geometry_from_vllm
        except ImportError as exc:
            raise ConfigError(
                f"--engine vllm needs vLLM ({exc}); install kvtier[vllm] or use --engine hf"
            ) from None
        geometry = geometry_from_vllm(args.geometry, dtype=args.dtype, block_size=args.block_size)
    else:
        geometry = load_geometry(args.geometry, dtype=args.dtype, block_size=args.block_size)
    if args.hit_tokens is not None and args.hit_tokens < 0:
        raise ConfigError(f"--hit-tokens {args.hit_tokens} must be >= 0")
    bpc = parse_blocks_per_chunk(args.blocks_per_chunk) if args.blocks_per_chunk is not None else None
    in_vllm_with_state = args.engine == "vllm" and any(g.is_state for g in geometry.groups)
    if in_vllm_with_state and args.chunk_tokens is None and bpc is None:
        bpc = 1  # a state chunk in vLLM is blocks_per_chunk state pages of which a hit reads one
    plan = make_plan(geometry, chunk_tokens=args.chunk_tokens, blocks_per_chunk=bpc)
    if in_vllm_with_state:
        # inside vLLM a state group's chunk is blocks_per_chunk state pages (engine_plan)
        from kvtier.integrations.vllm.engine_plan import engine_plan

        engine_bpc = native_blocks_per_chunk(plan)
        if engine_bpc is not None:
            plan = engine_plan(geometry, engine_bpc)[0]
    config = _read_json(args.geometry)
    laid_over = geometry  # the compute is laid over the HF reading's groups (their layer indices)
    if args.engine == "vllm" and config is not None:
        try:
            laid_over = load_geometry(args.geometry, dtype=args.dtype, block_size=args.block_size)
        except ConfigError:
            config = None
    compute = compute_model(config, laid_over)
    if args.json:
        print(json.dumps(plan_json(plan, args.hit_tokens, compute)))
        for w in vllm_warnings(plan):
            print(f"warning: {w}", file=sys.stderr)
    else:
        # a geometry JSON states its blocks; a config.json only with --block-size or --engine vllm
        engine_blocks = (args.engine == "vllm" or args.block_size is not None
                         or geometry.source.startswith("geometry file"))
        print(render(plan, args.hit_tokens, engine_blocks=engine_blocks, compute=compute))
    return 0


def _read_json(path: str) -> dict[str, object] | None:
    """The config.json at `path` (or in the model directory `path`), or None."""
    p = path if not os.path.isdir(path) else os.path.join(path, "config.json")
    try:
        with open(p, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
