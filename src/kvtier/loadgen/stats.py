"""Per-server figures of a list of timed requests, and the ratios between two servers.

Percentiles interpolate linearly between the two nearest ranks (numpy's default, and
`statistics.quantiles(method="inclusive")`), so p50 is the median. A ratio of two figures is
taken only when both are positive: a zero or missing figure gives None (printed `null`), never
an infinity that JSON cannot hold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Sample:
    """One streamed completion, timed by the client."""

    ttft_s: float  # request sent -> first token chunk received
    latency_s: float  # request sent -> last token chunk received (vLLM's request function)
    gaps_s: tuple[float, ...]  # between successive token chunks
    output_tokens: int
    prompt_tokens: int


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0..100) of `values`, linear between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} must be within 0..100")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or not (num > 0 and den > 0):
        return None
    if not (math.isfinite(num) and math.isfinite(den)):
        return None
    return num / den


def figures(samples: Sequence[Sample]) -> dict[str, float | int | None]:
    """TTFT p50/p90, inter-token p50/p90/p99 (over every gap of every request; p99 of a few hundred
    gaps is a handful of the slowest steps, so p50/p90 come along), output tokens per second
    (each request's output tokens over its whole latency, prefill included; the median request),
    and the totals they come from."""
    if not samples:
        return {"requests": 0, "ttft_p50_s": None, "ttft_p90_s": None, "itl_p50_s": None,
                "itl_p90_s": None, "itl_p99_s": None, "output_tokens_per_s": None, "output_tokens": 0,
                "prompt_tokens": 0}
    ttft = [s.ttft_s for s in samples]
    gaps = [g for s in samples for g in s.gaps_s]
    tps = [s.output_tokens / s.latency_s for s in samples if s.latency_s > 0]
    return {
        "requests": len(samples),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "itl_p50_s": percentile(gaps, 50) if gaps else None,
        "itl_p90_s": percentile(gaps, 90) if gaps else None,
        "itl_p99_s": percentile(gaps, 99) if gaps else None,
        "output_tokens_per_s": percentile(tps, 50) if tps else None,
        "output_tokens": sum(s.output_tokens for s in samples),
        "prompt_tokens": sum(s.prompt_tokens for s in samples),
    }


RATIO_FIGURES = ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p90_s", "itl_p99_s", "output_tokens_per_s")


def ratios(with_kvtier: dict[str, float | int | None],
           without: dict[str, float | int | None]) -> dict[str, float | None]:
    """Every figure as with / without (times: below 1 is faster with kvtier; tokens/s: above 1)."""
    return {k: ratio(with_kvtier.get(k), without.get(k)) for k in RATIO_FIGURES}  # type: ignore[arg-type]


def spread(values: Sequence[float | None]) -> dict[str, object]:
    """One figure over a run's repeats: median, min, max, the values, and `margin`, the larger
    distance from the median to min or max over the median. [min, max] of n independent repeats
    holds the median repeat with probability 1 - 2**(1 - n) (`coverage`): the run's own error bar.
    Repeats without the figure (None) are left out; margin is None under two values."""
    xs = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return {"median": None, "min": None, "max": None, "margin": None, "coverage": None,
                "repeats": 0, "values": []}
    med = percentile(xs, 50)
    margin = (max(med - min(xs), max(xs) - med) / abs(med)) if len(xs) > 1 and med != 0 else None
    return {"median": med, "min": min(xs), "max": max(xs), "margin": margin,
            "coverage": 1 - 2.0 ** (1 - len(xs)), "repeats": len(xs), "values": xs}


def within_margin(value: float | None, of: dict[str, object]) -> bool | None:
    """Whether `value` lies within the margin that spread `of` states around its median (None:
    either is missing)."""
    med, margin = of.get("median"), of.get("margin")
    if value is None or med is None or margin is None:
        return None
    return abs(value - med) <= margin * abs(med) + 1e-12  # type: ignore[operator]


def agree(runs: Sequence[dict[str, object]]) -> bool | None:
    """Whether every run's median lies within every other run's stated margin (spreads of one
    figure from separate runs); None where a run lacks the median or the margin."""
    checks = [within_margin(x.get("median"), y)  # type: ignore[arg-type]
              for i, x in enumerate(runs) for j, y in enumerate(runs) if i != j]
    if not checks or any(c is None for c in checks):
        return None
    return all(checks)


def sum_counts(items: Sequence[object]) -> object:
    """Numbers summed, dicts summed key by key (a key missing from one counts as absent there);
    None anywhere in a sum makes it None (a count that could not be taken)."""
    present = [x for x in items if x is not None]
    if any(x is None for x in items):
        return None
    if present and all(isinstance(x, dict) for x in present):
        keys = list(dict.fromkeys(k for x in present for k in x))  # type: ignore[union-attr]
        return {k: sum_counts([x[k] for x in present if k in x]) for k in keys}  # type: ignore[index]
    return sum(present)  # type: ignore[arg-type]
