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
    latency_s: float  # request sent -> stream finished
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
