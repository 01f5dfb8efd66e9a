"""Admission where hits land: which of a request's chunks each group stores warm, cold or not.

Rule (docs/admission.md, "Admission where hits land: the default"): full/MLA groups store every
chunk warm (every longer hit reads them). A state checkpoint or a sliding/chunked window serves
only hits that end at or near it, so those groups store warm only what hits ending at the
request's *endpoints* read, and the rest *cold* (evicted first, free while there is room):
- branch points of the prefix tree of chunk hashes (`BranchTree`), learned online;
- the request's last chunks at the offsets from a request's end where later requests' seen
  prefixes have ended lately (a next turn repeats all but the previous prompt's last, partial
  block: offset 1 on Mooncake traces). Learned online: per offset j < ENDS, a counter of later
  requests whose seen prefix ended j chunks before an earlier request's end; an offset is warm
  while its count is >= `ratio` x the largest. Counters halve every `decay` observations.

Bounded: the tree (<= `tree_nodes` x ~120 bytes) and ENDS counters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvtier.core.plan import Plan
from kvtier.errors import ConfigError
from kvtier.index.branches import ENDS, NODE_BYTES, BranchTree
from kvtier.index.pool import slot_counts

ChunkHash = bytes | int
WARM, COLD, SKIP = "warm", "cold", "skip"


PLACED_KINDS = ("sliding", "chunked", "state")  # the groups the Store and replay place (vLLM: state only)


def placement_share(plan: Plan, placed_kinds: Sequence[str]) -> str | dict[str, float]:
    """share="auto" under placement "hits": half of each tier to the full/MLA groups and half to
    the groups of `placed_kinds` (stored only where hits land), each half by chunk bytes, but the
    placed groups never more than their proportional bytes (they store fewer chunks than every-chunk
    storing, so more would sit empty: LFM2's 512-byte conv states beside 32 KiB attention chunks);
    a group of another kind keeps its proportional bytes (its chunk bytes over all groups'). Placed
    pools under "proportional" stay mostly empty, so their bytes go to the groups every hit reads
    (docs/admission.md). "proportional" where no full/MLA or no placed group is cacheable."""
    cacheable = plan.cacheable_groups
    anchors = [gp for gp in cacheable if gp.kind in ("full", "mla")]
    placed = [gp for gp in cacheable if gp.kind in placed_kinds and gp not in anchors]
    if not anchors or not placed or len({gp.name for gp in cacheable}) != len(cacheable):
        return "proportional"
    total = sum(gp.chunk_bytes for gp in cacheable)
    out = {gp.name: gp.chunk_bytes / total for gp in cacheable if gp not in anchors and gp not in placed}
    rest = 1 - sum(out.values())
    placed_part = min(0.5 * rest, sum(gp.chunk_bytes for gp in placed) / total)
    for side, part in ((anchors, rest - placed_part), (placed, placed_part)):
        side_bytes = sum(gp.chunk_bytes for gp in side)
        out.update({gp.name: part * gp.chunk_bytes / side_bytes for gp in side})
    return out  # sums to 1 up to float error, which slot_counts allows (no slot lost to rounding)


class HitsLand:
    """Per request, the endpoints where hits land; per group, warm/cold/skip per chunk."""

    name = "hits"

    def __init__(self, plan: Plan, tree_nodes: int = 1 << 16, ratio: float = 0.25,
                 warmup: int = 64, decay: int = 4096) -> None:
        if not 0 < ratio <= 1:
            raise ConfigError(f"hits placement: ratio={ratio!r} must be in (0, 1]")
        self.plan = plan
        self.tree = BranchTree(tree_nodes)
        self.ratio, self.warmup, self.decay = ratio, warmup, decay
        self.reuse = [0.0] * ENDS
        self.observed = 0
        self.anchors = frozenset(gp.index for gp in plan.cacheable_groups if gp.kind in ("full", "mla"))
        self._last: tuple[int, ChunkHash | None, frozenset[int]] = (0, None, frozenset())

    def offsets(self) -> tuple[int, ...]:
        """End offsets stored warm now: (0, 1) until `warmup` observations, then the learned ones."""
        if self.observed < self.warmup:
            return (0, 1)
        top = max(self.reuse)
        return tuple(j for j in range(ENDS) if self.reuse[j] >= self.ratio * top and top > 0)

    def endpoints(self, chunks: Sequence[ChunkHash], learn: bool = True) -> frozenset[int]:
        """This request's endpoints (chunk indices e: a hit may end after chunk e), learning from
        it on the first call; calls for the same request (per group) get the same answer.
        learn=False: a request already learned from that grew (decode): its chunks only inserted."""
        n = len(chunks)
        key = chunks[-1] if n else None
        if n and self._last[:2] == (n, key):
            return self._last[2]
        out = self.learn(chunks) if learn else self._ends(chunks)
        self._last = (n, key, out)
        return out

    def learn(self, chunks: Sequence[ChunkHash]) -> frozenset[int]:
        """Learn from one request and answer its endpoints (once per request)."""
        n = len(chunks)
        k = self.tree.match(chunks)
        if k:
            j = self.tree.end_offset(chunks[k - 1])
            if j < ENDS:
                self.reuse[j] += 1
                self.observed += 1
                if self.observed % self.decay == 0:
                    self.reuse = [r / 2 for r in self.reuse]
        return self._ends(chunks)

    def _ends(self, chunks: Sequence[ChunkHash]) -> frozenset[int]:
        """Insert the request's chunks (nothing learned) and answer its endpoints."""
        n = len(chunks)
        ends = set(self.tree.insert(chunks))
        ends.update(n - 1 - j for j in self.offsets() if n - 1 - j >= 0)
        return frozenset(ends)

    def admit(self, chunks: Sequence[ChunkHash], group: int, n: int | None = None, *,
              learn: bool = True) -> tuple[str, ...]:
        """warm / cold / skip for each of the first `n` (default all) chunks of `chunks` in
        `group`: the API the store and the vLLM manager call, per group, per request.
        learn=False: the request was learned from already (it grew): its chunks only inserted."""
        n = len(chunks) if n is None else n
        warm, cold = self.spots(self.endpoints(chunks, learn), group, n)
        if warm is None:
            return (WARM,) * n
        return tuple(WARM if i in warm else COLD if i in cold else SKIP for i in range(n))

    def admit_run(self, chunks: Sequence[ChunkHash], before: int, after: int = 0, n: int | None = None, *,
                  learn: bool = True) -> tuple[str, ...]:
        """warm / cold for each of the first `n` chunks of a group that a reader (vLLM's hit search)
        reads as a run around each hit's end: warm the chunks e - before + 1 .. e + after of every
        endpoint e, cold the rest. For readers whose window differs from the plan's rule (vLLM reads
        a sliding group's cdiv(W, C) chunks where the plan keeps those holding W - 1 tokens)."""
        n = len(chunks) if n is None else n
        warm: set[int] = set()
        for e in self.endpoints(chunks, learn):
            if e < n:
                warm.update(range(max(0, e - before + 1), min(n, e + after + 1)))
        return tuple(WARM if i in warm else COLD for i in range(n))

    def spots(self, ends: frozenset[int], group: int, n: int) -> tuple[set[int] | None, set[int]]:
        """(warm chunk indices, None = all; cold chunk indices) of `group` for the first n chunks."""
        if group in self.anchors:
            return None, set()
        c = self.plan.chunk_tokens
        warm: set[int] = set()
        for e in ends:
            if e < n:
                warm.update(self.plan.chunks_for_hit(group, (e + 1) * c))
        return warm, set(range(n)) - warm

    def place(self, chunks: Sequence[ChunkHash], n: int) -> dict[int, tuple[set[int] | None, set[int]]]:
        """Replay's view: every non-anchor cacheable group's (warm, cold)."""
        ends = self.learn(chunks)
        return {gp.index: self.spots(ends, gp.index, n) for gp in self.plan.cacheable_groups
                if gp.index not in self.anchors}

    @property
    def memory_bytes(self) -> int:
        return self.tree.memory_bytes + 8 * ENDS

    @staticmethod
    def max_memory_bytes(tree_nodes: int) -> int:
        return NODE_BYTES * tree_nodes + 8 * ENDS


def learned_start(plan: Plan, share: object, placement: object,
                  capacities: Mapping[str, int]) -> str | dict[str, float] | None:
    """Where a learned share's pools start (`Index(start=)`), in the Store and in replay alike: the
    fixed split of the placed groups (`placement_share`) under a placement, so a short run is no
    worse than that split (docs/admission.md); proportional (None) without a placement, or where a
    tier is too small for the split to give every group a chunk."""
    if share != "learned" or placement is None:
        return None
    split = placement_share(plan, PLACED_KINDS)
    try:
        slot_counts(plan, capacities, split)
    except ConfigError:
        return None
    return split


def tail_chunks(plan: Plan, group: int, num_chunks: int, endpoints: int) -> list[int]:
    """What a non-anchor group must hold so hits can end at the prompt's last `endpoints` chunk
    boundaries: the union of `plan.chunks_for_hit` over T = j*C, j = n-endpoints+1 .. n.

    Why: a sliding window or a state checkpoint serves only hits that end near it, and follow-up
    requests (the next turn of a chat) hit at the end of an earlier prompt, so a sliding group's
    early chunks and a state group's early checkpoints are bytes few hits read. With
    endpoints=2 a Mooncake next turn (which repeats all but the last, partial block) still hits.
    Replay stores these warm; the group's other chunks are stored *cold* (evicted before
    any warm entry, never refreshed by a save), so they cost nothing while there is room and
    still serve a prompt that branches in the middle of a cached one.
    """
    if endpoints <= 0:
        raise ConfigError(f"tail endpoints {endpoints} must be a positive number of chunk boundaries")
    c = plan.chunk_tokens
    out: set[int] = set()
    for j in range(max(1, num_chunks - endpoints + 1), num_chunks + 1):
        out.update(plan.chunks_for_hit(group, j * c))
    return sorted(out)


class StoreChunks:
    """Per prompt length n (in chunks), memoized: for each cacheable group, anchors first, the
    chunk indices worth storing (None = all of 0..n-1) and, with `tail_endpoints`, the warm ones
    (the rest is stored cold and not touched). Replay and the worth tuner's shadows share it."""

    def __init__(self, plan: Plan, tail_endpoints: int | None) -> None:
        self.plan, self.tail_endpoints = plan, tail_endpoints
        self.order = sorted(plan.cacheable_groups, key=lambda gp: gp.kind not in ("full", "mla"))
        self._memo: dict[int, list[tuple[int, set[int] | None, set[int] | None]]] = {}

    def __call__(self, n: int) -> list[tuple[int, set[int] | None, set[int] | None]]:
        got = self._memo.get(n)
        if got is None:
            plan, c, got = self.plan, self.plan.chunk_tokens, []
            for gp in self.order:
                idx = plan.store_chunks(gp.index, n * c)
                warm = None
                if self.tail_endpoints and gp.kind not in ("full", "mla"):
                    warm = set(tail_chunks(plan, gp.index, n, self.tail_endpoints))
                got.append((gp.index, None if idx == list(range(n)) else set(idx), warm))
            self._memo[n] = got
        return got


def store_request(chunks: Sequence[object], n: int, wanted: StoreChunks, spots: Mapping | None,
                  contains, touch_all, save) -> None:  # noqa: ANN001 - the index's methods, a save(h, g, cold=False)
    """Replay's save of one request's first n chunks by placement: a warm chunk already held is
    touched, else saved; a cold one is saved (cold) only when not held. `spots`: the placement's
    (warm, cold) per group it places, None for every chunk warm (tail endpoints aside)."""
    if not n:
        return
    for g, idx, warm in wanted(n):
        if spots is not None and g in spots:
            warm_g, cold_g = spots[g]
            for i in range(n):
                if idx is not None and i not in idx:
                    continue
                if warm_g is None or i in warm_g:
                    if not touch_all(chunks[i], g):
                        save(chunks[i], g)
                elif i in cold_g and not contains(chunks[i], g):
                    save(chunks[i], g, True)
            continue
        for i in range(n):
            if idx is not None and i not in idx:
                continue
            if warm is not None and i not in warm:
                if not contains(chunks[i], g):
                    save(chunks[i], g, True)
            elif not touch_all(chunks[i], g):
                save(chunks[i], g)
