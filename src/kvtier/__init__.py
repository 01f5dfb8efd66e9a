"""kvtier: hybrid-aware, tiered KV-cache offloading for LLM inference.

`import kvtier` stays light: it loads `errors` and `core` only, never torch, transformers or
vllm. The data plane's main names are exported lazily (PEP 562): `kvtier.Store`,
`kvtier.PrefixCache`, `kvtier.CpuTier`, `kvtier.DiskTier`, `kvtier.RedisTier` import their module
at first use.
"""

from __future__ import annotations

from kvtier.errors import ConfigError, KvtierError, TierError, UnsupportedModelError
from kvtier.core.geometry import Geometry, Group
from kvtier.core.load import load_geometry
from kvtier.core.plan import GroupPlan, Plan, make_plan

__version__ = "0.1.0"

_LAZY = {
    "Store": "kvtier.store.store",
    "CpuTier": "kvtier.store.tiers.cpu",
    "DiskTier": "kvtier.store.tiers.disk",
    "RedisTier": "kvtier.store.tiers.redis",
    "PrefixCache": "kvtier.integrations.transformers",
    "Keyed": "kvtier.store.integrity",
}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)

__all__ = [
    "ConfigError",
    "CpuTier",
    "DiskTier",
    "Keyed",
    "PrefixCache",
    "RedisTier",
    "Store",
    "Geometry",
    "Group",
    "GroupPlan",
    "KvtierError",
    "Plan",
    "TierError",
    "UnsupportedModelError",
    "load_geometry",
    "make_plan",
    "__version__",
]
