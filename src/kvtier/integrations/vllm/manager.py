"""The scheduler-side half of the kvtier spec: vLLM's OffloadingManager on kvtier's index.

vLLM asks per offload key (a block hash + a KV-cache group id). Each key becomes kvtier's
`(chunk_hash, group)`; the index decides where it lives (one slot pool per (tier, group), slots
sized for that group's chunk only), pins it while a load is in flight, and evicts per group with
kvtier's policies. Stores are write-through and all or nothing per tier (`plan_store`, below): a
chunk is reserved in every configured tier that takes the call, so the disk tier holds what the
host tier holds and survives the process. A pool whose entries are all pinned answers "full": that
store is skipped and counted, never waited on.

In this file, before the manager: the store plan (`chunks_to_store`, `protect`, `plan_store`,
`reserve`: which tiers take a prepare_store call's new chunks) and `LoadLedger` (each request's
loads; a failed one forgets its chunks in every tier, its promotion slots aborted, never committed
unfilled). Its other parts, one job each: promotion.py (a chunk only on disk or in Redis is
promoted into the cpu tier at lookup where the workers' host regions are mapped, HIT_PENDING until
its read landed, else at load); redis_lookup.py (a key the index lacks may be in the shared Redis
tier, asked off the engine thread: RETRY meanwhile); rebuild.py (at start, what a previous engine
left on disk); host_only.py (vLLM 0.33's `sync_load_budget_bytes`: HIT only for a whole cpu
chunk); events.py (vLLM's key of every held chunk, for KV events and evicted keys).
Placement (`kvtier.placement`, default "hits": kvtier.index.placement.HitsLand, the Store's rule):
`prepare_store` may store a subset of the keys it is given. Full/MLA chunks are stored as vLLM
offers them (every longer hit reads them). A windowed group's chunk (sliding, chunked-local,
state) is stored in every tier only if vLLM's own hit search reads it for a hit ending where hits
of the request land (its last chunks, the branch points of the prefix tree): vLLM reads the run
of its window in chunks ending at the hit's end (`placement.lookup_window`: a sliding group
cdiv(W, C) chunks, one more than kvtier's W - 1 tokens where C divides W - 1, a state group the
checkpoint at the end); elsewhere only in the tiers after the first (cold: disk, Redis) or, with
one tier, not at all (`store_skipped_placement`). What is not stored is never reserved, committed
or announced in a KV event; a lookup of it is a miss, and vLLM's search (the last run of its
window at or before the full groups' prefix) makes the hit shorter, never partial. The request's
chunks come from vLLM's positions of its keys (`ReqContext`), all of them known from its first
store; the placement learns once per request and again when decoding adds chunks.
Only chunks a load needs whole are promoted at load (bytes a load does not need are not restored,
so a slot filled from a partial load would claim too few blocks): with more than one block per
chunk, the first chunk of each group in a load may start mid-chunk and is not promoted.

Rule: write-through, never a demotion of host evictions (a copy job vLLM cannot schedule): kvtier's
one write policy, the Store's too (docs/store.md, "Write policy").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Container, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.index.index import Entry, Index
from kvtier.index.placement import COLD, SKIP, HitsLand
from kvtier.index.tuning import WorthTuner

from .compat import offload_key_positions
from .placement import lookup_window
from .common import SPLIT_MEMO_KEYS, ChunkItem, KvtierLoadStoreSpec, SlotMove, SlotRelease, SlotReserve, SpecContext
from .counters import Metrics
from .events import HeldKeys, KvEvents
from .host_only import HostOnlyHits
from .promotion import Promotions
from .rebuild import mark_reset, rebuild_from_disk
from .redis_lookup import RedisLookup
from .stats import config_info

_HIT_SOURCE = {"cpu": CacheHitSource.HOST, "disk": CacheHitSource.DISK}
PLACED_REQUESTS = 4096  # requests whose placement is kept (finished ones are dropped at once)
Chunk = tuple[bytes, int]  # (chunk hash, plan group)
Todo = list[tuple[Hashable, Chunk]]  # (engine key, chunk), in call order
# a request's placement memo: its keys' count, the answer per group, learned from yet, its chunks
Placed = tuple[int, dict[int, tuple[str, ...]], bool, list[bytes]]


# -- The store plan: which tiers take a prepare_store call's new chunks ------------------------
# vLLM's contract for prepare_store, kept to the letter (its own CPU manager does the same): every
# given chunk is protected from eviction for the whole call (`protect`); all or nothing per tier
# (`plan_store`): storing a part would evict chunks a lookup just answered HIT for and keep a
# prefix with holes; refused when no tier can take the new chunks (vLLM offers them again later).
# Write-through: reserved in every tier that takes the call (`reserve`).


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
    known to the plan, not being stored already (in `pending`), each chunk once (the first key)."""
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
    """Every given chunk a tier holds is pinned there until the block ends, so no reservation of
    the call evicts it (reserved entries are pinned already)."""
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
    """Reserve every new chunk in every tier that takes the call, in tier order, yielding (key,
    tier, slot, what it evicted) one at a time: whether an evicted chunk left its last tier
    depends on the reservations before it, so the caller handles each before the next."""
    for tier in plan.taking:
        for key, (h, g) in plan.new[tier]:
            r = index.reserve(h, g, tier)
            assert r.slot is not None, f"can_take promised {tier} room for every key ({r.status})"
            yield key, tier, r.slot, r.evicted


