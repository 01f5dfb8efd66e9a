"""Every counter kvtier keeps, declared once: its name, help text, labels and kind.

There is one registry per scope, each with one exporter:

- `STORE`: a `Store`'s counters (`store/metrics.py`, `StoreMetrics`): store-wide ones, and ones
  per (tier, group) with those labels. Read as `store.metrics()`; exported by the Store's
  Prometheus collector (`store.register_prometheus()`) as `kvtier_<name>_total`.
- `TIER`: every tier's own counters (the attributes of `store/tiers/base.Tier`, `TierStats`) and
  the redis tier's extra ones (`RedisTier.metrics()`), labelled by `tier`. Read as `tier.stats()`
  / `tier.metrics()` and in `store.metrics()["tier_counters"]`; exported by the Store's
  collector as `kvtier_tier_<name>_total` (gauges: `kvtier_tier_<name>`).
- `VLLM`: the vLLM integration's counters (`integrations/vllm/counters.Metrics`), written into
  the per-process counter files and exported on vLLM's stats path (`integrations/vllm/stats.py`:
  `vllm serve`'s /metrics) as `vllm:kvtier_<name>_total`; `{tier}` in a name makes one counter
  per tier in the files and one metric with a `tier` label on /metrics.

A call site names a counter by its string; every counting path checks the name against its
registry (`Registry.check`, a set lookup) and raises `UndeclaredCounter` on a name that is not
declared here, so a typo fails at the first count, and tests/test_counters.py finds every literal
at the call sites and checks it without running them. Standard library only (core/).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

TIERS = ("cpu", "disk", "redis")  # the tier names (store/tiers TIER_NAMES, vLLM config.TIERS)
_PLACEHOLDER = re.compile(r"\{(tier|g)\}")


class UndeclaredCounter(KeyError):
    """A counter name that no registry of kvtier.core.counters declares."""


@dataclass(frozen=True, slots=True)
class Counter:
    """One declared counter. `name` is what a call site counts and what a snapshot dict or counter
    file holds; `{tier}` in it stands for each of TIERS, `{g}` for a group index (file-only
    copies). `labels` are its Prometheus labels beyond the exporter's own. `kind` is "counter"
    or "gauge". `derived`: computed when read (never counted by a call site). `file_only`: kept
    in vLLM's counter files only, because another counter's labels carry it on /metrics
    (`exported_by` names that counter)."""

    name: str
    help: str
    labels: tuple[str, ...] = ()
    kind: str = "counter"
    derived: bool = False
    exported_by: str = ""  # file-only: the declared counter whose labels carry it

    @property
    def file_only(self) -> bool:
        return bool(self.exported_by)

    def names(self) -> tuple[str, ...]:
        """The concrete names a call site may count (`{g}` names match by pattern instead)."""
        if "{tier}" in self.name:
            return tuple(self.name.format(tier=t) for t in TIERS)
        return (self.name,)


class Registry:
    """One scope's declared counters, in declaration order; `check(name)` returns a declared
    concrete name or raises UndeclaredCounter."""

    def __init__(self, scope: str, counters: tuple[Counter, ...]) -> None:
        self.scope = scope
        self.counters = counters
        self._by_name: dict[str, tuple[Counter, str]] = {}  # concrete name -> (counter, tier)
        self._patterns: list[tuple[re.Pattern[str], Counter]] = []
        for c in counters:
            if "{g}" in c.name:
                self._patterns.append((re.compile(re.escape(c.name).replace(r"\{g\}", r"\d+") + "$"), c))
                continue
            for tier, name in zip(TIERS if "{tier}" in c.name else ("",), c.names()):
                if name in self._by_name:
                    raise ValueError(f"counter {name!r} declared twice in {scope}")
                self._by_name[name] = (c, tier)
        self._known: set[str] = set(self._by_name)  # checked names, `{g}` ones added when seen

    def __iter__(self) -> Iterator[Counter]:
        return iter(self.counters)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._known or self._match(name) is not None)

    def check(self, name: str) -> str:
        """`name` itself when declared (a set lookup), else UndeclaredCounter."""
        if name in self._known:
            return name
        if self._match(name) is None:
            raise UndeclaredCounter(f"{name!r} is not a declared {self.scope} counter; declare it in "
                                    f"kvtier/core/counters.py ({self.scope.upper()})")
        self._known.add(name)
        return name

    def counter(self, name: str) -> Counter:
        """The declared counter a concrete name belongs to."""
        hit = self._by_name.get(name)
        if hit is not None:
            return hit[0]
        c = self._match(name)
        if c is None:
            self.check(name)  # raises
        assert c is not None
        return c

    def tier_of(self, name: str) -> str:
        """The tier a per-tier concrete name counts (`loaded_chunks_disk` -> "disk"), else ""."""
        hit = self._by_name.get(name)
        return hit[1] if hit is not None else ""

    def names(self, *, counted: bool = False) -> tuple[str, ...]:
        """Every concrete name (`{g}` names excluded); counted=True: not the derived ones."""
        return tuple(n for n, (c, _) in self._by_name.items() if not (counted and c.derived))

    def _match(self, name: str) -> Counter | None:
        for pattern, c in self._patterns:
            if pattern.match(name):
                return c
        return None


TIER_GROUP = ("tier", "group")
GROUP = ("group",)

# -- the Store (store/metrics.py) ---------------------------------------------------------------
STORE = Registry("store", (
    # store-wide
    Counter("lookups", "Store lookups."),
    Counter("hit_lookups", "Store lookups that found a hit of at least one chunk."),
    Counter("miss_lookups", "Store lookups without a hit (lookups - hit_lookups).", derived=True),
    Counter("lookup_tokens", "Prompt tokens looked up."),
    Counter("hit_tokens", "Prompt tokens the lookups' hits covered."),
    Counter("restored_tokens", "Tokens whose KV the loads restored."),
    Counter("corrupt_dropped", "Payloads dropped as corrupt or foreign (read or rebuild)."),
    Counter("failed_saves", "Chunk writes a tier refused or failed."),
    Counter("skipped_saves", "Chunk writes skipped (every slot pinned, or already held)."),
    Counter("not_admitted", "Chunks the admission policy kept out."),
    Counter("promotions", "Chunks copied into a faster tier after a load from a slower one."),
    Counter("shared_exists_queries", "Existence queries sent to the shared tiers."),
    Counter("rebuild_refused", "Disk entries refused at the index rebuild (a layout that no longer fits)."),
    Counter("placement_cold", "Entries the placement stored only in the tiers after the first."),
    Counter("placement_skipped", "Entries the placement did not store (no hit likely to read them)."),
    Counter("share_resizes", "Pools the learned share resized (grown or shrunk; at a restart too)."),
    Counter("share_evicted", "Entries dropped because the learned share shrank their pool."),
    Counter("share_moved", "Payloads moved to a lower slot of a pool the learned share shrank."),
    Counter("share_move_failed", "Moves that failed (source bad or write failed): the entry dropped."),
    Counter("share_dropped", "Disk entries a resize relocated, dropped rather than moved while serving "
            "(a move is I/O inside a save)."),
    Counter("share_released_bytes", "Bytes of memory or disk given back past the ends of shrunk pools."),
    Counter("worth_tunings", "Tunings of the worth weight adopted (policy worth: shadow replays of "
            "recent saves, kvtier.index.tuning)."),
    Counter("worth_tunings_skipped", "Tunings of the worth weight skipped: the last one was still "
            "running, or the window evicted nothing in its shadow (every weight scores alike)."),
    Counter("worth_tunings_failed", "Tunings of the worth weight that failed (the shadow process died "
            "or answered garbage): the weight was kept."),
    # per (tier, group)
    Counter("load_chunks", "Chunks loaded from a tier.", TIER_GROUP),
    Counter("load_misses", "Chunk reads a tier could not serve (missing or a bad payload).", TIER_GROUP),
    Counter("load_bytes", "Payload bytes loaded from a tier.", TIER_GROUP),
    Counter("load_seconds", "Seconds spent reading chunks from a tier.", TIER_GROUP),
    Counter("save_chunks", "Chunks written into a tier.", TIER_GROUP),
    Counter("save_failures", "Chunk writes into a tier that failed.", TIER_GROUP),
    Counter("save_bytes", "Payload bytes written into a tier.", TIER_GROUP),
    Counter("save_seconds", "Seconds spent writing chunks into a tier (a batch's time shared by bytes).",
            TIER_GROUP),
    Counter("evictions", "Entries the index evicted from a tier (store.metrics()['evictions'] is "
            "their sum).", TIER_GROUP, derived=True),
))

# -- every tier (store/tiers/base.py) and the redis tier's own (store/tiers/redis.py) -------------
TIER_BASE = ("writes", "failed_writes", "reads", "misses", "corrupt_dropped", "bytes_written", "bytes_read")
TIER = Registry("tier", (
    Counter("writes", "Chunk payloads written.", ("tier",)),
    Counter("failed_writes", "Chunk writes that failed or were refused.", ("tier",)),
    Counter("reads", "Chunk reads asked of the tier.", ("tier",)),
    Counter("misses", "Chunk reads that restored nothing (absent, foreign or corrupt).", ("tier",)),
    Counter("corrupt_dropped", "Bad payloads dropped (freed, never read again).", ("tier",)),
    Counter("bytes_written", "Payload bytes written.", ("tier",)),
    Counter("bytes_read", "Payload bytes read and verified.", ("tier",)),
    # redis only (RedisTier._extra)
    Counter("vanished", "Redis: chunk reads that found no value (never stored, expired or evicted since lookup).", ("tier",)),
    Counter("skipped_reads", "Redis: reads skipped: the circuit breaker was open, or the call failed or ran late.", ("tier",)),
    Counter("skipped_saves", "Redis: writes skipped: the breaker was open, the call failed or ran late, or a SET was refused.", ("tier",)),
    Counter("budget_skipped", "Redis: writes skipped by the namespace's write budget.", ("tier",)),
    Counter("errors", "Redis: calls and replies that failed with an error other than a lost connection.", ("tier",)),
    Counter("deleted", "Redis: keys deleted.", ("tier",)),
    Counter("foreign_skipped", "Redis: intact payloads of another tenant (or unkeyed) left in place.",
            ("tier",)),
    Counter("up", "Redis: 1 while the circuit breaker is closed.", ("tier",), kind="gauge", derived=True),
    Counter("connection_failures", "Redis: connection failures the circuit breaker saw.", ("tier",),
            derived=True),
))
REDIS_EXTRA = tuple(c.name for c in TIER if c.name not in TIER_BASE and not c.derived)

# -- the vLLM integration (integrations/vllm/counters.py, stats.py) -------------------------------
VLLM = Registry("vllm", (
    # scheduler (KvtierManager)
    Counter("lookup_keys", "Offload keys vLLM looked up in kvtier's index (scheduler).", GROUP),
    Counter("lookup_hit_keys", "Lookups kvtier answered as a hit.", GROUP),
    Counter("lookup_keys_offload_off", "Lookups answered as a miss because offloading is off "
            "for this engine (a state model outside mamba_cache_mode=align)."),
    Counter("redis_lookups_queued", "Keys the scheduler asked Redis about off the engine thread."),
    Counter("redis_lookup_timeouts", "Redis existence checks without an answer in time (a miss)."),
    Counter("adopted_from_redis", "Chunks another engine stored in Redis that this index adopted.", GROUP),
    Counter("load_jobs_scheduled", "Load jobs the scheduler planned."),
    Counter("load_chunks_{tier}", "Chunks the scheduler planned to load, by the tier they are read "
            "from.", TIER_GROUP),
    Counter("load_keys_vanished", "Chunks evicted between lookup and load (that load fails and vLLM "
            "recomputes).", GROUP),
    Counter("store_chunks", "Chunks the scheduler reserved slots for.", GROUP),
    Counter("promote_chunks", "Chunks loaded from disk or Redis that the scheduler gave a cpu slot to "
            "be promoted into.", GROUP),
    Counter("promote_aborted", "Promotion slots released because their load failed.", GROUP),
    Counter("promote_at_lookup", "Promotions started by a lookup (through the worker's host region): "
            "the lookup answered pending until the chunk was in host memory.", GROUP),
    Counter("promote_read_failed", "Promotions started by a lookup whose read failed (a miss, a "
            "corrupt payload, a chunk stored in part): the chunk is served as before.", GROUP),
    Counter("lookup_pending_keys", "Lookups answered pending while their chunk was promoted into host "
            "memory (vLLM asks again next step).", GROUP),
    Counter("lookup_not_in_host", "Lookups answered as a miss because the chunk was only on disk or in "
            "Redis and could not be promoted (host-only loads: sync_load_budget_bytes).", GROUP),
    Counter("promote_skipped_full", "Promotions skipped because every cpu slot of the group was pinned "
            "or reserved (the load still reads the slower tier).", GROUP),
    Counter("promote_skipped_share", "Promotions at lookup read but not filled: a learned-share op on "
            "the group had not reached the workers yet, or the slot's memory is not reserved (host "
            "region); the chunk is served as before.", GROUP),
    Counter("promote_dropped", "Promotions at lookup not started because the reads out would pass "
            "kvtier.io_queue_bytes: the chunk is served as before (its load reads the slower tier; a "
            "miss with host-only loads).", GROUP),
    Counter("store_skipped_full_{tier}", "Stores skipped because every slot of the tier was pinned by "
            "transfers in flight.", TIER_GROUP),
    Counter("store_skipped_placement", "Chunks not stored because no hit is likely to end where they "
            "serve (kvtier.placement hits, one tier: a state checkpoint or sliding window away from the "
            "request's ends and branch points).", GROUP),
    Counter("store_cold", "Chunks stored only in the tiers after the first (kvtier.placement hits: "
            "unlikely to be read).", GROUP),
    Counter("store_calls_refused", "prepare_store calls answered None because no tier could take every "
            "new key (vLLM offers the keys again later)."),
    Counter("store_keys_offload_off", "Stores skipped because offloading is off for this engine."),
    Counter("kv_events_stored", "KV events announcing a chunk restorable from a tier (with vLLM's KV "
            "events on)."),
    Counter("kv_events_removed", "KV events announcing a chunk no longer restorable from a tier."),
    Counter("kv_events_dropped", "KV events dropped because nothing drained them (memory bound)."),
    Counter("evicted_{tier}", "Chunks evicted from a tier to make room.", TIER_GROUP),
    Counter("evicted_{tier}_dead", "Chunks evicted first because no hit could read them any more.",
            TIER_GROUP),
    Counter("load_failures", "Loads the workers could not restore (vLLM recomputed them)."),
    Counter("removed_after_failure", "Chunks forgotten after a failed load."),
    Counter("resets", "Cache resets (vLLM's reset_prefix_cache)."),
    Counter("resets_flushed", "Resets whose in-flight jobs the workers reported (vLLM 0.33)."),
    Counter("rebuilt_chunks", "Chunks adopted from the disk tier at start."),
    Counter("disk_journal_errors", "Disk event journal writes or compactions that failed: journaling "
            "stopped for this process (a restart announces fewer disk chunks to a router: misses only)."),
    Counter("disk_journal_full", "Times the disk event journal stopped at its size cap "
            "(DiskJournal.MAX_BYTES of live records)."),
    Counter("disk_journal_bad_records", "Disk event journal records of the wrong field types, skipped "
            "at start."),
    Counter("layout_from_workers", "Index rebuilds from the workers' exact layout at start."),
    Counter("share_resizes", "Times the learned share resized the index's pools (kvtier.share)."),
    Counter("share_evicted", "Chunks dropped because the learned share shrank their pool.", GROUP),
    Counter("worth_tunings", "Tunings of the worth weight adopted (policy worth: shadow replays of "
            "recent requests, kvtier.index.tuning)."),
    Counter("worth_tunings_skipped", "Tunings of the worth weight skipped: the last one was still "
            "running, or the window evicted nothing in its shadow (every weight scores alike)."),
    Counter("worth_tunings_failed", "Tunings of the worth weight that failed (the shadow process died "
            "or answered garbage): the weight was kept."),
    Counter("share_moved", "Chunks the learned share moved to a lower slot of a shrunk pool (the "
            "workers copy them: share_moves_applied).", GROUP),
    # workers (KvtierWorker)
    Counter("load_jobs", "Load jobs the workers finished."),
    Counter("load_jobs_failed", "Load jobs the workers failed (vLLM recomputes the request)."),
    Counter("sync_load_jobs", "Synchronous loads (vLLM 0.33's sync_load_budget_bytes) the workers "
            "restored from host memory."),
    Counter("sync_load_jobs_failed", "Synchronous loads that failed: the engine stopped rather than run "
            "a request on KV never restored (none expected; report it)."),
    Counter("store_jobs", "Store jobs the workers finished."),
    Counter("store_jobs_failed", "Store jobs the workers failed."),
    Counter("jobs_noncontiguous", "Jobs refused because a group's blocks were not contiguous."),
    Counter("loaded_chunks_{tier}", "Chunks read from a tier and restored.", TIER_GROUP),
    Counter("loaded_chunks_group{g}", "Chunks restored into group g (the counter files' copy of "
            "loaded_chunks by its group label).", exported_by="loaded_chunks_{tier}"),
    Counter("loaded_bytes_{tier}", "Bytes read from a tier and restored.", TIER_GROUP),
    Counter("loaded_blocks", "vLLM KV blocks written by loads.", GROUP),
    Counter("promoted_chunks_{tier}", "Chunks read and verified from a slower tier (the label) and "
            "copied into the cpu tier by their load.", TIER_GROUP),
    Counter("promote_skipped_partial", "Promotions skipped because the load needed only part of the "
            "chunk.", GROUP),
    Counter("load_miss_{tier}", "Chunk reads a tier could not serve (missing, overwritten or corrupt: "
            "the load fails and vLLM recomputes).", TIER_GROUP),
    Counter("load_miss_vanished", "Chunk reads with no place (evicted before the load).", GROUP),
    Counter("stored_chunks_{tier}", "Chunks written into a tier.", TIER_GROUP),
    Counter("stored_bytes_{tier}", "Bytes written into a tier.", TIER_GROUP),
    Counter("store_failed_{tier}", "Chunk writes a tier refused or failed.", TIER_GROUP),
    Counter("store_dropped_{tier}", "Chunk writes dropped because the background I/O queue was full "
            "(kvtier.io_queue_bytes).", TIER_GROUP),
    Counter("store_failed_unreported", "Chunks of store jobs a worker failed, which vLLM reported as "
            "stored: their cpu slot did not hold them, so no tier commits them.", GROUP),
    Counter("store_overwritten_{tier}", "Disk/Redis writes skipped because the cpu slot they were "
            "copied from was taken by another chunk first.", TIER_GROUP),
    Counter("share_moves_applied", "Chunks a worker copied to the slot the learned share moved them "
            "to.", GROUP),
    Counter("share_move_failed", "Moves whose source slot did not hold the chunk: the new slot is "
            "cleared, a load of it a counted miss (none expected).", GROUP),
    Counter("share_released_bytes", "Bytes of cpu-tier memory a worker gave back past the end of a "
            "pool the learned share shrank.", GROUP),
    Counter("share_reserve_failed", "Pools the learned share grew whose new slots a worker could not "
            "reserve in its host region (no room in the tmpfs): those slots take no writes, each "
            "store there a counted failed write and its load a counted miss.", GROUP),
))

REGISTRIES = (STORE, TIER, VLLM)
