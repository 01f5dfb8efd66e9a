"""The vLLM worker's own byte copies between its KV blocks and host chunk rows.

A chunk row is a cpu tier slot or a staging buffer of one group's chunk bytes: for each layer
ref of the group, in vLLM's order, the pages of the chunk's `blocks_per_chunk` blocks back to
back (`Ref.offset` is where a ref's pages start). A job's blocks are (block id, position in
chunk) pairs (placement.py); a copy moves only those positions.

On CPU a copy is one `index_select` a layer, done when it returns. On a GPU it is an async
gather + device<->host copy on a side stream (SideStream), into or out of page-locked
memory; the worker records the stream's event and a job ends when it has. Chunks in cpu slots
on a GPU go through vLLM's own handlers instead (SlabCopier, `HostCopies.copier`), which write
exactly this layout: one transfer per run of consecutive chunks of a group (`submit_runs`). A
job's copies are an (event, transfer ids) pair: `ended` polls it, `wait` blocks on it on the
engine thread, `wait_on_lane` on the I/O thread (a store's disk and Redis writes).

SlabCopier: GPU <-> host copies of the cpu tier through vLLM's own copy machinery.

On a GPU, the worker moves chunks between vLLM's KV blocks and the cpu tier's slots with vLLM's
`SingleDirectionOffloadingHandler` (the front end of vLLM's native CPU tier: one batched copy
over pointer descriptors, `swap_blocks_batch`, on pooled streams and events; unchanged from 0.32
to 0.33). kvtier's host layout differs from vLLM's native one: a slab per KV-cache group, each
slot as large as that group's chunk only. So there is one handler per group and direction (store,
load, and one more for the expedited loads of 0.33's sync loads, so they never queue behind
ordinary loads), each over views of its group's slab:

    slot s of group g, layer ref r (page bytes P, byte offset O in the chunk):
        slab[g][s, O : O + P * blocks_per_chunk]   viewed (num_slots, P * blocks_per_chunk), int8

which is exactly the layout the worker's own `copy_out`/`copy_in` write on CPU (above), so a
chunk stored by one path is read by the other. vLLM's KV tensors are passed as (num_blocks, P)
views of their rows (a row may be wider than a ref's page: only P bytes move).

Rules the worker keeps (worker.py, HostCopies):
- a transfer covers consecutive chunks of one group that all have a cpu slot (a "run"); only a
  run's first chunk may start mid-chunk (vLLM's `block_indices`, the handler's skip count);
- one handler runs its transfers in submission order; different handlers run in any order, so
  the worker never has two handlers touch one slot at once: a store's slot is not loaded before
  vLLM's `complete_store` (which follows this job's end), and a loaded slot is pinned by the
  manager until the load ends;
- a job ends when every transfer it submitted here has ended (`finished`); its disk and Redis
  writes are queued at submit, and each waits on the I/O thread for the job's transfers
  (`wait_polling`) and side-stream event before it reads the slot.

The handler asserts CUDA tensors; the tests drive it on CPU tensors that claim `is_cuda`, with a
memmove in place of `swap_blocks_batch` (tests/integrations/vllm_engineless/fake_cuda.py), through
vLLM's real descriptor code.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, GPULoadStoreSpec

from kvtier.core.plan import Plan
from kvtier.errors import ConfigError

from .compat import CPULoadStoreSpec, transfer_event
from .placement import consecutive_runs

STORE, LOAD, EXPEDITED = 0, 1, 2  # SlabCopier's directions


@dataclass(frozen=True, slots=True)
class Ref:
    tensor: torch.Tensor  # uint8 (num_blocks, >= page_bytes)
    page_bytes: int
    offset: int  # byte offset of this layer's pages inside a chunk payload


def layer_refs(tensors: Sequence[torch.Tensor], group_data_refs: Sequence[Sequence], plan: Plan,
               blocks_per_chunk: int) -> list[list[Ref]]:
    """Each group's layer refs over vLLM's KV tensors (uint8 views; `group_data_refs`: vLLM's
    `CanonicalKVCaches.group_data_refs`), with each ref's offset in a chunk. Raises when vLLM's
    groups or pages are not the layout kvtier planned: kvtier refuses a layout it did not plan."""
    if len(group_data_refs) != len(plan.groups):
        raise ConfigError(
            f"vLLM registered {len(group_data_refs)} KV-cache groups, kvtier planned "
            f"{len(plan.groups)}; the engine and the model config disagree"
        )
    out: list[list[Ref]] = []
    for g, refs in enumerate(group_data_refs):
        group, off = [], 0
        for r in refs:
            group.append(Ref(tensors[r.tensor_idx], r.page_size_bytes, off))
            off += r.page_size_bytes * blocks_per_chunk
        want = plan.groups[g].chunk_bytes
        if plan.groups[g].cacheable and off != want:
            raise ConfigError(
                f"vLLM's pages for group {plan.groups[g].name!r} make {off}-byte chunks but "
                f"kvtier planned {want} ({plan.geometry.source}); kvtier refuses a layout it did not plan"
            )
        out.append(group)
    return out


class HostCopies:
    """Copies of one worker's blocks into and out of host chunk rows (`stream`: the side stream
    on a GPU, None on CPU) and, on a GPU, into and out of the cpu tier's slots (`copier`)."""

    def __init__(self, refs: list[list[Ref]], blocks_per_chunk: int, device: torch.device,
                 slots=None) -> None:  # noqa: ANN001 - a CpuTier or None
        """`slots`: the cpu tier whose slots vLLM's handlers fill, where the KV tensors are on a
        GPU (None: every chunk is copied here)."""
        self.refs = refs
        self.bpc = blocks_per_chunk
        self.device = device
        self.pin = device.type == "cuda"
        self.stream: SideStream | None = SideStream(device) if self.pin else None
        self._block_bytes = [sum(r.page_bytes for r in group) for group in refs]  # every layer's page
        self.copier: SlabCopier | None = None
        if slots is not None:
            self.copier = SlabCopier([[(r.tensor, r.page_bytes, r.offset) for r in group] for group in refs],
                                     slots.slabs, slots.locked, blocks_per_chunk)

    def moved_bytes(self, g: int, blocks: list[tuple[int, int]]) -> int:
        """The bytes a transfer moves for these blocks of group g: what vLLM's transfer_size
        counts (its offload byte and throughput metrics), every layer's page of each block. Not
        the chunk's bytes: a group's first chunk may be moved in part (a load starting mid-chunk,
        a sliding group's store from a block mid-chunk)."""
        return len(blocks) * self._block_bytes[g]

    def copy_out(self, g: int, blocks: list[tuple[int, int]], row: torch.Tensor) -> None:
        """Copy blocks (block id, position in chunk; positions consecutive) of group g into a
        chunk row: for each layer ref, its pages at the positions they hold. One copy a layer on
        CPU (index_select into the row); on a GPU an async gather + device->host copy on the side
        stream, into pinned memory (the cpu tier's slabs are pinned where CUDA is present)."""
        bids, pages = self._row_pages(g, blocks, row)
        if self.stream is not None:
            def enqueue() -> None:
                ids = bids.to(self.device, non_blocking=True)
                for ref, page, dst in pages:
                    dst.copy_(ref.tensor.index_select(0, ids)[:, :page], non_blocking=True)

            self.stream.run(enqueue)
            return
        for ref, page, dst in pages:
            if ref.tensor.shape[1] == page:
                torch.index_select(ref.tensor, 0, bids, out=dst)
            else:
                dst.copy_(ref.tensor.index_select(0, bids)[:, :page])

    def copy_in(self, g: int, blocks: list[tuple[int, int]], row: torch.Tensor) -> None:
        """Copy a chunk row's pages at the blocks' positions into the blocks (the reverse)."""
        bids, pages = self._row_pages(g, blocks, row)
        if self.stream is not None:
            def enqueue() -> None:
                ids = bids.to(self.device, non_blocking=True)
                for ref, page, src in pages:
                    ref.tensor[ids, :page] = src.to(self.device, non_blocking=True)

            self.stream.run(enqueue)
            return
        for ref, page, src in pages:
            ref.tensor[bids, :page] = src

    def zero_unheld(self, g: int, blocks: list[tuple[int, int]], row: torch.Tensor) -> None:
        """Zero the positions of a chunk row of group g that `blocks` do not cover."""
        lo, hi = blocks[0][1], blocks[-1][1] + 1
        for ref in self.refs[g]:
            page, base = ref.page_bytes, ref.offset
            row[base:base + lo * page].zero_()
            row[base + hi * page:base + self.bpc * page].zero_()

    def _row_pages(self, g: int, blocks: list[tuple[int, int]], row: torch.Tensor) -> tuple[torch.Tensor, list]:
        """The blocks' ids (pinned on a GPU: a non_blocking copy from pageable memory may wait
        for the side stream) and, per layer ref of group g, (ref, page bytes, the row's
        (n, page) view of that ref's pages at the blocks' positions)."""
        lo, n = blocks[0][1], len(blocks)
        bids = torch.tensor([b for b, _ in blocks], pin_memory=self.pin)
        pages = [(ref, ref.page_bytes,
                  row[ref.offset + lo * ref.page_bytes:ref.offset + (lo + n) * ref.page_bytes].view(n, ref.page_bytes))
                 for ref in self.refs[g]]
        return bids, pages

    # -- chunks in cpu slots on a GPU: vLLM's handlers (SlabCopier, below) --------------------

    def by_copier(self, g: int, slot: int | None) -> bool:
        """Whether a chunk of group g in cpu slot `slot` (None: no slot) moves through vLLM's
        handlers (a GPU), not through `copy_out`/`copy_in`."""
        return slot is not None and self.copier is not None and self.copier.covers(g)

    def submit_runs(self, direction: int, chunks: list[tuple[int, int, list[tuple[int, int]], int]]) -> list[int]:
        """Hand chunks the copier moves (g, index in group, blocks, slot; `by_copier`) to it,
        one transfer per run of consecutive chunks of a group; the transfer ids."""
        copier = self.copier
        assert copier is not None
        tids: list[int] = []
        for run in consecutive_runs(chunks):  # placement.py
            bids = [b for _, _, blocks, _ in run for b, _ in blocks]
            tids.append(copier.submit(direction, run[0][0], bids, run[0][2][0][1], [s for *_, s in run]))
        return tids

    # -- a job's copies: (the side stream's event or None, the copier's transfer ids) ----------

    def poll(self) -> None:
        if self.copier is not None:
            self.copier.poll()

    def ended(self, event, tids: list[int]) -> bool:  # noqa: ANN001 - a torch.cuda.Event or None
        """Whether a job's copies ended (call `poll` first)."""
        return (event is None or event.query()) and (
            not tids or self.copier.finished(tids))  # type: ignore[union-attr]

    def wait(self, event, tids: list[int]) -> None:  # noqa: ANN001
        """Block until a job's copies ended, on the engine thread."""
        if event is not None:
            event.synchronize()
        if tids:
            self.copier.wait(tids)  # type: ignore[union-attr]

    def wait_on_lane(self, event, tids: list[int]) -> None:  # noqa: ANN001
        """What a store's disk and Redis writes run first on the I/O thread: block until the
        store's device->host copies ended, without spinning a core."""
        if event is None and not tids:
            return
        with torch.cuda.device(self.device) if self.pin else contextlib.nullcontext():  # never a context on another GPU
            if event is not None:
                event.synchronize()
            if tids:
                self.copier.wait_polling(tids)  # type: ignore[union-attr]

    def shutdown(self) -> None:
        """End every copy, before vLLM frees its KV tensors."""
        if self.stream is not None:
            self.stream.synchronize()
        if self.copier is not None:
            self.copier.shutdown()  # drains every transfer before the slabs go


