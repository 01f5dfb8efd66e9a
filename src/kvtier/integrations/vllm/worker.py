"""The worker-side half of the kvtier spec: copies chunks between vLLM's KV tensors and tiers.

vLLM hands the worker its KV cache as canonical per-block byte views: a list of int8 tensors of
shape (num_blocks, page_bytes) and, per KV-cache group, the (tensor, page bytes) of each of its
layers. A chunk payload of group g is, for each layer ref of g in vLLM's order, the pages of the
chunk's `blocks_per_chunk` blocks back to back: `sum(page_bytes) * blocks_per_chunk` bytes, the
group's own size (not a row sized for all groups).

`submit_*` never wait for a disk or a network (lane.py): a store copies the chunk's pages into
a host buffer and writes the cpu tier inline (memory copies), then queues its disk and Redis
writes on one background thread, whose queue drops a write past `kvtier.io_queue_bytes`
(counted `store_dropped_<tier>`). A load whose chunks are all in the cpu tier finishes inline;
one that reads disk or Redis reads and verifies on that thread, and its pages are scattered into
the KV tensors on the engine thread, in `get_finished` (a memory copy). vLLM keeps the request
waiting meanwhile, as it does for any asynchronous load. When the
tensors live on a GPU, the copies run on a side CUDA stream through pinned host buffers (after
waiting for the compute stream): a load finishes when its event fires (`get_finished` polls),
a store waits for its device->host copy before the tier write; tier I/O stays on the host.
(That GPU path has not run on a GPU yet: the machines this was built on had none.)

A job that cannot be completed (a tier miss, a corrupt payload, a layout mismatch) finishes
with `success=False` and is never reported as loaded. vLLM 0.32's own OffloadingConnector
asserts success; `KvtierConnector` (connector.py) turns the failure into vLLM's
"failed receive" so the request is recomputed.
"""

from __future__ import annotations

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
from kvtier.store.payload import ChunkHeader, make_header
from kvtier.store.tiers.base import Tier, TierLayout

from .common import ChunkItem, KvtierLoadStoreSpec, Metrics, SpecContext
from .lane import Lane

log = logging.getLogger("kvtier.vllm")


