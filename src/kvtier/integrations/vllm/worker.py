"""The worker-side half of the kvtier spec: the lifecycle of vLLM's transfer jobs between its KV
tensors and kvtier's tiers.

vLLM hands the worker its KV cache as canonical per-block byte views: a list of int8 tensors of
shape (num_blocks, page_bytes) and, per KV-cache group, the (tensor, page bytes) of each of its
layers. A chunk payload of group g is, for each layer ref of g in vLLM's order, the pages of the
chunk's `blocks_per_chunk` blocks back to back: `sum(page_bytes) * blocks_per_chunk` bytes, the
group's own size (not a row sized for all groups). Around the job lifecycle kept here:
- placement.py: which block of a job goes to which position of which chunk (pure arithmetic);
- common.py: a job's chunk headers (`SpecContext.blocks_header`, the scheduler's maker too);
- copies.py: the copies between blocks and host chunk rows: its own (a side stream on a GPU) and,
  for chunks in cpu slots on a GPU, vLLM's copy handlers (SlabCopier), and waiting for them;
- SlowIO (below): disk and Redis reads and write-behind on one background thread (store/lane.py);
- store/buffers.py: the pool of host staging buffers (`POOL_BUFFERS` per size);
- tiers.py: the tiers, built by store/tiers/factory.py.

`submit_*` never wait for a disk or a network. A store copies each chunk's pages once, straight
into the chunk's slot in the cpu tier (one preallocated slab per group, pinned where CUDA is
present: `CpuTier.begin`/`commit`), and queues the chunk's disk and Redis writes (SlowIO:
dropped past `kvtier.io_queue_bytes`, skipped when the slot was taken for another chunk before the
write ran). A chunk without a cpu slot is gathered into a zeroed host buffer instead. A load checks
each cpu-tier chunk's header and copies the slot's pages into the blocks in place, on the engine
thread (no store can take the slot in between); chunks on disk or in Redis are read and verified
on the background thread first, and copied in `get_finished`. vLLM keeps the request waiting
meanwhile, as it does for any asynchronous load. Such a chunk is also promoted when the scheduler
reserved a cpu slot for it (a second place `("cpu", slot)` in its item, promotion.py): the verified
bytes are copied into that slot on the engine thread and the blocks are filled from the slot, so
the next hit reads host memory. The cpu tier's slabs and slot table live in a file the
scheduler's process maps too (`kvtier.host_region`, host_region.py; one per tensor-parallel rank):
the scheduler fills slots it reserved for promotions started at lookup (promotion.py). The index
gives each slot to one writer at a time, so the two processes never write the same slot at once.
On a GPU, a chunk in a cpu slot moves through vLLM's own copy handlers (copies.py's SlabCopier:
one batched copy per run of consecutive chunks of a group, `HostCopies.submit_runs`), straight
between the blocks and the page-locked slot; any other chunk through a pooled pinned buffer on a
side stream (copies.py).
Nothing synchronizes in `submit_*`: a job finishes when its transfers and its event have ended
(`get_finished` polls). The tests run this path on CPU tensors that claim CUDA
(tests/integrations/vllm_engineless/fake_cuda.py); scripts/gpu-check.py is ready for a GPU.

A job that cannot be completed (a tier miss, a corrupt payload, a layout mismatch) finishes
with `success=False` and is never reported as loaded. vLLM 0.32's own OffloadingConnector
asserts success; `KvtierConnector` (connector.py) turns the failure into vLLM's
"failed receive" so the request is recomputed.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvtier.store.buffers import POOL_BUFFERS, BufferPool
from kvtier.store.lane import Lane
from kvtier.store.tiers.base import Tier
from kvtier.store.tiers.cpu import fence

from .common import ChunkItem, KvtierLoadStoreSpec, SlotMove, SlotRelease, SlotReserve, SpecContext
from .copies import EXPEDITED, LOAD, STORE, HostCopies, layer_refs
from .counters import Metrics
from .placement import Misplaced, place
from .tiers import worker_tiers

log = logging.getLogger("kvtier.vllm")


@dataclass(slots=True)
class _Job:
    """A job whose copies are still running on a GPU."""
    job_id: int
    event: object  # the side stream's torch.cuda.Event, or None
    tids: list[int]  # the copier's transfers
    bufs: list[torch.Tensor]  # host buffers its copies read, given back when it ends
    nbytes: int
    t0: float
    kind: str  # "store" / "load"


MOVED_KEPT = 65536  # moves remembered for queued disk/Redis writes (SlowIO.moved)


class KvtierWorker(OffloadingWorker):
    def __init__(self, ctx: SpecContext, kv_caches: CanonicalKVCaches, metrics: Metrics) -> None:
        self.ctx = ctx
        self.metrics = metrics
        self.bpc = ctx.blocks_per_chunk
        plan = ctx.plan
        tensors = [t.tensor.view(torch.uint8) for t in kv_caches.tensors]
        self.device = tensors[0].device
        self.refs = layer_refs(tensors, kv_caches.group_data_refs, plan, self.bpc)
        self.tiers: dict[str, Tier] = worker_tiers(ctx, self.device.type == "cuda")  # tiers.py
        # On a GPU: chunks in cpu slots move through vLLM's own copy handlers (SlabCopier); other
        # chunks (no cpu slot: staging buffers) on a side stream through pinned host buffers
        # (copies.py). A job finishes when its transfers and its event have ended (get_finished
        # polls); a store's disk and Redis writes wait for them on the lane. On CPU every job
        # finishes inside submit_*.
        self.copies = HostCopies(self.refs, self.bpc, self.device, self._cpu if tensors[0].is_cuda else None)
        self._in_flight: list[_Job] = []
        self._finished: list[TransferResult] = []
        self._pool = BufferPool(POOL_BUFFERS, pin=self.copies.pin)  # staging buffers, reused by size
        slow = [t for t in self.tiers if t != "cpu"]
        # loads whose disk/Redis reads finished on the lane: slow.read_done, ((job id, start,
        # placement), read result)
        self.slow = SlowIO(ctx, self.tiers, metrics, self._pool, self.copies,
                           Lane("tier-io", ctx.config.io_queue_bytes) if slow else None)
        self._reading: set[int] = set()
        self._share_batch = 0  # the last batch of share ops applied (apply_share_ops)
        self._region_seen = (0, 0)  # the host region's released bytes and failed reserves, exported
        self.metrics.flush(force=True)

    # -- the learned share's ops (manager.py `_observe`) ---------------------------------------

    def apply_share_ops(self, batch: int, ops: Sequence[SlotMove | SlotRelease | SlotReserve]) -> None:
        """The manager's moves, releases and reserves of one step, in order, before any transfer
        of this step is submitted (KvtierConnector.handle_preemptions); each batch once. No job in
        flight reads or writes a slot they touch: the index never moves a pinned or reserved
        entry, and keeps a pool above every such slot. With a host region the batch's number is
        published after its ops ran (`HostRegion.set_applied`): the scheduler fills a slot of a
        group only once every batch that touched the group is applied."""
        if batch <= self._share_batch:
            return
        self._share_batch = batch
        cpu = self._cpu
        for op in ops:
            if cpu is None or op.tier != "cpu":  # only the cpu tier is learned (SpecContext.learned)
                continue
            if isinstance(op, SlotMove):
                self._share_move(cpu, op)
            elif isinstance(op, SlotReserve):
                cpu.reserve(op.group, op.slots)  # a region's pages: reserved off this thread
            else:
                self._share_release(cpu, op)
        region = getattr(cpu, "region", None)
        if region is not None:
            region.set_applied(batch)
        self.region_counts()

    def region_counts(self) -> None:
        """What the cpu tier's host region did off the engine thread since the last call, into
        the metrics: bytes punched (`share_released_bytes`), reservations refused
        (`share_reserve_failed`)."""
        region = getattr(self._cpu, "region", None)
        if region is None:
            return
        freed, failed = region.released_bytes, region.reserve_failed
        if freed > self._region_seen[0]:
            self.metrics.add("share_released_bytes", freed - self._region_seen[0])
        if failed > self._region_seen[1]:
            self.metrics.add("share_reserve_failed", failed - self._region_seen[1])
        self._region_seen = (freed, failed)

    def _share_move(self, cpu, op: SlotMove) -> None:  # noqa: ANN001 - the CpuTier
        """Copy the chunk the index moved into its new slot; its old slot is freed. A source that
        no longer holds that chunk (never filled, overwritten: not expected) clears the new slot,
        so a load of it there is a counted miss, never another chunk's bytes."""
        g = op.group
        stored = cpu.header(g, op.src)
        if stored is None or stored.chunk_hash != op.chunk_hash or stored.namespace_id != self.ctx.namespace.id:
            cpu.free(g, op.dst)
            self.metrics.add("share_move_failed", group=g)
            return
        old = cpu.generation(g, op.src)
        ok = cpu.move(g, op.src, op.dst, stored)  # verified copy; src freed (both, if it fails)
        if ok:
            self.metrics.add("share_moves_applied", group=g)
            moved = self.slow.moved
            if len(moved) >= MOVED_KEPT:
                del moved[next(iter(moved))]
            moved[(g, op.src)] = (op.dst, old, cpu.generation(g, op.dst))
        else:  # the move freed both slots: a load of it is a counted miss
            self.metrics.add("share_move_failed", group=g)

    def _share_release(self, cpu, op: SlotRelease) -> None:  # noqa: ANN001 - the CpuTier
        """Give back the memory of the group's slots from `op.slots` on (their headers cleared;
        `CpuTier.release`: madvise DONTNEED, or a host region's pages punched off this thread,
        counted by `region_counts`)."""
        n = cpu.release(op.group, op.slots)
        if n:
            self.metrics.add("share_released_bytes", int(n), group=op.group)

    # -- OffloadingWorker ----------------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        t0 = time.perf_counter()
        assert isinstance(dst_spec, KvtierLoadStoreSpec)
        ok, nbytes, event, tids, later = self._store(src_spec, dst_spec.items)
        if later:  # each write first waits there for the copies (SlowIO.write_slow)
            self.slow.queue(later, (event, tids))
        if event is not None or tids:  # device->host copies in flight
            self._in_flight.append(_Job(job_id, event, tids, [], nbytes, t0, "store"))
        else:
            self._done(job_id, ok, nbytes, t0, "store")
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        """vLLM 0.33 passes `expedited=True` for a load it waits on within the step (a sync load,
        with `sync_load_budget_bytes`): its request runs on these blocks this very step and vLLM
        cannot hear that the load failed. The manager then hands out host-only loads (host_only.py),
        so such a load reads verified cpu slots only, in this call; one that would read disk or
        Redis, or that fails, stops the engine (SyncLoadError) rather than let a request run on
        KV that was never restored. 0.32 never passes the argument."""
        t0 = time.perf_counter()
        assert isinstance(src_spec, KvtierLoadStoreSpec)
        if expedited:
            self._sync_load(job_id, src_spec, dst_spec, t0)
            return True
        placement = self._placement(dst_spec, src_spec.items)
        if placement is None:
            self._done(job_id, False, 0, t0, "load")
            return True
        slow = any(it.places and it.places[0][0] != "cpu" for _, placed in placement for it, _ in placed)
        if slow and self.slow.lane is not None:
            self._reading.add(job_id)  # disk/Redis reads on the lane; scattered in get_finished
            # read_later False: the lane is closed (shutdown), a failed load
            if not self.slow.read_later(placement, (job_id, t0, placement)):
                self._reading.discard(job_id)
                self._done(job_id, False, 0, t0, "load")
            # an expedited load (0.33's sync loads) is waited for by vLLM's wait(), not here
            return True
        self._finish_load(job_id, t0, placement, self.slow.read(placement))
        return True

    def _sync_load(self, job_id: int, src_spec: KvtierLoadStoreSpec, dst_spec: GPULoadStoreSpec, t0: float) -> None:
        slow = [it for it in src_spec.items if not it.places or it.places[0][0] != "cpu"]
        placement = self._placement(dst_spec, src_spec.items) if not slow else None
        if placement is not None:
            before = len(self._finished)
            self._finish_load(job_id, t0, placement, self.slow.read(placement), expedited=True)
            if not any(r.job_id == job_id and not r.success for r in self._finished[before:]):
                self.metrics.add("sync_load_jobs")
                return
        self.metrics.add("sync_load_jobs_failed")
        self.metrics.flush(force=True)
        where = f"{len(slow)} of its chunks are not in host memory" if slow else "a cpu slot did not hold its chunk"
        raise SyncLoadError(f"kvtier: synchronous load job {job_id} failed ({where}); vLLM would run the "
                            "request on KV that was never restored, so the engine stops. Remove "
                            "sync_load_budget_bytes from kv_connector_extra_config and report this")

    def _finish_load(self, job_id: int, t0: float, placement: list, read: tuple[bool, list, int],
                     expedited: bool = False) -> None:
        """On the engine thread: check the chunks the cpu tier holds (their slots are read in
        place, right now, so no store can take a slot in between) and copy them and the chunks
        read from disk or Redis into their blocks. Nothing is copied unless every chunk is there."""
        ok, staged, _ = read
        # (g, index of the chunk in its group, blocks, row, tier, cpu slot or None)
        sources: list[tuple[int, int, list[tuple[int, int]], torch.Tensor, str, int | None]] = []
        held: list[torch.Tensor] = []  # staging buffers the copies read (given back after them)
        cpu = self._cpu
        for g, placed in placement if ok else ():
            for i, (item, blocks) in enumerate(placed):
                tier, slot = item.places[0]
                if tier != "cpu":
                    continue
                if cpu is None or not cpu.holds(g, slot, self.ctx.blocks_header(item, blocks)):
                    self.metrics.add("load_miss_cpu", group=g)  # evicted, or not the span needed
                    ok = False
                    break
                sources.append((g, i, blocks, cpu.slabs[g][slot], "cpu", slot))
            if not ok:
                break
        if not ok:
            for _, _, _, buf, _, _ in staged:
                self._pool.give(buf)
            self._done(job_id, False, 0, t0, "load")
            return
        for g, i, blocks, buf, tier, item in staged:
            row, slot = self._fill_at_load(cpu, g, blocks, buf, tier, item)
            if row is None:
                sources.append((g, i, blocks, buf, tier, None))
                held.append(buf)
            else:  # the blocks are filled from the slot (pinned on a GPU); the buffer is free now
                sources.append((g, i, blocks, row, tier, slot))
                self._pool.give(buf)
        # chunks in cpu slots: vLLM's handlers, one transfer a run; the rest copied here
        runs = [(g, i, blocks, slot) for g, i, blocks, _, _, slot in sources if self.copies.by_copier(g, slot)]
        tids = self.copies.submit_runs(EXPEDITED if expedited else LOAD, runs) if runs else []
        copied = [s for s in sources if not self.copies.by_copier(s[0], s[5])]
        if copied and self.copies.stream is not None:  # blocks just allocated may still be zeroed on the compute stream
            self.copies.stream.wait_compute()
        for g, _, blocks, row, _, _ in copied:
            self.copies.copy_in(g, blocks, row)
        nbytes = sum(self.copies.moved_bytes(g, blocks) for g, _, blocks, _, _, _ in sources)
        for g, _, blocks, _, tier, _ in sources:  # counted here, once the whole job restores
            self.metrics.add("loaded_blocks", len(blocks), group=g)
            self.metrics.add(f"loaded_chunks_{tier}", group=g)
            self.metrics.add(f"loaded_chunks_group{g}")
            self.metrics.add(f"loaded_bytes_{tier}", self.ctx.plan.groups[g].chunk_bytes, group=g)
        event = None
        if copied and self.copies.stream is not None:
            event = self.copies.stream.record()
        if event is None and not tids:
            for buf in held:
                self._pool.give(buf)
            self._done(job_id, True, nbytes, t0, "load")
            return
        # the slot rows stay valid: the manager keeps them pinned until this load ends
        self._in_flight.append(_Job(job_id, event, tids, held, nbytes, t0, "load"))

    def _finish_reads(self) -> None:
        read_done = self.slow.read_done
        while read_done:  # loads whose tier reads finished on the lane
            (job_id, t0, placement), read = read_done.popleft()
            self._reading.discard(job_id)
            self._finish_load(job_id, t0, placement, read)

    def get_finished(self) -> list[TransferResult]:
        self._finish_reads()
        self.region_counts()  # two integers compared: what the host region's keeper did
        if self._in_flight:
            self.copies.poll()
            running = []
            for job in self._in_flight:
                if not self.copies.ended(job.event, job.tids):
                    running.append(job)
                    continue
                for buf in job.bufs:  # host buffers may go now
                    self._pool.give(buf)
                self._done(job.job_id, True, job.nbytes, job.t0, job.kind)
            self._in_flight = running
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        if self.slow.lane is not None and self._reading & set(job_ids):
            # only when vLLM asks to wait for a load on disk or Redis. A store write queued before
            # it may wait for the copier's poll (SlabCopier.wait_polling): keep polling meanwhile
            while not self.slow.lane.drain(0.005):
                self.copies.poll()
            self._finish_reads()
        for job in self._in_flight:
            if job.job_id in job_ids:
                self.copies.wait(job.event, job.tids)

    def drain(self, timeout: float | None = 30.0) -> bool:
        """Wait until every disk and Redis write and read queued so far has run."""
        return self.slow.lane.drain(timeout) if self.slow.lane is not None else True

    def shutdown(self) -> None:
        # the copies end before vLLM frees its KV tensors, whether or not the lane will finish;
        # first, so that no queued store write still waits for one
        self.copies.shutdown()
        lane_closed = self.slow.lane is None or self.slow.lane.close()
        self.metrics.flush(force=True)
        if not lane_closed:
            # queued disk/Redis I/O did not finish in time: leave the tiers open to it
            log.warning("kvtier: background tier I/O still running at shutdown; tiers left open")
            return
        for tier in self.tiers.values():
            tier.close()

    # -- transfers -----------------------------------------------------------------------------

    def _done(self, job_id: int, ok: bool, nbytes: int, t0: float, kind: str) -> None:
        dt = time.perf_counter() - t0
        self.metrics.add(f"{kind}_jobs" if ok else f"{kind}_jobs_failed")
        self._finished.append(TransferResult(job_id, ok, nbytes if ok else None, dt if ok else None))

    def _placement(self, spec: GPULoadStoreSpec, items: Sequence[ChunkItem]) -> list | None:
        """Per group: each chunk item with its (block id, position in chunk) pairs
        (placement.place); None, logged, when vLLM's blocks and the items do not line up."""
        placed = place(spec.block_ids, spec.group_sizes, spec.block_indices, items, self.bpc)
        if isinstance(placed, Misplaced):
            log.error("kvtier: %s", placed.reason)
            if placed.noncontiguous:
                self.metrics.add("jobs_noncontiguous")
            return None
        return placed

    def _fill_at_load(self, cpu, g: int, blocks: list[tuple[int, int]], buf, tier: str,  # noqa: ANN001
                      item: ChunkItem) -> tuple[object | None, int | None]:
        """A promotion at load, this half's step on the engine thread: copy the verified chunk
        `buf` the load read from disk or Redis (`tier`) into the cpu slot the manager reserved for
        it (a second place ("cpu", slot) in its item), if any, and commit the slot's header; (the
        slot's row, the slot), or (None, None). A chunk the load needs only part of is not
        promoted (its header would claim blocks this load did not check): the slot is freed, a
        later read of it a counted miss. `cpu`: the CpuTier, or None."""
        slot = next((s for t, s in item.places[1:] if t == "cpu"), None)
        if cpu is None or slot is None:
            return None, None
        if len(blocks) != self.ctx.blocks_per_chunk:
            cpu.free(g, slot)
            self.metrics.add("promote_skipped_partial", group=g)
            return None, None
        if cpu.unreserved(g, slot):  # its pages not had (yet): never begun, so no stand-in row
            self.metrics.add("promote_skipped_share", group=g)  # is a copy source; the load
            return None, None  # fills the blocks from `buf`
        row = cpu.begin(g, slot)
        row.copy_(buf)
        cpu.commit(g, slot, self.ctx.blocks_header(item, blocks))
        self.metrics.add(f"promoted_chunks_{tier}", group=g)
        return row, slot

    @property
    def _cpu(self):  # noqa: ANN202 - the CpuTier, or None without a cpu tier
        return self.tiers.get("cpu")

    def _store(self, spec: GPULoadStoreSpec, items: Sequence[ChunkItem]) -> tuple:
        """Copy each chunk's pages out of its blocks, once: straight into its cpu tier slot (the
        slot's header is dropped first and set after, `CpuTier.begin`/`commit`), or, for a chunk
        without a cpu slot, into a zeroed host buffer. Returns (ok, bytes, the side stream's event
        or None, the copier's transfer ids, the disk/Redis writes to queue): a write waits for
        the copies first, and one of a chunk in a cpu slot copies the slot and goes ahead only if
        the slot still holds that chunk (`SlowIO.write_slow`)."""
        placement = self._placement(spec, items)
        if placement is None:
            return False, 0, None, [], []
        cpu, total = self._cpu, 0
        later: list[tuple] = []  # slow-tier writes
        to_slots: list[tuple[int, int, list[tuple[int, int]], int]] = []  # for the copier
        copied = False  # anything copied here (on a GPU: on the side stream)
        if self.copies.stream is not None:  # the side stream must see what the model wrote
            self.copies.stream.wait_compute()
        for g, placed in placement:
            nbytes = self.ctx.plan.groups[g].chunk_bytes
            for i, (item, blocks) in enumerate(placed):
                header = self.ctx.blocks_header(item, blocks)
                total += self.copies.moved_bytes(g, blocks)
                slow = [(t, slot) for t, slot in item.places if t != "cpu"]
                cpu_slot = next((slot for t, slot in item.places if t == "cpu"), None)
                if cpu is not None and cpu_slot is not None:
                    row = cpu.begin(g, cpu_slot)
                    if self.copies.by_copier(g, cpu_slot):
                        to_slots.append((g, i, blocks, cpu_slot))
                    else:
                        self.copies.copy_out(g, blocks, row)
                        copied = True
                    # on a GPU committed before the asynchronous copy lands: nothing reads the slot
                    # before the job ended (vLLM loads it after complete_store; the writes wait)
                    cpu.commit(g, cpu_slot, header)
                    self.metrics.add("stored_chunks_cpu", group=g)
                    self.metrics.add("stored_bytes_cpu", nbytes, group=g)
                    if slow:
                        gen = cpu.generation(g, cpu_slot)
                        later.append((g, slow, nbytes, ("cpu", cpu_slot, gen, header, blocks)))
                elif slow:
                    buf = self._pool.take(nbytes, zero=True)
                    self.copies.copy_out(g, blocks, buf)
                    copied = True
                    later.append((g, slow, nbytes, ("buf", buf, header)))
        tids = self.copies.submit_runs(STORE, to_slots) if to_slots else []
        event = None
        if copied and self.copies.stream is not None:
            event = self.copies.stream.record(blocking=True)  # the lane waits on it without spinning a core
        return True, total, event, tids, later


