"""kvtier: hybrid-aware, tiered KV-cache offloading for LLM inference.

`import kvtier` stays light: it never imports torch, transformers or vllm. The data plane
(tiers, transfer, integrations) is imported from its own modules when needed.
"""

from __future__ import annotations

from kvtier.errors import ConfigError, KvtierError, TierError, UnsupportedModelError
from kvtier.geometry import Geometry, Group, load_geometry
from kvtier.plan import GroupPlan, Plan, make_plan

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
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
