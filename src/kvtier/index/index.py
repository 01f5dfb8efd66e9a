"""The control-plane index: which (chunk_hash, group) lives in which tier and slot.

One index serves the store (with real tiers), the vLLM scheduler-side manager and `kvtier
replay` (no payloads at all): the same code decides hits, slots and evictions everywhere.

Pools. Every tier (in the order given: fastest first, e.g. cpu, disk) has one slot pool per
*cacheable* group; a pool's slots are all `plan.groups[g].chunk_bytes` big. The tier's byte
capacity is shared out among the cacheable groups by `share`:
- "proportional" (default): in proportion to each group's chunk_bytes, so every group gets
  the same number of slots: `capacity // sum(chunk_bytes)`. A chunk of every group fits as many
  times as the bytes allow; nothing is reserved for groups that do not exist.
- "equal": every group gets `capacity / n` bytes (small-chunk groups get more slots).
- "row-per-key": what a layout-blind offloader does (vLLM's native spec): every (key, group)
  entry reserves a row of all groups' bytes, so each group gets `capacity // (n * sum)` slots.
  Kept for `kvtier replay`'s comparison; never a sensible choice for a store.
- a dict {group name: fraction of the tier} (fractions > 0, summing to at most 1, every
  cacheable group named).
- "learned": starts proportional, or from `start` (the Store and replay: the placement's fixed
  split, `index.placement.learned_start`; vLLM's manager: its own, `vllm_placement_share`); a `kvtier.index.share.LearnedShare` per tier then moves
  bytes toward equal lifetimes of every group's warm entries (each group's bytes in proportion
  to the bytes it stored warm lately), through `resize`, called by `observe` once per request
  (the caller drops the entries it evicts and copies the ones it moves). A pool never has
  more than `max_slots(group, tier)` slots: what a slot tier is laid out for.
Fixed-size slots per group make a slot a file offset and a slab view; one shared pool of
variable-size entries would need a byte allocator (fragmentation) in every tier.

Lifecycle of an entry in one pool: reserve -> (RESERVED, pinned, invisible to lookup) ->
commit (COMMITTED, visible, in the eviction policy) or abort (gone). A committed entry may be
pinned (a load in flight) any number of times; a pinned entry is never evicted. `remove` of a
pinned entry hides it at once and frees its slot at the last unpin. Expected outcomes are
values: `reserve` answers "present" or "full" instead of raising.

Hit. `lookup(chunk_hashes, prompt_tokens)` gives the largest T (`plan.best_hit`: a multiple of
chunk_tokens, at most prompt_tokens - 1) that every cacheable group can restore from committed
entries in any tier, and per group the chunks to load, each from the first tier (in tier order)
that holds it. Only the chunks the hit reads are touched (a sliding group's early chunks are not
refreshed by hits that do not read them).

Group-aware eviction (the exact rule). The *anchor* groups are the cacheable `full`/`mla`
groups. Every hit that reads chunk i of any group has T >= (i+1)*C and so needs chunk i of every
anchor group (hash h_i: the chain makes h_i part of every longer prefix). Hence, when some anchor
group holds h_i in no tier (not reserved, not committed), no hit can read h_i in any other group:
those entries are *dead*. A pool evicts its dead entries first (oldest dead first), and only then
asks its policy. A dead entry revives if every anchor group holds h_i again. The rule never
drops a chunk some hit could read while a useless one stays. Geometries without a full/mla group
have no anchors and no dead entries. (The looser rule "the prefix is cached further on beyond
the window" is not used: a prompt that diverges right after chunk i still needs chunk i.)
Evicted entries come back from `reserve` with `dead=True` when they were dead (counted as
`dead_evictions`). Callers drop what is evicted, never copy it down: the store and the vLLM
manager write through to every tier at save time (docs/store.md, "Write policy").

Not thread-safe: callers serialize (the store holds one lock; vLLM's scheduler is one thread).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.index.pool import (_COMMITTED, _DOOMED, _RESERVED, _policy_factory, _Pool,
                               _Rec, slot_counts)
from kvtier.core.plan import Plan
from kvtier.index.policies import EvictionPolicy
from kvtier.index.share import LearnedShare

ChunkHash = bytes | int  # bytes from kvtier.core.keys; replay uses a trace's integer ids
PolicyFactory = Callable[[int], EvictionPolicy]



@dataclass(frozen=True, slots=True)
class Entry:
    chunk_hash: ChunkHash
    group: int
    tier: str
    slot: int
    dead: bool = False  # no hit could read it any more (see "Group-aware eviction")


@dataclass(frozen=True, slots=True)
class Move:
    """A kept entry a shrinking pool relocated: the caller copies the payload's bytes."""

    chunk_hash: ChunkHash
    group: int
    tier: str
    from_slot: int
    to_slot: int