@dataclass(frozen=True, slots=True)
class _Ref:
    tensor: torch.Tensor  # uint8 (num_blocks, >= page_bytes)
    page_bytes: int
    offset: int  # byte offset of this layer's pages inside a chunk payload


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
            layout = TierLayout(
                slot_bytes=tuple(gp.chunk_bytes if gp.cacheable else 0 for gp in plan.groups),
                num_slots=tuple(index.slots(gp.index, tier) if gp.cacheable else 0
                                for gp in plan.groups),
            )
            self.tiers[tier] = _make_tier(tier, layout, ctx, keyed)
        # On a GPU: copies run on a side stream through pinned host buffers; a load finishes
        # when its event fires (get_finished polls), a store waits for its device->host copy
        # before the tier write. On CPU every job finishes inside submit_*.
        self._pin = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._pin else None
        # (job id, event, host buffers the async copies read, bytes, start time)
        self._in_flight: list[tuple[int, torch.cuda.Event, list[torch.Tensor], int, float]] = []
        self._finished: list[TransferResult] = []
        slow = [t for t in self.tiers if t != "cpu"]
        self._lane = Lane("tier-io", ctx.config.io_queue_bytes) if slow else None
        # loads whose disk/Redis reads finished on the lane: (job id, start, placement, read result)
        self._read_done: deque[tuple[int, float, list, tuple[bool, list, int]]] = deque()
        self._reading: set[int] = set()
        self.metrics.flush(force=True)

    # -- OffloadingWorker ----------------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        t0 = time.perf_counter()
        assert isinstance(dst_spec, KvtierLoadStoreSpec)
        ok, nbytes = self._store(src_spec, dst_spec.items)
        self._done(job_id, ok, nbytes, t0, "store")
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        """vLLM 0.33 passes `expedited=True` for a load it waits on within the step (a sync load;
        the spec refuses `sync_load_budget_bytes`, so kvtier sees one only when driven by hand).
        Every load here finishes inside this call on CPU tensors, so both kinds are handled
        alike; 0.32 never passes the argument."""
        t0 = time.perf_counter()
        assert isinstance(src_spec, KvtierLoadStoreSpec)
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

    def _finish_load(self, job_id: int, t0: float, placement: list, read: tuple[bool, list, int]) -> None:
        ok, staged, nbytes = read
        pending = self._scatter_all(staged) if ok else None
        if pending is not None:  # device copies in flight on the side stream
            self._in_flight.append((job_id, pending[0], pending[1], nbytes, t0))
        else:
            self._done(job_id, ok, nbytes, t0, "load")

    def _finish_reads(self) -> None:
        while self._read_done:  # loads whose tier reads finished on the lane
            job_id, t0, placement, read = self._read_done.popleft()
            self._reading.discard(job_id)
            self._finish_load(job_id, t0, placement, read)

    def get_finished(self) -> list[TransferResult]:
        self._finish_reads()
        while self._in_flight and self._in_flight[0][1].query():  # in submission order
            job_id, _, _, nbytes, t0 = self._in_flight.pop(0)  # host buffers may go now
            self._done(job_id, True, nbytes, t0, "load")
        out, self._finished = self._finished, []
        if out:
            self.metrics.flush()
        return out

    def wait(self, job_ids: set[int]) -> None:
        if self._lane is not None and self._reading & set(job_ids):
            self._lane.drain()  # only when vLLM asks to wait for a load on disk or Redis
            self._finish_reads()
        for job_id, event, _, _, _ in self._in_flight:
            if job_id in job_ids:
                event.synchronize()

    def drain(self, timeout: float | None = 30.0) -> bool:
        """Wait until every disk and Redis write and read queued so far has run."""
        return self._lane.drain(timeout) if self._lane is not None else True

    def shutdown(self) -> None:
        if self._lane is not None and not self._lane.close():
            # queued disk/Redis I/O did not finish in time: leave the tiers open to it
            log.warning("kvtier: background tier I/O still running at shutdown; tiers left open")
            self.metrics.flush(force=True)
            return
        if self._stream is not None:
            self._stream.synchronize()
        self.metrics.flush(force=True)
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

    def _staging(self, num_chunks: int, nbytes: int) -> torch.Tensor:
        # zeros, not empty: positions a partial chunk does not hold are stored as zeros, never as
        # whatever the allocator left there (it would go to disk and Redis under a valid checksum)
        return torch.zeros((num_chunks, nbytes), dtype=torch.uint8, pin_memory=self._pin)

    def _store(self, spec: GPULoadStoreSpec, items: Sequence[ChunkItem]) -> tuple[bool, int]:
        placement = self._placement(spec, items)
        if placement is None:
            return False, 0
        ok, total = True, 0
        for g, placed in placement:
            nbytes = self.ctx.plan.groups[g].chunk_bytes
            buf = self._staging(len(placed), nbytes)
            ci, pos, bids = _index(placed)
            for ref in self.refs[g]:
                view = buf[:, ref.offset:ref.offset + ref.page_bytes * self.bpc]
                view = view.view(len(placed), self.bpc, ref.page_bytes)
                view[ci, pos] = self._gather(ref, bids)
            writes: dict[str, list[tuple[int, int, ChunkHeader, torch.Tensor]]] = {}
            for k, (item, blocks) in enumerate(placed):
                header = self._header(item, blocks)
                for tier, slot in item.places:
                    writes.setdefault(tier, []).append((g, slot, header, buf[k]))
            for tier, batch in writes.items():  # one batch a tier: the disk tier's two write lanes
                if tier != "cpu" and self._lane is not None:
                    if not self._lane.submit(lambda t=tier, b=batch, n=nbytes: self._write(t, b, n),
                                             write_bytes=nbytes * len(batch)):
                        # the queue is full: this tier skips these chunks (a later load there is
                        # a counted miss), the engine never waits for a disk or a network
                        self.metrics.add(f"store_dropped_{tier}", len(batch))
                    continue
                good = self._write(tier, batch, nbytes)
                total += good * nbytes
                ok = ok and good == len(batch)  # the index will find a miss at load time
        return ok, total

    def _write(self, tier: str, batch: list, nbytes: int) -> int:
        """Write a batch into one tier (inline for cpu, on the lane for disk and Redis)."""
        good = 0
        for written in self.tiers[tier].write_many(batch):
            if written:
                good += 1
                self.metrics.add(f"stored_chunks_{tier}")
            else:
                self.metrics.add(f"store_failed_{tier}")
        if tier != "cpu":
            self.metrics.flush()  # on the lane: the engine thread may not poll again soon
        return good

    def _read(self, placement: list) -> tuple[bool, list, int]:
        """Read and verify every chunk of a load into host buffers: (all found, staged, bytes).
        Runs on the lane when a chunk is on disk or in Redis, inline otherwise."""
        total = 0
        staged = []
        for g, placed in placement:
            nbytes = self.ctx.plan.groups[g].chunk_bytes
            buf = self._staging(len(placed), nbytes)
            for k, (item, blocks) in enumerate(placed):
                if not item.places:  # the scheduler lost it between lookup and load: a miss
                    self.metrics.add("load_miss_vanished")
                    return False, [], 0
                tier, slot = item.places[0]
                if not self.tiers[tier].read(g, slot, self._header(item, blocks), buf[k]):
                    # a miss or a corrupt payload (the tier counted and dropped it): nothing of
                    # this job is reported as loaded; vLLM recomputes the request
                    self.metrics.add(f"load_miss_{tier}")
                    return False, [], 0
                self.metrics.add(f"loaded_chunks_{tier}")
                self.metrics.add(f"loaded_chunks_group{g}")
            staged.append((g, placed, buf))
            total += nbytes * len(placed)
        return True, staged, total

    def _scatter_all(self, staged: list) -> tuple[torch.cuda.Event, list[torch.Tensor]] | None:
        """Write verified chunks into their blocks (the engine thread: a memory copy)."""
        blocks = 0
        keep: list[torch.Tensor] = []
        for g, placed, buf in staged:
            ci, pos, bids = _index(placed)
            for ref in self.refs[g]:
                view = buf[:, ref.offset:ref.offset + ref.page_bytes * self.bpc]
                view = view.view(len(placed), self.bpc, ref.page_bytes)
                keep.append(self._scatter(ref, bids, view[ci, pos]))
            blocks += len(bids)
        self.metrics.add("loaded_blocks", blocks)
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event, keep  # host buffers must outlive their async copies

    def _gather(self, ref: _Ref, bids: torch.Tensor) -> torch.Tensor:
        """The pages of blocks `bids` of one layer, as a host tensor (num_blocks, page_bytes)."""
        if self._stream is None:
            return ref.tensor.index_select(0, bids)[:, :ref.page_bytes]
        # the side stream must see what the model wrote on the compute stream
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            rows = ref.tensor.index_select(0, bids.to(self.device, non_blocking=True))
            host = torch.empty((len(bids), ref.page_bytes), dtype=torch.uint8, pin_memory=True)
            host.copy_(rows[:, :ref.page_bytes], non_blocking=True)
        self._stream.synchronize()  # the tier write reads `host` next
        return host

    def _scatter(self, ref: _Ref, bids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Write host `rows` (num_blocks, page_bytes) into blocks `bids` of one layer."""
        if self._stream is None:
            ref.tensor[bids, :ref.page_bytes] = rows
            return rows
        host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(rows)
        # blocks the scheduler just allocated may still be zeroed on the compute stream
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            dev = host.to(self.device, non_blocking=True)
            ref.tensor[bids.to(self.device, non_blocking=True), :ref.page_bytes] = dev
        return host

def _index(placed: list[tuple[ChunkItem, list[tuple[int, int]]]]):
    ci, pos, bids = [], [], []
    for k, (_, blocks) in enumerate(placed):
        for b, p in blocks:
            ci.append(k)
            pos.append(p)
            bids.append(b)
    return torch.tensor(ci), torch.tensor(pos), torch.tensor(bids)


def _make_tier(name: str, layout: TierLayout, ctx: SpecContext, keyed: Keyed | None) -> Tier:
    if name == "cpu":
        from kvtier.store.tiers.cpu import CpuTier

        return CpuTier(layout)
    if name == "disk":
        from kvtier.store.tiers.disk import DiskTier

        root = ctx.disk_root
        assert root is not None
        root.mkdir(parents=True, exist_ok=True)
        return DiskTier(root, layout, ctx.namespace.id, keyed=keyed)
    raise ConfigError(f"tier {name!r} is not available in the vLLM worker")
