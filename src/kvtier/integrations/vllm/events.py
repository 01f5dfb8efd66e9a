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
  chunks of the window before a boundary; mamba/state: a checkpoint at exactly the boundary;
  chunked local attention: its local chunk, in the window field); `block_size`: the group's
  tokens per block. kvtier turns vLLM's `self_describing_kv_events` on by default, which fills
  these on every event, and (`SelfDescribing`, below) the token ids and parent hash of every
  group's chunks, not only full attention's: groups of one model may span different tokens per
  chunk (Gemma 4, DeepSeek V4), and a router needs each group's own chain of hashes.

`kvtier.router` consumes exactly these events and answers the longest prefix each engine can
restore in every group (docs/vllm.md, "KV events").

The rule: an event names a chunk by vLLM's key, so only chunks whose key this manager knows are
announced. A chunk adopted from disk at start (kvtier keeps a digest of vLLM's hash, not the
hash) is announced at start from the disk's event journal (`DiskJournal`), else when a lookup
first names it. Every announced chunk is removed exactly once
per tier; nothing is announced twice. With vLLM's KV events off nothing is kept (vLLM never
drains `take_events` then).

Both name a chunk by vLLM's key, so the manager keeps vLLM's key of every chunk some tier holds
(`HeldKeys`): for these events, and for the keys prepare_store reports evicted (a chunk that left
its last tier). An entry lives exactly as long as its chunk is in some tier (a map of every key
ever looked up grew without bound).
"""

from __future__ import annotations

import logging
from collections.abc import Container, Iterable
from typing import TYPE_CHECKING

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import OffloadingEventsTracker

from kvtier.index.index import Entry, Index

from .counters import Metrics

if TYPE_CHECKING:
    from .promotion import Promotions

log = logging.getLogger("kvtier.vllm")

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

    def __init__(self, held: HeldKeys, metrics: Metrics, enabled: bool) -> None:
        self.enabled = enabled
        self._held = held  # its key_of: (chunk hash, plan group) -> vLLM's key, when known
        self._metrics = metrics
        self._announced: dict[tuple[bytes, int], set[str]] = {}  # chunk -> tiers announced in
        self._pending: list[tuple[str, bool, OffloadKey]] = []  # (tier, removed, key)

    def on_index(self, tier: str, group: int, chunk_hash: bytes, stored: bool) -> None:
        """`Index.listener`: an entry became visible in `tier` (stored) or stopped being."""
        if not self.enabled:
            return
        split = (chunk_hash, group)
        if stored:
            key = self._held.key_of.get(split)
            if key is not None:
                self._add(split, tier, key)
            return
        tiers = self._announced.get(split)
        if not tiers or tier not in tiers:
            return
        key = self._held.key_of.get(split)
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
            self._metrics.add("kv_events_dropped", MAX_PENDING // 2)
        self._pending.append((tier, removed, key))
        self._metrics.add("kv_events_removed" if removed else "kv_events_stored", 1)


class HeldKeys:
    """vLLM's key of every chunk the index holds (`key_of`), and the keys of chunks that left their
    last tier outside prepare_store (`later`: a promotion's eviction, a failed load, a Redis
    adoption), which vLLM hears of as evicted with the next prepare_store. A chunk has not left
    while a store of it (its key in `stores`, the manager's stores in flight) or a promotion of it
    into another tier (`promotions.in_flight`) is in flight."""

    def __init__(self, index: Index, metrics: Metrics, stores: Container[OffloadKey],
                 promotions: Promotions) -> None:
        self.index = index  # the manager's, replaced with it (`clear`)
        self.metrics = metrics
        self.stores = stores  # the manager's, never replaced
        self.promotions = promotions
        self.key_of: dict[tuple[bytes, int], OffloadKey] = {}
        self.later: list[OffloadKey] = []

    def gone(self, chunk_hash: bytes, group: int) -> OffloadKey | None:
        """vLLM's key of a chunk that just left a tier, if it left the last one (then forgotten)."""
        if self.index.where(chunk_hash, group):
            return None
        key = self.key_of.get((chunk_hash, group))
        if key is not None and (key in self.stores or self.promotions.in_flight(key, (chunk_hash, group))):
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
        """The manager's index was replaced: no chunk is held, nothing is left to report."""
        self.index = index
        self.key_of.clear()
        self.later.clear()


class SelfDescribing(OffloadingEventsTracker):
    """vLLM's tracker, recording every group's chunks (vLLM's records full attention's only and
    publishes the others as placeholders: one hash, no tokens, no parent, block_size 0). A windowed
    group's chunk is described like a full one: its block hashes at its own tokens per block, its
    tokens and its parent (the hash of the token before it), so a router can name the chunks of
    that group's own span. Chunked local attention's local chunk rides in the window field.
    Installed on vLLM's scheduler by `describe_every_group`."""

    def record_store(self, req, group_config, chunk_idx, offload_key) -> None:  # noqa: ANN001 - vLLM's
        super().record_store(req, _as_full(group_config), chunk_idx, offload_key)

    def record_lookup(self, req, group_config, chunk_idx, offload_key) -> None:  # noqa: ANN001 - vLLM's
        super().record_lookup(req, _as_full(group_config), chunk_idx, offload_key)

    def take_events(self, events):  # noqa: ANN001, ANN201 - vLLM's types
        journal: DiskJournal | None = getattr(self, "kvtier_journal", None)
        if journal is not None:
            events = list(events)
            journal.note(events, self._pending_event_metadata)
        return super().take_events(events)


def _as_full(group_config):  # noqa: ANN001, ANN202 - vLLM's GroupOffloadConfig (a NamedTuple)
    """The group as vLLM's tracker describes a full-attention one, its own kind kept."""
    from .compat import replace_fields

    spec = group_config.kv_event_group_spec
    chunk = getattr(group_config.kv_cache_spec, "attention_chunk_size", None)
    if spec.kv_cache_spec_sliding_window is None and chunk:
        spec = replace_fields(spec, kv_cache_spec_sliding_window=int(chunk))
    return replace_fields(group_config, sliding_window_size_in_chunks=None, kv_event_group_spec=spec)


def describe_every_group(scheduler: object) -> bool:
    """Make vLLM's offloading scheduler describe every group's chunks (`SelfDescribing`); False
    where its tracker is not vLLM's (another version: events stay as vLLM makes them)."""
    from .compat import events_tracker

    tracker = events_tracker(scheduler)
    if type(tracker) is not OffloadingEventsTracker:
        return False
    tracker.__class__ = SelfDescribing  # same state and constructor arguments (0.33 takes group specs)
    return True


class DiskJournal:
    """What the disk tier's chunks were announced with, kept beside them (`<disk>/events.journal`,
    0600): a restarted engine adopts its disk chunks by kvtier's digest of vLLM's hash, not the
    hash, and without the request no chunk's tokens are known; so each disk store's payload (vLLM's
    key, block hashes, parent, token ids) is appended here, each disk removal too, and at start
    the chunks the manager adopted are announced again from it (`announce_adopted`). It reveals
    the prompts' token ids as the disk payloads do: same directory, same owner.

    It runs inside vLLM's engine step (`take_events`), so it never raises: an I/O error (ENOSPC,
    EIO) or a record it cannot encode is logged once, counted (`errors`) and turns the
    journal off for this process (a restart then announces fewer chunks: router misses, never
    wrong KV). Bounded: once the file passes twice its live records' bytes (and `COMPACT_MIN`) it
    is rewritten to them; if the live records alone pass `MAX_BYTES`, journaling stops
    (counted `full`). Opened with O_NOFOLLOW, mode 0600. Its counts also go to the manager's
    counters (`metrics`, bound by `announce_adopted`): `disk_journal_errors`, `_full`,
    `_bad_records` in the counters file and on /metrics (stats.py), so a journal that stopped is seen."""

    NAME = "events.journal"
    MAX_BYTES = 64 << 20
    COMPACT_MIN = 1 << 20

    def __init__(self, root, metrics: Metrics | None = None) -> None:  # noqa: ANN001 - a Path
        self.path = root / self.NAME
        self.metrics = metrics  # the manager's counters, where these counts are exported too
        self._fd: int | None = None
        self.enabled = True
        self.errors = 0  # writes / compactions that failed
        self.full = 0  # times journaling stopped at MAX_BYTES
        self.bad_records = 0  # decodable records of wrong field types (announce_adopted)
        self._size = 0  # the file's bytes, as this process wrote them
        self._live: dict[bytes, int] = {}  # key -> its last store record's framed bytes

    def _fail(self, what: str, err: BaseException, counter: str = "errors") -> None:
        """Journaling off for this process, logged once, counted."""
        setattr(self, counter, getattr(self, counter) + 1)
        if self.metrics is not None:  # literal names: stats.py's families
            self.metrics.add("disk_journal_full" if counter == "full" else "disk_journal_errors")
        if self.enabled:
            log.warning("kvtier: the disk event journal %s %s (%s): journaling stops; a restart "
                        "announces only the chunks journaled until now", self.path, what, err)
        self.enabled = False
        self._close()

    def _close(self) -> None:
        import os

        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def note(self, events: list[OffloadingEvent], meta: dict) -> None:  # noqa: ANN001
        """Journal the disk stores and removals among `events`; never raises."""
        if not self.enabled:
            return
        try:
            import msgspec

            frames: list[tuple[bytes, bytes, bool]] = []  # (key, framed record, a removal)
            for ev in events:
                if ev.ownership != PLACE["disk"][2]:
                    continue
                for key in ev.keys:
                    m = meta.get(key)
                    if ev.removed:
                        frames.append((bytes(key), _frame(msgspec.msgpack.encode(["-", bytes(key)])), True))
                    elif m is not None:
                        rec = ["+", bytes(key), [bytes(h) for h in m.block_hashes],
                               None if m.parent_block_hash is None else bytes(m.parent_block_hash),
                               list(m.token_ids), m.block_size, m.lora_id, m.lora_name, m.group_idx,
                               m.kv_cache_spec.kv_cache_spec_kind, m.kv_cache_spec.kv_cache_spec_sliding_window]
                        frames.append((bytes(key), _frame(msgspec.msgpack.encode(rec)), False))
            if not frames:
                return
            data = b"".join(f for _, f, _ in frames)
            live = sum(self._live.values()) + len(data)
            if self._size + len(data) > max(2 * live, self.COMPACT_MIN) or self._size + len(data) > self.MAX_BYTES:
                self._compact()  # to the records written until now
                if not self.enabled:
                    return
                if self._size + len(data) > self.MAX_BYTES:
                    self._fail(f"passed {self.MAX_BYTES} bytes", OverflowError("journal full"), "full")
                    return
            for key, f, removed in frames:
                if removed:
                    self._live.pop(key, None)
                else:
                    self._live[key] = len(f)
            self._write(data)
        except Exception as e:  # noqa: BLE001 - inside vLLM's engine step: never raise
            self._fail("could not be written", e)

    def _compact(self) -> None:
        """Rewrite the file to its live records (this process's view: the ones it loads)."""
        self.rewrite(list(self.load().values()))

    def _write(self, data: bytes) -> None:
        """Append `data`; never raises (an error turns journaling off)."""
        import os

        if not self.enabled:
            return
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                                   0o600)
                self._size = os.fstat(self._fd).st_size
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
                self._size += n
        except (OSError, ValueError) as e:
            self._fail("could not be written", e)

    def load(self) -> dict[bytes, list]:
        """vLLM key -> its last announced store record, removals applied; a torn tail is ignored."""
        import os

        import msgspec

        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                data = f.read(self.MAX_BYTES + 1)
        except OSError:
            return {}
        out: dict[bytes, list] = {}
        i = 0
        while i + 4 <= len(data):
            n = int.from_bytes(data[i:i + 4], "big")
            if i + 4 + n > len(data):
                break
            try:
                rec = msgspec.msgpack.decode(data[i + 4:i + 4 + n])
            except msgspec.DecodeError:
                break
            i += 4 + n
            if isinstance(rec, list) and len(rec) >= 2 and isinstance(rec[1], bytes):
                if rec[0] == "-":
                    out.pop(rec[1], None)
                elif rec[0] == "+" and len(rec) == 11:
                    out[rec[1]] = rec
        return out

    def rewrite(self, records: Iterable[list]) -> None:
        """Keep only `records` (the adopted chunks'), atomically; never raises (an error turns
        journaling off)."""
        import os

        import msgspec

        self._close()
        if not self.enabled:
            return
        tmp = self.path.with_name(f".{self.NAME}.{os.getpid()}")
        try:
            live: dict[bytes, int] = {}
            frames = []
            for r in records:
                f = _frame(msgspec.msgpack.encode(r))
                frames.append(f)
                live[bytes(r[1])] = len(f)
            data = b"".join(frames)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path)
            self._size, self._live = len(data), live
        except Exception as e:  # noqa: BLE001 - also called inside vLLM's engine step
            try:
                os.unlink(tmp)
            except OSError:
                pass
            self._fail("could not be compacted", e)


