"""The worker-side half of the kvtier spec: copies chunks between vLLM's KV tensors and tiers.

vLLM hands the worker its KV cache as canonical per-block byte views: a list of int8 tensors of
shape (num_blocks, page_bytes) and, per KV-cache group, the (tensor, page bytes) of each of its
layers. A chunk payload of group g is, for each layer ref of g in vLLM's order, the pages of the
chunk's `blocks_per_chunk` blocks back to back: `sum(page_bytes) * blocks_per_chunk` bytes, the
group's own size (not a row sized for all groups).

`submit_*` never wait for a disk or a network (lane.py). A store copies each chunk's pages once,
straight into the chunk's slot in the cpu tier (one preallocated slab per group, pinned where
CUDA is present: `CpuTier.begin`/`commit`), and queues the chunk's disk and Redis writes on one
background thread, whose queue drops a write past `kvtier.io_queue_bytes` (counted
`store_dropped_<tier>`). That thread copies the slot and writes the copy only if the slot still
holds the chunk afterwards (the slot's sequence number unchanged; `begin` changes it before
new bytes arrive, cpu.py), so a slot taken for another chunk meanwhile never lands under the old chunk's
header on disk (counted `store_overwritten_<tier>`). A chunk without a cpu slot is gathered into
a zeroed host buffer instead. A load checks each cpu-tier chunk's header and copies the slot's
pages into the blocks in place, on the engine thread (no store can take the slot in between);
chunks on disk or in Redis are read and verified on the background thread first, and copied in
`get_finished`. vLLM keeps the request waiting meanwhile, as it does for any asynchronous load.
Such a chunk is also promoted when the scheduler reserved a cpu slot for it (a second place
`("cpu", slot)` in its item, manager.py): the verified bytes are copied into that slot on the
engine thread and the blocks are filled from the slot, so the next hit reads host memory.
The cpu tier's slabs and slot table live in a file the scheduler's process maps too
(`kvtier.host_region`, host_region.py; one per tensor-parallel rank): the scheduler fills slots it reserved
for promotions started at lookup (manager.py). The index gives each slot to one writer at a
time, so the two processes never write the same slot at once. Host buffers for reads and for stores without a cpu slot come
from a small pool (`POOL_BUFFERS` per size), not one allocation per call.
When the tensors live on a GPU, a chunk in a cpu slot moves through vLLM's own copy handlers
(copier.py: `SingleDirectionOffloadingHandler`, one batched copy per run of consecutive chunks of
a group, on vLLM's pooled streams; expedited loads on their own handler), straight between the
blocks and the slot (page-locked), one copy. A chunk without a cpu slot (a store to disk or Redis
only, a read not promoted) goes through a pooled pinned buffer on a side stream. Nothing
synchronizes in `submit_*`: a job finishes when its transfers and its event have ended
(`get_finished` polls), and a store's disk and Redis writes wait for its copies on the lane
thread. The tests run this path on CPU tensors that claim CUDA, through vLLM's real descriptor
code with the copy emulated asynchronously (tests/integrations/vllm_engineless/fake_cuda.py);
it has not run on a GPU yet (scripts/gpu-check.py is ready for one).

A job that cannot be completed (a tier miss, a corrupt payload, a layout mismatch) finishes
with `success=False` and is never reported as loaded. vLLM 0.32's own OffloadingConnector
asserts success; `KvtierConnector` (connector.py) turns the failure into vLLM's
"failed receive" so the request is recomputed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
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

from kvtier.errors import ConfigError
from kvtier.store.integrity import Keyed
from kvtier.store.lane import Lane
from kvtier.store.payload import make_header
from kvtier.store.tiers.base import Tier, TierLayout
from kvtier.store.tiers.cpu import fence

from .common import ChunkItem, KvtierLoadStoreSpec, Metrics, SpecContext
from .copier import EXPEDITED, LOAD, STORE, SideStream

log = logging.getLogger("kvtier.vllm")

POOL_BUFFERS = 8  # host staging buffers kept per size for reuse (pinned on a GPU)


@dataclass(frozen=True, slots=True)
class _Ref:
    tensor: torch.Tensor  # uint8 (num_blocks, >= page_bytes)
    page_bytes: int
    offset: int  # byte offset of this layer's pages inside a chunk payload


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
        if len(kv_caches.group_data_refs) != len(plan.groups):
            raise ConfigError(
                f"vLLM registered {len(kv_caches.group_data_refs)} KV-cache groups, kvtier planned "
                f"{len(plan.groups)}; the engine and the model config disagree"
            )
        tensors = [t.tensor.view(torch.uint8) for t in kv_caches.tensors]
        self.device = tensors[0].device
        self.refs: list[list[_Ref]] = []
        for g, refs in enumerate(kv_caches.group_data_refs):
            out, off = [], 0
            for r in refs:
                out.append(_Ref(tensors[r.tensor_idx], r.page_size_bytes, off))
                off += r.page_size_bytes * self.bpc
            want = plan.groups[g].chunk_bytes
            if plan.groups[g].cacheable and off != want:
                raise ConfigError(
                    f"vLLM's pages for group {plan.groups[g].name!r} make {off}-byte chunks but "
                    f"kvtier planned {want} ({ctx.plan.geometry.source}); kvtier refuses a layout it did not plan"
                )
            self.refs.append(out)
        self._block_bytes = [sum(r.page_bytes for r in refs) for refs in self.refs]  # every layer's page
        index = ctx.new_index()
        from .config import redis_password, tier_secret

        keyed = tier_secret(ctx.config)  # read once, for the disk and Redis tiers alike
        self.tiers: dict[str, Tier] = {}
        for tier in ctx.config.tiers:
            if tier == "redis":  # key-addressed: no slots to lay out
                from kvtier.store.tiers.redis import RedisTier

                self.tiers[tier] = RedisTier.from_url(str(ctx.config.redis_url),
                                                      namespace_id=ctx.namespace.id, keyed=keyed,
                                                      password=redis_password(ctx.config))
                continue
            self.tiers[tier] = _make_tier(tier, ctx.tier_layout(index, tier), ctx, keyed,
                                          self.device.type == "cuda")
        # On a GPU: chunks in cpu slots move through vLLM's own copy handlers (copier.py); other
        # chunks (no cpu slot: staging buffers) on a side stream through pinned host buffers. A
        # job finishes when its transfers and its event have ended (get_finished polls); a
        # store's disk and Redis writes are queued only then. On CPU every job finishes inside
        # submit_*.
        self._pin = self.device.type == "cuda"
        self._stream = SideStream(self.device) if self._pin else None
        self._copier = None
        cpu = self._cpu
        if tensors[0].is_cuda and cpu is not None:
            from .copier import SlabCopier

            self._copier = SlabCopier([[(r.tensor, r.page_bytes, r.offset) for r in refs] for refs in self.refs],
                                      cpu.slabs, cpu.locked, self.bpc)
        self._in_flight: list[_Job] = []
        self._finished: list[TransferResult] = []
        slow = [t for t in self.tiers if t != "cpu"]
        self._lane = Lane("tier-io", ctx.config.io_queue_bytes) if slow else None
        # loads whose disk/Redis reads finished on the lane: (job id, start, placement, read result)
        self._read_done: deque[tuple[int, float, list, tuple[bool, list, int]]] = deque()
        self._reading: set[int] = set()
        self._pool: dict[int, deque[torch.Tensor]] = {}  # staging buffers by size (_take/_give)
        self.metrics.flush(force=True)

    # -- OffloadingWorker ----------------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        t0 = time.perf_counter()
        assert isinstance(dst_spec, KvtierLoadStoreSpec)
        ok, nbytes, event, tids, later = self._store(src_spec, dst_spec.items)
        self._queue_slow(later, event, tids)
        if event is not None or tids:  # device->host copies in flight
            self._in_flight.append(_Job(job_id, event, tids, [], nbytes, t0, "store"))
        else:
            self._done(job_id, ok, nbytes, t0, "store")
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        """vLLM 0.33 passes `expedited=True` for a load it waits on within the step (a sync load,
        with `sync_load_budget_bytes`): its request runs on these blocks this very step and vLLM
        cannot hear that the load failed. The manager then hands out host-only loads (manager.py),
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
        if slow and self._lane is not None:
            self._reading.add(job_id)  # disk/Redis reads on the lane; scattered in get_finished

            def read(job_id=job_id, placement=placement) -> None:
                try:
                    result = self._read(placement)
                except Exception:  # noqa: BLE001 - a job must always finish, as a miss here
                    log.exception("kvtier: a tier read failed; the load fails and vLLM recomputes")
                    result = (False, [], 0)
                self._read_done.append((job_id, t0, placement, result))

            if not self._lane.submit(read):  # the lane is closed (shutdown): a failed load
                self._reading.discard(job_id)
                self._done(job_id, False, 0, t0, "load")
            # an expedited load (0.33's sync loads) is waited for by vLLM's wait(), not here
            return True
        self._finish_load(job_id, t0, placement, self._read(placement))
        return True

    def _sync_load(self, job_id: int, src_spec: KvtierLoadStoreSpec, dst_spec: GPULoadStoreSpec, t0: float) -> None:
        slow = [it for it in src_spec.items if not it.places or it.places[0][0] != "cpu"]
        placement = self._placement(dst_spec, src_spec.items) if not slow else None
        if placement is not None:
            before = len(self._finished)
            self._finish_load(job_id, t0, placement, self._read(placement), expedited=True)
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
                if cpu is None or not cpu.holds(g, slot, self._header(item, blocks)):
                    self.metrics.add("load_miss_cpu", group=g)  # evicted, or not the span needed
                    ok = False
                    break
                sources.append((g, i, blocks, cpu.slabs[g][slot], "cpu", slot))
            if not ok:
                break
        if not ok:
            for _, _, _, buf, _, _ in staged:
                self._give(buf)
            self._done(job_id, False, 0, t0, "load")
            return
        for g, i, blocks, buf, tier, item in staged:
            row, slot = self._promote(g, blocks, buf, tier, item)
            if row is None:
                sources.append((g, i, blocks, buf, tier, None))
                held.append(buf)
            else:  # the blocks are filled from the slot (pinned on a GPU); the buffer is free now
                sources.append((g, i, blocks, row, tier, slot))
                self._give(buf)
        # chunks in cpu slots: vLLM's handlers, one transfer a run; the rest copied here
        runs = [(g, i, blocks, slot) for g, i, blocks, _, _, slot in sources if self._by_copier(g, slot)]
        tids = self._submit_runs(EXPEDITED if expedited else LOAD, runs) if runs else []
        copied = [s for s in sources if not self._by_copier(s[0], s[5])]
        if copied and self._stream is not None:  # blocks just allocated may still be zeroed on the compute stream
            self._stream.wait_compute()
        for g, _, blocks, row, _, _ in copied:
            self._copy_in(g, blocks, row)
        nbytes = sum(self._moved_bytes(g, blocks) for g, _, blocks, _, _, _ in sources)
        for g, _, blocks, _, tier, _ in sources:  # counted here, once the whole job restores
            self.metrics.add("loaded_blocks", len(blocks), group=g)
            self.metrics.add(f"loaded_chunks_{tier}", group=g)
            self.metrics.add(f"loaded_chunks_group{g}")
            self.metrics.add(f"loaded_bytes_{tier}", self.ctx.plan.groups[g].chunk_bytes, group=g)
        event = None
        if copied and self._stream is not None:
            event = self._stream.record()
        if event is None and not tids:
            for buf in held:
                self._give(buf)
            self._done(job_id, True, nbytes, t0, "load")
            return
        # the slot rows stay valid: the manager keeps them pinned until this load ends
        self._in_flight.append(_Job(job_id, event, tids, held, nbytes, t0, "load"))

    def _moved_bytes(self, g: int, blocks: list[tuple[int, int]]) -> int:
        """The bytes a transfer moves for these blocks of group g: what vLLM's transfer_size
        counts (its offload byte and throughput metrics), every layer's page of each block. Not
        the chunk's bytes: a group's first chunk may be moved in part (a load starting mid-chunk,
        a sliding group's store from a block mid-chunk)."""
        return len(blocks) * self._block_bytes[g]

    def _by_copier(self, g: int, slot: int | None) -> bool:
        """Whether a chunk of group g in cpu slot `slot` (None: no slot) moves through vLLM's
        handlers (a GPU), not through `_copy_out`/`_copy_in`."""
        return slot is not None and self._copier is not None and self._copier.covers(g)

    def _submit_runs(self, direction: int, chunks: list[tuple[int, int, list[tuple[int, int]], int]]) -> list[int]:
        """Hand chunks the copier moves (g, index in group, blocks, slot; `_by_copier`) to it,
        one transfer per run of consecutive chunks of a group; the transfer ids."""
        copier = self._copier
        assert copier is not None
        tids: list[int] = []
        run: list[tuple[int, int, list[tuple[int, int]], int]] = []

        def flush() -> None:
            if run:
                bids = [b for _, _, blocks, _ in run for b, _ in blocks]
                tids.append(copier.submit(direction, run[0][0], bids, run[0][2][0][1], [s for *_, s in run]))
                run.clear()

        for g, i, blocks, slot in sorted(chunks, key=lambda c: (c[0], c[1])):
            if run and (run[-1][0] != g or run[-1][1] != i - 1):  # a gap: a chunk copied here
                flush()
            run.append((g, i, blocks, slot))
        flush()
        return tids

    def _promote(self, g: int, blocks: list[tuple[int, int]], buf: torch.Tensor, tier: str,
                 item: ChunkItem) -> tuple[torch.Tensor | None, int | None]:
        """On the engine thread: copy a verified chunk read from disk or Redis into the cpu slot
        the scheduler reserved for it, if any; (the slot's row, the slot), or (None, None). A chunk the
        load needs only part of is not promoted (its header would claim blocks whose bytes were
        not checked for this load): the slot is left empty, a later read of it a counted miss."""
        cpu = self._cpu
        slot = next((s for t, s in item.places[1:] if t == "cpu"), None)
        if cpu is None or slot is None:
            return None, None
        if len(blocks) != self.bpc:
            cpu.free(g, slot)
            self.metrics.add("promote_skipped_partial", group=g)
            return None, None
        row = cpu.begin(g, slot)
        row.copy_(buf)
        cpu.commit(g, slot, self._header(item, blocks))
        self.metrics.add(f"promoted_chunks_{tier}", group=g)
        return row, slot

    def _finish_reads(self) -> None:
        while self._read_done:  # loads whose tier reads finished on the lane
            job_id, t0, placement, read = self._read_done.popleft()
            self._reading.discard(job_id)
            self._finish_load(job_id, t0, placement, read)

    def get_finished(self) -> list[TransferResult]:
        self._finish_reads()
        if self._in_flight:
            if self._copier is not None:
                self._copier.poll()
            running = []
            for job in self._in_flight:
                if (job.event is not None and not job.event.query()) or (
                        job.tids and not self._copier.finished(job.tids)):  # type: ignore[union-attr]
                    running.append(job)
                    continue
                for buf in job.bufs:  # host buffers may go now
                    self._give(buf)
                self._done(job.job_id, True, job.nbytes, job.t0, job.kind)
            self._in_flight = running
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        if self._lane is not None and self._reading & set(job_ids):
            # only when vLLM asks to wait for a load on disk or Redis. A store write queued before
            # it may wait for the copier's poll (copier.wait_polling): keep polling meanwhile
            while not self._lane.drain(0.005):
                if self._copier is not None:
                    self._copier.poll()
            self._finish_reads()
        for job in self._in_flight:
            if job.job_id in job_ids:
                if job.event is not None:
                    job.event.synchronize()
                if job.tids:
                    self._copier.wait(job.tids)  # type: ignore[union-attr]

    def drain(self, timeout: float | None = 30.0) -> bool:
        """Wait until every disk and Redis write and read queued so far has run."""
        return self._lane.drain(timeout) if self._lane is not None else True

    def shutdown(self) -> None:
        # the copies end before vLLM frees its KV tensors, whether or not the lane will finish;
        # first, so that no queued store write still waits for one
        if self._stream is not None:
            self._stream.synchronize()
        if self._copier is not None:
            self._copier.shutdown()  # drains every transfer before the slabs go
        lane_closed = self._lane is None or self._lane.close()
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

    def _placement(
        self, spec: GPULoadStoreSpec, items: Sequence[ChunkItem]
    ) -> list[tuple[int, list[tuple[ChunkItem, list[tuple[int, int]]]]]] | None:
        """Per group: each chunk item with its (block id, position in chunk) pairs, following
        vLLM's rule: a group's blocks start at logical block `block_indices[g]`, so the first
        chunk may begin mid-chunk; items of a group are consecutive in vLLM's key order."""
        out = []
        pos_b = pos_i = 0
        block_ids = [int(b) for b in spec.block_ids]
        for g, (n, first) in enumerate(zip(spec.group_sizes, spec.block_indices)):
            if n == 0:
                continue
            skip = first % self.bpc
            num_chunks = -(-(n + skip) // self.bpc)
            group_items = items[pos_i:pos_i + num_chunks]
            if len(group_items) != num_chunks or any(it.group != g for it in group_items):
                log.error("kvtier: job layout mismatch in group %d (%d blocks from %d, %d items)",
                          g, n, first, len(group_items))
                return None
            placed: list[tuple[ChunkItem, list[tuple[int, int]]]] = [(it, []) for it in group_items]
            for i, b in enumerate(block_ids[pos_b:pos_b + n]):
                p = skip + i
                placed[p // self.bpc][1].append((b, p % self.bpc))
            # Positions are derived from the count of blocks, so they are right only if the blocks
            # are contiguous: only the first chunk may start mid-chunk, every later one must be
            # whole. vLLM leaves out null blocks inside a chunk in some configurations (sliding
            # windows with prefix-cache retention); there a shorter later chunk would put blocks
            # at the wrong positions, so the job fails (a load is recomputed) instead.
            if any(len(blocks) != self.bpc for _, blocks in placed[1:]):
                log.error("kvtier: group %d's blocks are not contiguous (%d blocks from %d for %d "
                          "chunks); the job fails rather than guess positions", g, n, first, num_chunks)
                self.metrics.add("jobs_noncontiguous")
                return None
            out.append((g, placed))
            pos_b += n
            pos_i += num_chunks
        if pos_i != len(items):
            log.error("kvtier: job has %d chunk items, vLLM's block spec covers %d", len(items), pos_i)
            return None
        return out

    def _header(self, item: ChunkItem, blocks: list[tuple[int, int]]):
        """The header of `item` covering only the block positions in `blocks` (block id, position
        in chunk): a store records the token span it really holds, a load asks for the span it
        needs, and a tier serves a load only from a chunk whose stored span contains the needed
        one (`payload.mismatch`). vLLM stores a group's first chunk from a block mid-chunk (a
        sliding group whose earlier blocks were freed); the positions it did not send are zeros
        in the payload and must never reach a block."""
        gp = self.ctx.plan.groups[item.group]
        tpb = gp.group.tokens_per_block
        lo = min(p for _, p in blocks)
        hi = max(p for _, p in blocks) + 1
        return make_header(self.ctx.namespace.id, item.chunk_hash, item.group,
                           item.token_start + lo * tpb, item.token_start + hi * tpb,
                           gp.chunk_bytes, "uint8")

    def _take(self, nbytes: int, zero: bool) -> torch.Tensor:
        """A host staging buffer from the pool (or a new one). zero=True for a store: positions a
        partial chunk does not hold are stored as zeros, never as whatever the buffer held (it
        would go to disk and Redis under a valid checksum). Called on both threads: the deque's
        pop and append are atomic."""
        q = self._pool.get(nbytes)
        try:
            buf = q.pop() if q else None
        except IndexError:  # emptied by the other thread in between
            buf = None
        if buf is None:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)
        if zero:
            buf.zero_()
        return buf

    def _give(self, buf: torch.Tensor) -> None:
        """Return a buffer no copy reads any more; kept for reuse up to POOL_BUFFERS per size."""
        q = self._pool.setdefault(buf.numel(), deque())
        if len(q) < POOL_BUFFERS:
            q.append(buf)

    @property
    def _cpu(self):  # noqa: ANN202 - the CpuTier, or None without a cpu tier
        return self.tiers.get("cpu")

    def _store(self, spec: GPULoadStoreSpec, items: Sequence[ChunkItem]) -> tuple:
        """Copy each chunk's pages out of its blocks, once: straight into its cpu tier slot (the
        slot's header is dropped first and set after, `CpuTier.begin`/`commit`), or, for a chunk
        without a cpu slot, into a zeroed host buffer. Returns (ok, bytes, the side stream's event
        or None, the copier's transfer ids, the disk/Redis writes to queue): a write waits for
        the copies first, and one of a chunk in a cpu slot copies the slot and goes ahead only if
        the slot still holds that chunk (`_write_slow`)."""
        placement = self._placement(spec, items)
        if placement is None:
            return False, 0, None, [], []
        cpu, total = self._cpu, 0
        later: list[tuple] = []  # slow-tier writes
        to_slots: list[tuple[int, int, list[tuple[int, int]], int]] = []  # for the copier
        copied = False  # anything copied here (on a GPU: on the side stream)
        if self._stream is not None:  # the side stream must see what the model wrote
            self._stream.wait_compute()
        for g, placed in placement:
            nbytes = self.ctx.plan.groups[g].chunk_bytes
            for i, (item, blocks) in enumerate(placed):
                header = self._header(item, blocks)
                total += self._moved_bytes(g, blocks)
                slow = [(t, slot) for t, slot in item.places if t != "cpu"]
                cpu_slot = next((slot for t, slot in item.places if t == "cpu"), None)
                if cpu is not None and cpu_slot is not None:
                    row = cpu.begin(g, cpu_slot)
                    if self._by_copier(g, cpu_slot):
                        to_slots.append((g, i, blocks, cpu_slot))
                    else:
                        self._copy_out(g, blocks, row)
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
                    buf = self._take(nbytes, zero=True)
                    self._copy_out(g, blocks, buf)
                    copied = True
                    later.append((g, slow, nbytes, ("buf", buf, header)))
        tids = self._submit_runs(STORE, to_slots) if to_slots else []
        event = None
        if copied and self._stream is not None:
            event = self._stream.record(blocking=True)  # the lane waits on it without spinning a core
        return True, total, event, tids, later

    def _queue_slow(self, later: list[tuple], event, tids: list[int]) -> None:  # noqa: ANN001
        """Queue a store's disk and Redis writes on the lane; each first waits there for the
        store's device->host copies (`event` on the side stream, `tids` in the copier)."""
        if not later:
            return
        wait = None
        if event is not None or tids:
            def wait() -> None:
                with torch.cuda.device(self.device) if self._pin else contextlib.nullcontext():  # never a context on another GPU
                    if event is not None:
                        event.synchronize()
                    if tids:
                        self._copier.wait_polling(tids)  # type: ignore[union-attr]
        for g, slow, nbytes, src in later:
            if self._lane is None:  # no lane (only when driven by hand): the writes run inline
                self._write_slow(wait, g, slow, nbytes, src)
            elif not self._lane.submit(
                    lambda g=g, slow=slow, n=nbytes, src=src: self._write_slow(wait, g, slow, n, src),
                    write_bytes=nbytes * len(slow)):
                # the queue is full: these tiers skip the chunk (a later load there is a counted
                # miss); the engine never waits for a disk or a network
                for tier, _ in slow:
                    self.metrics.add(f"store_dropped_{tier}", group=g)
                if src[0] == "buf" and self._stream is None:  # on a GPU its copy may still run:
                    self._give(src[1])  # left to PyTorch's pinned allocator, which waits for it

    def _write_slow(self, wait, g: int, slow: list, nbytes: int, src: tuple) -> None:  # noqa: ANN001
        """On the lane: write one chunk into its disk/Redis places, once its device->host copy
        ended (`wait`). From a cpu slot: the slot is copied first and the write goes ahead only if the
        slot still holds this chunk afterwards (its sequence number unchanged since the store
        committed it: every `begin`, in this process or the scheduler's, changes it before any
        new bytes arrive); otherwise the slot was taken for another chunk meanwhile and
        the write is skipped, counted `store_overwritten_<tier>`. Positions the chunk does not
        hold are zeros in what is written."""
        if wait is not None:
            wait()
        if src[0] == "buf":
            data, header = src[1], src[2]
        else:
            _, slot, gen, header, blocks = src
            cpu = self._cpu
            data = self._take(nbytes, zero=False)
            region = getattr(cpu, "region", None)
            lost = region is not None and not region.intact()  # truncated by a process of this user:
            if not lost:  # never touch the mapping then (SIGBUS); the write is a counted miss
                data.copy_(cpu.slabs[g][slot])
                fence()  # the copy's loads before the sequence number's (cpu.py's seqlock)
            if lost or cpu.generation(g, slot) != gen:
                for tier, tslot in slow:
                    self.metrics.add(f"store_overwritten_{tier}", group=g)
                    if tier == "disk":  # the slot's previous occupant must read as empty, not
                        # as a foreign chunk (a corrupt drop); later writes to it queue after this
                        self.tiers[tier].free(g, tslot)
                self._give(data)
                return
            self._zero_unheld(g, blocks, data)
        for tier, slot in slow:
            self._write(tier, [(g, slot, header, data)], nbytes)
        self._give(data)

    def _zero_unheld(self, g: int, blocks: list[tuple[int, int]], row: torch.Tensor) -> None:
        lo, hi = blocks[0][1], blocks[-1][1] + 1
        for ref in self.refs[g]:
            page, base = ref.page_bytes, ref.offset
            row[base:base + lo * page].zero_()
            row[base + hi * page:base + self.bpc * page].zero_()

    def _write(self, tier: str, batch: list, nbytes: int) -> int:
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

    def _read(self, placement: list) -> tuple[bool, list, int]:
        """Read and verify the chunks of a load that are on disk or in Redis into host buffers:
        (all found, [(group, index in group, blocks, buffer, tier, item)], bytes). Runs on the lane. Chunks in the
        cpu tier are checked and copied from their slots later, on the engine thread
        (`_finish_load`), which also promotes what was read here into the cpu tier."""
        total = 0
        staged = []
        for g, placed in placement:
            nbytes = self.ctx.plan.groups[g].chunk_bytes
            for i, (item, blocks) in enumerate(placed):
                if not item.places:  # the scheduler lost it between lookup and load: a miss
                    self.metrics.add("load_miss_vanished", group=g)
                    return False, [], 0
                tier, slot = item.places[0]
                if tier == "cpu":
                    continue
                buf = self._take(nbytes, zero=False)
                if not self.tiers[tier].read(g, slot, self._header(item, blocks), buf):
                    # a miss or a corrupt payload (the tier counted and dropped it): nothing of
                    # this job is reported as loaded; vLLM recomputes the request
                    self.metrics.add(f"load_miss_{tier}", group=g)
                    for st in staged:
                        self._give(st[3])
                    self._give(buf)
                    return False, [], 0
                staged.append((g, i, blocks, buf, tier, item))
                total += nbytes
        return True, staged, total

    def _copy_out(self, g: int, blocks: list[tuple[int, int]], row: torch.Tensor) -> None:
        """Copy blocks (block id, position in chunk; positions consecutive) of group g into a
        chunk row: for each layer ref, its pages at the positions they hold. One copy a layer on
        CPU (index_select into the row); on a GPU an async gather + device->host copy on the side
        stream, into pinned memory (the cpu tier's slabs are pinned where CUDA is present)."""
        bids, pages = self._row_pages(g, blocks, row)
        if self._stream is not None:
            def enqueue() -> None:
                ids = bids.to(self.device, non_blocking=True)
                for ref, page, dst in pages:
                    dst.copy_(ref.tensor.index_select(0, ids)[:, :page], non_blocking=True)

            self._stream.run(enqueue)
            return
        for ref, page, dst in pages:
            if ref.tensor.shape[1] == page:
                torch.index_select(ref.tensor, 0, bids, out=dst)
            else:
                dst.copy_(ref.tensor.index_select(0, bids)[:, :page])

    def _copy_in(self, g: int, blocks: list[tuple[int, int]], row: torch.Tensor) -> None:
        """Copy a chunk row's pages at the blocks' positions into the blocks (the reverse)."""
        bids, pages = self._row_pages(g, blocks, row)
        if self._stream is not None:
            def enqueue() -> None:
                ids = bids.to(self.device, non_blocking=True)
                for ref, page, src in pages:
                    ref.tensor[ids, :page] = src.to(self.device, non_blocking=True)

            self._stream.run(enqueue)
            return
        for ref, page, src in pages:
            ref.tensor[bids, :page] = src

    def _row_pages(self, g: int, blocks: list[tuple[int, int]], row: torch.Tensor) -> tuple[torch.Tensor, list]:
        """The blocks' ids (pinned on a GPU: a non_blocking copy from pageable memory may wait
        for the side stream) and, per layer ref of group g, (ref, page bytes, the row's
        (n, page) view of that ref's pages at the blocks' positions)."""
        lo, n = blocks[0][1], len(blocks)
        bids = torch.tensor([b for b, _ in blocks], pin_memory=self._pin)
        pages = [(ref, ref.page_bytes,
                  row[ref.offset + lo * ref.page_bytes:ref.offset + (lo + n) * ref.page_bytes].view(n, ref.page_bytes))
                 for ref in self.refs[g]]
        return bids, pages


class SyncLoadError(RuntimeError):
    """A synchronous load (vLLM 0.33's sync_load_budget_bytes) could not restore its chunks."""


def _make_tier(name: str, layout: TierLayout, ctx: SpecContext, keyed: Keyed | None, pin: bool) -> Tier:
    if name == "cpu":
        from kvtier.store.tiers.cpu import CpuTier

        region = _host_region(layout, ctx)
        if region is not None:  # a file the scheduler's process maps too (faulted in at creation)
            register = None
            if pin:
                from vllm.v1.kv_offload.cpu.host_register import host_register, host_unregister

                register = (host_register, host_unregister)
            return CpuTier(layout, pin_memory=pin, host_register=register, region=region)
        if not pin:
            tier = CpuTier(layout, pin_memory=False)
            # every page faulted in now, at start: a store into a slot never touched before paid
            # its page faults inside the engine step (8 chunks of 2.9 MiB: 11.7 ms, against
            # 2.9 ms once touched; a registered slab on a GPU is faulted in by its registration)
            for slab in tier.slabs:
                slab.zero_()
            return tier
        # page-locked as vLLM's own CPU tier locks its region (its host_register, which clears
        # CUDA's error state when registration fails), not through PyTorch's power-of-two allocator
        from vllm.v1.kv_offload.cpu.host_register import host_register, host_unregister

        return CpuTier(layout, pin_memory=True, host_register=(host_register, host_unregister))
    if name == "disk":
        from kvtier.store.tiers.disk import DiskTier

        root = ctx.disk_root
        assert root is not None
        root.mkdir(parents=True, exist_ok=True)
        return DiskTier(root, layout, ctx.namespace.id, keyed=keyed)
    raise ConfigError(f"tier {name!r} is not available in the vLLM worker")


def _host_region(layout: TierLayout, ctx: SpecContext):  # noqa: ANN202 - a HostRegion or None
    """The cpu tier's slabs in a file the scheduler's process maps (promotion at lookup,
    manager.py), or None (no region for this engine, or it cannot be made: then the slabs are
    private memory and promotion happens at load; the warning says how to fix it)."""
    name = ctx.new_region_name()
    base = ctx.config.host_region_dir
    if name is None or base is None or not any(layout.num_slots):
        return None
    from kvtier.store.tiers.host_region import HostRegion, RegionError

    try:
        return HostRegion.create(base, name, layout)
    except (RegionError, OSError) as exc:
        log.warning("kvtier: the cpu tier stays private to the worker, so chunks on disk or in Redis "
                    "are promoted at load, not at lookup: %s (or set kvtier.host_region to \"off\" "
                    "to silence this)", exc)
        return None
