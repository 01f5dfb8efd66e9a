"""Which tiers take a `prepare_store` call's new chunks: vLLM's all-or-nothing rule on kvtier's index.

vLLM's contract for an offloading manager's prepare_store, kept to the letter (its own CPU manager
does the same):
- every given chunk is protected from eviction for the whole call: a chunk already held is never
  the victim that makes room for the others (`protect`: pinned in each tier that holds it, and
  unpinned when the call returns; a chunk being stored stays reserved until its store completes);
- all or nothing per tier: a tier that cannot take every new chunk of the call (per group: free
  slots + unpinned entries not given) takes none of them and evicts nothing (`plan_store`).
  Storing a part would evict chunks a lookup just answered HIT for and keep a prefix with holes;
- when some chunk is new and no tier can take the call's new chunks, the call is refused
  (`StorePlan.refused`): vLLM counts an allocation failure and offers the keys again at a later
  step (when pins are released), instead of marking them stored.
Write-through: a chunk is reserved in every tier that takes the call's chunks (`reserve`).

Pure: no torch, no vLLM. The engine's key of a chunk (vLLM's OffloadKey) is opaque here; the
manager turns the answer into vLLM's PrepareStoreOutput.
"""

from __future__ import annotations

from collections.abc import Collection, Container, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from kvtier.index.index import Entry, Index

Chunk = tuple[bytes, int]  # (chunk hash, plan group)
Todo = list[tuple[Hashable, Chunk]]  # (engine key, chunk), in call order


@dataclass(frozen=True, slots=True)
class StorePlan:
    """`new[tier]`: the call's chunks `tier` has no record of, in call order; `taking`: the tiers
    that take all of theirs; `skipped[(tier, group)]`: new chunks of a tier too full to take them all."""

    new: dict[str, Todo]
    taking: tuple[str, ...]
    skipped: dict[tuple[str, int], int]

    @property
    def refused(self) -> bool:
        """Some chunk is new and no tier takes the call's new chunks: nothing is reserved."""
        return any(self.new.values()) and not self.taking


def chunks_to_store(splits: Iterable[tuple[Hashable, Chunk | None]], pending: Container[Hashable]) -> Todo:
    """The call's keys worth planning, in call order, from (key, its chunk or None): a chunk
    known to the plan (not None), not being stored already (in `pending`: reserved until its
    store completes), each chunk once (two keys of one chunk: the first)."""
    todo: Todo = []
    seen: set[Chunk] = set()
    for key, chunk in splits:
        if chunk is None or key in pending or chunk in seen:
            continue
        seen.add(chunk)
        todo.append((key, chunk))
    return todo


@contextmanager
def protect(index: Index, chunks: Iterable[Chunk]) -> Iterator[None]:
    """Every given chunk a tier holds is pinned there until the block ends (committed entries;
    reserved ones are pinned already), so no reservation of the call evicts it."""
    pinned = [(h, g, tier) for h, g in chunks for tier, _ in index.where(h, g) if index.pin(h, g, tier)]
    try:
        yield
    finally:
        for h, g, tier in pinned:
            index.unpin(h, g, tier)


def plan_store(index: Index, tiers: Sequence[str], todo: Todo, cold: Container[Hashable] = ()) -> StorePlan:
    """Per tier (in `tiers` order), the chunks of `todo` it lacks, and whether it can take them
    all now (`Index.can_take` per group). Keys in `cold` (the placement's) are planned in the
    tiers after the first only. Reserves nothing: call inside `protect`."""
    new: dict[str, Todo] = {t: [] for t in tiers}
    for key, chunk in todo:
        for tier in tiers[1:] if key in cold else tiers:
            if not index.has_record(*chunk, tier):
                new[tier].append((key, chunk))
    taking: list[str] = []
    skipped: dict[tuple[str, int], int] = {}
    for tier in tiers:
        if not new[tier]:
            continue
        per_group: dict[int, int] = {}
        for _, (_, g) in new[tier]:
            per_group[g] = per_group.get(g, 0) + 1
        if all(index.can_take(g, tier, n) for g, n in per_group.items()):
            taking.append(tier)
        else:
            skipped.update(((tier, g), n) for g, n in per_group.items())
    return StorePlan(new, tuple(taking), skipped)


def reserve(index: Index, plan: StorePlan) -> Iterator[tuple[Hashable, str, int, Collection[Entry]]]:
    """Reserve every new chunk in every tier that takes the call, in tier order: yields (key, tier,
    slot, what that reservation evicted) as each happens, since whether an evicted chunk left its
    last tier depends on the reservations before it (the caller handles each before the next)."""
    for tier in plan.taking:
        for key, (h, g) in plan.new[tier]:
            r = index.reserve(h, g, tier)
            assert r.slot is not None, f"can_take promised {tier} room for every key ({r.status})"
            yield key, tier, r.slot, r.evicted
