"""The vLLM worker's disk and Redis work, on one background thread (store/lane.py).

`submit_*` never wait for a disk or a network. A store's disk and Redis writes are queued here
after its copies were submitted (`queue`); the lane's queue drops a write past
`kvtier.io_queue_bytes` (counted `store_dropped_<tier>`). A write from a cpu slot copies the slot
and goes ahead only if the slot still holds the chunk afterwards (its sequence number unchanged;
`begin` changes it before new bytes arrive, cpu.py), so a slot taken for another chunk meanwhile
never lands under the old chunk's header on disk (counted `store_overwritten_<tier>`). A load's
chunks on disk or in Redis are read and verified into staging buffers here (`read`); the worker
copies them into blocks on the engine thread.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping

from kvtier.store.buffers import BufferPool
from kvtier.store.lane import Lane
from kvtier.store.tiers.base import Tier
from kvtier.store.tiers.cpu import fence

from .common import SpecContext
from .copies import HostCopies
from .counters import Metrics

log = logging.getLogger("kvtier.vllm")

Placement = list  # placement.place's answer: [(group, [(item, blocks)])]
ReadResult = tuple[bool, list, int]  # (all found, [(group, index in group, blocks, buffer, tier, item)], bytes)


class SlowIO:
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
                    lambda g=g, slow=slow, n=nbytes, src=src: self.write_slow(copies, g, slow, n, src),
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
        the write is skipped, counted `store_overwritten_<tier>`. Positions the chunk does not
        hold are zeros in what is written."""
        self.copies.wait_on_lane(*copies)
        if src[0] == "buf":
            data, header = src[1], src[2]
        else:
            _, slot, gen, header, blocks = src
            cpu = self.tiers.get("cpu")
            data = self.pool.take(nbytes, zero=False)
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

