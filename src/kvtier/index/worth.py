"""Eviction by worth: recency plus the compute an entry saves, weighted (issue 39, item 3).

A hit of T needs every cacheable group's entry at T, so within a pool (all slots of one group,
equal bytes) entries differ in worth by the compute the hits through them save and by how often
they serve:
- an anchor (full/MLA) chunk: every hit through it reads it; worth = 1 + its sightings since it
  was stored (a chunk of a shared prefix or a conversation that keeps coming back serves more);
- a non-anchor entry (a state checkpoint, a window): it serves hits *ending* at its chunk, and such
  a hit saves the whole prefix: worth = F((d + 1) x C) x (1 + sightings), F = the geometry's prefill
  FLOPs (`kvtier.core.cost`, quadratic attention term included), d = the chunk's depth in its
  prompt (from the prefix tree placement keeps; 0 when unknown).

`WorthLRU` orders a pool by priority = last use (a clock of the pool's inserts and touches)
+ w x z x slots, z = log2(worth / mean worth of new entries), clipped to [-4, 4]: a worth twice
the mean buys w more turnovers of the pool. The victim is the lowest priority. **w = 0 is LRU**,
exactly (priority = last use); `WorthWeight` holds w for every pool of an index, so a tuner
(`kvtier.index.tuning`) changes it for all at once. The dead-first, cold-first and orphan rules
of `kvtier.index.index` stay in front of the policy.

Memory: per resident entry a heap item, a (priority, clock) pair and a sightings count (the heap
keeps at most 4 x entries + 64 items: stale items are dropped on rebuild); learned state: the
running mean (one float) and w (one float, shared).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable

from kvtier.index.policies import Evictable

Key = Hashable
Z_CLIP = 4.0
MEAN_WINDOW = 1024  # the mean worth of new entries fades over about this many inserts


class WorthWeight:
    """The recency/worth weight w shared by an index's pools (0: LRU)."""

    __slots__ = ("w",)

    def __init__(self, w: float = 0.0) -> None:
        self.w = float(w)


class WorthLRU:
    """LRU + w x log-worth lifetime bonus (module docstring). `value(key, sightings)` -> worth."""

    name = "worth"

    def __init__(self, capacity: int, weight: WorthWeight,
                 value: Callable[[Key, int], float] | None = None) -> None:
        self.capacity = max(1, capacity)
        self.weight = weight
        self.value = value or (lambda key, sightings: 1.0)
        self.clock = 0
        self.mean = 0.0
        self.heap: list[tuple[float, int, Key]] = []
        self.entries: dict[Key, tuple[float, int]] = {}
        self.sightings: dict[Key, int] = {}

    def priority(self, key: Key, clock: int, fresh: bool) -> float:
        w = self.weight.w
        if not w:
            if fresh:  # keep the mean current, so a later w > 0 starts calibrated
                v = self.value(key, 0)
                self.mean = v if self.mean <= 0 else self.mean + (v - self.mean) / MEAN_WINDOW
            return float(clock)
        v = self.value(key, self.sightings[key])
        if fresh:
            self.mean = v if self.mean <= 0 else self.mean + (v - self.mean) / MEAN_WINDOW
        if self.mean <= 0 or v <= 0:
            return float(clock)
        z = max(-Z_CLIP, min(Z_CLIP, math.log2(v / self.mean)))
        return clock + w * z * self.capacity

    def _push(self, key: Key, fresh: bool) -> None:
        self.clock += 1
        p = self.priority(key, self.clock, fresh)
        self.entries[key] = (p, self.clock)
        heapq.heappush(self.heap, (p, self.clock, key))
        self._compact()

    def _compact(self) -> None:
        """Stale items (removed or touched since) dropped once the heap passes its bound: touches
        alone, with no eviction, must not grow it either."""
        if len(self.heap) > 4 * len(self.entries) + 64:
            self.heap = [(p, c, k) for k, (p, c) in self.entries.items()]
            heapq.heapify(self.heap)

    def insert(self, key: Key) -> None:
        if key in self.entries:
            self.touch(key)
            return
        self.sightings[key] = 0
        self._push(key, True)

    def touch(self, key: Key) -> None:
        if key in self.entries:
            self.sightings[key] += 1
            self._push(key, False)

    def remove(self, key: Key) -> None:
        if self.entries.pop(key, None) is not None:
            del self.sightings[key]
        self._compact()

    def victim(self, evictable: Evictable) -> Key | None:
        heap, entries = self.heap, self.entries
        while heap:
            p, c, k = heap[0]
            e = entries.get(k)
            if e is None or e[1] != c:
                heapq.heappop(heap)  # stale: removed, or touched since
                continue
            if evictable(k):
                return k
            break
        best: tuple[tuple[float, int], Key] | None = None  # a pinned head: scan (rare)
        for k, pc in entries.items():
            if evictable(k) and (best is None or pc < best[0]):
                best = (pc, k)
        return best[1] if best is not None else None

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    @property
    def heap_bound(self) -> int:
        """Most heap items this pool keeps: 4 x resident entries + 64."""
        return 4 * len(self.entries) + 64


def worth_value(kind: str, flops: Callable[[int], float], chunk_tokens: int,
                depth: Callable[[Key], int]) -> Callable[[Key, int], float]:
    """The worth of one group's entry (module docstring): anchors 1 + sightings; other groups
    F((d + 1) x C) x (1 + sightings)."""
    if kind in ("full", "mla"):
        return lambda key, sightings: 1.0 + sightings
    memo: dict[int, float] = {}

    def value(key: Key, sightings: int) -> float:
        d = depth(key)
        f = memo.get(d)
        if f is None:
            f = flops((d + 1) * chunk_tokens)
            if len(memo) < 4096:  # depths repeat; the memo stays bounded
                memo[d] = f
        return f * (1.0 + sightings)

    return value
