"""GPU <-> host copies of the cpu tier through vLLM's own copy machinery.

On a GPU, the worker moves chunks between vLLM's KV blocks and the cpu tier's slots with vLLM's
`SingleDirectionOffloadingHandler` (the front end of vLLM's native CPU tier: one batched copy
over pointer descriptors, `swap_blocks_batch`, on pooled streams and events; unchanged from 0.32
to 0.33). kvtier's host layout differs from vLLM's native one: a slab per KV-cache group, each
slot as large as that group's chunk only. So there is one handler per group and direction (store,
load, and one more for the expedited loads of 0.33's sync loads, so they never queue behind
ordinary loads), each over views of its group's slab:

    slot s of group g, layer ref r (page bytes P, byte offset O in the chunk):
        slab[g][s, O : O + P * blocks_per_chunk]   viewed (num_slots, P * blocks_per_chunk), int8

which is exactly the layout the worker's own `copy_out`/`copy_in` write on CPU (copies.py), so a
chunk stored by one path is read by the other. vLLM's KV tensors are passed as (num_blocks, P)
views of their rows (a row may be wider than a ref's page: only P bytes move).

Rules the worker keeps (worker.py, copies.py):
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

import time
from collections.abc import Iterable, Sequence

import torch
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, GPULoadStoreSpec

from .compat import CPULoadStoreSpec, transfer_event

STORE, LOAD, EXPEDITED = 0, 1, 2


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

