"""The Marconi baseline (Pan et al., MLSys 2025, "Marconi: Prefix Caching for the Era of Hybrid
LLMs"), replayed on kvtier's index: `kvtier replay --policy marconi`.

Rules, as the paper describes them, mapped onto chunks (simplifications in docs/replay.md):
- admission: full/MLA groups store every chunk (Marconi keeps all attention KV in its radix
  tree); the other groups (state checkpoints, and by extension sliding/chunked windows) store
  only what hits ending at likely reuse points read: a *branch point* of the prefix tree of chunk
  hashes (a node that gains a second distinct child: the request that creates the branch stores
  the checkpoint there) and the request's last chunk;
- eviction, per pool: the victim has the lowest recency + alpha x FLOP efficiency, both min-max
  normalised (recency over the pool's resident entries, efficiency over all entries seen);
  efficiency = FLOPs a hit ending at the entry saves per byte it holds;
- alpha: 0 (LRU) until the first eviction; then the next `factor` x (requests so far) requests
  (at most `max_window`) are recorded, replayed once per alpha of `grid` from an empty cache of
  the same size, and the alpha with the highest token hit rate is kept (the paper's bootstrap).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence

from kvtier.core.plan import Plan
from kvtier.index.branches import BranchTree
from kvtier.index.index import ChunkHash, Index
from kvtier.index.policies import Evictable
from kvtier.index.policies import policy_options
from kvtier.replay.run import CostModel, Result, admission_horizon, replay
from kvtier.replay.trace import Request, Trace

GRID = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)


class MarconiPlacement:
    """Marconi's admission as a replay placement: non-anchor groups store what hits ending at
    the request's branch points and its last `tail` chunks read; anchors store everything."""

    name = "marconi"

    def __init__(self, plan: Plan, tree: BranchTree, tail: int = 1) -> None:
        self.plan, self.tree, self.tail = plan, tree, tail
        self.others = [gp.index for gp in plan.cacheable_groups if gp.kind not in ("full", "mla")]

    def place(self, chunks: Sequence[ChunkHash], n: int) -> dict[int, tuple[Collection[int], Collection[int]]]:
        ends = set(self.tree.insert(chunks))
        ends.update(range(max(0, n - self.tail), n))
        c = self.plan.chunk_tokens
        out: dict[int, tuple[Collection[int], Collection[int]]] = {}
        for g in self.others:
            warm: set[int] = set()
            for e in ends:
                if e < n:
                    warm.update(self.plan.chunks_for_hit(g, (e + 1) * c))
            out[g] = (warm, ())
        return out


class Shared:
    """What every pool's policy of one run reads: alpha (tuned) and the tree (entry depths)."""

    def __init__(self, tree: BranchTree, alpha: float) -> None:
        self.tree, self.alpha = tree, alpha


class MarconiPolicy:
    """recency + alpha x FLOP efficiency; the victim is the lowest score among the least recent
    evictable entry of each depth class (log2 of the chunk index), so a victim costs
    O(classes), not a scan of the pool."""

    name = "marconi"

    def __init__(self, capacity: int, shared: Shared) -> None:
        self.shared = shared
        self.worth: Callable[[int], float] = lambda depth: 0.0
        self.clock = 0
        self.last: dict[ChunkHash, int] = {}
        self.eff: dict[ChunkHash, float] = {}
        self.order: OrderedDict[ChunkHash, None] = OrderedDict()
        self.classes: dict[int, OrderedDict[ChunkHash, None]] = {}
        self.klass: dict[ChunkHash, int] = {}
        self.lo, self.hi = float("inf"), float("-inf")

    def insert(self, key: ChunkHash) -> None:
        depth = self.shared.tree.depth(key)
        e = self.worth(depth)
        self.eff[key] = e
        self.lo, self.hi = min(self.lo, e), max(self.hi, e)
        k = depth.bit_length()
        self.klass[key] = k
        self.classes.setdefault(k, OrderedDict())[key] = None
        self.clock += 1
        self.last[key] = self.clock
        self.order[key] = None

    def touch(self, key: ChunkHash) -> None:
        if key in self.last:
            self.clock += 1
            self.last[key] = self.clock
            self.order.move_to_end(key)
            self.classes[self.klass[key]].move_to_end(key)

    def remove(self, key: ChunkHash) -> None:
        if key in self.last:
            del self.last[key], self.eff[key], self.order[key]
            del self.classes[self.klass.pop(key)][key]

    def victim(self, evictable: Evictable) -> ChunkHash | None:
        alpha = self.shared.alpha
        if not self.order:
            return None
        if alpha == 0:
            return next((k for k in self.order if evictable(k)), None)
        t_min = self.last[next(iter(self.order))]
        span = max(1, self.clock - t_min)
        e_span = self.hi - self.lo or 1.0
        best, best_score = None, float("inf")
        for queue in self.classes.values():
            for k in queue:
                if evictable(k):
                    score = (self.last[k] - t_min) / span + alpha * (self.eff[k] - self.lo) / e_span
                    if score < best_score:
                        best, best_score = k, score
                    break
        return best

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, key: object) -> bool:
        return key in self.last


