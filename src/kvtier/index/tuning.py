"""Eviction by worth, tuned online: the one rule of replay, the Store and the vLLM manager.

`worth_index(...)` builds an Index whose pools evict by worth (`kvtier.index.worth.WorthLRU`)
and, unless w is given, a `WorthTuner` that sets w from recent traffic. `default_policy(...)` is
what policy "auto" means everywhere: worth where placement "hits" places a group that is not an
anchor beside an anchor (only there do entries of one pool differ in the compute they save), LRU
elsewhere.

The tuner keeps a window of the most recent requests (chunk hashes in prefix order, at most
`max_chunks` chunks in all). From the first eviction in the first tier on, every `period` chunks
requested it replays the window, its hashes renumbered as integers, in a *shadow* for each weight
of `grid`: a fresh index of the same capacities, share, first split, anchoring and placement
rule with that w fixed (`shadow_flops`, the loop of `kvtier.replay.run.replay` for one policy and
no admission; index/ may not import replay/, a test checks the two agree). It adopts the weight
whose shadows saved the most prefill FLOPs, summed over the tunings with older ones fading by
`FADE` (one window is noisy); a tie keeps the smaller weight, so where worth does not pay w stays
0, which is LRU. It learns from the past only. A window whose shadow under the first weight
evicts nothing scores every weight alike: the other shadows are not run, and the tuning is
counted skipped.

Where the shadows run (`runner`): "inline" scores in `observe` (replay, tests); "process" (the
product's) in a child process (`python -m kvtier.index.tuning`, run by `kvtier.index.tuning_child`,
started at the first tuning). Each
window request is one bytes object (a small header and its hashes joined), so `observe` packs one
request and `tune` only hands the window over (a tuple of references to its requests): the
pickling runs on the tuner's thread, the renumbering and the shadows in the child (or in the
inline scorer), never on the caller's thread.

Memory (`memory_bytes`, bounded by `max_memory_bytes`): `hash_bytes` per chunk held (the Store's
and vLLM's hashes are bytes of up to 32; replay's integer ids are packed in 8) + `REQUEST_BYTES`
per request (at most `max_chunks`: a request has at least one chunk; empty ones are not kept)
+ w and one fading score per candidate. A tuning adds, while it runs, a copy of the window on its
way to the child, which holds it as integer ids and the shadow indexes of one window; the last
`KEPT_TUNINGS` adopted weights are kept in `tunings`.
"""

from __future__ import annotations

import struct
import weakref
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from kvtier.core.cost import ComputeModel, compute_model
from kvtier.core.plan import Plan
from kvtier.errors import ConfigError
from kvtier.index.index import Index
from kvtier.index.placement import HitsLand, StoreChunks, learned_start, store_request, tail_chunks  # noqa: F401 (tail_chunks: kvtier.index.tuning's name for it)
from kvtier.index.policies import policy_options
from kvtier.index.worth import WorthLRU, WorthWeight, worth_value

GRID = (0.0, 1.0, 2.0, 4.0)
FADE = 0.5  # each tuning, the candidates' past scores count half
# a window request beyond its hashes: the bytes object's own header (33), the record header
# (HEAD, 18), the allocator's rounding to 16 and the window's pointer to it (8)
REQUEST_BYTES = 80
KEPT_TUNINGS = 64  # adopted weights kept in `tunings` (the count is in `counts()`)
RUNNERS = ("inline", "process")
ANCHORS = ("full", "mla")
HEAD = struct.Struct("<QQH")  # a packed request: prompt tokens, input tokens, bytes per hash
_LEARNED = object()  # worth_index's default start: `learned_start`, as the Store and replay start

Req = tuple[tuple[int, ...], int, int]  # a renumbered request: chunk ids, prompt tokens, input tokens
Record = bytes | tuple[tuple[Hashable, ...], int, int]  # a window request: packed, or kept as given


