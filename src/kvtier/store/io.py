"""Moving payloads between the store's tiers, with the accounting: timed reads, promotion,
reserve-commit-write in batches, batched writes to shared tiers.

A mixin of `kvtier.store.store.Store` (split out to keep each module one concept): the facade decides
*what* to move (plan rules, hits, admission); this part moves bytes and counts what happened.
Every failure here is a value (False / 0) and a counter, never an exception into inference.
"""

from __future__ import annotations

import logging
import time

from kvtier.index.index import Index
from kvtier.store.metrics import StoreMetrics
from kvtier.store.payload import ChunkHeader
from kvtier.store.tiers.base import Tier

log = logging.getLogger("kvtier.store.store")


class TierIO:
    """Needs from the host class: index, slot_tiers (in tier order), promote, m."""

    index: Index | None
    slot_tiers: dict[str, Tier]
    promote: bool
    m: StoreMetrics

    def _timed_read(self, tier: Tier, g: int, slot: int, header: ChunkHeader, out: object) -> bool:
        before = tier.corrupt_dropped
        t0 = time.perf_counter()
        try:
            good = tier.read(g, slot, header, out)
        except OSError as exc:  # a tier that fails under us is a miss
            log.warning("tier %s: read failed: %s", tier.name, exc)
            good = False
        d = self.m.tg(tier.name, g)
        d["load_seconds"] += time.perf_counter() - t0
        if good:
            d["load_chunks"] += 1
            d["load_bytes"] += header.payload_bytes
        else:
            d["load_misses"] += 1
            self.m.add("corrupt_dropped", tier.corrupt_dropped - before)
        return good

    def _promote(self, h: bytes, g: int, header: ChunkHeader, data: object) -> None:
        first = next(iter(self.slot_tiers), None)
        if first is None or self.index is None or self.index.contains(h, g, first):
            return
        if self._store_many(first, [(h, g, header, data)], counted=False)[0]:
            self.m.add("promotions")

    # Writes are deferred, the index is not. `_store_many` walks its payloads one by one through
    # the index exactly as saving one by one does (held? touch; else reserve -> commit), so every
    # eviction policy sees the same sequence of events, but it only *queues* the writes, one per
    # slot, and hands them to the tier in one `write_many` (the disk tier's two write lanes). An
    # entry evicted from a tier is dropped, never copied: saves write every slot tier
    # (write-through, `Store._save_all`), so a lower tier already holds what it still can. An
    # entry evicted while still queued is not written at all (the entry that evicted it takes
    # its slot); the shared tiers still get it (`Store._write`). A write that fails removes its
    # entry from the index (it was committed when queued); the store's lock is held throughout,
    # so no lookup or load sees a queued entry before it is written.
    def _store_many(self, tier_name: str, items: list[tuple[bytes, int, ChunkHeader, object]],
                    counted: bool = True, skip_held: bool = False) -> list[int | None]:
        """Per payload: 1 if written, 0 if not, None if `skip_held` found it held by a slot
        tier already (touched in every tier, counted as a skipped save). A promotion that finds
        every slot pinned (`counted=False`) is not a failed save."""
        index = self.index
        assert index is not None
        out: list[int | None] = [0] * len(items)
        queue: dict[tuple[int, int], tuple[int, bytes, ChunkHeader, object]] = {}  # (group, slot) -> write
        try:
            for k, (h, g, header, data) in enumerate(items):
                if skip_held and any(index.contains(h, g, t) for t in self.slot_tiers):
                    self.m.add("skipped_saves")
                    for t in self.slot_tiers:
                        index.touch(h, g, t)
                    out[k] = None
                    continue
                res = index.reserve(h, g, tier_name)
                if res.slot is None:
                    if res.status != "present" and counted:
                        self.m.add("failed_saves")
                        self.m.tg(tier_name, g)["save_failures"] += 1
                    continue
                for ev in res.evicted:  # evicted before its write: never written
                    queue.pop((ev.group, ev.slot), None)
                index.commit(h, g, tier_name)
                queue[(g, res.slot)] = (k, h, header, data)
        finally:
            if queue:
                self._write_batch(tier_name, queue, out)
        return out

    def _write_batch(self, tier_name: str, batch: dict[tuple[int, int], tuple[int, bytes, ChunkHeader, object]],
                     out: list[int | None]) -> None:
        assert self.index is not None
        tier = self.slot_tiers[tier_name]
        t0 = time.perf_counter()
        try:
            results = tier.write_many([(g, slot, header, data) for (g, slot), (_, _, header, data) in batch.items()])
        except OSError as exc:
            log.warning("tier %s: write failed: %s", tier_name, exc)
            results = [False] * len(batch)
        share = (time.perf_counter() - t0) / max(1, sum(header.payload_bytes for _, _, header, _ in batch.values()))
        for ((g, _), (k, h, header, _)), good in zip(batch.items(), results):
            d = self.m.tg(tier_name, g)
            d["save_seconds"] += share * header.payload_bytes  # a batch's time, shared by bytes
            if not good:
                self.index.remove(h, g, tier_name)  # committed when queued
                self.m.add("failed_saves")
                d["save_failures"] += 1
                continue
            d["save_chunks"] += 1
            d["save_bytes"] += header.payload_bytes
            out[k] = 1

    def _shared_write(self, tier: Tier, batch: list[tuple[int, int, ChunkHeader, object]]) -> int:
        """Write what the shared tier lacks (one exists_many, then one write_many)."""
        t0 = time.perf_counter()
        try:
            present = tier.exists_many([item[2] for item in batch])
            skipped = sum(present)
            if skipped:
                self.m.add("skipped_saves", skipped)
                batch = [item for item, yes in zip(batch, present) if not yes]
            results = tier.write_many(batch) if batch else []
        except Exception as exc:  # a shared tier going away is a counted failure
            log.warning("shared tier %s: write failed: %s", tier.name, exc)
            results = [False] * len(batch)
        self._count_batch(tier, "save", [(g, h) for g, _, h, _ in batch], results, t0)
        failed = sum(1 for r in results if not r)
        if failed:
            self.m.add("failed_saves", failed)
        return len(results) - failed

    def _shared_read(self, tier: Tier, want: list[tuple[int, ChunkHeader, object]]) -> list[bool]:
        """Read many chunks from a shared tier in one batched call (a whole prefix costs one
        round trip per node, not one per chunk); items are (group, header, out)."""
        before = tier.corrupt_dropped
        t0 = time.perf_counter()
        try:
            results = tier.read_many([(g, -1, header, out)  # -1: key-addressed, no slot
                                        for g, header, out in want])
        except Exception as exc:  # a shared tier going away is a miss
            log.warning("shared tier %s: read failed: %s", tier.name, exc)
            results = [False] * len(want)
        self._count_batch(tier, "load", [(g, h) for g, h, _ in want], results, t0)
        self.m.add("corrupt_dropped", tier.corrupt_dropped - before)
        return list(results)

    def _count_batch(self, tier: Tier, kind: str, items: list[tuple[int, ChunkHeader]],
                     results: list[bool], t0: float) -> None:
        """Per-(tier, group) counters of one batched call; its time is shared out evenly."""
        share = (time.perf_counter() - t0) / max(1, len(items))
        failure = "save_failures" if kind == "save" else "load_misses"
        for (g, header), good in zip(items, results):
            d = self.m.tg(tier.name, g)
            d[f"{kind}_seconds"] += share
            if good:
                d[f"{kind}_chunks"] += 1
                d[f"{kind}_bytes"] += header.payload_bytes
            else:
                d[failure] += 1
