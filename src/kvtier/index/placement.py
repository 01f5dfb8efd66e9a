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
