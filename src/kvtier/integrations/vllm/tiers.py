"""The tiers of the vLLM halves, built from the engine's `kvtier.*` config by the one tier factory
(store/tiers/factory.py).

The worker owns every tier: its cpu tier's slabs live in a host region (a file the scheduler's
process maps too, host_region.py) when there is something to promote, else in private memory;
page-locked on a GPU as vLLM's own CPU tier locks its region (its `host_register`, which clears
CUDA's error state when registration fails), not through PyTorch's power-of-two allocator. The
scheduler's lookup promoter opens readers beside them: the disk directory read-only, and Redis;
its Redis presence cache (redis_lookup.py) a Redis client of its own (`redis_tier`).
"""

from __future__ import annotations

import logging

from kvtier.errors import ConfigError
from kvtier.store.tiers.base import Tier, TierLayout
from kvtier.store.tiers.factory import TierOptions, make_tier

from .common import SpecContext
from .config import redis_password, tier_secret

log = logging.getLogger("kvtier.vllm")


def worker_tiers(ctx: SpecContext, pin: bool) -> dict[str, Tier]:
    """The worker's tiers, in `kvtier.tiers` order; `pin`: the KV cache is on a GPU."""
    keyed = tier_secret(ctx.config)  # read once by parse_config, handed to the disk and Redis tiers
    tiers: dict[str, Tier] = {}
    for name in ctx.config.tiers:
        if name == "redis":  # key-addressed: no slots to lay out
            tiers[name] = redis_tier(ctx, ctx.namespace.id, keyed)
        elif name == "cpu":
            layout = ctx.tier_layout(name)
            register = None
            if pin:
                from vllm.v1.kv_offload.cpu.host_register import host_register, host_unregister

                register = (host_register, host_unregister)
            # private, unpinned slabs are faulted in at start (factory.py); a region is at creation.
            # With the learned share each group is laid out for the most slots it may get (address
            # space): only the starting pools' slots are faulted in, or reserved in a region
            # (SpecContext.learned; host_region.py, "Reserved slots")
            learned = ctx.learned
            if learned and pin:  # the platform said CPU, the KV cache is on a GPU: pinned whole
                log.warning("kvtier: the learned share on a GPU's KV cache pins every group's largest "
                            "layout; set kvtier.share to \"proportional\" or \"equal\"")
            start = ctx.start_slots(name) if learned else None
            tiers[name] = make_tier("cpu", layout, TierOptions(
                pin_memory=pin, host_register=register,
                region=None if learned and pin else host_region(layout, ctx, start),
                fault_in=start if start is not None else True))
        elif name == "disk":
            root = ctx.disk_root
            assert root is not None
            root.mkdir(parents=True, exist_ok=True)
            tiers[name] = make_tier("disk", ctx.tier_layout(name),
                                    TierOptions(namespace_id=ctx.namespace.id, keyed=keyed, root=root))
        else:
            raise ConfigError(f"tier {name!r} is not available in the vLLM worker")
    return tiers


def reader_tiers(ctx: SpecContext, namespace_id: str) -> dict[str, Tier]:
    """The scheduler's readers of one rank's disk and Redis tiers (its namespace). A disk reader
    that cannot be opened is left out, with a warning: its chunks are promoted at load."""
    out: dict[str, Tier] = {}
    keyed = tier_secret(ctx.config)
    root = ctx.disk_root
    if root is not None:
        try:
            out["disk"] = make_tier("disk", ctx.tier_layout("disk"), TierOptions(
                namespace_id=namespace_id, keyed=keyed, root=root, reader=True))
        except Exception as exc:  # noqa: BLE001 - no reader: disk chunks are promoted at load
            log.warning("kvtier: cannot read the disk tier from the scheduler (%s)", exc)
    if "redis" in ctx.config.tiers:
        out["redis"] = redis_tier(ctx, namespace_id, keyed)
    return out


def redis_tier(ctx: SpecContext, namespace_id: str, keyed=None) -> Tier:  # noqa: ANN001 - Keyed | None
    """The Redis tier under one rank's namespace: `kvtier.redis_url`, the password (`redis_password`),
    the tenant secret `keyed` for tiers that read or write payloads (redis_lookup.py only asks EXISTS)."""
    return make_tier("redis", None, TierOptions(namespace_id=namespace_id, keyed=keyed,
                                                redis_url=str(ctx.config.redis_url),
                                                redis_password=redis_password(ctx.config)))


def host_region(layout: TierLayout, ctx: SpecContext, reserve: tuple[int, ...] | None = None):  # noqa: ANN201 - a HostRegion or None
    """The cpu tier's slabs in a file the scheduler's process maps (promotion at lookup,
    promotion.py), or None (no region for this engine, or it cannot be made: then the slabs are
    private memory and promotion happens at load; the warning says how to fix it). `reserve`:
    the slots per group reserved now (the learned share's starting pools), the rest a hole."""
    name = ctx.new_region_name()
    base = ctx.config.host_region_dir
    if name is None or base is None or not any(layout.num_slots):
        return None
    from kvtier.store.tiers.host_region import HostRegion, RegionError

    try:
        return HostRegion.create(base, name, layout, reserve)
    except (RegionError, OSError) as exc:
        log.warning("kvtier: the cpu tier stays private to the worker, so chunks on disk or in Redis "
                    "are promoted at load, not at lookup: %s (or set kvtier.host_region to \"off\" "
                    "to silence this)", exc)
        return None
