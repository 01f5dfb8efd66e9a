"""An upper bound on the hit rate of online caches that know a set of features of each chunk.

The claim (docs/admission.md, "A bound for online rules"): let F be features a cache can compute
when a chunk is requested (how often it was requested before, where it sits in its request, ...),
and assume that, given its F-class, the time to a request's chunk's next use is independent of
everything else the cache can observe (assumption A(F)). Then no online cache of C chunks,
whatever its admission and eviction, has an expected hit rate above

    B(F) = min over lambda >= 0 of  [ sum over classes c of max over tau of (H_c(tau) - lambda * S_c(tau))
                                      + lambda * C * (R - 1) ] / accesses

where, over the accesses a of class c (one per chunk of each request), H_c(tau) counts those
whose next use comes within tau requests and S_c(tau) = sum of min(next-use gap, tau, requests
left) is the chunk-intervals a "keep for tau requests" rule occupies. Why: under A(F), a cache's
only information about an access's next use is its class and whether the use has happened yet,
so whatever it does amounts to keeping the chunk for some (possibly random) time tau after the
access; an access with gap g then hits iff g <= tau and occupies min(g, tau) of the R - 1
intervals between requests. Holding at most C chunks at every instant implies holding at most
C * (R - 1) chunk-intervals in all (the relaxation), and for every lambda the bracket is an upper
bound on hits under that budget (weak duality). Hits are counted per chunk, not per prefix, which
only loosens it. With one class (F empty) the rule is "LRU as a time-to-live" (Che's
approximation), and the bound lands next to LRU's replayed hit rate; with every access in its
own class it is the perfect-foresight bound.

The class distributions are taken from the trace itself: the cache is given them exactly, which
is generous to it. `in_sample` is that figure. It over-states B(F) when classes are small (each
class's tau is chosen with hindsight); `cross_fitted` fits each class's tau on the even requests
and scores the odd ones, and the other way round (the mean): what such a rule, learned, reaches
on requests it did not see. It is an estimate, not a replay: the scored half's space use is not
checked against its share of the capacity. A feature set whose in-sample figure rises while its
cross-fitted one falls is memorising the trace, not predicting it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.errors import ConfigError
from kvtier.replay.trace import Trace

POPULAR_SIGHTINGS = 16

# name -> (what it is, how it is computed from an access's record)
FEATURES: dict[str, str] = {
    "sightings": "times the chunk was requested before: 0, 1, 2-3, 4-7, 8-15, 16+",
    "position": "chunks after it in its request: 0, 1, 2 or more",
    "length": "its request's length in chunks, log2 class (1, 2-3, ..., 256+)",
    "depth": "how much of its request was seen before: none, a part, all",
    "popular": f"the chunk itself, once requested {POPULAR_SIGHTINGS}+ times (a heavy-hitter sketch)",
    "fill": "tokens in its request's last chunk, in quarters of a chunk",
    "arrival": "which tenth of the trace its request arrives in",
}


@dataclass(frozen=True)
class Bound:
    features: tuple[str, ...]
    classes: int
    in_sample: float  # % of all chunk accesses
    cross_fitted: float  # %

    def to_dict(self) -> dict[str, object]:
        return {"features": list(self.features) or ["none"], "classes": self.classes,
                "in_sample_pct": round(self.in_sample, 2), "cross_fitted_pct": round(self.cross_fitted, 2)}


def parse_features(spec: str) -> tuple[str, ...]:
    """'none' or a comma list of FEATURES names."""
    if spec.strip() == "none":
        return ()
    names = tuple(s.strip() for s in spec.split(",") if s.strip())
    bad = [n for n in names if n not in FEATURES]
    if bad or not names:
        raise ConfigError(f"online-bound features {spec!r}: unknown {', '.join(bad) or '(empty)'}; "
                          f"use 'none' or a comma list of: {', '.join(FEATURES)}")
    return names


@dataclass
class _Accesses:
    gap: np.ndarray  # requests to the next use (inf: none)
    cost_cap: np.ndarray  # gap, or the requests left when there is no next use
    request: np.ndarray  # index of the request
    records: list[dict[str, object]]


def accesses(trace: Trace, chunk_tokens: int, future: list[list[float]] | None = None) -> _Accesses:
    """What `online_bound` reads from a trace (compute once, pass to every call). `future`:
    `kvtier.replay.oracle.next_uses(trace)` where the caller has it already."""
    from kvtier.replay.oracle import next_uses

    reqs = trace.requests
    R = len(reqs)
    if future is None:
        future = next_uses(trace)
    seen: dict[object, int] = {}
    gap, cap, req, records = [], [], [], []
    for r, (request, row) in enumerate(zip(reqs, future)):
        chunks = request.chunks
        n = len(chunks)
        k = 0
        while k < n and chunks[k] in seen:
            k += 1
        depth = 0 if k == 0 else (1 if k < n else 2)
        fill = (request.input_tokens % chunk_tokens) * 4 // chunk_tokens
        for i, h in enumerate(chunks):
            s = seen.get(h, 0)
            records.append({
                "sightings": 0 if s == 0 else min(5, 1 + int(math.log2(s))),
                "position": min(2, n - 1 - i),
                "length": min(8, int(math.log2(n))),
                "depth": depth,
                "popular": h if s >= POPULAR_SIGHTINGS else None,
                "fill": fill,
                "arrival": 10 * r // R,
            })
            g = row[i] - r  # inf stays inf: no next use
            gap.append(g)
            cap.append(g if g != math.inf else float(R - 1 - r))
            req.append(r)
        for h in chunks:
            seen[h] = seen.get(h, 0) + 1
    return _Accesses(np.array(gap), np.array(cap), np.array(req), records)


class _Class:
    """One class's accesses: H(tau) and S(tau) at every candidate tau (its finite gaps)."""

    def __init__(self, gap: np.ndarray, cap: np.ndarray) -> None:
        fin = np.sort(gap[np.isfinite(gap)])
        self.taus = fin
        caps = np.sort(cap)
        csum = np.concatenate(([0.0], np.cumsum(caps)))
        below = np.searchsorted(caps, fin, side="right")  # caps <= tau count in full
        self.S = csum[below] + fin * (len(caps) - below)
        self.H = np.arange(1, len(fin) + 1, dtype=float)

    def best(self, lam: float) -> tuple[float, float]:
        """max over tau of H - lam * S (tau = 0 gives 0), and the tau."""
        if not len(self.taus):
            return 0.0, 0.0
        v = self.H - lam * self.S
        i = int(np.argmax(v))
        return (float(v[i]), float(self.taus[i])) if v[i] > 0 else (0.0, 0.0)


