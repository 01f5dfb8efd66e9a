"""`KvtierOffloadingSpec`: kvtier as an out-of-tree offloading spec for vLLM's OffloadingConnector.

    kv_transfer_config = {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": "KvtierOffloadingSpec",
            "spec_module_path": "kvtier.integrations.vllm.spec",
            "kvtier.tiers": "cpu,disk", "kvtier.cpu_bytes": "4GiB",
            "kvtier.disk_bytes": "64GiB", "kvtier.directory": "/var/cache/kvtier",
        },
    }

vLLM builds the spec once in the scheduler process (`get_manager`) and once per worker
(`get_worker`). Both build the same `SpecContext` from the engine's offloading config: the
geometry of vLLM's own KV-cache groups (geometry.py), the chunk plan (`blocks_per_chunk` blocks
per chunk, or `kvtier.chunk_tokens`), the namespace (model, geometry fingerprint, dtype, rank)
and the tier capacities, so the manager's index and the worker's tiers agree on every slot.
"""

from __future__ import annotations

import logging
import math

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingSpec, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig

from kvtier.errors import ConfigError
from kvtier.core.keys import Namespace
from kvtier.core.plan import make_plan

from .common import Metrics, SpecContext, model_identity
from .config import parse_config
from .geometry import EngineGroup, geometry_for_groups

log = logging.getLogger("kvtier.vllm")


class KvtierOffloadingSpec(OffloadingSpec):
    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        tier_config = parse_config(config.extra_config)
        groups = [EngineGroup(g.group_id, g.tokens_per_block, tuple(g.layer_names))
                  for g in config.groups]
        bpc = self.blocks_per_chunk
        if tier_config.chunk_tokens is not None:
            bpc = _blocks_for(tier_config.chunk_tokens, groups, config.extra_config)
            # vLLM's scheduler reads the spec's blocks_per_chunk, so this is the chunk size
            # both sides use (and the one `kvtier plan` prints as kvtier.chunk_tokens)
            self.blocks_per_chunk = bpc
        geometry = geometry_for_groups(config.model.name, config.model.dtype, groups,
                                       config.cache.tokens_per_hash)
        plan = make_plan(geometry, blocks_per_chunk=bpc)
        rank, world = config.parallel.rank, config.parallel.world_size
        namespace = Namespace(model=model_identity(config.model.name),
                              geometry_fingerprint=geometry.fingerprint(),
                              dtype=config.model.dtype, rank=rank, world_size=world,
                              tenant=tier_config.tenant)
        self.ctx = SpecContext(plan=plan, namespace=namespace, config=tier_config,
                               group_of={g.group_id: i for i, g in enumerate(groups)},
                               blocks_per_chunk=bpc)
        self._manager: OffloadingManager | None = None
        self._worker: OffloadingWorker | None = None
        self.reports_failures = False  # set by KvtierConnector, which turns failures into recomputes

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            from .manager import KvtierManager

            metrics = Metrics("scheduler", self.ctx.config.directory)
            # what vLLM's own CPU spec would reserve per key (one row for every chunk of any
            # group), recorded beside kvtier's per-group slots so the two can be compared
            metrics.info["vllm_row_bytes"] = self.config.worker_kv_bytes_per_block * self.blocks_per_chunk
            for gp in self.ctx.plan.groups:
                metrics.info[f"chunk_bytes_group{gp.index}"] = gp.chunk_bytes
            self._manager = KvtierManager(self.ctx, metrics)
            log.info("kvtier: manager on %s, plan chunk_tokens=%d, namespace %s",
                     dict(self.ctx.config.capacities_bytes), self.ctx.plan.chunk_tokens,
                     self.ctx.namespace.id)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            from .worker import KvtierWorker

            rank = self.ctx.namespace.rank
            self._worker = KvtierWorker(self.ctx, kv_caches,
                                        Metrics(f"worker{rank}", self.ctx.config.directory))
        return self._worker


def _blocks_for(chunk_tokens: int, groups: list[EngineGroup], extra: object) -> int:
    tpbs = sorted({g.tokens_per_block for g in groups})
    unit = math.lcm(*tpbs)
    if chunk_tokens % unit:
        raise ConfigError(
            f"kvtier.chunk_tokens={chunk_tokens} is not a multiple of vLLM's block size "
            f"{unit}; use {max(unit, chunk_tokens // unit * unit)} or {(chunk_tokens // unit + 1) * unit}"
        )
    if len(tpbs) > 1:
        raise ConfigError(
            f"kvtier.chunk_tokens: vLLM's groups have {tpbs} tokens per block and vLLM uses one "
            "blocks_per_chunk for all of them; set \"blocks_per_chunk\" instead"
        )
    bpc = chunk_tokens // tpbs[0]
    given = extra.get("blocks_per_chunk") if hasattr(extra, "get") else None  # type: ignore[union-attr]
    if given is not None and int(given) != bpc:
        raise ConfigError(
            f"kvtier.chunk_tokens={chunk_tokens} means blocks_per_chunk={bpc} but "
            f"blocks_per_chunk={given} is also set; give only one"
        )
    return bpc