def default_policy(plan: Plan, placement: object) -> str:
    """Policy "auto": "worth" under placement "hits" (the name or a HitsLand) on a plan with a
    cacheable anchor (full/MLA) group and a cacheable group that is not one; "lru" elsewhere (one
    group, no anchor, or every chunk warm): as `placement_share`, worth pays only beside anchors."""
    hits = isinstance(placement, HitsLand) or (isinstance(placement, str) and placement == "hits")
    kinds = [gp.kind in ANCHORS for gp in plan.cacheable_groups]
    return "worth" if hits and any(kinds) and not all(kinds) else "lru"


def worth_options(name: str) -> dict[str, float | int]:
    """`worth` or `worth:w=4,max_chunks=N,period=N` -> options (w fixes the weight: no tuning)."""
    return policy_options(name, "worth", ("w", "max_chunks", "period"), "w",
                          "worth takes w=W (fixed, no tuning), max_chunks=N, period=N")


@dataclass(frozen=True, slots=True)
class Shadow:
    """What a shadow replay needs besides the window and w (it travels to the child with each
    job, so it pickles): the placement as HitsLand's parameters (None: every chunk warm).
    `cold_in_first`: with one tier, a cold chunk goes into it as a first victim (replay's rule)
    or is not stored (the Store's and vLLM's): the shadow stores as its caller does."""

    plan: Plan
    capacities: Mapping[str, int]
    share: str | Mapping[str, float]
    start: str | Mapping[str, float] | None
    placement: tuple[int, float, int, int] | None  # HitsLand's tree_nodes, ratio, warmup, decay
    tail_endpoints: int | None
    compute: ComputeModel
    anchored: bool = True
    cold_in_first: bool = False
    learned_tiers: tuple[str, ...] | None = None  # Index(learned_tiers=): the caller's


@dataclass(frozen=True, slots=True)
class Job:
    """One tuning: the window (as the tuner holds it) scored under every weight of the grid."""

    shadow: Shadow
    grid: tuple[float, ...]
    window: tuple[Record, ...]

    def scores(self) -> list[float] | None:
        """FLOPs saved per weight; None where the first weight's shadow evicts nothing (every
        weight would score the same: the tuning is skipped)."""
        window = renumber(self.window)
        first, evicted = _shadow(self.shadow, window, self.grid[0])
        if not evicted:
            return None
        return [first, *(shadow_flops(self.shadow, window, w) for w in self.grid[1:])]


def pack(chunk_hashes: Sequence[Hashable], prompt_tokens: int, input_tokens: int) -> Record:
    """One window request as one bytes object: HEAD and the hashes joined, when they are bytes of
    one length (the Store's, vLLM's) or integers (replay's, 8 bytes each); else kept as given."""
    try:
        first = chunk_hashes[0]
        if isinstance(first, bytes):
            size = len(first)
            if 0 < size < 1 << 16 and all(len(h) == size for h in chunk_hashes):  # type: ignore[arg-type]
                return HEAD.pack(prompt_tokens, input_tokens, size) + b"".join(chunk_hashes)  # type: ignore[arg-type]
        elif isinstance(first, int):
            return HEAD.pack(prompt_tokens, input_tokens, 8) + struct.pack(f"<{len(chunk_hashes)}q", *chunk_hashes)
    except (struct.error, TypeError):
        pass
    return tuple(chunk_hashes), prompt_tokens, input_tokens


def chunk_count(record: Record) -> int:
    if isinstance(record, bytes):
        return (len(record) - HEAD.size) // HEAD.unpack_from(record)[2]
    return len(record[0])  # type: ignore[index]


def renumber(window: Sequence[Record]) -> tuple[Req, ...]:
    """The window with its hashes renumbered 0, 1, ... in order of first sight (a dict built for
    this tuning only): the shadows' keys, whatever the hashes were."""
    ids: dict[Hashable, int] = {}
    out = []
    for rec in window:
        if isinstance(rec, bytes):
            p, i, size = HEAD.unpack_from(rec)
            chunks = tuple(ids.setdefault(rec[o:o + size], len(ids)) for o in range(HEAD.size, len(rec), size))
        else:
            hashes, p, i = rec  # type: ignore[misc]
            chunks = tuple(ids.setdefault(h, len(ids)) for h in hashes)
        out.append((chunks, p, i))
    return tuple(out)