def _classes(acc: _Accesses, key: Callable[[dict[str, object]], object], mask: np.ndarray) -> dict[object, np.ndarray]:
    out: dict[object, list[int]] = {}
    for a in np.flatnonzero(mask):
        out.setdefault(key(acc.records[a]), []).append(int(a))
    return {c: np.array(ix) for c, ix in out.items()}


def _dual_min(classes: list[_Class], budget: float) -> float:
    """min over lambda of the dual (any lambda is a valid bound; the search only tightens it)."""
    def dual(x: float) -> float:
        lam = 10.0 ** x
        return sum(c.best(lam)[0] for c in classes) + lam * budget

    lo, hi = -15.0, 3.0
    best = min(dual(lo), dual(hi), float(sum(len(c.taus) for c in classes)))  # lambda -> 0: every reuse
    for _ in range(80):  # the dual is convex in lambda, so unimodal in log lambda
        m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        d1, d2 = dual(m1), dual(m2)
        best = min(best, d1, d2)
        if d1 <= d2:
            hi = m2
        else:
            lo = m1
    return best


def _fit_taus(acc: _Accesses, groups: dict[object, np.ndarray], budget: float) -> dict[object, float]:
    """Per-class tau on these accesses: the lambda whose pure rule uses at most `budget`."""
    cls = {c: _Class(acc.gap[ix], acc.cost_cap[ix]) for c, ix in groups.items()}

    def rule(lam: float) -> tuple[dict[object, float], float]:
        taus = {c: k.best(lam)[1] for c, k in cls.items()}
        used = sum(float(np.minimum(acc.cost_cap[ix], taus[c]).sum()) for c, ix in groups.items())
        return taus, used

    lo, hi = -15.0, 3.0
    taus, used = rule(10.0 ** hi)
    for _ in range(50):
        mid = (lo + hi) / 2
        t, u = rule(10.0 ** mid)
        if u > budget:
            lo = mid
        else:
            hi, taus = mid, t
    return taus


def online_bound(trace: Trace, capacity_chunks: int, features: Sequence[str], chunk_tokens: int,
                 acc: _Accesses | None = None) -> Bound:
    """B(F) for a cache of `capacity_chunks` chunks (see the module docstring)."""
    feats = tuple(features)
    if acc is None:
        acc = accesses(trace, chunk_tokens)
    n = len(acc.gap)
    R = len(trace.requests)
    if n == 0 or R < 2:
        return Bound(feats, 0, 0.0, 0.0)

    def key(rec: dict[str, object]) -> object:
        return tuple(rec[f] for f in feats)

    budget = float(capacity_chunks) * (R - 1)
    everyone = np.ones(n, dtype=bool)
    groups = _classes(acc, key, everyone)
    in_sample = _dual_min([_Class(acc.gap[ix], acc.cost_cap[ix]) for ix in groups.values()], budget)
    scores = []
    for fit_parity in (0, 1):
        fit = acc.request % 2 == fit_parity
        taus = _fit_taus(acc, _classes(acc, key, fit), budget * fit.sum() / n)
        hits = 0
        for c, ix in _classes(acc, key, ~fit).items():
            hits += int((acc.gap[ix] <= taus.get(c, 0.0)).sum())
        scores.append(100.0 * hits / max(1, int((~fit).sum())))
    return Bound(feats, len(groups), 100.0 * min(in_sample, n) / n, sum(scores) / 2)
