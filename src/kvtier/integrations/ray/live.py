"""This process's live routers, for inspection. Ray Serve pickles the router's package by value
into every process that routes (a copy of each module), so the router imports this one at run
time, from sys.modules: one registry per process."""

from __future__ import annotations

import weakref

LIVE: weakref.WeakSet = weakref.WeakSet()


def routers() -> list:
    """This process's routers (Ray Serve builds one per deployment handle, in the caller's process:
    the driver's for `serve.run`'s handle, the proxy's for HTTP)."""
    return list(LIVE)
