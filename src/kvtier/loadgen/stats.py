"""Per-server figures of a list of timed requests, and the ratios between two servers.

Percentiles interpolate linearly between the two nearest ranks (numpy's default, and
`statistics.quantiles(method="inclusive")`), so p50 is the median. A ratio of two figures is
taken only when both are positive: a zero or missing figure gives None (printed `null`), never
an infinity that JSON cannot hold.

Two servers in one run are compared per pair (the same prompt sent to both: `paired`, a
geometric mean of ratios with a 95% interval from per-pair noise), or, for a figure that exists
only once per repeat, over repeats (`over_repeats`, a t-interval); two runs agree on a figure
when a z-test on the log difference of their estimates says so (`agree`). `spread` (median and
min-max over repeats) stays as the secondary view.
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
    sent_s: float | None = None  # when it was sent, seconds since the epoch (`drive`'s `sent`)


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


Z95 = 1.959963984540054  # the normal distribution's 97.5th percentile: a two-sided 95% interval
# Student's t, 97.5th percentile, by degrees of freedom (1..30); above 30 the Cornish-Fisher series
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
         2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """The two-sided 95% critical value of Student's t with `df` degrees of freedom."""
    if df < 1:
        raise ValueError(f"t975 needs df >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = Z95
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def _estimate(mean_log: float, se: float | None, crit: float, **extra: object) -> dict[str, object]:
    """An estimate on the log scale as the JSON carries it: the figure exp(mean_log), its 95%
    interval exp(mean_log -+ crit x se), `margin` the interval's wider side over the figure
    (exp(crit x se) - 1), and `se_log` (what `agree` combines)."""
    est = math.exp(mean_log)
    if se is None:
        return {"estimate": est, "low": None, "high": None, "se_log": None, "margin": None, **extra}
    return {"estimate": est, "low": math.exp(mean_log - crit * se), "high": math.exp(mean_log + crit * se),
            "se_log": se, "margin": math.expm1(crit * se), **extra}


def _log_ratio(num: float | None, den: float | None) -> float | None:
    r = ratio(num, den)
    return None if r is None else math.log(r)


def paired(num: Sequence[Sequence[float | None]], den: Sequence[Sequence[float | None]]) -> dict[str, object] | None:
    """The geometric mean of per-pair ratios num/den with a 95% interval: `num[r][i]` and
    `den[r][i]` are one prompt (position i) sent to both servers in repeat r (each repeat sends
    the same shapes in the same order, tokens of its own). Every pair gives log(num/den); the
    estimate is exp of their mean, the interval exp(mean -+ t x se).

    The standard error is stratified by prompt: each log ratio less its prompt's mean over the
    repeats, pooled into one sd with N(R-1) degrees of freedom, se = sd / sqrt(R x N)
    (notes/41-serve-analysis.md, section 2). The plain per-pair SE (sd of all R x N log ratios)
    is not equivalent here: a trace workload's prompts differ by design (a first turn's ratio is
    about 1, a later turn's 1.4-5.8), the same in every run, and the plain SE counts that design
    as noise (measured widths: docs/changelog.md). A shift shared by a whole repeat is not
    per-pair noise, so the se never goes below the spread of the repeats' means (t at R - 1).
    With one repeat there is nothing to stratify over: the plain per-pair SE (wider; `method`
    says which). A position missing or not positive in any repeat is left out
    of every repeat. None without a pair."""
    R = len(num)
    if R == 0 or len(den) != R:
        return None
    n = min(min(len(x) for x in num), min(len(x) for x in den))
    logs = [[_log_ratio(num[r][i], den[r][i]) for i in range(n)] for r in range(R)]
    keep = [i for i in range(n) if all(logs[r][i] is not None for r in range(R))]
    L = [[logs[r][i] for i in keep] for r in range(R)]  # type: ignore[misc]
    N = len(keep)
    if N == 0:
        return None
    flat: list[float] = [v for row in L for v in row]  # type: ignore[misc]
    mean = math.fsum(flat) / len(flat)
    per_repeat = [math.exp(math.fsum(row) / N) for row in L]  # type: ignore[arg-type]
    if R > 1:
        prompt_mean = [math.fsum(L[r][i] for r in range(R)) / R for i in range(N)]  # type: ignore[misc]
        df = N * (R - 1)
        sd = math.sqrt(math.fsum((L[r][i] - prompt_mean[i]) ** 2 for r in range(R) for i in range(N)) / df)  # type: ignore[operator]
        # a shift shared by a whole repeat is not per-pair noise: the spread of the repeats' means
        # bounds the SE from below (R - 1 degrees of freedom), whichever is larger is used
        rep = [math.fsum(row) / N for row in L]  # type: ignore[arg-type]
        se_rep = math.sqrt(math.fsum((m - mean) ** 2 for m in rep) / (R - 1) / R)
        if se_rep > sd / math.sqrt(R * N):
            return _estimate(mean, se_rep, t975(R - 1), pairs=R * N, repeats=R, df=R - 1, sd_log=sd,
                             method="paired, between repeats (the repeats' means spread more than "
                                    "per-pair noise predicts)", values=per_repeat)
        return _estimate(mean, sd / math.sqrt(R * N), t975(df), pairs=R * N, repeats=R, df=df, sd_log=sd,
                         method="paired, stratified by prompt", values=per_repeat)
    elif N > 1:
        df = N - 1
        sd = math.sqrt(math.fsum((v - mean) ** 2 for v in flat) / df)
        method = "paired, per pair (one repeat: prompts' differences count as noise, wider)"
    else:
        return _estimate(mean, None, Z95, pairs=1, repeats=1, df=0, sd_log=None, method="one pair",
                         values=per_repeat)
    return _estimate(mean, sd / math.sqrt(R * N), Z95, pairs=R * N, repeats=R, df=df, sd_log=sd,
                     method=method, values=per_repeat)


def over_repeats(values: Sequence[float | None]) -> dict[str, object] | None:
    """A figure that exists only once per repeat (a ratio of two servers' pooled percentiles): the
    geometric mean of the repeats' values with a t-interval over them, exp(mean log -+ t(R-1) x
    sd / sqrt(R)). Three repeats give t = 4.30, so the interval is wide; `method` says it is not
    paired. Values missing or not positive are left out; None without one."""
    logs = [math.log(v) for v in values if v is not None and math.isfinite(v) and v > 0]
    R = len(logs)
    if R == 0:
        return None
    mean = math.fsum(logs) / R
    vals = [math.exp(x) for x in logs]
    if R == 1:
        return _estimate(mean, None, Z95, pairs=None, repeats=1, df=0, sd_log=None,
                         method="one repeat", values=vals)
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in logs) / (R - 1))
    return _estimate(mean, sd / math.sqrt(R), t975(R - 1), pairs=None, repeats=R, df=R - 1, sd_log=sd,
                     method=f"t over {R} repeats (not paired per request)", values=vals)


