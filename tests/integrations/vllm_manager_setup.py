"""The vLLM manager without an engine, for the placement tests (test_vllm_manager_placement.py,
test_vllm_manager_placement_sliding.py): its context from a geometry and tier bytes, a request's
keys with every position known (as vLLM's update_offload_keys records them when the request is
hashed), and a store vLLM completes at once."""

from __future__ import annotations

from pathlib import Path

from vllm.v1.kv_offload.base import ReqContext, make_offload_key

from kvtier.core.geometry import Geometry
from kvtier.core.keys import Namespace
from kvtier.core.plan import make_plan
from kvtier.integrations.vllm.common import SpecContext
from kvtier.integrations.vllm.config import parse_config
from kvtier.integrations.vllm.counters import Metrics
from kvtier.integrations.vllm.manager import KvtierManager


def row_bytes(geom: Geometry) -> int:
    """One chunk of every group, one block a chunk."""
    return sum(gp.chunk_bytes for gp in make_plan(geom, blocks_per_chunk=1).groups)


def context(tmp_path: Path, geom: Geometry, tier_bytes: dict[str, int], placement: str | None = None,
            **ctx_extra: object) -> SpecContext:
    """The context of an engine with `geom` (vLLM group i is plan group i, one block a chunk),
    tiers `tier_bytes` in order, no host region, `placement` (None: the default)."""
    extra: dict[str, object] = {"kvtier.tiers": ",".join(tier_bytes), "kvtier.host_region": "off",
                                "kvtier.directory": str(tmp_path)}
    extra.update({f"kvtier.{t}_bytes": n for t, n in tier_bytes.items()})
    if placement is not None:
        extra["kvtier.placement"] = placement
    return SpecContext(plan=make_plan(geom, blocks_per_chunk=1),
                       namespace=Namespace("m", geom.fingerprint(), "float16"), config=parse_config(extra), group_of={i: i for i in range(len(geom.groups))},
                       blocks_per_chunk=1, **ctx_extra)


def manager(tmp_path: Path, geom: Geometry, tier_bytes: dict[str, int], placement: str | None = None,
            **ctx_extra: object) -> KvtierManager:
    """A manager on `context(...)`, KV events on."""
    return KvtierManager(context(tmp_path, geom, tier_bytes, placement, **ctx_extra), Metrics("scheduler", None),
                         events=True)


def request_keys(req: str, seeds: list[int], tokens: int, groups: int = 2) -> tuple[ReqContext, list[list]]:
    """A request whose chunk i has hash seed seeds[i] (shared seeds: a shared prefix): its keys
    per vLLM group, every key's position known."""
    rc = ReqContext(req_id=req)
    keys = [[make_offload_key(bytes([s % 256, i]) * 16, g) for i, s in enumerate(seeds)] for g in range(groups)]
    for g in range(groups):
        for i, k in enumerate(keys[g]):
            rc.set_offload_key_position(k, (i + 1) * tokens)
    return rc, keys


def store(m: KvtierManager, rc: ReqContext, keys: list) -> list:
    """prepare_store, then complete_store of what it took: the keys stored."""
    out = m.prepare_store(keys, rc)
    m.complete_store(out.keys_to_store, rc)
    return list(out.keys_to_store)
