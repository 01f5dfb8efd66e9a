"""The wire types of kvtier's two halves in vLLM: the context both build from the same engine
config (`SpecContext`), the transfer spec that travels from the manager to the worker with every
job (`ChunkItem`, `KvtierLoadStoreSpec`), and what a worker tells the scheduler once at start
(`KvtierHandshake`).

Both sides build the context independently (vLLM creates the spec once per process) from the
same inputs, so they agree on the plan, the namespace and every tier's slot layout without
exchanging anything but the per-job `KvtierLoadStoreSpec` and the handshake. The counter files
live in counters.py, the model's identity in `kvtier.integrations.weights`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import logging

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata
from vllm.v1.kv_offload.base import LoadStoreSpec, OffloadKey

from kvtier.index.index import Index
from kvtier.index.placement import placement_share
from kvtier.index.pool import slot_counts
from kvtier.core.keys import Namespace, chunk_hashes_from_block_hashes
from kvtier.core.plan import Plan

from .config import VllmTierConfig
from .placement import header_span
# kept importable from here for code written against it before counters.py (worker.py, the
# vLLM upstream tests); new code imports it from .counters
from .counters import Metrics  # noqa: F401

log = logging.getLogger("kvtier.vllm")
# the tiers whose bytes the learned share moves: the cpu tier (slots in host memory, a move is a
# memory copy); a disk tier keeps the fixed split (a move there would be I/O in a step)
LEARNED_TIERS = ("cpu",)
_LOGGED: set[str] = set()  # the learned share's and worth's "why not" lines, once per process

# every per-key map of the scheduler side (the manager's key memo, promotion and Redis answers)
# is cleared when it reaches this many entries, so none grows without bound
SPLIT_MEMO_KEYS = 1 << 16


@dataclass(frozen=True, slots=True)
class ChunkItem:
    """One chunk of one group to move: where its payload lives (one place for a load, every
    tier that reserved a slot for a store) and what its header must say. A load from disk or
    Redis may carry a second place, ("cpu", slot): the slot it is promoted into (promotion.py)."""

    group: int  # kvtier plan group index (position in vLLM's offloaded groups)
    chunk_hash: bytes
    token_start: int
    token_end: int
    places: tuple[tuple[str, int], ...]  # (tier, slot), fastest tier first


class KvtierLoadStoreSpec(LoadStoreSpec):
    """The manager's answer to prepare_load / prepare_store: chunks in vLLM's key order (group
    by group, prefix order within a group), which is the order of vLLM's GPU block spec."""

    def __init__(self, items: list[ChunkItem]) -> None:
        self.items = tuple(items)

    def __repr__(self) -> str:
        return f"KvtierLoadStoreSpec({len(self.items)} chunks)"


@dataclass(frozen=True, slots=True)
class SlotMove:
    """A share op (the learned share): the index moved chunk `chunk_hash` of `group` from slot
    `src` to slot `dst` of `tier`; the worker copies the bytes (verified: src must hold it)."""

    tier: str
    group: int
    chunk_hash: bytes
    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class SlotRelease:
    """A share op: `group`'s pool in `tier` shrank to `slots`; the worker gives back the memory of
    its slots >= `slots` (after the moves before it in the same batch)."""

    tier: str
    group: int
    slots: int


@dataclass(frozen=True, slots=True)
class SlotReserve:
    """A share op: `group`'s pool in `tier` grew to `slots`; the worker reserves their memory
    (a host region's pages: host_region.py, "Reserved slots") before any store of this step."""

    tier: str
    group: int
    slots: int


@dataclass
class KvtierConnectorMetadata(OffloadingConnectorMetadata):
    """vLLM's per-step metadata plus the share ops the manager queued during that step's
    scheduling (`KvtierConnector.build_connector_meta`): every worker applies them, in order,
    before the step's transfers (`KvtierConnector.handle_preemptions`). `share_batch` numbers
    the batches, so a worker applies each once."""

    share_ops: tuple = ()
    share_batch: int = 0


