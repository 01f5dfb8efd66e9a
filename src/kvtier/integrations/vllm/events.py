"""KV events for what kvtier holds, per tier and per group, in vLLM's own event types.

vLLM publishes KV events (`--kv-events-config`, ZMQ) for its GPU prefix cache and, through an
offloading manager's `take_events()`, for offloaded chunks. kvtier's manager emits one vLLM
`OffloadingEvent` for every chunk that becomes restorable from a tier (committed: a store, a
promotion, a Redis adoption) and for every chunk that stops being (evicted, removed after a
failed load, reset). vLLM's connector turns them into `BlockStored` / `BlockRemoved` with:

- `medium`: "CPU" for the cpu tier, "STORAGE" for disk and Redis; `locality` "LOCAL" (cpu,
  disk) or "REMOTE" (Redis, shared); `ownership` None for the cpu tier (vLLM's primary tier) and
  "kvtier-disk" / "kvtier-redis" for the others, so a consumer tells the tiers apart;
- `group_idx`: vLLM's KV-cache group; `kv_cache_spec_kind` and `kv_cache_spec_sliding_window`:
  the group's residency rule (full attention: every chunk of the prefix; sliding window W: the
  chunks holding the last W-1 tokens before a boundary; mamba/state: a checkpoint at exactly the
  boundary). kvtier turns vLLM's `self_describing_kv_events` on by default, which fills these on
  every event and the token ids of full-attention chunks (their chain of hashes, from which a
  router matches a prompt).

`kvtier.router` consumes exactly these events and answers the longest prefix each engine can
restore in every group (docs/vllm.md, "KV events").

The rule: an event names a chunk by vLLM's key, so only chunks whose key this manager knows are
announced. A chunk adopted from disk at start (kvtier keeps a digest of vLLM's hash, not the
hash) is announced when a lookup first names it. Every announced chunk is removed exactly once
per tier; nothing is announced twice. With vLLM's KV events off nothing is kept (vLLM never
drains `take_events` then).

Both name a chunk by vLLM's key, so the manager keeps vLLM's key of every chunk some tier holds
(`HeldKeys`): for these events, and for the keys prepare_store reports evicted (a chunk that left
its last tier). An entry lives exactly as long as its chunk is in some tier (a map of every key
ever looked up grew without bound).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey

from kvtier.index.index import Entry, Index

from .counters import Metrics

# tier -> (medium, locality, ownership)
PLACE: dict[str, tuple[Medium, Locality, str | None]] = {
    "cpu": (Medium.CPU, Locality.LOCAL, None),
    "disk": (Medium.STORAGE, Locality.LOCAL, "kvtier-disk"),
    "redis": (Medium.STORAGE, Locality.REMOTE, "kvtier-redis"),
}
MAX_PENDING = 1 << 18  # events kept undrained before the oldest are dropped (and counted)


class KvEvents:
    """The manager's event log: fed by the index's listener (`Index.listener`), drained by
    vLLM through the manager's `take_events`."""

    def __init__(self, key_of: Callable[[tuple[bytes, int]], OffloadKey | None],
                 count: Callable[[str, int], None], enabled: bool) -> None:
        self.enabled = enabled
        self._key_of = key_of  # (chunk hash, plan group) -> vLLM's key, or None when unknown
        self._count = count
        self._announced: dict[tuple[bytes, int], set[str]] = {}  # chunk -> tiers announced in
        self._pending: list[tuple[str, bool, OffloadKey]] = []  # (tier, removed, key)

    def on_index(self, tier: str, group: int, chunk_hash: bytes, stored: bool) -> None:
        """`Index.listener`: an entry became visible in `tier` (stored) or stopped being."""
        if not self.enabled:
            return
        split = (chunk_hash, group)
        if stored:
            key = self._key_of(split)
            if key is not None:
                self._add(split, tier, key)
            return
        tiers = self._announced.get(split)
        if not tiers or tier not in tiers:
            return
        key = self._key_of(split)
        tiers.discard(tier)
        if not tiers:
            del self._announced[split]
        if key is not None:
            self._push(tier, True, key)

    def named(self, split: tuple[bytes, int], key: OffloadKey, tiers: Iterable[str]) -> None:
        """A lookup named a chunk held in `tiers`: announce the tiers not announced yet (a chunk
        adopted at start, or committed before its key was known)."""
        if self.enabled:
            for tier in tiers:
                self._add(split, tier, key)

    def reset(self, key_of_all: dict[tuple[bytes, int], OffloadKey]) -> None:
        """The index was dropped whole (reset_cache): every announced chunk is removed."""
        for split, tiers in self._announced.items():
            key = key_of_all.get(split)
            if key is not None:
                for tier in sorted(tiers):
                    self._push(tier, True, key)
        self._announced.clear()

    def take(self) -> list[OffloadingEvent]:
        """The events since the last call, consecutive keys of one (tier, kind) batched."""
        out: list[OffloadingEvent] = []
        pending, self._pending = self._pending, []
        for tier, removed, key in pending:
            last = out[-1] if out else None
            medium, locality, ownership = PLACE[tier]
            if (last is not None and last.removed == removed and last.medium == medium
                    and last.ownership == ownership and last.locality == locality):
                last.keys.append(key)
                continue
            out.append(OffloadingEvent(keys=[key], medium=medium, removed=removed, locality=locality,
                                       ownership=ownership, removal_expected=not removed))
        return out

    def _add(self, split: tuple[bytes, int], tier: str, key: OffloadKey) -> None:
        tiers = self._announced.setdefault(split, set())
        if tier not in tiers:
            tiers.add(tier)
            self._push(tier, False, key)

    def _push(self, tier: str, removed: bool, key: OffloadKey) -> None:
        if len(self._pending) >= MAX_PENDING:  # nobody drains: keep memory bounded, say so
            del self._pending[: MAX_PENDING // 2]
            self._count("kv_events_dropped", MAX_PENDING // 2)
        self._pending.append((tier, removed, key))
        self._count("kv_events_removed" if removed else "kv_events_stored", 1)


class HeldKeys:
    """vLLM's key of every chunk the index holds (`key_of`), and the keys of chunks that left their
    last tier outside prepare_store (`later`: a promotion's eviction, a failed load, a Redis
    adoption), which vLLM hears of as evicted with the next prepare_store. `busy(key, chunk)`: a
    store or a promotion of the chunk into another tier is in flight (it has not left yet)."""

    def __init__(self, index: Index, metrics: Metrics,
                 busy: Callable[[OffloadKey, tuple[bytes, int]], bool]) -> None:
        self.index = index  # the manager's, replaced with it (`clear`)
        self.metrics = metrics
        self._busy = busy
        self.key_of: dict[tuple[bytes, int], OffloadKey] = {}
        self.later: list[OffloadKey] = []

    def gone(self, chunk_hash: bytes, group: int) -> OffloadKey | None:
        """vLLM's key of a chunk that just left a tier, if it left the last one (then forgotten)."""
        if self.index.where(chunk_hash, group):
            return None
        key = self.key_of.get((chunk_hash, group))
        if key is not None and self._busy(key, (chunk_hash, group)):
            return None
        return self.key_of.pop((chunk_hash, group), None)

    def report_gone(self, chunk_hash: bytes, group: int) -> None:
        """A chunk left a tier outside prepare_store: if it left the last one, vLLM hears of it
        as evicted with the next prepare_store."""
        gone = self.gone(chunk_hash, group)
        if gone is not None:
            self.later.append(gone)

    def evicted(self, entries: Iterable[Entry], tier: str, into: list[OffloadKey]) -> None:
        """Count entries a reservation in `tier` evicted, and add to `into` vLLM's key of each
        that left its last tier."""
        for e in entries:
            self.metrics.add(f"evicted_{tier}" + ("_dead" if e.dead else ""), group=e.group)
            gone = self.gone(e.chunk_hash, e.group)
            if gone is not None:
                into.append(gone)

    def evicted_elsewhere(self, entries: Iterable[Entry], tier: str) -> None:
        """A reservation outside prepare_store (a promotion) evicted `entries`: vLLM hears of
        those that left their last tier with the next prepare_store."""
        self.evicted(entries, tier, self.later)

    def take_later(self) -> list[OffloadKey]:
        later, self.later = self.later, []
        return later

    def clear(self, index: Index) -> None:
        """The manager's index was replaced: no chunk is held, nothing is left to report. The
        dict is cleared in place (KvEvents reads it)."""
        self.index = index
        self.key_of.clear()
        self.later.clear()
