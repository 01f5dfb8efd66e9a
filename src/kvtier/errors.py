"""kvtier's exceptions: one root, caller mistakes raise at the boundary.

Expected outcomes (a miss, a full tier, a failed transfer) are values, not exceptions.
Exceptions are for mistakes a caller can fix; every message names the bad value and the fix.
"""

from __future__ import annotations


class KvtierError(Exception):
    """Root of every exception kvtier raises on purpose."""


class ConfigError(KvtierError, ValueError):
    """A setting, geometry or file the caller gave is wrong; the message says how to fix it."""


class UnsupportedModelError(ConfigError):
    """A model kvtier cannot serve correctly (it refuses rather than restore wrong KV)."""


class TierError(KvtierError):
    """A tier could not be built or used (bad directory, server unreachable at construction)."""
