"""The store: lookup / load / save of chunk payloads across tiers, the facade integrations use.

Tier order is fastest first: `cpu` -> `disk` -> shared key-addressed tiers (`redis`). The
index (`kvtier.index.index`) knows which (chunk hash, group) sits in which cpu/disk slot; shared
tiers are asked at lookup, once per prompt, with one batched `exists_many` for the chunks the
local index lacks.

- lookup(chunk_hashes, prompt_tokens) -> Hit: the largest T every cacheable group can
  restore (plan rules), and per group the chunks to load, each from the first tier holding it.
- load(hit, buffers) -> tokens restored. Each payload is read into the caller's buffer
  `buffers[(group, chunk_index)]` and checked (disk and redis: header + checksum). A missing or
  bad copy is dropped from its tier and the index (counted); the next tier's copy is tried, and
  without one the hit shrinks to the largest T every group can still restore from what was
  read, so wrong KV is never used.
  A chunk read from disk/redis is promoted (copied up to cpu) when a cpu tier exists.
- save(chunk_hashes, payloads, num_tokens): stores only what `plan.store_chunks` says some hit
  reads, only the leading chunks the admission policy admits, skips chunks already held. Of
  those, the placement (default "hits": `kvtier.index.placement.HitsLand`) says per group which
  are *warm* (the first tier), *cold* (only a later tier: disk or a shared tier; not stored
  when there is none) or skipped: full/MLA chunks are always warm, a sliding window or a state
  checkpoint only where hits land (docs/admission.md). `placement="every"` stores every chunk
  warm. A hit still needs every cacheable group's entry at its T (lookup, load), so a skipped
  entry only makes a hit shorter, never partial.
  Write-through, the one write policy (docs/store.md, "Write policy"): a save goes to every slot
  tier (cold entries: every one after the first), so the disk holds each saved chunk at once (a
  restart keeps it) and a cpu eviction is a drop, no I/O. Shared tiers get the chunks they lack
  at save time, in one batch, so other processes see them at once.
  A failed write (ENOSPC, read-only directory, server down) is a counted failure, never an
  exception: inference goes on.

Share (`share="auto"`): with placement "hits" the learned share (`Index(share="learned")`):
once per saved request `Index.observe` may resize the groups' pools toward equal lifetimes of
their warm entries; the store frees what a shrink evicted, moves what it kept below the pool's
new end (`SlotTier.move`, verified) and releases the slots past it (`SlotTier.release`), so what
a tier commits stays within its bytes while its layout spans the most slots each group may get.
A page-locked cpu tier keeps the fixed `placement_share` (docs/admission.md, "The learned share
in the Store").

Eviction (`policy="auto"`, `kvtier.index.tuning.default_policy`): by worth (recency plus the
compute an entry saves) where placement "hits" places a group that is not full/MLA, its weight
tuned from recent saves by shadow replays in a child process (`self.tuner`, stopped by `close`
without waiting for it); LRU elsewhere. docs/store.md, "Eviction".

Restart: a disk tier's slots are listed and fed to `Index.rebuild`, so a restarted process
keeps its cache (under a learned share `Index.fit` then brings the pools, which restart at their
first split, back within the tier's bytes, keeping every entry that fits). One lock serializes
the calls, I/O included (the index is not thread-safe):
the engines we serve call the store from one thread per process, and the single lock keeps
promotion ordering simple.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError
from kvtier.index.index import Index, Load, Move, Resized
from kvtier.index.placement import COLD, SKIP, WARM, HitsLand
from kvtier.index.placement import PLACED_KINDS, learned_start
from kvtier.index.placement import placement_share as _placement_share
from kvtier.index.policies import POLICIES
from kvtier.index.tuning import WorthTuner, default_policy, worth_index, worth_options
from kvtier.core.keys import Namespace, chunk_hashes as _chunk_hashes
from kvtier.store.metrics import StoreMetrics, metrics_dict, register_prometheus, tier_counters
from kvtier.store.integrity import load_secret
from kvtier.store.payload import DTYPE_CODES, ChunkHeader, as_bytes_view, chunk_header
from kvtier.core.plan import Plan
from kvtier.store.tiers.base import Tier, TierLayout
from kvtier.store.tiers.cpu import as_u8
from kvtier.store.tiers.factory import TierOptions, make_tier, tier_layout
from kvtier.store.io import TierIO

log = logging.getLogger("kvtier.store.store")

Buffers = Mapping[tuple[int, int], torch.Tensor] | Callable[[int, int], "torch.Tensor | None"]
SHARED_SLOT = -1  # the slot of a Load from a key-addressed tier
PLACEMENTS = ("hits", "every")


# the Store places every kind but full/MLA (sliding windows, chunked-local spans, state checkpoints)


def placement_share(plan: Plan) -> str | dict[str, float]:
    """The share that goes with placement "hits" in the Store (`index.placement.placement_share`)."""
    return _placement_share(plan, PLACED_KINDS)


def make_placement(plan: Plan, placement: object) -> object | None:
    """The placement object for `placement` ("hits", "every", or an object with
    `admit(request_chunks, group, n)`); None stores every chunk warm."""
    if placement == "every":
        return None
    if placement == "hits":
        # one full-attention group (or none but state/sliding ones with nothing to share): a
        # HitsLand still finds the endpoints, but only non-anchor groups have anything to skip
        if all(gp.kind in ("full", "mla") for gp in plan.cacheable_groups):
            return None
        return HitsLand(plan)
    if isinstance(placement, str) or not callable(getattr(placement, "admit", None)):
        raise ConfigError(f"placement={placement!r} is unknown; use one of {', '.join(PLACEMENTS)} or an "
                          "object with admit(request_chunks, group, n) (kvtier.index.placement.HitsLand)")
    return placement


def resolve_share(plan: Plan, share: str | Mapping[str, float], placement: object,
                  pinned: bool = False) -> str | Mapping[str, float]:
    """share="auto": "learned" (`kvtier.index.share.LearnedShare`) with a placement that stores
    only where hits land, `placement_share(plan)` (the fixed half/half rule) there when the cpu
    tier is page-locked (`pinned`: a learned share lays the tier out for the most slots each
    group may get, and a page-locked slab is committed whole), "proportional" with placement
    "every"."""
    if share != "auto":
        return share
    if placement in (None, "every"):
        return "proportional"
    return placement_share(plan) if pinned else "learned"


@dataclass(frozen=True, slots=True)
class Hit:
    """What a prompt can restore. `chunks[g]`: the loads of group g (chunk_index, tier, slot)."""

    tokens: int
    chunks: tuple[tuple[Load, ...], ...]
    chunk_hashes: tuple[bytes, ...]
    prompt_tokens: int

    def buffers_needed(self) -> list[tuple[int, int]]:
        return [(g, ld.chunk_index) for g, loads in enumerate(self.chunks) for ld in loads]


def _getter(buffers: Buffers) -> Callable[[tuple[int, int]], object]:
    if isinstance(buffers, Mapping):
        return buffers.get
    if callable(buffers):
        return lambda key: buffers(*key)
    raise ConfigError(f"buffers must be a mapping (group, chunk_index) -> tensor or a callable, not {type(buffers).__name__}")


class Store(TierIO):
    """The tiered chunk store of one (plan, namespace). See the module docstring."""

    def __init__(
        self,
        plan: Plan,
        namespace: Namespace,
        *,
        cpu_bytes: int | None = None,
        disk_dir: str | os.PathLike[str] | None = None,
        disk_bytes: int | None = None,
        shared: Sequence[Tier] = (),
        policy: str = "auto",
        share: str | Mapping[str, float] = "auto",
        admission: object | str | None = None,
        placement: object | str = "hits",
        promote: bool = True,
        fsync: str = "never",
        pin_memory: bool | None = None,
        secret: bytes | None = None,
        accept_legacy_macs: bool = True,
    ) -> None:
        """`secret`: the tenant's key for the disk tier's payload MACs (integrity.Keyed); None reads
        `KVTIER_SECRET_FILE` / `KVTIER_SECRET`. A shared tier takes its own (`RedisTier(keyed=)`).
        `accept_legacy_macs=False`: the disk tier restores only current-format MACs (Keyed).
        `admission`: how many leading chunks of a save are stored at all (kvtier.index.admission);
        `placement`: of those, per group, which are warm, cold or skipped ("hits", "every", or a
        HitsLand-like object); `share="auto"`: the share that goes with the placement
        ("learned" with "hits": `kvtier.index.share.LearnedShare`, pools resized once per saved
        request, but `placement_share`'s fixed one when the cpu tier is page-locked (`pin_memory`
        True, or None where CUDA is present); "proportional" with "every").
        `policy`: eviction within a pool; "auto" (`kvtier.index.tuning.default_policy`): "worth"
        under placement "hits" with a group that is not full/MLA, else "lru"; "worth" tunes its
        weight in a child process (`self.tuner`), "worth:w=W" fixes it; or lru, fifo, arc, s3fifo."""
        self.plan = plan
        self.namespace = namespace
        self.ns_id = namespace.id
        if (disk_dir is None) != (disk_bytes is None):
            raise ConfigError("give both disk_dir and disk_bytes for a disk tier, or neither")
        capacities: dict[str, int] = {}
        if cpu_bytes is not None:
            capacities["cpu"] = cpu_bytes
        if disk_bytes is not None:
            capacities["disk"] = disk_bytes
        for t in shared:
            if not getattr(t, "shared", False):
                raise ConfigError(f"tier {t.name!r} is slot-addressed; pass cpu_bytes/disk_dir instead of shared=")
        if not capacities and not shared:
            raise ConfigError("the store has no tier; give cpu_bytes, disk_dir + disk_bytes, or shared=[...]")
        if isinstance(admission, str):
            from kvtier.index.admission import make_admission

            admission = make_admission(admission)  # unknown names raise ConfigError here
        if admission is not None and not callable(getattr(admission, "admit", None)):
            raise ConfigError(f"admission {admission!r} has no admit(chunk_hashes) method; use kvtier.index.admission.make_admission")
        self.placement = make_placement(plan, placement)
        pinned = "cpu" in capacities and (torch.cuda.is_available() if pin_memory is None else bool(pin_memory))
        if share == "learned" and pinned:
            raise ConfigError("share='learned' lays the cpu tier out for the most slots each group may get, "
                              "and a page-locked slab is committed whole; pass pin_memory=False, or a fixed "
                              "share ('auto' keeps the fixed one with a pinned cpu tier)")
        if share == "auto" and pinned and self.placement is not None:
            log.info("store: a page-locked cpu tier keeps the fixed share (placement_share), not the learned "
                     "one: its slabs are committed whole, so the learned share's layout would lock more "
                     "than cpu_bytes (pin_memory=False runs the learned share)")
        share = resolve_share(plan, share, self.placement, pinned)
        # the learned share starts from the placement's fixed split, as vLLM's manager does: a
        # short run is no worse than that (from proportional it must first move the bytes)
        start = learned_start(plan, share, self.placement, capacities)
        self.tuner: WorthTuner | None = None  # policy worth, tuned: its weight is tuner.weight.w
        self.index: Index | None = None
        if capacities:
            self.index, self.tuner = self._new_index(policy, capacities, share, start)
        self.m = StoreMetrics()
        self.slot_tiers: dict[str, Tier] = {}
        for name in capacities:
            layout = self._layout(name)
            if name == "cpu":
                options = TierOptions(pin_memory=pin_memory)
            else:
                assert disk_dir is not None
                keyed = load_secret(secret, accept_legacy_macs=accept_legacy_macs,  # integrity.py, once
                                    missing=f"accept_legacy_macs={accept_legacy_macs!r} needs a secret: pass "
                                            "secret=..., or set KVTIER_SECRET_FILE / KVTIER_SECRET")
                options = TierOptions(namespace_id=self.ns_id, keyed=keyed, root=disk_dir, fsync=fsync)
            self.slot_tiers[name] = make_tier(name, layout, options)  # tiers/factory.py
        self.shared: tuple[Tier, ...] = tuple(shared)
        self.admission = admission
        self.promote = promote
        self._lock = threading.RLock()
        self._dtypes = [gp.group.dtype if gp.group.dtype in DTYPE_CODES else "uint8" for gp in plan.groups]
        self.rebuilt = self._rebuild()

    # -- construction helpers -------------------------------------------------------------
    def _new_index(self, policy: object, capacities: dict[str, int], share: str | Mapping[str, float],
                   start: str | Mapping[str, float] | None) -> tuple[Index, WorthTuner | None]:
        """The index under `policy` ("auto" resolved by the placement), and worth's tuner."""
        name = default_policy(self.plan, self.placement) if policy == "auto" else policy
        if isinstance(name, str) and name.partition(":")[0] == "worth":
            opts = worth_options(name)  # bad options: ConfigError naming them
            w = opts.get("w")
            # cold_in_first left False: with one tier a cold chunk is not stored (`save`), so the
            # tuner's shadows do not store it either
            return worth_index(self.plan, capacities, share=share, placement=self.placement, start=start,
                               w=None if w is None else float(w), runner="process",
                               **{k: int(v) for k, v in opts.items() if k in ("max_chunks", "period")})
        if isinstance(name, str) and name not in POLICIES:
            raise ConfigError(f"unknown eviction policy {policy!r}; use one of: auto, worth, worth:w=W, "
                              f"{', '.join(POLICIES)}")
        return Index(self.plan, capacities, policy=name, share=share, start=start), None  # type: ignore[arg-type]

    def _layout(self, tier: str) -> TierLayout:
        """Each group's most slots (`Index.max_slots`): a pool's slots, or under a learned share
        the most it may get (address space; pages and blocks are committed where written)."""
        index = self.index
        assert index is not None
        return tier_layout(self.plan, lambda g: index.max_slots(g, tier))  # tiers/factory.py

    def header(self, chunk_hash: bytes, group: int, chunk_index: int) -> ChunkHeader:
        """The header a (chunk, group) payload of this store carries (unsealed; payload.chunk_header)."""
        c = self.plan.chunk_tokens
        return chunk_header(self.plan, self.ns_id, chunk_hash, group, chunk_index * c, (chunk_index + 1) * c,
                            self._dtypes[group])

    def _rebuild(self) -> int:
        """Feed what persistent slot tiers hold to the index; free what it refuses."""
        count = 0
        for name, tier in self.slot_tiers.items():
            if not tier.persistent or self.index is None:
                continue
            c = self.plan.chunk_tokens
            entries, bad = [], []
            for g, slot, h in tier.list():
                gp = self.plan.groups[g]
                if (not gp.cacheable or h.payload_bytes != gp.chunk_bytes or h.token_end - h.token_start != c
                        or h.token_start % c or h.dtype != self._dtypes[g]):
                    bad.append((g, slot))
                    continue
                entries.append((h.chunk_hash, g, name, slot))
            refused = self.index.rebuild(entries)  # e.g. a key found twice: keep the first
            self.m.add("corrupt_dropped", tier.corrupt_dropped + len(bad))
            self.m.add("rebuild_refused", len(refused))
            for g, slot in [*bad, *((e.group, e.slot) for e in refused)]:
                tier.free(g, slot)
            count += len(entries) - len(refused)
            if self.index.learners:
                count -= self._fit(name)
        return count

    def _fit(self, tier: str) -> int:
        """A learned share's pools restart from their first split, the slots found are where the
        last run's share put them: `Index.fit` keeps each entry the tier's bytes hold (with the
        capacity unchanged, every one; moved down where a pool is smaller now), and the blocks
        past every pool's end are given back before the store serves. Returns the entries dropped."""
        index = self.index
        assert index is not None
        before = {(tier, gp.index): index.slots(gp.index, tier) for gp in self.plan.cacheable_groups}
        dropped = self._apply_resize(index.fit(tier), before)
        for (_, g), was in before.items():  # the pools that shrank were released just now
            if index.slots(g, tier) >= was:
                self._release(tier, g)
        return dropped

    # -- the learned share (share="learned") -------------------------------------------------
    def _observe(self) -> None:
        """One request was saved: let the learned share resize pools (`Index.observe`) and apply
        it to the slot tiers: evicted entries freed, kept ones moved below a shrunk pool's end,
        and the slots past that end released, so committed bytes stay within each tier's.

        A move never races a load: every store call holds the store lock throughout, a load pins
        its entries and unpins them before it lets go, and this runs under the lock after the
        save's writes finished, so while pools resize no entry is pinned or reserved
        (`Index.resize` would neither move nor evict one that were) and no reader is in a slot
        whose bytes move or whose pages are released."""
        index = self.index
        if index is None or not index.learners:
            return
        before = {(t, gp.index): index.slots(gp.index, t) for t in self.slot_tiers
                  for gp in self.plan.cacheable_groups}
        self._apply_resize(index.observe(), before, io_moves=False)

    def _tune(self, chunks: Sequence[bytes], num_tokens: int) -> None:
        """One request was saved: the worth tuner remembers it (and tunes every period of chunks
        after the first eviction in the first tier; `kvtier.index.tuning`)."""
        tuner, index = self.tuner, self.index
        if tuner is None or index is None:
            return
        first = index.tiers[0]
        evicted = tuner.started or any(index.counters(gp.index, first)["evictions"]
                                       for gp in self.plan.cacheable_groups)
        tuner.observe(chunks, num_tokens, num_tokens, evicted)
        self._count_tunings()

    def _count_tunings(self) -> None:
        """Bring the store's worth_tunings* counters up to the tuner's."""
        assert self.tuner is not None
        for name, value in self.tuner.counts().items():
            self.m.add(name, value - self.m.totals[name])

    def _apply_resize(self, resized: Resized, before: dict[tuple[str, int], int], io_moves: bool = True) -> int:
        """Free what a resize evicted, move what it relocated, release the slots past the end of
        each pool that shrank since `before`; returns the entries dropped (counted).
        `io_moves=False` (a resize while serving): an entry relocated in a tier other than cpu is
        dropped, not moved: a disk move is a read and a write, and one resize may relocate 1/32
        of the tier inside a save; at a restart (`_fit`) they are moved."""
        index = self.index
        assert index is not None
        for e in resized.evicted:
            self.slot_tiers[e.tier].free(e.group, e.slot)
        self.m.add("share_evicted", len(resized.evicted))
        failed = 0
        for mv in resized.moved:
            if not io_moves and mv.tier != "cpu":
                tier = self.slot_tiers[mv.tier]
                tier.free(mv.group, mv.from_slot)
                tier.free(mv.group, mv.to_slot)
                index.remove(mv.chunk_hash, mv.group, mv.tier)
                self.m.add("share_dropped")
                continue
            if self._move(mv):
                self.m.add("share_moved")
            else:  # src held nothing valid, or the write failed: dst holds nothing either
                index.remove(mv.chunk_hash, mv.group, mv.tier)
                failed += 1
        self.m.add("share_move_failed", failed)
        for (t, g), was in before.items():
            now = index.slots(g, t)
            if now != was:
                self.m.add("share_resizes")
            if now < was:
                self._release(t, g)
        return len(resized.evicted) + failed

    def _move(self, mv: Move) -> bool:
        """Copy a moved entry's payload to its new slot (`SlotTier.move`, verified as a read is).
        The index knows a chunk by its hash, not its position, so the chunk index of the header
        expected at `from_slot` is taken from the header the tier holds there (`tier.header`);
        the tier then checks that header (namespace, hash, group, span, size, dtype) and the
        payload against the expected one, exactly as a load would."""
        tier = self.slot_tiers[mv.tier]
        try:
            stored = tier.header(mv.group, mv.from_slot)  # type: ignore[attr-defined]
            if stored is None:  # nothing there: the entry is dropped
                tier.free(mv.group, mv.to_slot)
                return False
            expected = self.header(mv.chunk_hash, mv.group, stored.token_start // self.plan.chunk_tokens)  # type: ignore[arg-type]
            return tier.move(mv.group, mv.from_slot, mv.to_slot, expected)  # type: ignore[attr-defined]
        except OSError as exc:  # a tier failing under us: the entry is dropped, counted
            log.warning("tier %s: move of group %d slot %d failed: %s", mv.tier, mv.group, mv.from_slot, exc)
            return False

    def _release(self, tier: str, group: int) -> None:
        """Give back the memory or disk blocks of `group`'s slots past its pool's end."""
        assert self.index is not None
        self.m.add("share_released_bytes", self.slot_tiers[tier].release(group, self.index.slots(group, tier)))  # type: ignore[attr-defined]

    # -- lookup ---------------------------------------------------------------------------
    def lookup(self, chunk_hashes: Sequence[bytes], prompt_tokens: int) -> Hit:
        hashes = tuple(chunk_hashes)
        with self._lock:
            self.m.add("lookups")
            self.m.add("lookup_tokens", prompt_tokens)
            in_shared = self._shared_presence(hashes, prompt_tokens) if self.shared else {}
            if not in_shared and self.index is not None:
                ih = self.index.lookup(hashes, prompt_tokens)
                hit = Hit(ih.tokens, ih.chunks, hashes, prompt_tokens)
            else:
                hit = self._lookup_with_shared(hashes, prompt_tokens, in_shared)
            if hit.tokens:
                self.m.add("hit_lookups")
                self.m.add("hit_tokens", hit.tokens)
            return hit

    def lookup_tokens(self, token_ids: Sequence[int], extra_keys: Sequence[object] = ()) -> Hit:
        """`lookup` from token ids (hashes with kvtier.core.keys in this store's namespace)."""
        return self.lookup(self.hashes(token_ids, extra_keys), len(token_ids))

    def hashes(self, token_ids: Sequence[int], extra_keys: Sequence[object] = ()) -> list[bytes]:
        return _chunk_hashes(self.plan, self.namespace, token_ids, extra_keys)

    def _local(self, h: bytes, g: int) -> tuple[str, int] | None:
        if self.index is None:
            return None
        where = self.index.where(h, g)
        return where[0] if where else None

    def _shared_presence(self, hashes: tuple[bytes, ...], prompt_tokens: int) -> dict[tuple[int, int], Tier]:
        """(group, chunk) -> shared tier, for chunks the local index lacks; one query per tier."""
        n = min(len(hashes), self.plan.max_hit_tokens(prompt_tokens) // self.plan.chunk_tokens)
        wanted = [(gp.index, i) for gp in self.plan.cacheable_groups for i in range(n)
                  if self._local(hashes[i], gp.index) is None]
        found: dict[tuple[int, int], Tier] = {}
        for tier in self.shared:
            ask = [k for k in wanted if k not in found]
            if not ask:
                break
            self.m.add("shared_exists_queries")
            try:
                present = tier.exists_many([self.header(hashes[i], g, i) for g, i in ask])
            except Exception as exc:  # a shared tier going away is a miss, not an error
                log.warning("shared tier %s: exists_many failed: %s", tier.name, exc)
                continue
            for k, yes in zip(ask, present):
                if yes:
                    found[k] = tier
        return found

    def _lookup_with_shared(self, hashes: tuple[bytes, ...], prompt_tokens: int,
                            in_shared: dict[tuple[int, int], Tier]) -> Hit:
        def has(g: int, i: int) -> bool:
            return i < len(hashes) and ((g, i) in in_shared or self._local(hashes[i], g) is not None)

        tokens = self.plan.best_hit(prompt_tokens, has)
        chunks: list[tuple[Load, ...]] = []
        for gp in self.plan.groups:
            loads = []
            for i in self.plan.chunks_for_hit(gp.index, tokens):
                where = self._local(hashes[i], gp.index)
                if where is not None:
                    assert self.index is not None
                    self.index.touch(hashes[i], gp.index, where[0])
                    loads.append(Load(i, hashes[i], where[0], where[1]))
                else:
                    loads.append(Load(i, hashes[i], in_shared[(gp.index, i)].name, SHARED_SLOT))
            chunks.append(tuple(loads))
        return Hit(tokens, tuple(chunks), hashes, prompt_tokens)

    # -- load -----------------------------------------------------------------------------
    def load(self, hit: Hit, buffers: Buffers) -> int:
        """Fill the caller's buffers for `hit`; returns the tokens every group restored."""
        if hit.tokens == 0:
            return 0
        get = _getter(buffers)
        ok: set[tuple[int, int]] = set()
        bad: set[tuple[int, int]] = set()
        with self._lock:
            # pin what the hit names, so a promotion's eviction cannot push out a chunk this
            # same load still has to read
            pinned = [(ld.chunk_hash, g, ld.tier) for g, loads in enumerate(hit.chunks) for ld in loads
                      if ld.tier in self.slot_tiers and self.index is not None
                      and self.index.pin(ld.chunk_hash, g, ld.tier)]
            try:
                tokens = self._load_locked(hit, get, ok, bad)
            finally:
                for key in pinned:
                    self.index.unpin(*key)  # type: ignore[union-attr]
            self.m.add("restored_tokens", tokens)
            return tokens

    def _load_locked(self, hit: Hit, get: Callable[[tuple[int, int]], object],
                     ok: set[tuple[int, int]], bad: set[tuple[int, int]]) -> int:
        plan = self.plan
        tokens = hit.tokens
        if self.shared:
            self._prefetch_shared(hit, get, ok, bad)
        for _ in range(4 * len(plan.groups) + 4):  # each round loads or drops something
            for gp in plan.cacheable_groups:
                for i in plan.chunks_for_hit(gp.index, tokens):
                    if (gp.index, i) in ok or (gp.index, i) in bad:
                        continue
                    if self._load_one(hit.chunk_hashes, gp.index, i, get):
                        ok.add((gp.index, i))
                    else:
                        bad.add((gp.index, i))
            got = plan.best_hit(tokens + 1, lambda g, i: (g, i) in ok)
            if got == tokens:
                break
            # something was bad: the best hit below `tokens` from what is still available
            tokens = plan.best_hit(
                tokens + 1,
                lambda g, i: (g, i) in ok or ((g, i) not in bad and self._available(hit, g, i, get)),
            )
        else:  # pragma: no cover - bounded by construction
            tokens = plan.best_hit(tokens + 1, lambda g, i: (g, i) in ok)
        return tokens

    def _prefetch_shared(self, hit: Hit, get: Callable[[tuple[int, int]], object],
                         ok: set[tuple[int, int]], bad: set[tuple[int, int]]) -> None:
        """Read the hit's chunks that only shared tiers hold with one `read_many` per tier.

        A chunk no shared tier returned goes to `bad` (no local copy exists to fall back to),
        so the per-chunk pass after this does not ask for it again; it shrinks the hit there.
        """
        want: list[tuple[int, int, ChunkHeader, object]] = []
        for g, loads in enumerate(hit.chunks):
            for ld in loads:
                if ld.slot != SHARED_SLOT or self._local(ld.chunk_hash, g) is not None:
                    continue
                out = get((g, ld.chunk_index))
                if out is None:
                    continue
                out_u8 = as_u8(out) if isinstance(out, torch.Tensor) else out
                want.append((g, ld.chunk_index, self.header(ld.chunk_hash, g, ld.chunk_index), out_u8))
        for tier in self.shared:
            if not want:
                return
            results = self._shared_read(tier, [(g, header, out) for g, _, header, out in want])
            rest = []
            for item, good in zip(want, results):
                g, i, header, out = item
                if good:
                    ok.add((g, i))
                    if self.promote and self.index is not None:
                        self._promote(hit.chunk_hashes[i], g, header, out)
                else:
                    rest.append(item)
            want = rest
        bad.update((g, i) for g, i, _, _ in want)

    def load_tokens(self, token_ids: Sequence[int], buffers: Buffers, extra_keys: Sequence[object] = ()) -> int:
        return self.load(self.lookup_tokens(token_ids, extra_keys), buffers)

    def _available(self, hit: Hit, g: int, i: int, get: Callable[[tuple[int, int]], object]) -> bool:
        if i >= len(hit.chunk_hashes) or get((g, i)) is None:
            return False
        h = hit.chunk_hashes[i]
        return self._local(h, g) is not None or any(t.exists_many([self.header(h, g, i)])[0] for t in self.shared)

    def _load_one(self, hashes: tuple[bytes, ...], g: int, i: int, get: Callable[[tuple[int, int]], object]) -> bool:
        out = get((g, i))
        if out is None:
            return False
        h = hashes[i]
        header = self.header(h, g, i)
        out_u8 = as_u8(out) if isinstance(out, torch.Tensor) else out
        # every copy in tier order: a bad cpu copy falls back to the disk one (write-through)
        for tier_name, slot in self.index.where(h, g) if self.index is not None else ():
            assert self.index is not None
            if not self.index.pin(h, g, tier_name):
                continue
            try:
                good = self._timed_read(self.slot_tiers[tier_name], g, slot, header, out_u8)
            finally:
                self.index.unpin(h, g, tier_name)
            if not good:
                self.index.remove(h, g, tier_name)
                continue
            if tier_name != "cpu" and self.promote:
                self._promote(h, g, header, out_u8)
            return True
        for tier in self.shared:
            if self._timed_read(tier, g, SHARED_SLOT, header, out_u8):
                if self.promote and self.index is not None:
                    self._promote(h, g, header, out_u8)
                return True
        return False

    # -- save -----------------------------------------------------------------------------
    def save(self, chunk_hashes: Sequence[bytes], payloads: Buffers, num_tokens: int) -> int:
        """Store the chunks worth storing; returns the payloads written, summed over the tiers
        (a chunk written to cpu, disk and Redis counts 3)."""
        get = _getter(payloads)
        plan = self.plan
        with self._lock:
            whole = min(len(chunk_hashes), num_tokens // plan.chunk_tokens)  # the request's chunks
            n = whole
            if self.admission is not None:
                admitted = int(self.admission.admit(list(chunk_hashes[:n])))  # type: ignore[attr-defined]
                self.m.add("not_admitted", n - min(n, admitted))
                n = min(n, admitted)
            # anchors (full/mla) first, so a dependent chunk is never stored ahead of its prefix
            order = sorted(plan.cacheable_groups, key=lambda gp: gp.kind not in ("full", "mla"))
            wanted = {gp.index: set(plan.store_chunks(gp.index, n * plan.chunk_tokens)) for gp in order}
            places = self._places([gp.index for gp in order], chunk_hashes[:whole], n)
            warm: list[tuple[bytes, int, ChunkHeader, object]] = []
            cold: list[tuple[bytes, int, ChunkHeader, object]] = []
            for i in range(n):
                h = chunk_hashes[i]
                for gp in order:
                    g = gp.index
                    if i not in wanted[g]:
                        continue
                    where = places[g][i] if places else WARM
                    if where == SKIP or (where == COLD and not self._cold_tiers()):
                        self.m.add("placement_skipped")
                        continue
                    data = get((g, i))
                    if data is None:
                        continue
                    data = as_u8(data) if isinstance(data, torch.Tensor) else as_bytes_view(data)
                    header = self.header(h, g, i)
                    size = data.numel() if isinstance(data, torch.Tensor) else len(data)
                    if size != header.payload_bytes:
                        raise ConfigError(
                            f"payload of group {g} chunk {i} has {size} bytes; the plan "
                            f"says {header.payload_bytes} (plan.groups[{g}].chunk_bytes)")
                    (warm if where == WARM else cold).append((h, g, header, data))
            self.m.add("placement_cold", len(cold))
            stored = self._write(warm, cold=False) + self._write(cold, cold=True)
            self._observe()  # once per saved request, after its writes
            self._tune(chunk_hashes[:whole], num_tokens)
            return stored

    def _places(self, groups: list[int], request: Sequence[bytes], n: int) -> dict[int, Sequence[str]]:
        """Per group, warm / cold / skip for each of the first `n` chunks (empty: all warm)."""
        if self.placement is None or n == 0:
            return {}
        chunks = list(request)
        places = {g: list(self.placement.admit(chunks, g, n)) for g in groups}  # type: ignore[attr-defined]
        if n < len(chunks):  # admission cut the save short: its last chunk is where the next hit ends
            for answer in places.values():
                if len(answer) >= n:
                    answer[n - 1] = WARM
        return places

    def _cold_tiers(self) -> bool:
        """Whether a tier after the first exists for cold entries (a later slot tier or a shared one)."""
        return len(self.slot_tiers) + len(self.shared) > 1

    def _write(self, todo: list[tuple[bytes, int, ChunkHeader, object]], cold: bool) -> int:
        """Write `todo` to every slot tier (warm) or only those after the first (cold), shared
        tiers last: they get, in one batch, every chunk no slot tier held before this save,
        whether or not a slot tier kept it (a chunk a slot tier already held was shared when it
        was first saved)."""
        if not todo:
            return 0
        wrote, new = self._save_all(todo, skip_first=cold)
        stored = sum(wrote)
        shared = self.shared[1:] if cold and not self.slot_tiers else self.shared
        shared_batch = [(g, SHARED_SLOT, header, data) for (_, g, header, data), fresh in zip(todo, new) if fresh]
        for tier in shared:
            if shared_batch:
                stored += self._shared_write(tier, shared_batch)
        return stored

    def save_tokens(self, token_ids: Sequence[int], payloads: Buffers, extra_keys: Sequence[object] = ()) -> int:
        return self.save(self.hashes(token_ids, extra_keys), payloads, len(token_ids))

    def _save_all(self, todo: list[tuple[bytes, int, ChunkHeader, object]], skip_first: bool = False,
                  ) -> tuple[list[int], list[bool]]:
        """Write each payload no slot tier holds yet to every slot tier, tier after tier
        (write-through; `skip_first`, cold entries: the slot tiers after the first only). Per
        payload: how many slot tiers it was written to, and whether it is new (no slot tier held
        it before: the shared tiers take it, even where a slot tier dropped it in this save)."""
        index = self.index
        names = list(self.slot_tiers)[1:] if skip_first else list(self.slot_tiers)
        if index is None:
            return [0] * len(todo), [True] * len(todo)
        if not names:
            return [0] * len(todo), [not any(index.contains(h, g, t) for t in self.slot_tiers) for h, g, _, _ in todo]
        first = self._store_many(names[0], todo, skip_held=True)
        new = [w is not None for w in first]
        wrote = [w or 0 for w in first]
        ks = [k for k, fresh in enumerate(new) if fresh]
        for t in names[1:]:
            for k, w in zip(ks, self._store_many(t, [todo[k] for k in ks])):
                wrote[k] += w or 0
        return wrote, new

    # -- metrics and lifecycle ------------------------------------------------------------
    def metrics(self) -> dict[str, object]:
        with self._lock:
            if self.tuner is not None:
                self.tuner.poll()  # a tuning finished since the last save counts now
                self._count_tunings()
            ev: dict[tuple[str, int], int] = {}
            if self.index is not None:
                for name in self.slot_tiers:
                    for gp in self.plan.cacheable_groups:
                        c = self.index.counters(gp.index, name)
                        ev[(name, gp.index)] = c["evictions"] + c["dead_evictions"]
            own = {t.name: tier_counters(t) for t in (*self.slot_tiers.values(), *self.shared)}
            return metrics_dict(self.m, [gp.name for gp in self.plan.groups], ev, own)

    def register_prometheus(self, registry: object | None = None, prefix: str = "kvtier") -> object:
        """One collector reading `metrics()` at scrape time; give each store in a process its
        own `prefix` (or registry), since the collector does not declare names up front."""
        return register_prometheus(self.metrics, registry, prefix)

    def close(self) -> None:
        """Close every tier under the store lock: a save or load running in another thread
        finishes first (closing a slab fd under a writer let the next open reuse its number and
        take the rest of a payload). Afterwards the tiers refuse I/O (misses, failed writes)."""
        with self._lock:
            for t in (*self.slot_tiers.values(), *self.shared):
                t.close()
            if self.tuner is not None:
                self.tuner.poll()  # a tuning that finished but was not taken yet is counted
                self._count_tunings()
                self.tuner.close()  # never waits: its thread stops the child (a tuning in flight: failed)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
