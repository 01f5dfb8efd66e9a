"""Moving payloads between the store's tiers, with the accounting: timed reads, promotion,
reserve-write-commit with write-back demotion, batched writes to shared tiers.

A mixin of `kvtier.store.Store` (split out to keep each module one concept): the facade decides
*what* to move (plan rules, hits, admission); this part moves bytes and counts what happened.
Every failure here is a value (False / 0) and a counter, never an exception into inference.
"""

from __future__ import annotations

import logging
import time

from kvtier.index import Index
from kvtier.metrics import StoreMetrics
from kvtier.payload import HASH_BYTES, ChunkHeader
from kvtier.tiers.base import Tier
from kvtier.tiers.cpu import CpuTier

log = logging.getLogger("kvtier.store")


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
        if self._store_in(first, h, g, header, data, counted=False):
            self.m.add("promotions")

    def _store_in(self, tier_name: str, h: bytes, g: int, header: ChunkHeader, data: object,
                  counted: bool = True) -> int:
        """`_store_many` of one payload: 1 if written."""
        return self._store_many(tier_name, [(h, g, header, data)], counted)[0]

    def _store_many(self, tier_name: str, items: list[tuple[bytes, int, ChunkHeader, object]],
                    counted: bool = True) -> list[int]:
        """reserve each -> demote the evicted -> write them all (one `write_many`: the disk tier
        runs it on two lanes) -> commit/abort each, in order; 1 per payload written. A
        promotion that finds every slot pinned (`counted=False`) is not a failed save.

        The order of index events is the one-by-one order except that the reservations come
        before the writes: a reservation pins its slot, so a payload of this batch is never
        evicted by a later one of the same batch. Where that leaves no slot (a tier smaller
        than the batch), the payloads reserved so far are written and committed first, and the
        reservation is tried again: then it evicts what one-by-one saving would have."""
        assert self.index is not None
        out: list[int] = []
        batch: list[tuple[bytes, int, ChunkHeader, object, int]] = []
        for h, g, header, data in items:
            res = self.index.reserve(h, g, tier_name)
            if res.slot is None and res.status == "full" and batch:
                out += self._write_batch(tier_name, batch)
                batch = []
                res = self.index.reserve(h, g, tier_name)
            if res.slot is None:
                if res.status != "present" and counted:
                    self.m.add("failed_saves")
                    self.m.tg(tier_name, g)["save_failures"] += 1
                out.append(0)
                continue
            # write-back now, in reservation order (a demoted anchor revives its dependents before
            # they are evicted in turn), while the evicted bytes are still in the slot
            for ev in res.evicted:
                self._demote(tier_name, ev.chunk_hash, ev.group, ev.slot, ev.dead)
            batch.append((h, g, header, data, res.slot))
        return out + self._write_batch(tier_name, batch)

    def _write_batch(self, tier_name: str, batch: list[tuple[bytes, int, ChunkHeader, object, int]]) -> list[int]:
        """Write the reserved payloads (one `write_many`), then commit or abort each, in order."""
        assert self.index is not None
        if not batch:
            return []
        tier = self.slot_tiers[tier_name]
        t0 = time.perf_counter()
        try:
            results = tier.write_many([(g, slot, header, data) for _, g, header, data, slot in batch])
        except OSError as exc:
            log.warning("tier %s: write failed: %s", tier_name, exc)
            results = [False] * len(batch)
        share = (time.perf_counter() - t0) / max(1, sum(hd.payload_bytes for _, _, hd, _, _ in batch))
        out = []
        for (h, g, header, _, _), good in zip(batch, results):
            d = self.m.tg(tier_name, g)
            d["save_seconds"] += share * header.payload_bytes  # a batch's time, shared by bytes
            if not good:
                self.index.abort(h, g, tier_name)
                self.m.add("failed_saves")
                d["save_failures"] += 1
                out.append(0)
                continue
            self.index.commit(h, g, tier_name)
            d["save_chunks"] += 1
            d["save_bytes"] += header.payload_bytes
            out.append(1)
        return out

    def _demote(self, tier_name: str, h: object, g: int, slot: int, dead: bool) -> None:
        """Copy an entry evicted from `tier_name` down to the next slot tier (write-back)."""
        names = list(self.slot_tiers)
        k = names.index(tier_name)
        if dead or k + 1 >= len(names) or not isinstance(h, bytes):
            return
        assert self.index is not None
        lower = names[k + 1]
        if self.index.contains(h, g, lower):
            return
        src = self.slot_tiers[tier_name]
        if not isinstance(src, CpuTier):
            return
        old = src.header(g, slot)
        if old is None or old.key != (h.ljust(HASH_BYTES, b"\0"), g):
            return
        if self._store_in(lower, h, g, old, src.view(g, slot, old.payload_bytes)):
            self.m.add("demotions")

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