@dataclass(frozen=True)
class KvtierHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler after registering its KV caches: its exact bytes per
    block of each offloaded group (vLLM gives the scheduler flattened specs)."""

    page_bytes: tuple[int, ...]
    # the worker's namespace parts: the scheduler's flattened specs describe some groups
    # differently, and the scheduler must look chunks up (Redis, disk) under the workers' name
    geometry_fingerprint: str = ""
    kv_dtype: str = ""
    host_region: str = ""  # the name of the worker's cpu tier region, "" without one (the scheduler maps it)
    rank: int = 0  # the worker's rank (tensor parallel: every rank has its own region)




@dataclass(frozen=True, slots=True)
class SpecContext:
    plan: Plan
    namespace: Namespace
    config: VllmTierConfig
    group_of: dict[int, int]  # vLLM KV-cache group id -> kvtier plan group index
    blocks_per_chunk: int
    span_tokens: tuple[int, ...] = ()  # tokens one chunk of each plan group covers (engine_plan)
    # why offloading is off for this engine ("" when on): every lookup misses, nothing is stored
    off_reason: str = ""
    # vLLM's bytes per block of each group (its KV-cache specs), when the spec saw them
    page_bytes: tuple[int, ...] | None = None
    # one scheduler hashes for every tensor-parallel rank: vLLM's scheduler has rank 0. A scheduler
    # of another rank (vLLM's external_launcher: every rank runs its own, with its own rank's
    # namespace and chunk hashes) stands for its own rank only. (Rank 0's scheduler there cannot
    # tell that mode apart, and counts the other ranks' records, hashed otherwise, as missing:
    # misses at restart and in Redis, never wrong KV; that mode is not tested.)
    one_scheduler: bool = True
    # what widens vLLM's hit search of a windowed group (manager placement, `lookup_window`), from
    # its KV-cache specs: extra_retained_tokens of its sliding specs, its EAGLE/MTP drafter groups
    retained_tokens: int = 0
    draft_groups: frozenset[int] = frozenset()  # plan group indices
    # KvtierConnector runs this spec (it hands over vLLM's KV-cache config): it carries the learned
    # share's slot moves to the workers; vLLM's stock OffloadingConnector does not
    kvtier_connector: bool = False

    def rank_namespace_ids(self) -> list[str]:
        """The namespaces whose shards one chunk of this scheduler stands for, its own first:
        every rank's under tensor parallel (each worker stores its own shard of the scheduler's
        chunk under its rank's namespace), only its own otherwise."""
        from dataclasses import replace

        ns = self.namespace
        if not self.one_scheduler:
            return [ns.id]
        return [ns.id] + [replace(ns, rank=r).id for r in range(ns.world_size) if r != ns.rank]

    @property
    def mixed_spans(self) -> bool:
        """Whether the cacheable groups' chunks span different tokens (engine_plan)."""
        return len({s for s, gp in zip(self.span_tokens, self.plan.groups) if gp.cacheable}) > 1

    @property
    def learned(self) -> bool:
        """Whether the index moves each tier's bytes between groups as traffic goes
        (`kvtier.share` "learned" or "auto", where `learned_off_reason` is empty)."""
        if self.config.share not in ("auto", "learned"):
            return False
        why = self.learned_off_reason()
        if why:
            line = f"kvtier: kvtier.share={self.config.share!r}: a fixed share, {why}"
            if line not in _LOGGED:
                _LOGGED.add(line)
                (log.warning if self.config.share == "learned" else log.info)(line)
        return not why

    def learned_off_reason(self) -> str:
        """Why the learned share does not apply to this engine ("" where it does). Both sides ask
        the same config and platform, so they agree without a handshake. It needs slabs that are
        address space, committed where written: the worker lays each group out for the most slots
        it may get (`slot_counts`); a host region (made with a disk or Redis tier) reserves only
        the pools' slots and follows them (store/tiers/host_region.py, "Reserved slots"), but
        page-locked slabs (a GPU) are committed whole: N x the tier."""
        if not self.kvtier_connector:
            return ("the learned share needs kv_connector \"KvtierConnector\" (vLLM's OffloadingConnector "
                    "does not carry its slot moves to the workers)")
        if "cpu" not in self.config.tiers:
            return f"the learned share moves the cpu tier's bytes, and kvtier.tiers is {','.join(self.config.tiers)}"
        from vllm.platforms import current_platform

        device = str(getattr(current_platform, "device_type", ""))
        if device != "cpu":
            return f"the learned share is applied only on a CPU engine (page-locked slabs are committed whole), not {device!r}"
        if self.mixed_spans:
            return "the groups' chunks span different tokens"
        return ""

    def share(self) -> str | dict[str, float]:
        """The share rule both sides size each tier's slots by (with the learned share: the one
        its pools start from). Where the groups' chunks span
        different tokens, "proportional" shares each tier by bytes per token, so every group
        covers the same tokens (equal slots would give a 64-token group a quarter of a 256-token
        group's tokens)."""
        share: str | dict[str, float] = self.config.share
        if share in ("auto", "learned"):  # the placement's; groups of mixed spans store every chunk (self.placement)
            share = "proportional" if self.placement in (None, "every") else vllm_placement_share(self.plan)
        if self.mixed_spans and share == "proportional":
            per_token = {gp.name: gp.chunk_bytes / span
                         for gp, span in zip(self.plan.groups, self.span_tokens) if gp.cacheable}
            total = sum(per_token.values()) * (1 + 1e-9)  # fractions must sum to at most 1
            share = {name: v / total for name, v in per_token.items()}
        return share

    @property
    def placement(self) -> str:
        """`kvtier.placement`, "every" where the groups' chunks span different tokens: the
        placement's endpoints are chunk indices of one chunk size (kvtier.index.placement)."""
        return "every" if self.mixed_spans else self.config.placement

    @property
    def policy(self) -> str:
        """`kvtier.policy` resolved: "auto" is worth where placement "hits" places a cacheable
        group other than full/MLA (`kvtier.index.tuning.default_policy`), else lru. Worth with
        mixed spans is lru: an entry's depth and the tuner's shadows count chunks of one size."""
        from kvtier.index.tuning import default_policy

        name = self.config.policy
        if name == "auto":
            name = default_policy(self.plan, self.placement)
        if name.partition(":")[0] == "worth" and self.mixed_spans:
            line = f"kvtier: kvtier.policy={self.config.policy!r}: lru, the groups' chunks span different tokens"
            if line not in _LOGGED:
                _LOGGED.add(line)
                log.warning(line)
            return "lru"
        return name

    def new_index(self) -> Index:
        """The scheduler's index, with worth's weight fixed at its start (`new_tuned_index`):
        the same pools and slots, for whoever sizes or lays out a tier."""
        return self.new_tuned_index(None, tune=False)[0]

    def new_tuned_index(self, placement: object | None, *, tune: bool = True):  # noqa: ANN201 - (Index, WorthTuner | None)
        """The scheduler's index (`share()`, `policy`) and, under worth with w not fixed, its
        tuner (`kvtier.index.tuning.worth_index`, shadows in a child process; `placement`: the
        manager's HitsLand, whose prefix tree gives an entry's depth and the shadows' rule).
        With mixed spans the dead-first rule is off (chunk hashes line up across groups only at
        common boundaries). With the learned share, its pools start from the fixed rule (auto's:
        a short run is no worse than that) and one `LearnedShare` per tier moves bytes from there
        (`Index.observe`, manager.py)."""
        learned = self.learned
        share = "learned" if learned else self.share()
        start = self.share() if learned else None
        policy = self.policy
        if policy.partition(":")[0] != "worth":
            return Index(self.plan, self.config.capacities, policy=policy, share=share, start=start,
                         anchored=not self.mixed_spans, learned_tiers=LEARNED_TIERS), None
        from kvtier.index.tuning import worth_index, worth_options

        opts = worth_options(policy)
        w = opts.get("w", None if tune else 0.0)
        sizes = {k: int(v) for k, v in opts.items() if k in ("max_chunks", "period")}
        # cold_in_first left False: with one tier the manager stores no cold chunk (`_place`)
        return worth_index(self.plan, self.config.capacities, share=share, placement=placement, w=w,
                           runner="process", start=start, anchored=not self.mixed_spans,
                           learned_tiers=LEARNED_TIERS, **sizes)

    def slot_counts(self) -> dict[tuple[str, int], int]:
        """Slots per (tier, cacheable group) the worker lays each tier out for: those of
        `new_index()`'s pools, or, with the learned share, the most a pool may ever get (address
        space, committed where written; `max_slots`)."""
        if not self.learned:
            return slot_counts(self.plan, self.config.capacities, self.share())
        index = self.new_index()
        return {(tier, gp.index): index.max_slots(gp.index, tier)
                for tier in index.tiers for gp in self.plan.cacheable_groups}

    def start_slots(self, tier: str) -> tuple[int, ...]:
        """Per plan group, the slots of `tier`'s pool when the index starts (0 for a group not
        cached): under the learned share the worker faults in only these at start."""
        index = self.new_index()
        return tuple(index.slots(gp.index, tier) if gp.cacheable else 0 for gp in self.plan.groups)

    def tier_layout(self, tier: str):  # noqa: ANN201 - a TierLayout
        """The slots of `tier` per group, as the worker lays the tier out (and the scheduler's
        readers of it expect): each cacheable group's chunk bytes and slots (`slot_counts`), laid
        out by store/tiers/factory.tier_layout as the Store's are."""
        from kvtier.store.tiers.factory import tier_layout

        slots = self.slot_counts()
        return tier_layout(self.plan, lambda g: slots[(tier, g)])

    def new_region_name(self) -> str | None:
        """A fresh name for the cpu tier's host region (store/tiers/host_region.py) the worker
        creates (the scheduler learns it from the worker's handshake and maps exactly that one),
        or None where there is none: `kvtier.host_region` "off", or no disk or Redis tier (nothing
        to promote). With tensor parallel every rank makes its own (its own shard; the scheduler
        maps them all). Random per engine start: two engines never share or guess each other's
        region."""
        if self.config.host_region == "off" or not set(self.config.tiers) - {"cpu"}:
            return None
        import os
        import secrets

        return f"vllm-{os.getpid()}-{secrets.token_hex(8)}"

    def span(self, group: int) -> int:
        """Tokens one chunk of plan group `group` covers (all groups alike without span_tokens)."""
        return self.span_tokens[group] if self.span_tokens else self.plan.chunk_tokens

    def chunk_span(self, group: int, end: int | None) -> tuple[int, int]:
        """The token span of a chunk of plan group `group` that ends at token `end` (vLLM's
        position of its offload key); (0, 0) when vLLM gave none."""
        if end is None:
            return 0, 0
        return max(0, end - self.span(group)), end

    def chunk_header(self, chunk_hash: bytes, group: int, start: int, end: int):  # noqa: ANN201 - a ChunkHeader
        """The header of chunk `(chunk_hash, group)` claiming tokens [start, end), for either side
        (the scheduler's whole chunks, the worker's job blocks): store/payload.chunk_header."""
        from kvtier.store.payload import chunk_header

        return chunk_header(self.plan, self.namespace.id, chunk_hash, group, start, end)

    def whole_chunk_header(self, chunk_hash: bytes, group: int, end: int | None):  # noqa: ANN201 - a ChunkHeader
        """The header of the whole chunk `(chunk_hash, group)` ending at token `end`, or None when
        vLLM gave no position or the span is not a whole chunk."""
        start, end = self.chunk_span(group, end)
        if end - start != self.span(group):
            return None
        return self.chunk_header(chunk_hash, group, start, end)

    def blocks_header(self, item: ChunkItem, blocks: list[tuple[int, int]]):  # noqa: ANN201 - a ChunkHeader
        """The header of `item` covering only the block positions in `blocks` (the worker's:
        placement.header_span; a store records the span it holds, a load asks for the span it
        needs)."""
        tokens_per_block = self.plan.groups[item.group].group.tokens_per_block
        return self.chunk_header(item.chunk_hash, item.group,
                                 *header_span(item.token_start, tokens_per_block, blocks))

    @property
    def disk_root(self) -> Path | None:
        d = self.config.directory
        return Path(d) / "disk" if d is not None and "disk" in self.config.tiers else None

    def chunk_hash(self, block_hash: bytes) -> bytes:
        """kvtier's chunk hash for vLLM's hash of a chunk's last block (namespace mixed in)."""
        return chunk_hashes_from_block_hashes(self.plan, self.namespace, [block_hash],
                                              self.plan.chunk_tokens)[0]

    def split_key(self, key: OffloadKey) -> tuple[bytes, int] | None:
        """(chunk_hash, plan group) of a vLLM offload key; None for a group kvtier does not cache."""
        g = self.group_of.get(int.from_bytes(key[-4:], "big"))
        if g is None or not self.plan.groups[g].cacheable:
            return None
        return self.chunk_hash(bytes(key[:-4])), g


def vllm_placement_share(plan) -> str | dict[str, float]:  # noqa: ANN001 - kvtier.core.plan.Plan
    """share="auto" with placement "hits" in vLLM: the half/half split over state groups only.
    Sliding and chunked-local groups are placed too (manager.py `_request_places`) but keep their
    proportional bytes: vLLM offers them only their last window of a prompt prefilled in one step,
    so a request needs about as many of their chunks as of a full group's and half/half would
    starve them (docs/admission.md, "In vLLM")."""
    return placement_share(plan, ("state",))
