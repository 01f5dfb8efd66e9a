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
  for chunks in cpu slots on a GPU, vLLM's copy handlers (copier.py), and waiting for them;
- slow_io.py: disk and Redis reads and write-behind on one background thread (store/lane.py);
- store/buffers.py: the pool of host staging buffers (`POOL_BUFFERS` per size);
- tiers.py: the tiers, built by store/tiers/factory.py.

`submit_*` never wait for a disk or a network. A store copies each chunk's pages once, straight
into the chunk's slot in the cpu tier (one preallocated slab per group, pinned where CUDA is
present: `CpuTier.begin`/`commit`), and queues the chunk's disk and Redis writes (slow_io.py:
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
On a GPU, a chunk in a cpu slot moves through vLLM's own copy handlers (copier.py: one batched
copy per run of consecutive chunks of a group, `HostCopies.submit_runs`), straight between the blocks and
the page-locked slot; any other chunk through a pooled pinned buffer on a side stream (copies.py).
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
from collections.abc import Sequence
from dataclasses import dataclass

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

from .common import ChunkItem, KvtierLoadStoreSpec, SpecContext
from .copier import EXPEDITED, LOAD, STORE
from .copies import HostCopies, layer_refs
from .counters import Metrics
from .placement import Misplaced, place
from .slow_io import SlowIO
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
        # On a GPU: chunks in cpu slots move through vLLM's own copy handlers (copier.py); other
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
        self.metrics.flush(force=True)

    # -- OffloadingWorker ----------------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        t0 = time.perf_counter()
        assert isinstance(dst_spec, KvtierLoadStoreSpec)
        ok, nbytes, event, tids, later = self._store(src_spec, dst_spec.items)
        if later:  # each write first waits there for the copies (slow_io.py)
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
            # it may wait for the copier's poll (copier.wait_polling): keep polling meanwhile
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


class SyncLoadError(RuntimeError):
    """A synchronous load (vLLM 0.33's sync_load_budget_bytes) could not restore its chunks."""