# -- on a GPU: vLLM's copy handlers over the cpu tier's slabs, and the side stream -----------


class SlabCopier:
    """vLLM's copy handlers over the cpu tier's slabs, one set per group; transfers are named by
    ids this class hands out (several per vLLM job: one per group run)."""

    def __init__(self, refs: Sequence[Sequence[tuple[torch.Tensor, int, int]]],
                 slabs: Sequence[torch.Tensor], locked: Sequence[bool], blocks_per_chunk: int) -> None:
        """refs[g]: (KV tensor (num_blocks, >= page) uint8, page bytes, byte offset in the chunk)
        per layer ref of group g, in vLLM's order; slabs[g]: (num_slots, slot bytes) uint8;
        locked[g]: the slab is page-locked (pinned or registered), so vLLM may pick its copy kernel
        that reads host memory from the GPU."""
        from vllm.v1.kv_offload.cpu.gpu_worker import SingleDirectionOffloadingHandler

        self.bpc = blocks_per_chunk
        self._handlers: list[tuple | None] = []
        for grefs, slab, pinned in zip(refs, slabs, locked):
            if not grefs or slab.numel() == 0:
                self._handlers.append(None)
                continue
            gpu = [t.view(torch.int8)[:, :page] for t, page, _ in grefs]
            s8 = slab.view(torch.int8)
            cpu = [s8.as_strided((slab.shape[0], page * blocks_per_chunk), (slab.stride(0), 1),
                                 s8.storage_offset() + off) for _, page, off in grefs]
            layer_refs = [[CanonicalKVCacheRef(i, page) for i, (_, page, _) in enumerate(grefs)]]
            self._handlers.append(tuple(
                SingleDirectionOffloadingHandler(
                    gpu_tensors=gpu, cpu_tensors=cpu, blocks_per_chunk=blocks_per_chunk,
                    layer_refs_per_group=layer_refs, gpu_to_cpu=direction == STORE,
                    host_memory_is_pinned=bool(pinned))
                for direction in (STORE, LOAD, EXPEDITED)))
        self._next = 0
        self._owner: dict[int, tuple] = {}  # transfer id -> its handler, until it ends
        self._ended: set[int] = set()

    def covers(self, group: int) -> bool:
        return group < len(self._handlers) and self._handlers[group] is not None

    def submit(self, direction: int, group: int, block_ids: list[int], first_pos: int,
               slots: list[int]) -> int:
        """One transfer of consecutive chunks of `group`: `block_ids` are vLLM's blocks in order,
        the first at position `first_pos` of the chunk in `slots[0]`; later chunks are whole."""
        assert len(slots) == -(-(len(block_ids) + first_pos) // self.bpc), (len(block_ids), first_pos, slots)
        handler = self._handlers[group][direction]  # type: ignore[index]
        tid = self._next
        self._next += 1
        gpu = GPULoadStoreSpec(block_ids, [len(block_ids)], [first_pos])
        host = CPULoadStoreSpec(slots)
        if direction == STORE:
            handler.transfer_async(tid, gpu, host)
        else:
            handler.transfer_async(tid, host, gpu)
        self._owner[tid] = handler
        return tid

    def poll(self) -> None:
        """Collect the transfers that ended (each handler reports in its submission order)."""
        for hs in self._handlers:
            for h in hs or ():
                for r in h.get_finished():
                    self._owner.pop(r.job_id, None)
                    self._ended.add(r.job_id)

    def finished(self, tids: Iterable[int]) -> bool:
        """True (and forgets them) when every transfer in `tids` ended; call `poll` first."""
        tids = list(tids)
        if not all(t in self._ended for t in tids):
            return False
        self._ended.difference_update(tids)
        return True

    def wait(self, tids: Iterable[int]) -> None:
        """Block until these transfers ended (vLLM waits so for an expedited load)."""
        for t in tids:
            h = self._owner.get(t)
            if h is not None:
                h.wait({t})

    def wait_polling(self, tids: Iterable[int], interval_s: float = 0.0005) -> None:
        """Block until these transfers ended, from another thread (kvtier's I/O thread, before a
        store's disk or Redis write), without spinning a core: vLLM's events are not
        blocking-sync events, so their `synchronize()` would busy-wait for up to a forward pass.
        A transfer this object no longer knows has ended. (If the engine thread recycles an
        event meanwhile, this waits for a later transfer: longer, never too short.) Where the
        handler keeps no per-transfer event (a vLLM other than 0.32/0.33), nothing of the handler
        is called from this thread: it waits until the engine thread's `poll` saw the transfer
        end, at most a step later."""
        for t in tids:
            h = self._owner.get(t)
            event = transfer_event(h, t) if h is not None else None
            if event is None:
                while t in self._owner:
                    time.sleep(interval_s)
                continue
            while not event.query():
                time.sleep(interval_s)

    def shutdown(self) -> None:
        for hs in self._handlers:
            for h in hs or ():
                h.shutdown()  # waits for every transfer
        self._handlers = []
        self._owner.clear()  # so no `wait_polling` waits on for a `poll` that will not come


class SideStream:
    """The worker's own CUDA stream for chunks without a cpu slot (staging buffers): copies are
    enqueued on it (`run`), after the compute stream's work so far (`wait_compute`), and a job
    ends when the event recorded after them fires. The tests replace it with an emulation that
    runs the enqueued copies later (tests/integrations/vllm_engineless/fake_cuda.py)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def wait_compute(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def run(self, fn) -> None:  # noqa: ANN001
        """Enqueue the copies `fn` makes (asynchronous: they may run after this returns)."""
        with torch.cuda.stream(self.stream):
            fn()

    def record(self, blocking: bool = False):  # noqa: ANN201 - a torch.cuda.Event
        """An event after everything enqueued so far; `blocking`: its synchronize() sleeps
        instead of spinning (for the I/O thread)."""
        event = torch.cuda.Event(blocking=blocking)
        event.record(self.stream)
        return event

    def synchronize(self) -> None:
        self.stream.synchronize()

