"""Ray Serve request routing by what kvtier restores: `KvtierRequestRouter` (router.py) sends each
request to the replica whose vLLM engine restores the most of its prompt from kvtier's tiers, as
`kvtier.router` predicts it per KV-cache group from the engine's KV events, weighed per tier by
its load cost and against the replica's queue (score.py); Ray's power of two choices when no
replica restores anything. One replica = one vLLM engine with kvtier and KV events on;
deployment: docs/vllm.md, "Ray Serve".

    RequestRouterConfig(request_router_class="kvtier.integrations.ray.KvtierRequestRouter",
                        request_router_kwargs={"queue_cost_tokens": 512})

The Ray-free parts (score.py) import without Ray; the router itself is exported lazily.
"""

from __future__ import annotations

from .live import routers
from .score import DEFAULT_QUEUE_COST_TOKENS, DEFAULT_TIER_COSTS, Choice, prompt_tokens, rank, saved_tokens

__all__ = ["DEFAULT_QUEUE_COST_TOKENS", "DEFAULT_TIER_COSTS", "EVENTS_KEY", "REPLAY_KEY", "Choice",
           "KvtierRequestRouter", "prompt_tokens", "rank", "replica_metadata", "routers", "saved_tokens"]
_RAY = {"KvtierRequestRouter", "replica_metadata", "EVENTS_KEY", "REPLAY_KEY"}


def __getattr__(name: str) -> object:
    if name in _RAY:
        from . import router

        return getattr(router, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