# -- the worker's disk and Redis work, on the lane (SlowIO) ------------------------------------

Placement = list  # placement.place's answer: [(group, [(item, blocks)])]
ReadResult = tuple[bool, list, int]  # (all found, [(group, index in group, blocks, buffer, tier, item)], bytes)


class SlowIO:
    """The worker's disk and Redis work, on one background thread (store/lane.py).

    `submit_*` never wait for a disk or a network. A store's disk and Redis writes are queued here
    after its copies were submitted (`queue`); the lane's queue drops a write past
    `kvtier.io_queue_bytes` (counted `store_dropped_<tier>`). A write from a cpu slot copies the slot
    and goes ahead only if the slot still holds the chunk afterwards (its sequence number unchanged;
    `begin` changes it before new bytes arrive, cpu.py), so a slot taken for another chunk meanwhile
    never lands under the old chunk's header on disk (counted `store_overwritten_<tier>`). A load's
    chunks on disk or in Redis are read and verified into staging buffers here (`read`); the worker
    copies them into blocks on the engine thread.
    """

    def __init__(self, ctx: SpecContext, tiers: Mapping[str, Tier], metrics: Metrics, pool: BufferPool,
                 copies: HostCopies, lane: Lane | None) -> None:
        """`ctx`: the worker's (chunk bytes, `blocks_header`: a chunk's header over its blocks);
        `lane`: None when there is no disk or Redis tier."""
        self.ctx = ctx
        self.tiers = tiers
        self.metrics = metrics
        self.pool = pool
        self.copies = copies
        self.chunk_bytes = [gp.chunk_bytes for gp in ctx.plan.groups]
        self.lane = lane
        # (group, old slot) -> (new slot, the old slot's generation, the new one's) of each chunk
        # the learned share moved (KvtierWorker._share_move), so a write queued before the move
        # follows the chunk (write_slow); bounded: the oldest go first (a write queued that long
        # is a counted skip)
        self.moved: dict[tuple[int, int], tuple[int, int, int]] = {}
        # loads read on the lane: (the caller's tag, the read's result), in the order they ran
        self.read_done: deque[tuple[object, ReadResult]] = deque()

    def queue(self, later: list[tuple], copies: tuple) -> None:
        """Queue a store's disk and Redis writes (g, [(tier, slot)], bytes, source) on the lane;
        each first waits there for `copies`, the store's device->host copies (event, transfer
        ids: `HostCopies.wait_on_lane`)."""
        for g, slow, nbytes, src in later:
            if self.lane is None:  # no lane (only when driven by hand): the writes run inline
                self.write_slow(copies, g, slow, nbytes, src)
            elif not self.lane.submit(
                    partial(self.write_slow, copies, g, slow, nbytes, src),
                    write_bytes=nbytes * len(slow)):
                # the queue is full: these tiers skip the chunk (a later load there is a counted
                # miss); the engine never waits for a disk or a network
                for tier, _ in slow:
                    self.metrics.add(f"store_dropped_{tier}", group=g)
                if src[0] == "buf" and self.copies.stream is None:  # on a GPU its copy may still run:
                    self.pool.give(src[1])  # left to PyTorch's pinned allocator, which waits for it

    def write_slow(self, copies: tuple, g: int, slow: list, nbytes: int, src: tuple) -> None:
        """On the lane: write one chunk into its disk/Redis places, once its device->host copies
        (event, transfer ids) ended. From a cpu slot: the slot is copied first and the write goes
        ahead only if the slot still holds this chunk afterwards (its sequence number unchanged
        since the store committed it: every `begin`, in this process or the scheduler's, changes
        it before any new bytes arrive); otherwise the slot was taken for another chunk meanwhile and
        the write is skipped, counted `store_overwritten_<tier>` (so is one whose slot's memory is
        not reserved in the host region: `HostRegion.copy_out`); a chunk the learned share moved
        meanwhile (the old slot's generation at the move was the one committed) is copied from
        its new slot under the same check. Positions the chunk does not hold are zeros in what
        is written."""
        self.copies.wait_on_lane(*copies)
        if src[0] == "buf":
            data, header = src[1], src[2]
        else:
            _, slot, gen, header, blocks = src
            cpu = self.tiers.get("cpu")
            data = self.pool.take(nbytes, zero=False)
            region = getattr(cpu, "region", None)
            lost = region is not None and not region.intact()  # truncated by a process of this user:
            for _ in range(4):  # moved by the learned share since (once or again)? follow it first
                moved = None if lost or cpu.generation(g, slot) == gen else self.moved.get((g, slot))
                if moved is None or moved[1] != gen:
                    break
                slot, gen = moved[0], moved[2]  # this very chunk, at its new slot
            if lost:  # never touch the mapping then (SIGBUS); the write is a counted miss
                copied = False
            elif region is not None:  # only a reserved slot, never while its pages are punched
                copied = region.copy_out(g, slot, data)
            else:
                data.copy_(cpu.slabs[g][slot])
                copied = True
            fence()  # the copy's loads before the sequence number's (cpu.py's seqlock)
            if not copied or cpu.generation(g, slot) != gen:
                for tier, tslot in slow:
                    self.metrics.add(f"store_overwritten_{tier}", group=g)
                    if tier == "disk":  # the slot's previous occupant must read as empty, not
                        # as a foreign chunk (a corrupt drop); later writes to it queue after this
                        self.tiers[tier].free(g, tslot)
                self.pool.give(data)
                return
            self.copies.zero_unheld(g, blocks, data)
        for tier, slot in slow:
            self.write(tier, [(g, slot, header, data)], nbytes)
        self.pool.give(data)

    def write(self, tier: str, batch: list, nbytes: int) -> int:
        """Write a batch into a disk or Redis tier (on the lane)."""
        good = 0
        for (g, _, _, _), written in zip(batch, self.tiers[tier].write_many(batch)):
            if written:
                good += 1
                self.metrics.add(f"stored_chunks_{tier}", group=g)
                self.metrics.add(f"stored_bytes_{tier}", nbytes, group=g)
            else:
                self.metrics.add(f"store_failed_{tier}", group=g)
        return good

    def read_later(self, placement: Placement, tag: object) -> bool:
        """Queue `read(placement)` on the lane; `(tag, result)` is appended to `read_done` there
        after it, a failed read as a miss (a job must always finish). False: the lane is closed
        (shutdown), nothing queued."""
        assert self.lane is not None

        def read() -> None:
            try:
                result = self.read(placement)
            except Exception:  # noqa: BLE001 - a job must always finish, as a miss here
                log.exception("kvtier: a tier read failed; the load fails and vLLM recomputes")
                result = (False, [], 0)
            self.read_done.append((tag, result))

        return self.lane.submit(read)

    def read(self, placement: Placement) -> ReadResult:
        """Read and verify the chunks of a load that are on disk or in Redis into host buffers:
        (all found, [(group, index in group, blocks, buffer, tier, item)], bytes). Runs on the lane. Chunks in the
        cpu tier are checked and copied from their slots later, on the engine thread
        (the worker's `_finish_load`), which also promotes what was read here into the cpu tier."""
        total = 0
        staged = []
        for g, placed in placement:
            nbytes = self.chunk_bytes[g]
            for i, (item, blocks) in enumerate(placed):
                if not item.places:  # the scheduler lost it between lookup and load: a miss
                    self.metrics.add("load_miss_vanished", group=g)
                    return False, [], 0
                tier, slot = item.places[0]
                if tier == "cpu":
                    continue
                buf = self.pool.take(nbytes, zero=False)
                if not self.tiers[tier].read(g, slot, self.ctx.blocks_header(item, blocks), buf):
                    # a miss or a corrupt payload (the tier counted and dropped it): nothing of
                    # this job is reported as loaded; vLLM recomputes the request
                    self.metrics.add(f"load_miss_{tier}", group=g)
                    for st in staged:
                        self.pool.give(st[3])
                    self.pool.give(buf)
                    return False, [], 0
                staged.append((g, i, blocks, buf, tier, item))
                total += nbytes
        return True, staged, total


class SyncLoadError(RuntimeError):
    """A synchronous load (vLLM 0.33's sync_load_budget_bytes) could not restore its chunks."""