def agree(a: dict[str, object] | None, b: dict[str, object] | None) -> dict[str, object]:
    """Whether two runs' estimates of one figure agree: a test on the log difference,
    |log a - log b| <= t x sqrt(se_a^2 + se_b^2), t at the smaller of the two degrees of freedom
    (1.96 where either lacks them). `z` is the difference over that combined
    standard error (None where it is 0 and the figures differ); `agree` None where a side lacks
    the estimate or its standard error."""
    if not a or not b or a.get("se_log") is None or b.get("se_log") is None:
        return {"z": None, "agree": None, "ratio": None}
    d = math.log(a["estimate"]) - math.log(b["estimate"])  # type: ignore[arg-type]
    s = math.sqrt(a["se_log"] ** 2 + b["se_log"] ** 2)  # type: ignore[operator]
    z = d / s if s > 0 else (0.0 if d == 0 else None)
    dfs = [int(x["df"]) for x in (a, b) if isinstance(x.get("df"), int) and x["df"] >= 1]  # type: ignore[arg-type]
    crit = t975(min(dfs)) if len(dfs) == 2 else Z95  # an SE from few repeats is itself uncertain
    return {"z": z, "agree": abs(d) <= crit * s + 1e-12, "ratio": math.exp(d), "crit": crit}


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