def _build(plan: Plan, capacities: Mapping[str, int], share: str | Mapping[str, float],
           start: str | Mapping[str, float] | None, anchored: bool, placement: object,
           weight: WorthWeight, compute: ComputeModel,
           learned_tiers: tuple[str, ...] | None = None) -> Index:
    """An Index whose pools evict by worth with `weight`; depth from the placement's prefix tree."""
    index = Index(plan, capacities, policy=lambda slots: WorthLRU(slots, weight), share=share,
                  start=start, anchored=anchored, learned_tiers=learned_tiers)
    tree = getattr(placement, "tree", None)
    depth = tree.depth if tree is not None else (lambda key: 0)
    for gp in plan.cacheable_groups:
        value = worth_value(gp.kind, compute.flops, plan.chunk_tokens, depth)
        for tier in capacities:
            index.policy_of(gp.index, tier).value = value  # type: ignore[attr-defined]
    return index


def worth_index(plan: Plan, capacities: Mapping[str, int], *, share: str | Mapping[str, float],
                placement: object, cost: object | None = None, tail_endpoints: int | None = None,
                w: float | None = None, runner: str = "process", max_chunks: int = 32768,
                period: int = 32768, start: object = _LEARNED, anchored: bool = True,
                grid: Sequence[float] = GRID, cold_in_first: bool = False,
                learned_tiers: Sequence[str] | None = None) -> tuple[Index, WorthTuner | None]:
    """An Index whose pools evict by worth and its tuner (None when `w` fixes the weight).
    `cost`: a ComputeModel, or replay's CostModel (its `.model`); default: the plan geometry's
    estimate. `start`: the learned share's first split (default `learned_start`, as the Store and
    replay start); the shadows use the same one, and a fresh placement of the same rule.
    `cold_in_first`: with one tier, whether the caller stores cold chunks in it as first victims
    (replay) or skips them (the Store and vLLM's manager: the default), so the shadows do the same.
    `learned_tiers`: `Index(learned_tiers=)`, the shadows' too."""
    learned = None if learned_tiers is None else tuple(learned_tiers)
    compute = _compute(plan, cost)
    if start is _LEARNED:
        start = learned_start(plan, share, placement, capacities)
    weight = WorthWeight(0.0 if w is None else w)
    index = _build(plan, capacities, share, start, anchored, placement, weight, compute, learned)  # type: ignore[arg-type]
    if w is not None:
        return index, None
    if placement is None:
        rule = None
    elif isinstance(placement, HitsLand):
        rule = (placement.tree.max_nodes, placement.ratio, placement.warmup, placement.decay)
    else:
        raise ConfigError(f"policy 'worth': tuning w needs placement 'hits' or 'every', not "
                          f"{getattr(placement, 'name', placement)!r}; give a fixed weight (worth:w=W)")
    shadow = Shadow(plan, dict(capacities), share if isinstance(share, str) else dict(share),
                    start if start is None or isinstance(start, str) else dict(start),  # type: ignore[arg-type]
                    rule, tail_endpoints, compute, anchored, cold_in_first, learned)
    return index, WorthTuner(shadow, weight, runner=runner, max_chunks=max_chunks, period=period, grid=grid)


def _compute(plan: Plan, cost: object | None) -> ComputeModel:
    if cost is None:
        return compute_model(None, plan.geometry)
    model = getattr(cost, "model", cost)
    if not isinstance(model, ComputeModel):
        raise ConfigError(f"cost={cost!r}: give a kvtier.core.cost.ComputeModel (or replay's CostModel)")
    return model


def shadow_flops(shadow: Shadow, window: Sequence[Req], w: float) -> float:
    """Prefill FLOPs the window's hits save in a fresh index with w fixed: `replay`'s loop
    (lookup, promotion, write-through save by placement, learned share) without its accounting."""
    return _shadow(shadow, window, w)[0]


