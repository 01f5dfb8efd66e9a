"""The pools behind `kvtier.index.index`: slot allocation, records, share rules (see index.py).

Split out of index.py to keep modules small; nothing here is public API.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvtier.errors import ConfigError
from kvtier.core.plan import Plan
from kvtier.index.policies import EvictionPolicy, make_policy

ChunkHash = bytes | int
PolicyFactory = Callable[[int], EvictionPolicy]

_RESERVED, _COMMITTED, _DOOMED = 0, 1, 2
SHARES = ("proportional", "equal", "row-per-key", "learned")


class _Rec:
    __slots__ = ("slot", "pins", "state")

    def __init__(self, slot: int, pins: int, state: int) -> None:
        self.slot = slot
        self.pins = pins
        self.state = state


class _Pool:
    """The slots of one (tier, group): allocation, records, policy, dead set, counters."""

    __slots__ = ("tier", "group", "num_slots", "slot_bytes", "next_fresh", "freed", "recs",
                 "policy", "dead", "cold", "counts")

    def __init__(self, tier: str, group: int, num_slots: int, slot_bytes: int,
                 policy: EvictionPolicy) -> None:
        self.tier = tier
        self.group = group
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.next_fresh = 0  # slots >= next_fresh were never handed out
        self.freed: list[int] = []
        self.recs: dict[ChunkHash, _Rec] = {}
        self.policy = policy
        self.dead: dict[ChunkHash, None] = {}  # ordered set, oldest first
        self.cold: dict[ChunkHash, None] = {}  # stored as unlikely to be read: evicted next
        self.counts = dict.fromkeys(
            ("commits", "warm_commits", "hits", "evictions", "dead_evictions", "removes", "aborts",
             "full"), 0)

    def alloc(self) -> int | None:
        if self.freed:
            return self.freed.pop()
        if self.next_fresh < self.num_slots:
            self.next_fresh += 1
            return self.next_fresh - 1
        return None

    @property
    def used(self) -> int:
        return self.next_fresh - len(self.freed)

    def evictable(self, h: ChunkHash) -> bool:
        return self.recs[h].pins == 0

    def pick_victim(self) -> ChunkHash | None:
        recs = self.recs
        for h in self.dead:
            if recs[h].pins == 0:
                return h
        for h in self.cold:
            if recs[h].pins == 0:
                return h
        return self.policy.victim(self.evictable)


def _policy_factory(policy: str | PolicyFactory) -> PolicyFactory:
    if isinstance(policy, str):
        make_policy(policy, 1)  # unknown names fail here, at construction
        return lambda slots: make_policy(policy, slots)
    if callable(policy):
        return policy
    raise ConfigError(f"policy {policy!r} must be a policy name or a factory(slots) -> policy")


def slot_counts(plan: Plan, capacities: Mapping[str, int],
                share: str | Mapping[str, float] = "proportional") -> dict[tuple[str, int], int]:
    """Slots per (tier, cacheable group index) that an `Index(plan, capacities, share=share)` has:
    the one share rule, answered without building an index (the vLLM worker sizes its slabs with
    it). Raises, as the index does, on a bad tier name, capacity or share."""
    cacheable = plan.cacheable_groups
    out: dict[tuple[str, int], int] = {}
    for tier, capacity in capacities.items():
        if not isinstance(tier, str) or not tier:
            raise ConfigError(f"tier name {tier!r} must be a non-empty string")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ConfigError(
                f"tier {tier!r} has capacity {capacity!r} bytes; give a positive byte count "
                "or leave the tier out"
            )
        for gp, slots in zip(cacheable, _slots(plan, tier, capacity, share)):
            out[(tier, gp.index)] = slots
    return out


def _slots(plan: Plan, tier: str, capacity: int, share: str | Mapping[str, float]) -> list[int]:
    cacheable = plan.cacheable_groups
    total = sum(gp.chunk_bytes for gp in cacheable)
    n = len(cacheable)
    if share in ("proportional", "learned"):  # learned: starts proportional (kvtier.index.share)
        slots = [capacity // total] * n
        shares = [capacity * gp.chunk_bytes / total for gp in cacheable]
    elif share == "equal":
        shares = [capacity / n] * n
        slots = [capacity // (n * gp.chunk_bytes) for gp in cacheable]
    elif share == "row-per-key":
        shares = [capacity / n] * n
        slots = [capacity // (n * total)] * n
    elif isinstance(share, Mapping):
        names = {gp.name for gp in cacheable}
        unknown = sorted(set(share) - names)
        missing = sorted(names - set(share))
        if unknown or missing:
            raise ConfigError(
                f"share names {unknown or missing} {'not cacheable groups' if unknown else 'missing'}; "
                f"give a fraction for every cacheable group: {', '.join(sorted(names))}"
            )
        fractions = [share[gp.name] for gp in cacheable]
        if any(not isinstance(f, (int, float)) or isinstance(f, bool) or f <= 0 for f in fractions):
            raise ConfigError(f"share fractions {dict(share)} must all be numbers > 0")
        if sum(fractions) > 1 + 1e-9:
            raise ConfigError(f"share fractions {dict(share)} sum to {sum(fractions):.3f}; at most 1")
        shares = [capacity * f for f in fractions]
        slots = [int(capacity * f) // gp.chunk_bytes for f, gp in zip(fractions, cacheable)]
    else:
        raise ConfigError(
            f"unknown share rule {share!r}; use one of: {', '.join(SHARES)}, or a dict "
            "{group name: fraction}"
        )
    for gp, s, b in zip(cacheable, slots, shares):
        if s <= 0:
            raise ConfigError(
                f"tier {tier!r} ({capacity} bytes) gives group {gp.name!r} {int(b)} bytes, less than "
                f"one chunk ({gp.chunk_bytes} bytes); give the tier at least "
                f"{_min_capacity(plan, share, gp.index)} bytes or use smaller chunks"
            )
    return slots


def _min_capacity(plan: Plan, share: str | Mapping[str, float], group: int) -> int:
    cacheable = plan.cacheable_groups
    total = sum(gp.chunk_bytes for gp in cacheable)
    gp = plan.groups[group]
    if share in ("proportional", "learned"):
        return total
    if share == "equal":
        return gp.chunk_bytes * len(cacheable)
    if share == "row-per-key":
        return total * len(cacheable)
    assert isinstance(share, Mapping)
    return int(gp.chunk_bytes / share[gp.name]) + 1
