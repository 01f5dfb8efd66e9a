"""One place that builds a tier from (name, layout, options), and a slot tier's layout from the
plan (`tier_layout`): the Store and the vLLM halves alike. What differs between them is options
(pinned or registered slabs, a host region, a disk reader beside its writer, the tenant secret),
so they are fields here, and the rules that go with them live once:
- cpu: `CpuTier(layout, pin_memory, host_register, region)`; `fault_in` touches every page of
  private slabs now, at start, so a store never pays first-touch page faults inside an engine
  step (scripts/first-touch-timing.py). A region is faulted in when it is made, and a registered
  slab by its registration, so `fault_in` skips them.
- disk: `DiskTier(root, layout, namespace_id, fsync, keyed, reader)`.
- redis: `RedisTier.from_url(redis_url, namespace_id, keyed, password)`; key-addressed, so it
  takes no layout.
Imports are lazy: the vLLM scheduler builds its disk reader and Redis client without torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvtier.core.plan import Plan
    from kvtier.store.integrity import Keyed
    from kvtier.store.tiers.base import Tier, TierLayout
    from kvtier.store.tiers.cpu import HostRegister
    from kvtier.store.tiers.host_region import HostRegion

NAMES = ("cpu", "disk", "redis")


@dataclass(frozen=True, slots=True)
class TierOptions:
    namespace_id: str | None = None  # disk: its directory; redis: restricts list() and checks writes
    keyed: Keyed | None = None  # disk, redis: the tenant secret payloads are MACed with
    # cpu
    pin_memory: bool | None = None  # None: pinned where CUDA is present
    host_register: HostRegister | None = None  # page-lock by registering plain memory (vLLM's)
    region: HostRegion | None = None  # slabs and slot table in a file another process maps
    # touch every page of private, unpinned slabs now (True), or each group's first slots only (a
    # tuple per group: a learned share's starting pools; the rest of its layout is address space)
    fault_in: bool | tuple[int, ...] = False
    # disk
    root: str | os.PathLike[str] | None = None
    fsync: str = "never"
    reader: bool = False  # read a directory another process writes
    # redis
    redis_url: str | None = None
    redis_password: str | None = None


def tier_layout(plan: Plan, slots: Callable[[int], int]) -> TierLayout:
    """A slot tier's layout: each cacheable group's chunk bytes and `slots(group)` slots, nothing
    for the others. The Store asks its index's pools, the vLLM halves `index.pool.slot_counts`:
    the same numbers."""
    from kvtier.store.tiers.base import TierLayout

    groups = plan.groups
    return TierLayout(slot_bytes=tuple(gp.chunk_bytes if gp.cacheable else 0 for gp in groups),
                      num_slots=tuple(slots(gp.index) if gp.cacheable else 0 for gp in groups))


def make_tier(name: str, layout: TierLayout | None, options: TierOptions) -> Tier:
    """The tier `name` ("cpu", "disk", "redis") laid out by `layout` (None for redis)."""
    if name == "cpu":
        from kvtier.store.tiers.cpu import CpuTier

        assert layout is not None
        tier = CpuTier(layout, pin_memory=options.pin_memory, host_register=options.host_register,
                       region=options.region)
        if options.fault_in is not False and options.region is None and not tier.pinned:
            for g, slab in enumerate(tier.slabs):
                slab[:slab.shape[0] if options.fault_in is True else options.fault_in[g]].zero_()
        return tier
    if name == "disk":
        from kvtier.store.tiers.disk import DiskTier

        if options.root is None or layout is None or options.namespace_id is None:
            raise ConfigError("a disk tier needs a directory, a layout and a namespace id")
        return DiskTier(options.root, layout, options.namespace_id, fsync=options.fsync,
                        keyed=options.keyed, reader=options.reader)
    if name == "redis":
        from kvtier.store.tiers.redis import RedisTier

        if options.redis_url is None:
            raise ConfigError("a redis tier needs a url, e.g. redis://127.0.0.1:6379/0")
        return RedisTier.from_url(str(options.redis_url), namespace_id=options.namespace_id,
                                  keyed=options.keyed, password=options.redis_password)
    raise ConfigError(f"unknown tier {name!r}; use one of: {', '.join(NAMES)}")