def _shadow(shadow: Shadow, window: Sequence[Req], w: float) -> tuple[float, bool]:
    """`shadow_flops` and whether any pool evicted (w only ever picks victims)."""
    plan, caps = shadow.plan, dict(shadow.capacities)
    rule = shadow.placement
    placement = None if rule is None else HitsLand(plan, tree_nodes=rule[0], ratio=rule[1],
                                                     warmup=rule[2], decay=rule[3])
    index = _build(plan, caps, shadow.share, shadow.start, shadow.anchored, placement,
                   WorthWeight(w), shadow.compute, shadow.learned_tiers)
    tiers = list(caps)
    first = tiers[0]
    wanted = StoreChunks(plan, shadow.tail_endpoints)

    def save(h: int, g: int, cold: bool = False) -> None:
        if not cold:
            for tier in tiers:  # write-through
                index.put(h, g, tier)
        elif len(tiers) > 1:  # cold: the tiers after the first
            for tier in tiers[1:]:
                index.put(h, g, tier)
        elif shadow.cold_in_first:  # one tier: into it as a first victim (replay)
            index.put(h, g, first, cold=True)
        # else one tier: not stored (the Store and vLLM)

    flops_of: dict[int, float] = {}
    saved = 0.0
    contains, touch_all = index.contains, index.touch_all
    learned = bool(index.learners)
    for chunks, prompt_tokens, input_tokens in window:
        hit = index.lookup(chunks, prompt_tokens)
        if hit.tokens:
            tok = min(hit.tokens, input_tokens)
            f = flops_of.get(tok)
            if f is None:
                f = flops_of[tok] = shadow.compute.flops(tok)
            saved += f
            for g, loads in enumerate(hit.chunks):
                for ld in loads:
                    if ld.tier != first and not contains(ld.chunk_hash, g, first):
                        index.put(ld.chunk_hash, g, first)  # promotion
        n = len(chunks)
        spots = placement.place(chunks, n) if placement is not None else None
        store_request(chunks, n, wanted, spots, contains, touch_all, save)
        if learned:
            index.observe()
    evicted = any(index.counters(gp.index, t)["evictions"] or index.counters(gp.index, t)["dead_evictions"]
                  for gp in plan.cacheable_groups for t in tiers)
    return saved, evicted




