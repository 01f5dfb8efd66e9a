"""Data-plane tiers behind one contract (`kvtier.store.tiers.base.Tier`): cpu, disk, redis.

`make_tier(name, ...)` builds one by name; the modules import torch, so import them only
where the data plane runs.
"""

from __future__ import annotations

from kvtier.core.counters import TIERS as TIER_NAMES  # noqa: F401  (declared once, in core)
