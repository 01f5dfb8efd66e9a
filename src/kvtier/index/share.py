"""Each group's share of a tier's bytes, learned from recent traffic (`Index(share="learned")`).

A hit of T needs every cacheable group's entry at T, so the entries of one endpoint are worth
something only while *all* of them are held. Under recency eviction an entry lives about
(its pool's bytes) / (the bytes its group stores warm per request) requests; a pool whose entries
live shorter than the others' is the one hits miss on, and the others' extra lifetime is bytes no
hit can use. So the controller equalises lifetimes: every `period` requests it sets each group's
target bytes in proportion to the bytes it stored *warm* lately (new warm entries x chunk bytes,
fading by `fade` a period; cold entries ride on free room and do not count), and moves each pool
toward its target by at most `step` x the tier's bytes (`Index.resize`: shrinking evicts cold and
dead entries first). With every chunk warm this is the proportional share; with warm only where
hits land (`kvtier.index.placement`) a state group's share falls to what its endpoints need
(docs/admission.md).

A pool with empty slots that stored at most `step` x the tier's bytes in the last period gets at
most what it holds plus `step` (the controller gives bytes back as fast as it fills); the rest
goes to the other pools by their warm rates (water-filling), and while every pool has room nothing
moves. Why: bytes a pool leaves empty serve no hit, while another pool's cold entries, which live
on its free room, serve hits ending where none ended before (a new branch point), which no warm
entry can.

No group goes below `floor` x its proportional bytes (and one chunk): a hit needs every group, so
none may be starved, even one that stored nothing warm lately. Starts proportional, or from the
split `Index(start=...)` gives (the Store: its placement's fixed share).

Not ghost lists (the compute a group's recent evictions would have saved): a group's ghost hits
are few and joint with the other groups' (a hit needs every group), so that share swung and lost
hits (docs/admission.md).

Memory: 4 numbers per group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from kvtier.core.plan import Plan
from kvtier.errors import ConfigError
from kvtier.index.pool import _Pool


class Index(Protocol):
    """What the controller uses of `kvtier.index.index.Index` (which owns it; a Protocol, so this
    module does not import index.py back)."""

    plan: Plan
    capacities: Mapping[str, int]

    def _pool(self, group: int, tier: str) -> _Pool: ...
    def resize(self, group: int, tier: str, slots: int) -> object: ...


class LearnedShare:
    """One tier's byte share across its groups' pools: equal lifetimes of warm entries."""

    def __init__(self, index: Index, tier: str, *, period: int = 64, step: float = 1 / 32,
                 floor: float = 0.1, fade: float = 0.875) -> None:
        if period <= 0 or not 0 < step <= 1 or not 0 <= floor <= 1 or not 0 < fade <= 1:
            raise ConfigError(f"learned share: period={period} must be > 0, step={step} in (0, 1], "
                              f"floor={floor} in [0, 1], fade={fade} in (0, 1]")
        plan = index.plan
        self.index, self.tier = index, tier
        self.period, self.step, self.fade = period, step, fade
        self.capacity = index.capacities[tier]
        self.groups = [gp.index for gp in plan.cacheable_groups]
        self.chunk_bytes = {g: plan.groups[g].chunk_bytes for g in self.groups}
        total = sum(self.chunk_bytes.values())
        self.pools = {g: index._pool(g, tier) for g in self.groups}
        self.floor_slots = {g: max(1, int(floor * self.capacity / total)) for g in self.groups}
        # what a pool never goes below: its floor, or its start where that is lower (a pool below
        # its floor is only ever grown), so `max_slots` holds for good
        self._low = {g: min(self.floor_slots[g], self.pools[g].num_slots) for g in self.groups}
        self.rate = dict.fromkeys(self.groups, 0.0)  # warm bytes stored, fading
        self._seen = {g: self.pools[g].counts["warm_commits"] for g in self.groups}
        self._stored = {g: self.pools[g].counts["commits"] for g in self.groups}  # warm and cold
        self.requests = 0
        self.moves = 0

    def max_slots(self, group: int) -> int:
        """The most slots `group`'s pool can ever get: the tier's bytes less every other group's
        floor (or start, where lower), in this group's slots. A slot tier laid out for this many
        (address space: a page is committed only once written) never has to be rebuilt when the
        share moves."""
        others = sum(self._low[h] * self.chunk_bytes[h] for h in self.groups if h != group)
        return max(self.pools[group].num_slots, (self.capacity - others) // self.chunk_bytes[group])

    def fit(self) -> list:
        """After a rebuild (`Index.rebuild` accepts slots up to `max_slots`): every pool back
        within the tier's bytes, keeping every entry that fits. Each pool gets at least what it
        holds (and its floor); when that is more than the tier (a smaller tier than the run that
        wrote it), the largest pools give up the excess (their policy's victims); bytes left
        over go out as equal slot counts, as the proportional share starts. Before a restart
        the pools held at most the tier's bytes, so with the same capacity nothing is lost.
        Pools within the tier's bytes (nothing rebuilt past a pool's end) are left as they are."""
        pools, cb, floor = self.pools, self.chunk_bytes, self.floor_slots
        if sum(p.num_slots * cb[g] for g, p in pools.items()) <= self.capacity:
            return []
        want = {g: max(floor[g], pools[g].used) for g in self.groups}
        excess = sum(want[g] * cb[g] for g in self.groups) - self.capacity
        for g in sorted(self.groups, key=lambda g: -want[g] * cb[g]):
            if excess <= 0:
                break
            cut = min(want[g] - floor[g], -(-excess // cb[g]))
            want[g] -= cut
            excess -= cut * cb[g]
        if excess < 0:
            more = -excess // sum(cb.values())
            want = {g: w + more for g, w in want.items()}
        out = [self.index.resize(g, self.tier, want[g]) for g in self.groups if want[g] < pools[g].num_slots]
        out += [self.index.resize(g, self.tier, want[g]) for g in self.groups if want[g] > pools[g].num_slots]
        return out

    def shares(self) -> dict[int, float]:
        """Each group's fraction of the tier's bytes now."""
        return {g: self.pools[g].num_slots * self.chunk_bytes[g] / self.capacity for g in self.groups}

    def observe(self) -> list:
        """One request went by; every `period` requests, move bytes toward the targets."""
        self.requests += 1
        if self.requests % self.period:
            return []
        return self.rebalance()

    def targets(self) -> dict[int, int] | None:
        """Slots per group that equalise warm lifetimes, from the fading warm byte rates, no pool
        above what it fills (module docstring). None: nothing to move (nothing stored warm yet, or
        every pool has room)."""
        pools, cb = self.pools, self.chunk_bytes
        step = self.step * self.capacity
        room: dict[int, float] = {}  # the most bytes a pool with empty slots needs
        for g in self.groups:
            pool = pools[g]
            c, stored = pool.counts["warm_commits"], pool.counts["commits"]
            self.rate[g] = self.rate[g] * self.fade + (c - self._seen[g]) * cb[g]
            inflow = (stored - self._stored[g]) * cb[g]
            self._seen[g], self._stored[g] = c, stored
            if pool.used < pool.num_slots and inflow <= step:
                room[g] = pool.used * cb[g] + step
        if sum(self.rate.values()) <= 0:
            return None
        capped: dict[int, float] = {}
        while True:  # water-filling: bytes by warm rate, no pool above its room
            free = [g for g in self.groups if g not in capped]
            if not free:
                return None
            left = self.capacity - sum(capped.values())
            total = sum(self.rate[g] for g in free)
            share = {g: left * self.rate[g] / total if total > 0 else left / len(free) for g in free}
            over = [g for g in free if g in room and share[g] > room[g]]
            if not over:
                break
            capped.update((g, room[g]) for g in over)
        share.update(capped)
        return {g: max(self.floor_slots[g], int(share[g]) // cb[g]) for g in self.groups}

    def rebalance(self) -> list:
        target = self.targets()
        if target is None:
            return []
        pools, cb = self.pools, self.chunk_bytes
        step = self.step * self.capacity
        out = []
        for g in self.groups:  # shrink first: what grows takes only bytes no pool holds
            have = pools[g].num_slots
            if target[g] < have:
                out.append(self.index.resize(g, self.tier, max(target[g], have - max(1, int(step // cb[g])))))
        spare = self.capacity - sum(p.num_slots * cb[g] for g, p in pools.items())
        for g in sorted(self.groups, key=lambda g: pools[g].num_slots - target[g]):
            have = pools[g].num_slots
            grow = min(target[g] - have, int(min(step, spare) // cb[g]))
            if grow > 0:
                out.append(self.index.resize(g, self.tier, have + grow))
                spare -= grow * cb[g]
        if out:
            self.moves += 1
        return out

    @property
    def memory_bytes(self) -> int:
        return 4 * 8 * len(self.groups)