# -- Each request's loads -----------------------------------------------------------------------


class LoadLedger:
    """Per request: the chunks of its last load, its load jobs in flight (prepare_load ..
    complete_load), whether it finished meanwhile, whether its load failed in the output vLLM is
    handling now. Per engine key: the tier of each index pin its loads hold, oldest first (each
    complete_load releases the oldest). A request finished while its load is in flight keeps its
    chunks until the load completes, so a failed load still forgets them."""

    def __init__(self) -> None:
        self._chunks: dict[str, list[Chunk]] = {}
        self._jobs: dict[str, int] = {}
        self._finished: set[str] = set()  # finished while loading: chunks kept until the load ends
        self._failing: set[str] = set()
        self._pins: dict[Hashable, list[str]] = {}

    def started(self, req_id: str, chunks: list[Chunk]) -> None:
        """prepare_load scheduled a load job of `chunks` for the request."""
        self._chunks[req_id] = chunks
        self._jobs[req_id] = self._jobs.get(req_id, 0) + 1

    def pinned(self, key: Hashable, tier: str) -> None:
        """A load of `key` pinned its chunk in `tier` (prepare_load)."""
        self._pins.setdefault(key, []).append(tier)

    def unpin(self, key: Hashable) -> str | None:
        """The tier of `key`'s oldest load pin, released here (complete_load); None without one."""
        tiers = self._pins.get(key)
        if not tiers:
            return None
        tier = tiers.pop(0)
        if not tiers:
            del self._pins[key]
        return tier

    def source(self, key: Hashable) -> str | None:
        """The tier `key`'s latest load reads from, while its pin is held."""
        tiers = self._pins.get(key)
        return tiers[-1] if tiers else None

    def pins(self) -> int:
        """Load pins held, over every key."""
        return sum(len(t) for t in self._pins.values())

    def completed(self, req_id: str) -> None:
        """vLLM completed one of the request's load jobs (also a failed one)."""
        left = self._jobs.pop(req_id, 0) - 1
        if left > 0:
            self._jobs[req_id] = left
        elif req_id in self._finished and req_id not in self._failing:
            # finished while loading and the load worked: nothing will ask for its chunks again
            self._finished.discard(req_id)
            self._chunks.pop(req_id, None)

    def finished(self, req_id: str) -> None:
        """vLLM finished the request: its chunks are dropped, or kept until its load completes."""
        if req_id in self._jobs:
            self._finished.add(req_id)
        else:
            self._chunks.pop(req_id, None)

    def failed(self, req_id: str) -> list[Chunk]:
        """The request's load failed (after its complete_load): the chunks to forget, dropped here."""
        self._finished.discard(req_id)
        return self._chunks.pop(req_id, [])

    def mark_failed(self, req_ids: Collection[str]) -> None:
        """These requests' loads failed in the output vLLM handles next (until `clear_failed`)."""
        self._failing = set(req_ids)

    def clear_failed(self) -> None:
        self._failing = set()

    def failing(self, req_id: str) -> bool:
        """Whether `mark_failed` named the request's load."""
        return req_id in self._failing

    def busy(self) -> bool:
        """Some load is in flight, holds a pin or its chunks are kept."""
        return bool(self._chunks or self._jobs or self._pins)

    def clear(self) -> None:
        """The manager's index was reset: no load's chunks or pins are kept (the failed marks of
        the output being handled stay)."""
        self._pins.clear()
        self._chunks.clear()
        self._jobs.clear()
        self._finished.clear()


# -- The manager -------------------------------------------------------------------------------


class WorkersContext(Protocol):
    """The spec (spec.py's KvtierOffloadingSpec), as the manager asks it."""

    def workers_context(self, page_bytes: tuple[int, ...], fingerprint: str = "",
                        kv_dtype: str = "") -> SpecContext | None:
        """The context for the workers' layout, None when unchanged."""


