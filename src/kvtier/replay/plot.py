"""Rendering for `kvtier replay`: the side-by-side table and the hit-rate-vs-capacity PNG."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvtier.core.plan import Plan
from kvtier.replay.run import Result
from kvtier.core.units import human_bytes


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for k, r in enumerate(rows):
        out.append("  ".join(c.rjust(w) if j >= 4 else c.ljust(w)
                             for j, (c, w) in enumerate(zip(r, widths))).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def render_table(doc: Mapping[str, object], plan: Plan,
                 rows: Sequence[tuple[Mapping[str, int], Result]]) -> str:
    lines = [
        f"trace {doc['trace']}: {doc['requests']} requests, {doc['total_chunks']} chunks, "
        f"{doc['unique_chunks']} unique ({human_bytes(int(doc['footprint_bytes']))} in all groups)",
        f"geometry {doc['geometry']}: chunk_tokens {plan.chunk_tokens}, per-chunk bytes "
        + ", ".join(f"{gp.name} {human_bytes(gp.chunk_bytes)}" for gp in plan.cacheable_groups),
        "",
    ]
    header = ["tiers", "accounting", "admission", "policy", "hit rate", "token hit",
              "compute saved", "hits by tier", "loaded", "written", "evictions", "prefill saved", "wall"]
    table = [header]
    for caps, r in rows:
        hits = ", ".join(f"{t} {sum(v.values())}" for t, v in r.loads.items())
        table.append([
            " ".join(f"{t}={human_bytes(b)}" for t, b in caps.items()),
            r.share,
            r.admission,
            r.policy.upper() if r.policy == "min" else r.policy,
            f"{100 * r.hit_rate:.2f}%",
            f"{100 * r.token_hit_rate:.2f}%",
            f"{100 * r.compute_saved:.2f}%",
            hits,
            human_bytes(sum(sum(v.values()) for v in r.loaded_bytes.values())),
            human_bytes(sum(sum(v.values()) for v in r.written_bytes.values())),
            str(sum(sum(v.values()) for v in r.evictions.values())
                + sum(sum(v.values()) for v in r.dead_evictions.values())),
            f"{r.prefill_seconds_saved:.1f}s",
            f"{r.wall_seconds:.1f}s",
        ])
    lines.append(_table(table))
    lines.append("")
    lines.append("MIN: Belady's offline optimum (farthest next use, no store without a next use); "
                 "compute saved = prefill FLOPs skipped / all prompts' FLOPs; prefill saved = "
                 "compute time saved - load time (see --help)")
    return "\n".join(lines)


def plot_sweep(rows: Sequence[tuple[Mapping[str, int], Result]], tier: str, footprint: int,
               out: str, title: str) -> None:
    """Hit rate against the first tier's capacity, one line per (accounting, admission, policy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, list[tuple[float, float]]] = {}
    for caps, r in rows:
        label = r.policy.upper() if r.policy == "min" else r.policy
        if r.admission not in ("all", "oracle"):
            label = f"{r.admission} + {label}"
        if r.share != "proportional":
            label = f"{label} ({r.share})"
        lines.setdefault(label, []).append((100 * caps[tier] / footprint, 100 * r.hit_rate))
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    for label, pts in lines.items():
        pts.sort()
        style = "--" if label.startswith("MIN") else "-"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3, label=label)
    ax.set_xscale("log")
    ax.set_xlabel(f"{tier} capacity, % of the trace's unique chunks (all groups' bytes)")
    ax.set_ylabel("hit rate (% of chunks)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
