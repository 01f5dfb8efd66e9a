"""The vLLM worker's own byte copies between its KV blocks and host chunk rows.

A chunk row is a cpu tier slot or a staging buffer of one group's chunk bytes: for each layer
ref of the group, in vLLM's order, the pages of the chunk's `blocks_per_chunk` blocks back to
back (`Ref.offset` is where a ref's pages start). A job's blocks are (block id, position in
chunk) pairs (placement.py); a copy moves only those positions.

On CPU a copy is one `index_select` a layer, done when it returns. On a GPU it is an async
gather + device<->host copy on a side stream (copier.SideStream), into or out of page-locked
memory; the worker records the stream's event and a job ends when it has. Chunks in cpu slots
on a GPU go through vLLM's own handlers instead (copier.SlabCopier, `copier` here), which write
exactly this layout: one transfer per run of consecutive chunks of a group (`submit_runs`). A
job's copies are an (event, transfer ids) pair: `ended` polls it, `wait` blocks on it on the
engine thread, `wait_on_lane` on the I/O thread (a store's disk and Redis writes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.core.plan import Plan
from kvtier.errors import ConfigError

from .copier import SideStream, SlabCopier
from .placement import consecutive_runs


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

    # -- chunks in cpu slots on a GPU: vLLM's handlers (copier.py) -----------------------------

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