class WorthTuner:
    """Window of recent requests + periodic shadow replays over `grid` (module docstring)."""

    def __init__(self, shadow: Shadow | None, weight: WorthWeight | None = None, *, runner: str = "inline",
                 max_chunks: int = 32768, period: int = 32768, grid: Sequence[float] = GRID,
                 hash_bytes: int = 32, timeout_s: float = 600.0) -> None:
        if max_chunks <= 0 or period <= 0 or not grid or any(g < 0 for g in grid):
            raise ConfigError(f"worth tuner: max_chunks={max_chunks} and period={period} must be "
                              f"positive, grid={tuple(grid)} non-empty and >= 0")
        if runner not in RUNNERS:
            raise ConfigError(f"worth tuner: runner={runner!r} is unknown; use one of {', '.join(RUNNERS)}")
        if runner == "process" and shadow is None:
            raise ConfigError("worth tuner: runner='process' needs a Shadow to send (worth_index builds one)")
        self.shadow = shadow
        self.weight = weight if weight is not None else WorthWeight()
        self.runner = runner
        self.max_chunks, self.period, self.grid = max_chunks, period, tuple(sorted(grid))
        self.hash_bytes = hash_bytes
        self.window: deque[Record] = deque()
        self.chunks = 0  # chunks in the window
        self.since = 0  # chunks requested since the last tuning (or the first eviction)
        self.started = False
        self.tunings: list[float] = []  # the weight adopted at each tuning (the last KEPT_TUNINGS)
        self.totals = [0.0] * len(self.grid)  # each candidate's fading sum of window scores
        self._counts = dict.fromkeys(("worth_tunings", "worth_tunings_skipped", "worth_tunings_failed"), 0)
        self._child: Child | None = None
        if runner == "process":
            self._child = Child(timeout_s)
            self._finalizer = weakref.finalize(self, self._child.close)

    def observe(self, chunk_hashes: Sequence[Hashable], prompt_tokens: int, input_tokens: int,
                evicted: bool) -> None:
        """After each request: remember it; tune when a period of chunks has gone by since the
        first eviction (`evicted`: the first tier has evicted something)."""
        self.poll()
        n = self._add(chunk_hashes, prompt_tokens, input_tokens)
        if not self.started:
            self.started = bool(evicted)
            return
        self.since += n
        if self.since >= self.period:
            self.since = 0
            self.tune()

    def _add(self, chunk_hashes: Sequence[Hashable], prompt_tokens: int, input_tokens: int) -> int:
        """Remember one request, its first `max_chunks` chunks (the oldest requests leave while
        the window holds too many chunks); returns its chunk count."""
        n = len(chunk_hashes)
        if n == 0:
            return 0
        if n > self.max_chunks:
            chunk_hashes, n = chunk_hashes[:self.max_chunks], self.max_chunks
        self.window.append(pack(chunk_hashes, prompt_tokens, input_tokens))
        self.chunks += n
        while self.chunks > self.max_chunks:
            self.chunks -= chunk_count(self.window.popleft())
        return n

    def reset(self) -> None:
        """Forget the window and the first eviction (a new, empty index: vLLM's reset_cache); w,
        the candidates' scores and the child stay."""
        self.window.clear()
        self.chunks = self.since = 0
        self.started = False

    def tune(self) -> None:
        """Score the window under every weight: inline, now; in the child, handed over as it is
        (skipped and counted while one is in flight)."""
        window = tuple(self.window)
        if not window:
            return
        if self._child is not None:
            if self._child.busy or not self._child.submit((self.shadow, self.grid, window)):  # type: ignore[arg-type]
                self._counts["worth_tunings_skipped"] += 1
            return
        scores = self._scores(window)
        if scores is None:
            self._counts["worth_tunings_skipped"] += 1
        else:
            self._adopt(scores)

    def _scores(self, window: tuple[Record, ...]) -> list[float] | None:
        assert self.shadow is not None, "a tuner without a shadow scores with its own _scores"
        return Job(self.shadow, self.grid, window).scores()

    def _adopt(self, scores: Sequence[float]) -> None:
        self.totals = [FADE * t + s for t, s in zip(self.totals, scores)]
        best = max(range(len(self.grid)), key=lambda i: (self.totals[i], -i))
        self.weight.w = self.grid[best]
        self.tunings.append(self.weight.w)
        del self.tunings[:-KEPT_TUNINGS]
        self._counts["worth_tunings"] += 1

    def poll(self) -> None:
        """Adopt a tuning the child finished (a failed one is counted; w is kept)."""
        if self._child is None:
            return
        done = self._child.take()
        if done is None:
            return
        ok, scores = done
        if not ok:
            self._counts["worth_tunings_failed"] += 1
        elif scores is None:
            self._counts["worth_tunings_skipped"] += 1
        else:
            self._adopt(scores)

    @property
    def busy(self) -> bool:
        """A tuning is in flight in the child."""
        return self._child is not None and self._child.busy

    @property
    def pid(self) -> int | None:
        """The child's process id while it runs (None inline or before the first tuning)."""
        return self._child.pid if self._child is not None else None

    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    def close(self) -> None:
        """Stop the child without waiting for it (its thread reaps it); a tuning in flight is
        counted failed. Idempotent."""
        if self._child is not None and self._child.close():
            self._counts["worth_tunings_failed"] += 1

    @property
    def memory_bytes(self) -> int:
        return self.hash_bytes * self.chunks + REQUEST_BYTES * len(self.window) + 8 * (1 + len(self.grid))

    @staticmethod
    def max_memory_bytes(max_chunks: int, hash_bytes: int = 32, candidates: int = len(GRID)) -> int:
        return (hash_bytes + REQUEST_BYTES) * max_chunks + 8 * (1 + candidates)


from kvtier.index.tuning_child import Child  # noqa: E402 - it imports nothing of this module at import


def _score(shadow: Shadow, grid: tuple[float, ...], window: tuple[Record, ...]) -> list[float] | None:
    """The child's scorer (`tuning_child.serve`)."""
    return Job(shadow, grid, window).scores()


if __name__ == "__main__":
    import sys

    from kvtier.index.tuning import _score as score  # the module itself, so a Shadow unpickles as its Shadow
    from kvtier.index.tuning_child import serve

    serve(int(sys.argv[1]), score, idle="--normal" not in sys.argv[2:])