@dataclass(frozen=True, slots=True)
class Resized:
    slots: int  # the pool's slots now (more than asked when pinned entries forbid shrinking)
    evicted: tuple[Entry, ...] = ()
    moved: tuple[Move, ...] = ()


@dataclass(frozen=True, slots=True)
class Load:
    chunk_index: int
    chunk_hash: ChunkHash
    tier: str
    slot: int


@dataclass(frozen=True, slots=True)
class Hit:
    tokens: int
    chunks: tuple[tuple[Load, ...], ...]  # by group index; empty for groups with nothing to load


@dataclass(frozen=True, slots=True)
class Reservation:
    slot: int | None  # the reserved slot; None when status is "present" or "full"
    # "reserved" | "present" (already held or reserved in that tier) | "full" (every entry
    # pinned) | "busy" (a removed copy is still pinned by a load; retry after it ends)
    status: str
    evicted: tuple[Entry, ...] = ()


_NO_RESIZE = Resized(0)
_PRESENT = Reservation(None, "present")
_BUSY = Reservation(None, "busy")
_FULL = Reservation(None, "full")


class Index:
    """Key -> (tier, slot) with per-group pools, pins and eviction. See the module docstring."""

    def __init__(
        self,
        plan: Plan,
        capacities: Mapping[str, int],
        policy: str | PolicyFactory = "lru",
        share: str | Mapping[str, float] = "proportional",
        *,
        anchored: bool = True,
        start: str | Mapping[str, float] | None = None,
        learned_tiers: Collection[str] | None = None,
    ) -> None:
        """`anchored=False` turns the dead-first rule off: for plans whose groups' chunks span
        different tokens (vLLM's chunking of groups with different tokens per block), chunk
        hashes line up across groups only at common boundaries, so most chunks of a
        small-block group would look dead to the anchor groups from the moment they commit.
        `start` (share="learned" only): the share rule the pools start from (default
        "proportional"; the Store starts from its placement's fixed share). `learned_tiers`
        (read under share="learned" only): the tiers whose bytes move (default every tier); the
        others keep the `start` split (vLLM's manager learns only its cpu tier: a move elsewhere is I/O)."""
        if start is not None and share != "learned":
            raise ConfigError(f"start={start!r} is the learned share's first split; give share='learned' "
                              f"with it, not share={share!r}")
        self.plan = plan
        if not capacities:
            raise ConfigError("no tiers: give at least one tier capacity, e.g. {'cpu': 8 << 30}")
        cacheable = [gp for gp in plan.groups if gp.cacheable]
        if not cacheable:
            raise ConfigError("the plan has no cacheable group: there is nothing to index")
        factory = _policy_factory(policy)
        self.tiers: tuple[str, ...] = tuple(capacities)
        self.capacities = dict(capacities)
        self._pools: dict[tuple[str, int], _Pool] = {}
        # per group index: that group's pools in tier order (empty for non-cacheable groups)
        self._by_group: list[list[_Pool]] = [[] for _ in plan.groups]
        sizes = slot_counts(plan, capacities, start if start is not None else share)
        for (tier, g), slots in sizes.items():
            pool = _Pool(tier, g, slots, plan.groups[g].chunk_bytes, factory(slots))
            self._pools[(tier, g)] = pool
            self._by_group[g].append(pool)
        self.anchors: tuple[int, ...] = (
            tuple(gp.index for gp in cacheable if gp.kind in ("full", "mla")) if anchored else ())
        self._anchor_set = frozenset(self.anchors)
        self._dependents: tuple[int, ...] = (
            tuple(gp.index for gp in cacheable if gp.index not in self.anchors) if self.anchors else ()
        )
        self.counts = dict.fromkeys(("lookups", "hit_lookups", "hit_tokens"), 0)
        # told of every entry that becomes visible (stored=True: commit, put, rebuild) or stops
        # being visible (stored=False: evicted, removed, dropped); reserved entries that never
        # committed are never told. For KV events (the vLLM manager); None costs nothing.
        self.listener: Callable[[str, int, ChunkHash, bool], None] | None = None
        # share="learned": one controller per tier (kvtier.index.share)
        self.learners: tuple[LearnedShare, ...] = ()
        if share == "learned":
            self.learners = tuple(LearnedShare(self, tier) for tier in self.tiers
                                  if learned_tiers is None or tier in learned_tiers)
        self._learner_of = {learner.tier: learner for learner in self.learners}

    # -- queries -------------------------------------------------------------------------------

    def _pool(self, group: int, tier: str) -> _Pool:
        pool = self._pools.get((tier, group))
        if pool is None:
            if tier not in self.capacities:
                raise ConfigError(f"unknown tier {tier!r}; this index has tiers: {', '.join(self.tiers)}")
            raise ConfigError(
                f"group {group!r} is not a cacheable group of this plan; cacheable groups: "
                f"{', '.join(str(gp.index) for gp in self.plan.cacheable_groups)}"
            )
        return pool

    def policy_of(self, group: int, tier: str) -> EvictionPolicy:
        """The eviction policy of (tier, group)'s pool (a policy that scores entries by group,
        such as replay's Marconi baseline, is told its group through it)."""
        return self._pool(group, tier).policy

    def slots(self, group: int, tier: str) -> int:
        """Number of slots of (tier, group)."""
        return self._pool(group, tier).num_slots

    def max_slots(self, group: int, tier: str) -> int:
        """The most slots (tier, group)'s pool may ever have: under a learned share the tier's
        bytes less every other group's floor (`LearnedShare.max_slots`), else its slots. A slot
        tier is laid out for this many, so a resize never moves a slab."""
        learner = self._learner_of.get(tier)
        return learner.max_slots(group) if learner is not None else self._pool(group, tier).num_slots

    def contains(self, chunk_hash: ChunkHash, group: int, tier: str | None = None) -> bool:
        """Committed and visible in `tier` (any tier when None)."""
        pools = self._by_group[group] if tier is None else [self._pool(group, tier)]
        for pool in pools:
            rec = pool.recs.get(chunk_hash)
            if rec is not None and rec.state == _COMMITTED:
                return True
        return False

    def where(self, chunk_hash: ChunkHash, group: int) -> list[tuple[str, int]]:
        """(tier, slot) of every committed copy, in tier order."""
        out = []
        for pool in self._by_group[group]:
            rec = pool.recs.get(chunk_hash)
            if rec is not None and rec.state == _COMMITTED:
                out.append((pool.tier, rec.slot))
        return out

    def lookup(self, chunk_hashes: Sequence[ChunkHash], prompt_tokens: int, *, touch: bool = True) -> Hit:
        """The hit for a prompt whose full chunks have `chunk_hashes` (prefix order)."""
        by_group = self._by_group
        n = len(chunk_hashes)

        def has(g: int, i: int) -> bool:
            if i >= n:
                return False
            h = chunk_hashes[i]
            for pool in by_group[g]:
                rec = pool.recs.get(h)
                if rec is not None and rec.state == _COMMITTED:
                    return True
            return False

        plan = self.plan
        tokens = plan.best_hit(prompt_tokens, has)
        self.counts["lookups"] += 1
        if tokens == 0:
            return Hit(0, tuple(() for _ in plan.groups))
        self.counts["hit_lookups"] += 1
        self.counts["hit_tokens"] += tokens
        chunks: list[tuple[Load, ...]] = []
        for g, pools in enumerate(by_group):
            loads = []
            for i in plan.chunks_for_hit(g, tokens) if pools else ():
                h = chunk_hashes[i]
                for pool in pools:
                    rec = pool.recs.get(h)
                    if rec is not None and rec.state == _COMMITTED:
                        loads.append(Load(i, h, pool.tier, rec.slot))
                        if touch:
                            pool.policy.touch(h)
                            if pool.cold:
                                pool.cold.pop(h, None)
                            pool.counts["hits"] += 1
                        break
            chunks.append(tuple(loads))
        return Hit(tokens, tuple(chunks))

    def observe(self) -> Resized:
        """Once per request (after its save): with share="learned", now and then move bytes
        between the groups' pools (`resize`). Returns what moved: evicted entries (drop
        them) and relocated ones (copy their payloads); nothing for other shares."""
        if not self.learners:
            return _NO_RESIZE
        evicted: list[Entry] = []
        moved: list[Move] = []
        for learner in self.learners:
            for r in learner.observe():
                evicted.extend(r.evicted)
                moved.extend(r.moved)
        return Resized(0, tuple(evicted), tuple(moved)) if evicted or moved else _NO_RESIZE

    def fit(self, tier: str) -> Resized:
        """After `rebuild` of `tier`, under a learned share: its pools back within the tier's
        bytes (`LearnedShare.fit`: each keeps what it holds where the bytes allow). Returns, as
        `observe` does, the entries to drop and the ones to move; nothing for other shares."""
        learner = self._learner_of.get(tier)
        if learner is None:
            return _NO_RESIZE
        evicted: list[Entry] = []
        moved: list[Move] = []
        for r in learner.fit():
            evicted.extend(r.evicted)
            moved.extend(r.moved)
        return Resized(0, tuple(evicted), tuple(moved)) if evicted or moved else _NO_RESIZE

    def resize(self, group: int, tier: str, slots: int) -> Resized:
        """Give (tier, group) `slots` slots. Shrinking evicts (dead, cold, then the policy's
        victims) down to `slots` and relocates kept entries from slots >= `slots` into free
        ones below (`moved`: the caller copies their bytes); pinned or reserved entries are
        neither evicted nor moved, so the pool may keep more slots than asked (`Resized.slots`).
        Byte budgets across groups are the caller's (`LearnedShare` keeps the tier's)."""
        if isinstance(slots, bool) or not isinstance(slots, int) or slots <= 0:
            raise ConfigError(f"resize of group {group} tier {tier!r} to {slots!r} slots: give a "
                              "positive number of slots")
        pool = self._pool(group, tier)
        if slots >= pool.num_slots:
            pool.num_slots = slots
            return Resized(slots)
        evicted: list[Entry] = []
        while pool.used > slots:
            victim = pool.pick_victim()
            if victim is None:
                break
            evicted.append(self._evict(pool, victim))
        keep = max(slots, pool.used)
        high = [(h, rec) for h, rec in pool.recs.items() if rec.slot >= keep]
        pinned = [rec.slot for _, rec in high if rec.pins or rec.state != _COMMITTED]
        if pinned:
            keep = max(keep, max(pinned) + 1)
            high = [(h, rec) for h, rec in high if rec.slot >= keep]
        moved: list[Move] = []
        if pool.next_fresh > keep:
            free = [s for s in pool.freed if s < keep]
            for h, rec in high:
                to = free.pop()
                moved.append(Move(h, group, tier, rec.slot, to))
                rec.slot = to
            pool.freed, pool.next_fresh = free, keep
        pool.num_slots = keep
        return Resized(keep, tuple(evicted), tuple(moved))

    # -- pins and touches -----------------------------------------------------------------------

    def touch(self, chunk_hash: ChunkHash, group: int, tier: str) -> bool:
        pool = self._pool(group, tier)
        rec = pool.recs.get(chunk_hash)
        if rec is None or rec.state != _COMMITTED:
            return False
        pool.policy.touch(chunk_hash)
        pool.cold.pop(chunk_hash, None)
        return True

    def touch_hit(self, hit: Hit) -> None:
        """Count a hit that was looked up with touch=False (e.g. once the load is scheduled)."""
        for g, loads in enumerate(hit.chunks):
            for load in loads:
                if self.touch(load.chunk_hash, g, load.tier):
                    self._pools[(load.tier, g)].counts["hits"] += 1

    def pin(self, chunk_hash: ChunkHash, group: int, tier: str) -> bool:
        """Pin a committed entry (a load in flight); False if it is not there any more."""
        rec = self._pool(group, tier).recs.get(chunk_hash)
        if rec is None or rec.state != _COMMITTED:
            return False
        rec.pins += 1
        return True

    def unpin(self, chunk_hash: ChunkHash, group: int, tier: str) -> None:
        pool = self._pool(group, tier)
        rec = pool.recs.get(chunk_hash)
        if rec is None or rec.pins == 0 or rec.state == _RESERVED:
            raise ConfigError(
                f"unpin of chunk {_short(chunk_hash)} group {group} tier {tier!r}: it is not pinned "
                "(unpin exactly once per successful pin; commit/abort end a reservation)"
            )
        rec.pins -= 1
        if rec.pins == 0 and rec.state == _DOOMED:
            self._drop(pool, chunk_hash, rec)

    def pin_hit(self, hit: Hit) -> bool:
        """Pin every load of `hit`; all or nothing (False: something left since the lookup)."""
        done: list[tuple[ChunkHash, int, str]] = []
        for g, loads in enumerate(hit.chunks):
            for load in loads:
                if not self.pin(load.chunk_hash, g, load.tier):
                    for key in done:
                        self.unpin(*key)
                    return False
                done.append((load.chunk_hash, g, load.tier))
        return True

    def unpin_hit(self, hit: Hit) -> None:
        for g, loads in enumerate(hit.chunks):
            for load in loads:
                self.unpin(load.chunk_hash, g, load.tier)

    # -- storing --------------------------------------------------------------------------------

    def reserve(self, chunk_hash: ChunkHash, group: int, tier: str) -> Reservation:
        """A slot for a payload about to be written; evicts one entry if the pool is full."""
        pool = self._pools.get((tier, group)) or self._pool(group, tier)
        rec = pool.recs.get(chunk_hash)
        if rec is not None:  # held, or a removed copy a load still reads (its slot is not free)
            return _PRESENT if rec.state != _DOOMED else _BUSY
        slot, evicted = self._free_slot(pool)
        if slot is None:
            return _FULL
        pool.recs[chunk_hash] = _Rec(slot, 1, _RESERVED)
        if group in self._anchor_set and self._dependents:
            self._maybe_revive(chunk_hash)
        return Reservation(slot, "reserved", evicted)

    def has_record(self, chunk_hash: ChunkHash, group: int, tier: str) -> bool:
        """Whether `tier` has any record of the chunk: committed, reserved (a write in flight) or
        removed but still pinned by a load. `reserve` gives such a chunk no slot."""
        return chunk_hash in self._pool(group, tier).recs

    def can_take(self, group: int, tier: str, count: int) -> bool:
        """Whether `count` reservations in (tier, group) would all get a slot now: free slots
        plus unpinned committed entries (the only ones `reserve` may evict). Pin what must not be
        evicted first. Stops counting once enough are found: a full pool with few pins answers
        after a few entries, not a scan of every slot."""
        pool = self._pool(group, tier)
        need = count - (pool.num_slots - pool.used)
        if need <= 0:
            return True
        for rec in pool.recs.values():
            if rec.pins == 0 and rec.state == _COMMITTED:
                need -= 1
                if need <= 0:
                    return True
        return False

    def _free_slot(self, pool: _Pool) -> tuple[int | None, tuple[Entry, ...]]:
        slot = pool.alloc()
        if slot is not None:
            return slot, ()
        victim = pool.pick_victim()
        if victim is None:
            pool.counts["full"] += 1
            return None, ()
        entry = self._evict(pool, victim)
        return pool.alloc(), (entry,)

    def _evict(self, pool: _Pool, victim: ChunkHash) -> Entry:
        vrec = pool.recs[victim]
        dead = victim in pool.dead
        entry = Entry(victim, pool.group, pool.tier, vrec.slot, dead)
        pool.counts["dead_evictions" if dead else "evictions"] += 1
        self._drop(pool, victim, vrec)
        if not dead and len(self._dependents) > 1 and pool.group in self._dependents:
            self._orphan(victim, pool.group)
        return entry

    def _orphan(self, chunk_hash: ChunkHash, group: int) -> None:
        # A hit ending at this chunk needed the evicted entry too: the other non-anchor groups'
        # entries there lost the endpoint they were stored for (a sliding chunk may still serve
        # a later endpoint of its window, so it is demoted, not dropped).
        if self._held(chunk_hash, group):
            return
        for g in self._dependents:
            if g != group:
                for p in self._by_group[g]:
                    rec = p.recs.get(chunk_hash)
                    if rec is not None and rec.state == _COMMITTED and chunk_hash not in p.dead:
                        p.cold[chunk_hash] = None

    def victim(self, group: int, tier: str) -> Entry | None:
        """The entry the next `reserve` in a full (tier, group) pool would evict (dead entries,
        then cold ones, then the policy's choice; never a pinned one), or None; nothing changes.
        For a caller that decides what to drop itself (e.g. before a batch of saves)."""
        pool = self._pool(group, tier)
        h = pool.pick_victim()
        if h is None:
            return None
        return Entry(h, group, tier, pool.recs[h].slot, h in pool.dead)

    def demote(self, chunk_hash: ChunkHash, group: int, tier: str | None = None) -> bool:
        """Make a committed entry a first victim (cold: after dead entries, before the policy's
        victims) until a hit or touch warms it; in every tier when `tier` is None. For a caller
        that knows the entry lost its worth (the endpoint it served is gone). False: not held."""
        found = False
        for pool in self._by_group[group] if tier is None else [self._pool(group, tier)]:
            rec = pool.recs.get(chunk_hash)
            if rec is not None and rec.state == _COMMITTED:
                pool.cold[chunk_hash] = None
                found = True
        return found

    def commit(self, chunk_hash: ChunkHash, group: int, tier: str, *, cold: bool = False) -> None:
        """The payload is written: the entry becomes visible to lookup and evictable.

        cold=True: as `put(cold=True)`, evicted before any warm entry until a touch warms it."""
        pool = self._pool(group, tier)
        rec = pool.recs.get(chunk_hash)
        if rec is None or rec.state != _RESERVED:
            raise ConfigError(
                f"commit of chunk {_short(chunk_hash)} group {group} tier {tier!r} without a "
                "reservation; call reserve first and commit once"
            )
        rec.state = _COMMITTED
        rec.pins -= 1
        pool.policy.insert(chunk_hash)
        pool.counts["commits"] += 1
        if cold:
            pool.cold[chunk_hash] = None
        else:
            pool.counts["warm_commits"] += 1
        if self._dependents and group not in self._anchor_set and not self._anchored(chunk_hash):
            pool.dead[chunk_hash] = None
        if self.listener is not None:
            self.listener(tier, group, chunk_hash, True)

    def abort(self, chunk_hash: ChunkHash, group: int, tier: str) -> None:
        """The write failed or was cancelled: free the reserved slot."""
        pool = self._pool(group, tier)
        rec = pool.recs.get(chunk_hash)
        if rec is None or rec.state != _RESERVED:
            raise ConfigError(
                f"abort of chunk {_short(chunk_hash)} group {group} tier {tier!r} without a "
                "reservation"
            )
        pool.counts["aborts"] += 1
        self._drop(pool, chunk_hash, rec)

    def put(self, chunk_hash: ChunkHash, group: int, tier: str, *, cold: bool = False) -> Reservation:
        """reserve + commit in one step, for callers with nothing to write in between (replay).

        cold=True: the entry is unlikely to be read (e.g. a sliding chunk in the middle of a
        prompt): it is evicted after dead entries and before the policy's victims, until a
        touch warms it. It costs nothing while the pool has room."""
        pool = self._pools.get((tier, group)) or self._pool(group, tier)
        recs = pool.recs
        rec = recs.get(chunk_hash)
        if rec is not None:
            return _PRESENT if rec.state != _DOOMED else _BUSY
        slot, evicted = self._free_slot(pool)
        if slot is None:
            return _FULL
        recs[chunk_hash] = _Rec(slot, 0, _COMMITTED)
        pool.policy.insert(chunk_hash)
        pool.counts["commits"] += 1
        if cold:
            pool.cold[chunk_hash] = None
        else:
            pool.counts["warm_commits"] += 1
        if self._dependents:
            if group in self._anchor_set:
                self._maybe_revive(chunk_hash)
            elif not self._anchored(chunk_hash):
                pool.dead[chunk_hash] = None
        if self.listener is not None:
            self.listener(tier, group, chunk_hash, True)
        return Reservation(slot, "reserved", evicted)

    def touch_all(self, chunk_hash: ChunkHash, group: int) -> bool:
        """Touch every committed copy of (chunk_hash, group); False if no tier holds one."""
        found = False
        for pool in self._by_group[group]:
            rec = pool.recs.get(chunk_hash)
            if rec is not None and rec.state == _COMMITTED:
                pool.policy.touch(chunk_hash)
                if pool.cold:
                    pool.cold.pop(chunk_hash, None)
                found = True
        return found

    def remove(self, chunk_hash: ChunkHash, group: int, tier: str) -> bool:
        """Drop a committed entry (corrupt payload, tier error). Pinned: hidden now, freed at unpin."""
        pool = self._pool(group, tier)
        rec = pool.recs.get(chunk_hash)
        if rec is None or rec.state != _COMMITTED:
            return False
        pool.counts["removes"] += 1
        if rec.pins:
            rec.state = _DOOMED
            if self.listener is not None:
                self.listener(tier, group, chunk_hash, False)
            pool.policy.remove(chunk_hash)
            pool.dead.pop(chunk_hash, None)
            pool.cold.pop(chunk_hash, None)
            self._after_anchor_loss(chunk_hash, group)
        else:
            self._drop(pool, chunk_hash, rec)
        return True

    def rebuild(self, entries: Iterable[tuple[ChunkHash, int, str, int]]) -> list[Entry]:
        """Commit entries found in a tier after a restart, at their slots, in the given order
        (oldest first: the policy sees them as inserted in that order).

        Returns the entries refused (slot out of range or taken, key already held, unknown
        tier or group): the caller frees them in the tier.

        Under a learned share a pool's slots moved while the tier ran, and a new index starts
        from its first split: a slot is in range below `max_slots` (the tier's layout), the pool
        grows to hold it, and the caller calls `fit(tier)` next to bring the pools back within
        the tier's bytes (with the capacity unchanged every entry fits: only moves).
        """
        rejected: list[Entry] = []
        touched: set[_Pool] = set()
        taken: dict[_Pool, set[int]] = {}
        for chunk_hash, group, tier, slot in entries:
            pool = self._pools.get((tier, group))
            if pool is None:
                rejected.append(Entry(chunk_hash, group, tier, slot))
                continue
            if pool not in taken:
                taken[pool] = {r.slot for r in pool.recs.values()}
            bound = pool.num_slots if tier not in self._learner_of else self.max_slots(group, tier)
            if not (0 <= slot < bound) or slot in taken[pool] or chunk_hash in pool.recs:
                rejected.append(Entry(chunk_hash, group, tier, slot))
                continue
            taken[pool].add(slot)
            if slot >= pool.num_slots:  # a learned pool held more before the restart: `fit` next
                pool.num_slots = slot + 1
            pool.recs[chunk_hash] = _Rec(slot, 0, _COMMITTED)
            pool.policy.insert(chunk_hash)
            touched.add(pool)
            if self.listener is not None:
                self.listener(tier, group, chunk_hash, True)
        for pool in touched:
            # every slot not held is free again; a fresh-slot counter cannot express holes
            held = {r.slot for r in pool.recs.values()}
            pool.freed = [s for s in range(pool.num_slots - 1, -1, -1) if s not in held]
            pool.next_fresh = pool.num_slots
        for pool in touched:
            if pool.group in self._dependents:
                for h in pool.recs:
                    if not self._anchored(h):
                        pool.dead[h] = None
        return rejected

    # -- internals ------------------------------------------------------------------------------

    def _drop(self, pool: _Pool, chunk_hash: ChunkHash, rec: _Rec) -> None:
        del pool.recs[chunk_hash]
        if rec.state == _COMMITTED:
            pool.policy.remove(chunk_hash)
            if self.listener is not None:
                self.listener(pool.tier, pool.group, chunk_hash, False)
        pool.dead.pop(chunk_hash, None)
        pool.cold.pop(chunk_hash, None)
        pool.freed.append(rec.slot)
        if rec.state != _DOOMED:  # a doomed entry already counted as lost
            self._after_anchor_loss(chunk_hash, pool.group)

    def _held(self, chunk_hash: ChunkHash, group: int) -> bool:
        for pool in self._by_group[group]:
            rec = pool.recs.get(chunk_hash)
            if rec is not None and rec.state != _DOOMED:
                return True
        return False

    def _anchored(self, chunk_hash: ChunkHash) -> bool:
        return all(self._held(chunk_hash, a) for a in self.anchors)

    def _after_anchor_loss(self, chunk_hash: ChunkHash, group: int) -> None:
        if not self._dependents or group not in self._anchor_set:
            return
        holders = [pool for g in self._dependents for pool in self._by_group[g]
                   if (rec := pool.recs.get(chunk_hash)) is not None and rec.state == _COMMITTED]
        if holders and not self._held(chunk_hash, group):
            for pool in holders:
                pool.dead[chunk_hash] = None

    def _maybe_revive(self, chunk_hash: ChunkHash) -> None:
        dead_in = [pool for g in self._dependents for pool in self._by_group[g] if chunk_hash in pool.dead]
        if dead_in and self._anchored(chunk_hash):
            for pool in dead_in:
                del pool.dead[chunk_hash]

    # -- accounting -----------------------------------------------------------------------------

    def stats(self) -> dict[str, object]:
        """Plain counters: per tier and group slots, use, pins, dead and event counts."""
        tiers: dict[str, object] = {}
        for tier in self.tiers:
            groups: dict[str, object] = {}
            for g, pools in enumerate(self._by_group):
                for pool in pools:
                    if pool.tier != tier:
                        continue
                    groups[self.plan.groups[g].name] = {
                        "group": g,
                        "slots": pool.num_slots,
                        "slot_bytes": pool.slot_bytes,
                        "used": pool.used,
                        "committed": sum(1 for r in pool.recs.values() if r.state == _COMMITTED),
                        "pinned": sum(1 for r in pool.recs.values() if r.pins),
                        "dead": len(pool.dead),
                        "cold": len(pool.cold),
                        **pool.counts,
                    }
            tiers[tier] = {"capacity_bytes": self.capacities[tier], "groups": groups}
        return {**self.counts, "tiers": tiers}

    def counters(self, group: int, tier: str) -> dict[str, int]:
        """The event counters of one pool (a live view; copy it to keep a snapshot)."""
        return self._pool(group, tier).counts

    def used(self, group: int, tier: str) -> int:
        return self._pool(group, tier).used


def _short(chunk_hash: ChunkHash) -> str:
    return chunk_hash.hex()[:12] if isinstance(chunk_hash, bytes) else str(chunk_hash)