def worth_fn(plan: Plan, group: int, cost: CostModel) -> Callable[[int], float]:
    """FLOPs per byte of group `group`'s entry at chunk index d: an attention chunk, the compute
    of its own tokens per byte of it; a state checkpoint, the whole prefix a hit ending at it
    saves per byte that hit reads (the anchors' chunks and the checkpoint)."""
    c, gp = plan.chunk_tokens, plan.groups[group]
    flops = cost.model.flops
    anchors = sum(a.chunk_bytes for a in plan.cacheable_groups if a.kind in ("full", "mla"))
    memo: dict[int, float] = {}

    def worth(d: int) -> float:
        w = memo.get(d)
        if w is None:
            if gp.kind == "state":
                w = flops((d + 1) * c) / ((d + 1) * anchors + gp.chunk_bytes)
            else:
                w = (flops((d + 1) * c) - flops(d * c)) / gp.chunk_bytes
            memo[d] = w
        return w

    return worth


def marconi_replay(plan: Plan, trace: Trace, capacities: Mapping[str, int], *,
                   share: str | Mapping[str, float] = "proportional", cost: CostModel | None = None,
                   admission: object | None = None, admission_name: str = "all",
                   progress: Callable[[int], None] | None = None, alpha: float | None = None,
                   tail: int = 1, tree_nodes: int | None = None, factor: int = 5,
                   max_window: int = 4096, grid: Sequence[float] = GRID) -> Result:
    """Replay `trace` under Marconi's rules; alpha is tuned online (bootstrap) unless given.
    The tree holds at most `tree_nodes` nodes (default: 2 x the first tier's anchor chunks)."""
    cost = cost or CostModel()
    first = next(iter(capacities))
    if tree_nodes is None:
        tree_nodes = max(1024, 2 * admission_horizon(plan, first, capacities[first], share))
    tree = BranchTree(tree_nodes)
    shared = Shared(tree, 0.0 if alpha is None else alpha)

    def setup(index: Index) -> None:
        for gp in plan.cacheable_groups:
            for tier in capacities:
                pol = index.policy_of(gp.index, tier)
                assert isinstance(pol, MarconiPolicy)
                pol.worth = worth_fn(plan, gp.index, cost)

    tuner = None
    if alpha is None:
        tuner = _Tuner(trace.requests, first, factor, max_window, lambda window, a: marconi_replay(
            plan, window, capacities, share=share, cost=cost, alpha=a, tail=tail,
            tree_nodes=tree_nodes).token_hit_rate, grid, shared)
    res = replay(plan, trace, capacities, lambda slots: MarconiPolicy(slots, shared),
                 admission=admission, admission_name=admission_name, share=share, cost=cost,
                 progress=progress, placement=MarconiPlacement(plan, tree, tail), setup=setup,
                 observe=tuner.observe if tuner else None)
    label = f"marconi(alpha={shared.alpha:g}{', tuned' if tuner and tuner.done else ''}" \
            f"{f', tail={tail}' if tail != 1 else ''})"
    return dataclasses.replace(res, policy=label)


def run_marconi(name: str, plan: Plan, trace: Trace, capacities: Mapping[str, int],
                **kwargs: object) -> Result:
    """`run_all`'s runner for `--policy marconi[:options]`."""
    return marconi_replay(plan, trace, capacities, **kwargs, **marconi_options(name))  # type: ignore[arg-type]


def marconi_options(name: str) -> dict[str, float | int]:
    """`marconi` or `marconi:alpha=1,tail=2,factor=5` -> keyword arguments of marconi_replay."""
    return policy_options(name, "marconi", ("alpha", "tail", "factor", "tree_nodes", "max_window"), "alpha", "marconi takes alpha=A (fixed, no tuning), tail=K, factor=F, tree_nodes=N, max_window=N")


class _Tuner:
    """The bootstrap: record a window after the first eviction, grid-search alpha on it once.
    Memory: at most `max_window` request references while recording, none after."""

    def __init__(self, requests: Sequence[Request], tier: str, factor: int, max_window: int,
                 score: Callable[[Trace, float], float], grid: Sequence[float], shared: Shared) -> None:
        self.requests, self.tier, self.factor, self.max_window = requests, tier, factor, max_window
        self.score, self.grid, self.shared = score, grid, shared
        self.start: int | None = None
        self.done = False

    def observe(self, r: int, index: Index) -> None:
        if self.done:
            return
        if self.start is None:
            if any(index.counters(gp.index, self.tier)["evictions"] for gp in index.plan.cacheable_groups):
                self.start = r + 1
                self.end = min(r + 1 + self.max_window, r + 1 + self.factor * (r + 1))
            return
        if r + 1 < self.end and r + 1 < len(self.requests):
            return
        window = self.requests[self.start:r + 1]
        trace = Trace("window", tuple(window), len({h for q in window for h in q.chunks}),
                      sum(len(q.chunks) for q in window), sum(q.input_tokens for q in window))
        scores = [self.score(trace, a) for a in self.grid]
        best = max(range(len(scores)), key=lambda i: (scores[i], -i))  # a tie: the smaller alpha
        self.shared.alpha = self.grid[best]
        self.done = True
