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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey

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
