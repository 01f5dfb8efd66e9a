"""Host-only loads (vLLM 0.33's `sync_load_budget_bytes` set; config.py): which hits a lookup
may answer (the manager's lookup asks `hit` once a chunk is not being promoted).

vLLM runs a request on its synchronously loaded KV in the same step and cannot hear that such a
load failed, so every load must read verified host memory only. A lookup then answers HIT only
for a chunk whose fastest place is the cpu tier; a chunk only on disk or in Redis is promoted at
lookup (HIT_PENDING, promotion.py) or, where it cannot be (no region, no free slot, its request
promoted once already, a failed read), is a MISS: the hit ends there and vLLM computes the rest.
A cpu entry answered HIT must hold the whole chunk in the slot table (read through the host
region: vLLM 0.33 never reports a failed store, so the index alone may name an empty slot) and
stays pinned until the step ends (`end_step`, from the manager's `on_schedule_end`), after the
request's prepare_load (same step) pinned it for its load: vLLM's lookup of a request goes on
after a HIT (other groups, sliding windows scanned from the end), and a promotion it starts
reserves a cpu slot, which must not evict a chunk already answered HIT.
"""

from __future__ import annotations

import logging

from vllm.v1.kv_offload.base import OffloadKey, ReqContext

from kvtier.index.index import Index

from .common import SpecContext
from .counters import Metrics
from .promotion import LookupPromoter

log = logging.getLogger("kvtier.vllm")


class HostOnlyHits:
    """The cpu entries this step's lookups answered HIT for, pinned until the step ends."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._step_pins: set[tuple[bytes, int]] = set()
        self._warned_no_region = False

    def hit(self, index: Index, promoter: LookupPromoter, ctx: SpecContext, key: OffloadKey,
            split: tuple[bytes, int], rc: ReqContext) -> bool:
        """Whether the lookup of `key` (chunk `split`, held by `index`) may answer HIT; the cpu
        entry is pinned until `end_step` when it may."""
        group = split[1]
        places = index.where(*split)
        if not places or places[0][0] != "cpu":  # not promoted, so not a hit
            self.metrics.add("lookup_not_in_host", group=group)
            return False
        if split not in self._step_pins:  # kept in host memory until this step's loads pinned it
            if not index.pin(split[0], split[1], "cpu"):
                return False
            if not self._holds(promoter, ctx, key, split, places[0][1], rc):
                index.unpin(split[0], split[1], "cpu")
                self.metrics.add("lookup_not_in_host", group=group)
                return False
            self._step_pins.add(split)
        return True

    def _holds(self, promoter: LookupPromoter, ctx: SpecContext, key: OffloadKey, split: tuple[bytes, int],
               slot: int, rc: ReqContext) -> bool:
        """Whether the cpu slot the index names really holds the whole chunk, read from the slot
        table through the worker's host region. The index alone is not enough: vLLM 0.33 never
        reports a failed store, so a store job the worker failed leaves entries committed over
        slots that hold nothing (an asynchronous load then fails and is recomputed; a synchronous
        one cannot be). Without the region nothing can be checked: no hit (warned once)."""
        want = ctx.whole_chunk_header(split[0], split[1], rc.get_offload_key_position(key))
        held = promoter.holds(split[1], slot, split[0], want) if want is not None else False
        if held is None:
            if not self._warned_no_region:
                self._warned_no_region = True
                log.warning("kvtier: sync_load_budget_bytes needs the workers' host regions to check host "
                            "slots before a synchronous load, and there are none (kvtier.host_region "
                            "\"off\", or a worker could not make one: its warning says why): every lookup misses")
            return False
        return held

    def end_step(self, index: Index) -> None:
        """Release the cpu entries this step's lookups answered HIT for (each request's
        prepare_load, in the step, pinned those it loads)."""
        for h, g in self._step_pins:
            index.unpin(h, g, "cpu")
        self._step_pins.clear()

    def forget(self) -> None:
        """The manager's index was replaced (a reset, the workers' layout): its pins went with it."""
        self._step_pins.clear()