def _frame(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def _bytes_or_none(v: object) -> bool:
    return v is None or isinstance(v, bytes)


def _int_or_none(v: object) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool))


def valid_record(rec: list) -> bool:
    """A journal store record with every field of the type `announce_adopted` hands vLLM."""
    if not isinstance(rec, list) or len(rec) != 11:
        return False
    _, key, hashes, parent, tokens, block, lora_id, lora_name, group, kind, window = rec
    return (isinstance(key, bytes) and isinstance(hashes, list) and all(isinstance(h, bytes) for h in hashes)
            and _bytes_or_none(parent) and isinstance(tokens, list)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)
            and isinstance(block, int) and not isinstance(block, bool) and _int_or_none(lora_id)
            and (lora_name is None or isinstance(lora_name, str))
            and isinstance(group, int) and not isinstance(group, bool)
            and isinstance(kind, str) and _int_or_none(window))


def announce_adopted(manager, tracker, journal: DiskJournal) -> int:  # noqa: ANN001 - KvtierManager, SelfDescribing
    """Announce the disk chunks the manager adopted at start, described as when they were stored
    (the journal), so a router sees a restarted engine's warm disk before any lookup names it;
    the journal is compacted to them. A record whose fields have the wrong types is skipped
    (counted on the journal, logged). The number announced."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (OffloadingEventGroupSpec,
                                                                                _OffloadEventMetadata)
    from vllm.v1.kv_offload.base import OffloadKey

    from .compat import tracker_records

    if journal.metrics is None:
        journal.metrics = manager.metrics
    kept = []
    for raw, rec in journal.load().items():
        if not valid_record(rec):
            if not journal.bad_records:
                log.warning("kvtier: %s holds records of the wrong types: skipped", journal.path)
            journal.bad_records += 1
            if journal.metrics is not None:
                journal.metrics.add("disk_journal_bad_records")
            continue
        key = OffloadKey(raw)
        split = manager.ctx.split_key(key)
        if split is None or not any(t == "disk" for t, _ in manager.index.where(*split)):
            continue
        kept.append(rec)
        _, _, hashes, parent, tokens, block, lora_id, lora_name, group, kind, window = rec
        tracker_records(tracker)[key] = _OffloadEventMetadata(
            block_hashes=tuple(hashes), parent_block_hash=parent, token_ids=tuple(tokens), block_size=block,
            lora_id=lora_id, lora_name=lora_name, extra_keys=None, group_idx=group,
            kv_cache_spec=OffloadingEventGroupSpec(kind, window), active_residencies=set())
        manager.held.key_of[split] = key
        manager.events.named(split, key, [t for t, _ in manager.index.where(*split)])
    journal.rewrite(kept)
    return len(kept)


def publish_now(connector, events: Iterable) -> bool:  # noqa: ANN001 - KvtierConnector, KVCacheEvents
    """Publish `events` (drained only then) at once through the scheduler's publisher; False when
    none was found."""
    import time

    from vllm.distributed.kv_events import KVEventBatch

    from .compat import scheduler_publisher

    publisher = scheduler_publisher(connector)
    if publisher is None:
        return False
    batch = list(events)
    if batch:
        publisher.publish(KVEventBatch(ts=time.time(), events=batch))
    return True