class KvtierManager(OffloadingManager):
    def __init__(self, ctx: SpecContext, metrics: Metrics, spec: WorkersContext | None = None,
                 events: bool = False) -> None:
        """`spec`: the spec that built this manager, asked for the context of the workers'
        layout by `adopt_worker_layout` (`workers_context`). `events`: vLLM's KV events are on
        (`enable_kv_cache_events`): what each tier holds is announced through `take_events`
        (events.py)."""
        self.ctx = ctx
        self.spec = spec
        self.metrics = metrics
        self._new_placement()
        # the worth weight's tuner (policy worth, w not fixed; else None) and its counts exported
        self.tuner: WorthTuner | None = None
        self._tuner_counts: dict[str, int] = {}
        self.index: Index = self._tuned_index()
        # memo of key -> (chunk hash, group); bounded (recomputing is one blake2b call)
        self._split: dict[OffloadKey, tuple[bytes, int] | None] = {}
        self._pending: dict[OffloadKey, list[tuple[str, int]]] = {}  # places reserved by a store in flight
        self.loads = LoadLedger()  # each request's loads: their chunks, jobs and pins
        self.promotions = Promotions(ctx, self.index, metrics)
        self.promotions.settled = self.share_settled
        # vLLM's key of every chunk the index holds; a chunk is not gone while a store (_pending)
        # or a promotion into another tier is in flight
        self.held = HeldKeys(self.index, metrics, self._pending, self.promotions)
        self.events = KvEvents(self.held, metrics, events)
        self.index.listener = self.events.on_index
        self.host_only = HostOnlyHits(metrics)  # host-only loads: the hits this step pinned
        # shared with other engines: a key this index lacks may still be in Redis
        self.redis_lookup = RedisLookup(ctx, metrics) if "redis" in ctx.config.tiers else None
        # the learned share's ops for the workers (moves, releases, reserves), in order, until the
        # connector takes them into the step's metadata (`take_share_ops`); batches numbered from 1
        self._share_ops: list[SlotMove | SlotRelease | SlotReserve] = []
        self._share_batch = 0
        self._share_slots = self._pool_slots()
        # per cpu group, the last batch with an op on it (`share_settled`)
        self._share_touched: dict[int, int] = {}
        self._reset_unflushed = False  # a reset whose in-flight jobs may still write (reset_cache)
        rebuild_from_disk(ctx, self.index, metrics)
        metrics.flush(force=True)

    def _new_placement(self) -> None:
        """The placement rule for `self.ctx` (None: every chunk), and per request (`Placed`) its
        keys' count, the answer per group (learned once per request and chunk count) and its
        chunks (the worth tuner takes them at finish)."""
        from kvtier.store.store import make_placement

        self.placement = make_placement(self.ctx.plan, self.ctx.placement)
        self._placed: dict[str, Placed] = {}

    def adopt_worker_layout(self, page_bytes: tuple[int, ...], fingerprint: str = "", kv_dtype: str = "") -> bool:
        """The workers' exact bytes per block and namespace (KvtierConnector's handshake, before
        any request): the spec's context for them (`spec.workers_context`) is adopted when it
        differs (slots, chunk sizes and namespace are rebuilt from it); True then. The layout
        travels one way: the spec never calls the manager back."""
        ctx = self.spec.workers_context(page_bytes, fingerprint, kv_dtype) if self.spec is not None else None
        if ctx is None:
            return False
        if self._pending or self.loads.busy() or self.promotions.busy():
            raise RuntimeError("kvtier: the workers' layout arrived after transfers began")
        self.ctx = ctx
        self._new_placement()  # first: the new index's worth reads its prefix tree
        self._new_index()
        self.promotions.relayout(ctx, self.index)
        self._split.clear()
        if self.redis_lookup is not None:
            self.redis_lookup.relayout(ctx)
        for gp in ctx.plan.groups:
            self.metrics.info[f"chunk_bytes_group{gp.index}"] = gp.chunk_bytes
        self.metrics.add("layout_from_workers")
        rebuild_from_disk(ctx, self.index, self.metrics)
        self.metrics.flush(force=True)
        return True

    def adopt_region(self, names: list[str]) -> bool:
        """The workers' cpu tiers live in these host regions, one per rank in rank order
        (KvtierConnector's handshake, after `adopt_worker_layout`, whose new context replaces the
        promoter, before any request): map them, for promotion at lookup."""
        return self.promotions.promoter.attach(names)

    def mark_failed(self, req_ids: Collection[str]) -> None:
        """The workers reported these requests' loads failed in the output vLLM handles next
        (KvtierConnector, before vLLM's own handling calls complete_load for them): their
        promotion slots are aborted, never committed unfilled. Until `clear_failed`."""
        self.loads.mark_failed(req_ids)

    def clear_failed(self) -> None:
        """vLLM handled the output `mark_failed` named (KvtierConnector, then `load_failed`)."""
        self.loads.clear_failed()

    def _new_index(self) -> None:
        """An empty index for `self.ctx` (a reset, the workers' layout): every chunk announced in
        a KV event is announced removed, and nothing kept about the old index's chunks."""
        self.events.reset(self.held.key_of)
        self.index = self._tuned_index()
        self.index.listener = self.events.on_index
        self.host_only.forget()  # pins of the old index
        self.held.clear(self.index)
        # ops of the old index not taken yet are moot (none of its chunks is referenced any more);
        # the new pools start at the first split, so every pool's tail past it is given back: a
        # pool the old share had grown would otherwise keep its pages while another grows again
        self._share_slots = self._pool_slots()
        learned = {learner.tier for learner in self.index.learners}
        pools = [(tier, g, slots) for (tier, g), slots in self._share_slots.items() if tier in learned]
        self._share_ops = ([SlotRelease(tier, g, slots) for tier, g, slots in pools]
                           + [SlotReserve(tier, g, slots) for tier, g, slots in pools])

    def _tuned_index(self) -> Index:
        """A fresh index for `self.ctx` and the placement's prefix tree. A running tuner (a
        reset, the workers' layout) is kept: the new pools share its weight, it scores with the
        new context's shadow, and only its window and start signal are cleared (`reset`): w is
        what traffic taught, not what the old index held, and its child is stopped at shutdown."""
        index, tuner = self.ctx.new_tuned_index(self.placement)
        old = self.tuner
        if old is None or tuner is None:  # the first index (or no tuning under this context)
            self._close_tuner()
            self.tuner, self._tuner_counts = tuner, {}
            return index
        for tier in index.tiers:
            for gp in self.ctx.plan.cacheable_groups:
                index.policy_of(gp.index, tier).weight = old.weight  # type: ignore[attr-defined]
        old.shadow = tuner.shadow  # this context's plan and slots; a job in flight keeps its own
        tuner.close()  # never started a child: nothing to wait for
        old.reset()
        return index

    # -- eviction by worth (SpecContext.policy; docs/vllm.md, "Eviction by worth") -------------

    def _tune(self, rc: ReqContext, memo: Placed | None) -> None:
        """Once per finished request: its chunks to the worth tuner, which hands a tuning to its
        child process every `period` chunks once the first tier has evicted (never waits). The
        index only: worth picks victims, the workers never hear of it. The chunks are the
        placement's (`memo`, `_request_places`) when it saw the request's keys as they are now."""
        if self.tuner is None:
            return
        positions = offload_key_positions(rc)
        if not isinstance(positions, dict):
            chunks: list[bytes] = []
        elif memo is not None and memo[0] == len(positions):
            chunks = memo[3]
        else:
            chunks = self._request_chunks(positions)
        # ReqContext carries no prompt length: the hit rule's P as if the prompt ran one token past
        # the request's last whole chunk (every chunk vLLM hashed, its output's too, may be hit)
        tokens = len(chunks) * self.ctx.span(self.ctx.plan.cacheable_groups[0].index)
        first = self.index.tiers[0]
        evicted = self.tuner.started or any(self.index.counters(gp.index, first)["evictions"]
                                            for gp in self.ctx.plan.cacheable_groups)
        self.tuner.observe(chunks, tokens + 1, tokens, evicted)
        self._export_tunings()

    def _export_tunings(self) -> None:
        """The tuner's counts since the last call, into the metrics (`worth_tunings`, ...)."""
        if self.tuner is None:
            return
        now = self.tuner.counts()
        for name, n in now.items():
            if n > self._tuner_counts.get(name, 0):
                self.metrics.add(name, n - self._tuner_counts.get(name, 0))
        self._tuner_counts = now

    def _close_tuner(self) -> None:
        """Stop the tuner's child, never waiting for it (shutdown): a finished tuning is adopted,
        one still in flight is dropped and counted failed (`WorthTuner.close`), exported once."""
        tuner = self.tuner
        if tuner is None:
            return
        tuner.poll()
        tuner.close()
        self._export_tunings()
        self.tuner = None

    # -- the learned share (SpecContext.learned; docs/vllm.md, "The learned share") ------------

    def _pool_slots(self) -> dict[tuple[str, int], int]:
        return {(tier, gp.index): self.index.slots(gp.index, tier)
                for tier in self.index.tiers for gp in self.ctx.plan.cacheable_groups}

    def _observe(self) -> None:
        """Once per finished request: the learned share may move bytes between the groups'
        pools now and then (`Index.observe`). Its evictions are reported as evictions; the
        workers copy its moves and then give back each shrunk pool's tail (`SlotRelease`), in
        the order queued here. Pinned (a load in flight) and reserved (a store or promotion in
        flight) entries are never moved, and keep their pool above their slot, so no op touches
        a slot a job still uses."""
        if not self.index.learners:
            return
        r = self.index.observe()
        by_tier: dict[str, list[Entry]] = {}
        for e in r.evicted:
            by_tier.setdefault(e.tier, []).append(e)
        for tier, entries in by_tier.items():
            self.held.evicted_elsewhere(entries, tier)
        for e in r.evicted:
            self.metrics.add("share_evicted", group=e.group)
        for m in r.moved:
            self._share_ops.append(SlotMove(m.tier, m.group, m.chunk_hash, m.from_slot, m.to_slot))
            self.metrics.add("share_moved", group=m.group)
        now = self._pool_slots()
        # every release before any reserve: a host region gives pages back before it takes more
        self._share_ops += [SlotRelease(tier, g, slots) for (tier, g), slots in now.items()
                            if slots < self._share_slots[(tier, g)]]
        self._share_ops += [SlotReserve(tier, g, slots) for (tier, g), slots in now.items()
                            if slots > self._share_slots[(tier, g)]]
        if now != self._share_slots:
            self.metrics.add("share_resizes")
        self._share_slots = now

    def take_share_ops(self) -> tuple[int, tuple[SlotMove | SlotRelease | SlotReserve, ...]]:
        """(batch number, the ops queued since the last call) for the step's metadata
        (KvtierConnector.build_connector_meta); (0, ()) when none."""
        if not self._share_ops:
            return 0, ()
        ops, self._share_ops = tuple(self._share_ops), []
        self._share_batch += 1
        for op in ops:
            if op.tier == "cpu":
                self._share_touched[op.group] = self._share_batch
        return self._share_batch, ops

    def share_settled(self, group: int) -> int | None:
        """The share-op batch the workers must have applied before a slot of the cpu tier's
        `group` may be written from this process (promotion at lookup; host_region.py, "Reserved
        slots"): the last batch with an op on it (0: none), None while an op on it waits for
        the next step's metadata."""
        if any(op.tier == "cpu" and op.group == group for op in self._share_ops):
            return None
        return self._share_touched.get(group, 0)

    def _key(self, key: OffloadKey) -> tuple[bytes, int] | None:
        split = self._split.get(key)
        if split is None and key not in self._split:
            if len(self._split) >= SPLIT_MEMO_KEYS:
                self._split.clear()
            split = self._split[key] = self.ctx.split_key(key)
        return split

    def _span(self, key: OffloadKey, group: int, rc: ReqContext) -> tuple[int, int]:
        """The token span of `key`'s chunk, a chunk of plan group `group`."""
        return self.ctx.chunk_span(group, rc.get_offload_key_position(key))

    # -- OffloadingManager ---------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        split = self._key(key)
        group = split[1] if split is not None else None
        self.metrics.add("lookup_keys", group=group)
        if self.ctx.off_reason:
            self.metrics.add("lookup_keys_offload_off")
            return LookupResult.MISS
        if split is None:
            return LookupResult.MISS
        for h, g in self.promotions.lookup_pass(getattr(req_context, "req_id", None)):  # reads land at a pass's start
            self.held.report_gone(h, g)  # a failed read's cpu reservation released
        if split in self.promotions.fetches:
            self.metrics.add("lookup_pending_keys", group=group)
            return LookupResult.HIT_PENDING  # being promoted: vLLM asks again next step
        if not self.index.contains(*split):
            if key in self._pending:  # its store is in flight: vLLM waits for it, never recomputes
                self.metrics.add("lookup_pending_keys", group=group)
                return LookupResult.HIT_PENDING
            held, evicted = self.redis_lookup.adopt(self.index, split) if self.redis_lookup else (False, ())
            for e in evicted:
                self.held.report_gone(e.chunk_hash, e.group)
            if held is None:
                return LookupResult.RETRY  # vLLM asks again next step; the step never waits
            if not held:
                return LookupResult.MISS
        self.held.key_of[split] = key  # held: its eviction is reported under this key
        if self.events.enabled:  # a chunk adopted at start is announced once a lookup names it
            self.events.named(split, key, [t for t, _ in self.index.where(*split)])
        started, evicted = self.promotions.start_at_lookup(key, split, req_context)
        self.held.evicted_elsewhere(evicted, "cpu")
        if started:
            self.metrics.add("lookup_pending_keys", group=group)
            return LookupResult.HIT_PENDING
        if self.ctx.config.host_only_loads and not self.host_only.hit(
                self.index, self.promotions.promoter, self.ctx, key, split, req_context):
            return LookupResult.MISS
        self.metrics.add("lookup_hit_keys", group=group)
        return LookupResult.HIT

    def has_pending_work(self) -> bool:
        """Keep the engine stepping while a promotion started at lookup is in flight (0.33's
        engine asks; 0.32's does not, and steps while a request waits on it anyway)."""
        return bool(self.promotions.fetches)

    def on_schedule_end(self, context) -> None:  # noqa: ANN001 - vLLM's ScheduleEndContext
        """Once a step (both versions, from build_connector_meta): land promotions whose reads
        finished, also those no request asks for again (an abort)."""
        for h, g in self.promotions.end_step():
            self.held.report_gone(h, g)  # a failed read's cpu reservation released
        self.host_only.end_step(self.index)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        items: list[ChunkItem] = []
        chunks: list[tuple[bytes, int]] = []
        seen: set[int] = set()  # groups with an item already: their later chunks are whole
        promote: list[tuple[int, OffloadKey]] = []  # (item index, key): read from disk or Redis
        vanished = False
        for key in keys:
            split = self._key(key)
            assert split is not None, "vLLM loads only keys that lookup() reported as hits"
            h, g = split
            whole = g in seen or self.ctx.blocks_per_chunk == 1
            seen.add(g)
            places = tuple(self.index.where(h, g)[:1])
            if not places:
                # Evicted between lookup() and now (another request's store or a Redis adoption
                # took its slot): an item with no place fails the load job in the worker, so vLLM
                # recomputes the request. Never an assertion in the scheduler process.
                self.metrics.add("load_keys_vanished", group=g)
                vanished = True
            else:
                tier = places[0][0]
                pinned = self.index.pin(h, g, tier)
                assert pinned
                self.index.touch(h, g, tier)
                self.loads.pinned(key, tier)
                if tier != "cpu" and whole:
                    promote.append((len(items), key))
                self.metrics.add(f"load_chunks_{tier}", group=g)
            items.append(ChunkItem(g, h, *self._span(key, g, req_context), places))
            chunks.append(split)
        if not vanished:  # after every source is pinned; none for a job that fails anyway
            for evicted in self.promotions.reserve_for_load(items, promote, req_context):
                self.held.evicted_elsewhere(evicted, "cpu")
        self.loads.started(req_context.req_id, chunks)
        self.metrics.add("load_jobs_scheduled")
        return KvtierLoadStoreSpec(items)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        """The tier a hit's key is loaded from (asked after prepare_load), for vLLM's
        `vllm:prompt_tokens_cached_by_source`: cpu is vLLM's `host`, disk its `disk`; Redis (shared,
        remote) has no source of its own in vLLM and stays `external_unspecified`."""
        tier = self.loads.source(key)
        if tier is None:
            split = self._key(key)
            places = self.index.where(*split) if split is not None else ()
            tier = places[0][0] if places else ""
        return _HIT_SOURCE.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for key in keys:
            split = self._key(key)
            if split is not None:
                for tier, _ in self.index.where(*split)[:1]:
                    self.index.touch(split[0], split[1], tier)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        req_id = req_context.req_id
        self.loads.completed(req_id)
        failed = self.loads.failing(req_id)
        for key in keys:
            split = self._key(key)
            # a cpu slot it promoted into: filled by the worker unless its job failed
            if self.promotions.complete_at_load(key, split, req_id, failed=failed):
                self.held.report_gone(*split)
            tier = self.loads.unpin(key) if split is not None else None
            if tier is not None:
                self.index.unpin(split[0], split[1], tier)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """vLLM's contract, kept to the letter (the store plan, above): every given key is
        protected from eviction for the whole call; all or nothing per tier; None when some key is
        new and no tier can take the call's new keys (vLLM offers them again later; evictions
        reported later are kept for the next call). Write-through: a key is reserved in every tier
        that takes the call's keys."""
        if self.ctx.off_reason:  # never a store no hit can read
            self.metrics.add("store_keys_offload_off", len(keys))
            return PrepareStoreOutput(keys_to_store=[], store_spec=KvtierLoadStoreSpec([]),
                                      evicted_keys=self.held.take_later())
        todo = chunks_to_store(((key, self._key(key)) for key in keys), self._pending)
        with protect(self.index, [split for _, split in todo]):  # skipped keys too: never a victim
            cold, skipped = self._place(todo, req_context)
            if skipped:
                todo = [t for t in todo if t[0] not in skipped]
            plan = plan_store(self.index, self.ctx.config.tiers, todo, cold=cold)
            for (tier, g), n in plan.skipped.items():
                self.metrics.add(f"store_skipped_full_{tier}", n, group=g)
            if plan.refused:
                self.metrics.add("store_calls_refused")
                return None  # vLLM offers these keys again later; held.later kept for then
            evicted = self.held.take_later()
            places_of: dict[OffloadKey, list[tuple[str, int]]] = {}
            for key, tier, slot, gone in reserve(self.index, plan):
                self.held.evicted(gone, tier, evicted)  # before the next reservation evicts more
                places_of.setdefault(key, []).append((tier, slot))
            items: list[ChunkItem] = []
            to_store: list[OffloadKey] = []
            for key, (h, g) in todo:
                places = places_of.get(key)
                if places:
                    self.held.key_of[(h, g)] = key
                    items.append(ChunkItem(g, h, *self._span(key, g, req_context), tuple(places)))
                    to_store.append(key)
                    self._pending[key] = places
        stored = Counter(it.group for it in items)  # chunks reserved, by group
        if evicted and to_store:  # evicted earlier and stored again now: not an eviction
            storing = set(to_store)
            evicted = [k for k in evicted if k not in storing]
        for g, n in stored.items():
            self.metrics.add("store_chunks", n, group=g)
        if not stored:
            self.metrics.add("store_chunks", 0)
        return PrepareStoreOutput(keys_to_store=to_store, store_spec=KvtierLoadStoreSpec(items),
                                  evicted_keys=evicted)

    def _place(self, todo: list, rc: ReqContext) -> tuple[set[OffloadKey], set[OffloadKey]]:
        """(cold keys: stored in the tiers after the first only; skipped keys: not stored) of a
        prepare_store call, by the placement's answer for the request's chunks."""
        if self.placement is None or not todo:
            return set(), set()
        places = self._request_places(rc)
        if places is None:
            return set(), set()
        cold_ok = len(self.ctx.config.tiers) > 1
        cold: set[OffloadKey] = set()
        skipped: set[OffloadKey] = set()
        for key, (_, g) in todo:
            end = rc.get_offload_key_position(key)
            answer = places.get(g, ())
            i = end // self.ctx.span(g) - 1 if end is not None else -1
            where = answer[i] if 0 <= i < len(answer) else None
            if where == SKIP or (where == COLD and not cold_ok):
                skipped.add(key)
                self.metrics.add("store_skipped_placement", group=g)
            elif where == COLD:
                cold.add(key)
                self.metrics.add("store_cold", group=g)
        return cold, skipped

    def _request_places(self, rc: ReqContext) -> dict[int, tuple[str, ...]] | None:
        """Per plan group, warm / cold / skip for each chunk of the request, from its keys' chunk
        hashes in prefix order (vLLM's positions of the request's keys, every one it hashed so
        far); asked once per request and chunk count. None: vLLM gave no positions."""
        positions = offload_key_positions(rc)
        if not isinstance(positions, dict) or not positions:
            return None
        req_id = str(getattr(rc, "req_id", ""))
        memo = self._placed.get(req_id)
        if memo is not None and memo[0] == len(positions):
            return memo[1]
        chunks = self._request_chunks(positions)
        # learned from once per request: its decode growth (a later call, more chunks) only
        # inserted, else every step would count the request's own prefix as reused
        learned = memo is not None and memo[2]
        places: dict[int, tuple[str, ...]] = {}
        if chunks and isinstance(self.placement, HitsLand):
            for g, (before, after) in self._windows().items():
                places[g] = self.placement.admit_run(chunks, before, after, learn=not learned)
                learned = True  # the endpoints of one request and chunk count: learned once
        if len(self._placed) >= PLACED_REQUESTS:  # requests vLLM never finished: the oldest go
            del self._placed[next(iter(self._placed))]
        self._placed.pop(req_id, None)
        self._placed[req_id] = (len(positions), places, learned or bool(places), chunks)
        return places

    def _request_chunks(self, positions: dict) -> list[bytes]:
        """A request's chunk hashes in prefix order, from vLLM's positions of its keys (the first
        cacheable group's: every group's chunk i has the same hash), up to the first one missing."""
        ref = self.ctx.plan.cacheable_groups[0].index
        span = self.ctx.span(ref)
        by_index: dict[int, bytes] = {}
        for key, end in positions.items():
            split = self._key(key)
            if split is not None and split[1] == ref and end % span == 0:
                by_index[end // span - 1] = split[0]
        chunks: list[bytes] = []
        while len(chunks) in by_index:
            chunks.append(by_index[len(chunks)])
        return chunks

    def _windows(self) -> dict[int, tuple[int, int]]:
        """Per windowed cacheable group, the chunks before and after a hit's end that vLLM's
        hit search reads (`lookup_window`); full/MLA groups are not placed."""
        out: dict[int, tuple[int, int]] = {}
        for gp in self.ctx.plan.cacheable_groups:
            g = gp.group
            run = lookup_window(gp.kind, self.ctx.span(gp.index), g.window, g.attention_chunk,
                                self.ctx.retained_tokens, gp.index in self.ctx.draft_groups)
            if run is not None:
                out[gp.index] = run
        return out

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """A store job the worker failed is reported as a success by vLLM 0.33 (and by vLLM's own
        connector on 0.32): it never hears of store failures. Where the workers' host regions are
        mapped, the chunk's cpu slot is read: a slot that does not hold the chunk (the job wrote
        nothing, in any tier: a job fails whole) is not committed in any tier
        (`store_failed_unreported`), so no lookup is answered from it."""
        for key in keys:
            places = self._pending.pop(key, None)
            split = self._key(key)
            if not places or split is None:
                continue
            if self._reset_unflushed:  # a store prepared after the reset completed: see reset_cache
                self._reset_flushed()
            ok = success
            cpu_slot = next((slot for t, slot in places if t == "cpu"), None)
            if ok and cpu_slot is not None and self.promotions.promoter.holds(split[1], cpu_slot, split[0]) is False:
                ok = False
                self.metrics.add("store_failed_unreported", group=split[1])
            for tier, _ in places:
                (self.index.commit if ok else self.index.abort)(split[0], split[1], tier)
            if not ok:
                self.held.gone(*split)

    def on_request_finished(self, req_context: ReqContext) -> None:
        """vLLM signals this also while the request's load is in flight (an abort): its chunks
        are then kept until the load completes, so a failed load still forgets them."""
        self.promotions.request_finished(req_context.req_id)
        self.loads.finished(req_context.req_id)
        memo = self._placed.pop(str(req_context.req_id), None)
        self._observe()
        self._tune(req_context, memo)

    def load_failed(self, req_id: str) -> None:
        """The worker could not restore this request's load (a tier error, a corrupt payload):
        forget every chunk of it, so no later request is offered the same bad hit."""
        removed = 0
        for h, g in self.loads.failed(req_id):
            for tier, _ in self.index.where(h, g):
                removed += self.index.remove(h, g, tier)
            self.held.report_gone(h, g)
        self.metrics.add("load_failures")
        self.metrics.add("removed_after_failure", removed)

    def reset_cache(self) -> None:
        """Forget every chunk. Jobs vLLM had in flight at the reset are flushed by the workers at
        the start of the next step, before any store prepared after the reset is submitted (both
        versions defer stores one step), and vLLM drops their completions; so an old job's write
        into a slot the new index hands out lands first and is overwritten, and a load never reads
        a slot of the new index before the store that filled it. Worst case a stale payload sits in
        a slot whose header names another chunk: a counted miss, never wrong KV. Every chunk
        announced in a KV event is announced removed (vLLM's own manager says nothing here).
        Durable (rebuild.py): the connector marks the reset in the disk directory now, and it is
        marked again once the jobs in flight at the reset are flushed (their disk writes carry
        later times): at vLLM 0.33's `on_reset_flushed`, or (0.32, which reports no flush) at
        the first completion of a store prepared after the reset, which the workers submit only
        after the flush. Records written between the flush and that mark are not adopted at a
        restart (misses, never a dropped chunk back); a crash before the flush is reported can
        still adopt a pre-reset job's write. Eviction by worth keeps its tuner, w and child
        (`_tuned_index`)."""
        self._new_index()
        self._reset_unflushed = True
        self._pending.clear()
        self._placed.clear()  # what it learned of traffic stays (the placement's tree)
        self.loads.clear()
        self.promotions.reset(self.index)  # no promotion at lookup until on_reset_flushed
        if self.redis_lookup is not None:  # Redis answers from before the reset are not used
            self.redis_lookup.forget()
        self.metrics.add("resets")

    def take_events(self):  # noqa: ANN201 - Iterable[OffloadingEvent]
        """vLLM's KV events for what kvtier's tiers gained and lost since the last call
        (events.py); vLLM's connector publishes them as BlockStored / BlockRemoved."""
        return self.events.take()

    def on_reset_flushed(self) -> None:
        """vLLM 0.33: the workers reported every job in flight at the last reset; promotion at
        lookup may write slots again; the reset is marked again (reset_cache)."""
        self.promotions.reset_flushed()
        self.metrics.add("resets_flushed")
        if self._reset_unflushed:
            self._reset_flushed()

    def _reset_flushed(self) -> None:
        """The jobs in flight at the last reset wrote what they wrote: the reset is marked again,
        so none of their disk records is adopted at a restart."""
        self._reset_unflushed = False
        mark_reset(self.ctx.disk_root)

    def config_info(self) -> list[dict[str, str | int]]:
        """vLLM 0.33's kv_offload config info series: the plan and each tier's slots per group."""
        return config_info(self.ctx, self.index)

    def shutdown(self) -> None:
        self.promotions.close()
        self._close_tuner()
        self.metrics.flush(force=True)
        if self.redis_lookup is not None:
            self.redis_lookup.close()
