"""The tier contract: a place that holds chunk payloads in slots.

Two kinds of tier share one contract:
- slot-addressed (`cpu`, `disk`): the index picks `(group, slot)`; the tier is a set of
  per-group slabs of fixed-size slots (`TierLayout`).
- key-addressed and shared between processes (`redis`, `shared = True`): the key is taken
  from the header (namespace id, chunk hash, group); the slot number is ignored. Such a tier
  answers `exists_many` so a lookup asks it once per prompt for the chunks the local index lacks.

Expected outcomes are values: `write` returns False when it could not store (disk full,
read-only, server down: counted in `failed_writes`), `read` returns False on a miss, and a
payload that is present but bad (foreign header, checksum mismatch, truncated) is a miss that
the tier counts in `corrupt_dropped`, logs (one line a minute per tier, `LogOnce`: 500 bad slots
after a crash are one line and a count) and frees, so it is never restored and never read again.
Only caller mistakes (a slot out of range, a buffer of the wrong size) raise.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from kvtier.core.counters import TIER_BASE
from kvtier.errors import ConfigError
from kvtier.store.payload import ChunkHeader

log = logging.getLogger("kvtier.tiers")
WARN_EVERY_S = 60.0  # a tier logs a failing write or a corrupt drop at most this often (the rest are counted)


class LogOnce:
    """At most one warning per kind per `interval_s`, with how many were held back: what a tier
    logs for an outcome that can repeat for every chunk (a full disk, 500 corrupt slots after a
    crash: 500 lines said nothing the counter and one line do not). Thread-safe; `clock` is a
    fixture in tests. Shared by the disk and Redis tiers so both log alike."""

    def __init__(self, log: logging.Logger, clock: Callable[[], float] = time.monotonic,
                 interval_s: float = WARN_EVERY_S) -> None:
        self._log = log
        self._clock = clock
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def warn(self, kind: str, message: str) -> None:
        with self._lock:
            now = self._clock()
            last = self._last.get(kind)
            if last is not None and now - last < self._interval_s:
                self._held[kind] = self._held.get(kind, 0) + 1
                return
            held = self._held.pop(kind, 0)
            self._last[kind] = now
        suffix = f" ({held} more like it since the last line)" if held else ""
        self._log.warning("%s%s", message, suffix)


@dataclass(frozen=True, slots=True)
class TierLayout:
    """Per-group slot pools of a slot-addressed tier: `slot_bytes[g]` payload bytes per slot,
    `num_slots[g]` slots. A group with 0 slots (not cacheable, or given no share) holds nothing."""

    slot_bytes: tuple[int, ...]
    num_slots: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.slot_bytes) != len(self.num_slots):
            raise ConfigError(
                f"tier layout has {len(self.slot_bytes)} slot sizes but {len(self.num_slots)} "
                "slot counts; give one of each per group"
            )
        for g, (b, n) in enumerate(zip(self.slot_bytes, self.num_slots)):
            if b < 0 or n < 0:
                raise ConfigError(f"group {g}: slot_bytes={b}, num_slots={n}; both must be >= 0")
            if n > 0 and b == 0:
                raise ConfigError(f"group {g} has {n} slots of 0 bytes; give slot_bytes > 0")
        if sum(self.num_slots) == 0:
            raise ConfigError(
                "tier capacity is 0 slots for every group; give a capacity that holds at least "
                "one chunk of some group"
            )

    @property
    def num_groups(self) -> int:
        return len(self.slot_bytes)

    @property
    def total_bytes(self) -> int:
        return sum(b * n for b, n in zip(self.slot_bytes, self.num_slots))


@dataclass(frozen=True, slots=True)
class TierStats:
    """A tier's base counters, one field per name of kvtier.core.counters.TIER_BASE (declared
    there with their help; tests/test_counters.py checks the fields match)."""

    writes: int
    failed_writes: int
    reads: int
    misses: int
    corrupt_dropped: int
    bytes_written: int
    bytes_read: int


class Tier(ABC):
    """One place for chunk payloads. See the module doc for the contract."""

    name: str = "tier"
    shared: bool = False  # key-addressed and shared between processes (redis)
    persistent: bool = False  # survives a restart; `list()` feeds the index rebuild

    def __init__(self) -> None:
        self.writes = 0
        self.failed_writes = 0
        self.reads = 0
        self.misses = 0
        self.corrupt_dropped = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self.last_error = ""
        self._warnings = LogOnce(log)  # corrupt drops: one line a minute per tier

    # -- the contract --------------------------------------------------------------------
    @abstractmethod
    def write(self, group: int, slot: int, header: ChunkHeader, data: object) -> bool:
        """Store `data` (a 1-D uint8 tensor or a buffer of `header.payload_bytes` bytes)."""

    @abstractmethod
    def read(self, group: int, slot: int, header: ChunkHeader, out: object) -> bool:
        """Fill `out` (a uint8 buffer of `header.payload_bytes` bytes) with the payload whose
        header matches `header`; False on a miss (absent, foreign or corrupt: dropped)."""

    @abstractmethod
    def free(self, group: int, slot: int) -> None:
        """Forget the payload in (group, slot); reading it afterwards is a miss."""

    @abstractmethod
    def list(self) -> Iterator[tuple[int, int, ChunkHeader]]:
        """Every (group, slot, header) this tier holds with a valid header (payloads are not
        verified here; `read` verifies). Order: oldest first where the tier knows ages."""

    # -- key-addressed tiers and batching (defaults: one call per item) ------------------
    def exists_many(self, headers: Sequence[ChunkHeader]) -> list[bool]:
        """Whether each chunk is present (shared tiers); slot tiers answer from the index."""
        raise NotImplementedError(f"tier {self.name!r} is slot-addressed; ask the index")

    def write_many(self, items: Iterable[tuple[int, int, ChunkHeader, object]]) -> list[bool]:
        return [self.write(g, s, h, d) for g, s, h, d in items]

    def read_many(self, items: Iterable[tuple[int, int, ChunkHeader, object]]) -> list[bool]:
        return [self.read(g, s, h, o) for g, s, h, o in items]

    def close(self) -> None:
        """Release files, locks, connections. Idempotent."""

    # -- helpers for implementations -----------------------------------------------------
    def stats(self) -> TierStats:
        return TierStats(**{name: getattr(self, name) for name in TIER_BASE})

    def _drop_corrupt(self, group: int, slot: int, reason: str) -> bool:
        """Count, log (at most once a minute, `LogOnce`) and free a bad payload; returns False so
        `read` can `return self._drop...`."""
        self.corrupt_dropped += 1
        self.misses += 1
        self._warnings.warn("corrupt", f"tier {self.name}: dropped group {group} slot {slot}: {reason}")
        self.free(group, slot)
        return False

    def _failed_write(self, group: int, slot: int, error: str) -> bool:
        """Count a failed write; log it at most once a minute per tier (a full disk failed every
        chunk of every save: 1,600 lines for 200 saves), with how many were not logged."""
        self.failed_writes += 1
        self.last_error = error
        now = time.monotonic()
        last = getattr(self, "_warned_at", None)
        if last is None or now - last >= WARN_EVERY_S:
            quiet = self.failed_writes - getattr(self, "_warned_count", 0) - 1
            more = f" ({quiet} more failed writes since the last line)" if quiet > 0 else ""
            log.warning("tier %s: write of group %d slot %d failed: %s%s", self.name, group, slot, error, more)
            self._warned_at, self._warned_count = now, self.failed_writes
        return False


class SlotTier(Tier):
    """Base of slot-addressed tiers: a `TierLayout` and bounds checks.

    Under a learned share (index/share.py) the layout gives each group the most slots it may
    ever get: that costs address space only, since memory pages and disk blocks are committed
    where a slot is written, and `release` gives back those of a pool that shrank. So what the
    tier holds stays within its capacity (plus at most a page per group at a pool's end)."""

    def __init__(self, layout: TierLayout) -> None:
        super().__init__()
        self.layout = layout

    def header(self, group: int, slot: int) -> ChunkHeader | None:
        """The header the slot holds, None when empty or unreadable; the payload is not verified
        (`read` and `move` verify): what a caller that knows a chunk by its hash alone (a learned
        share's moves) builds the expected header from."""
        raise NotImplementedError(f"tier {self.name!r} cannot report a slot's header")

    def release(self, group: int, slots: int) -> int:
        """Empty every slot >= `slots` of `group` (a read of one is a miss, `list()` skips it)
        and give back its memory or disk blocks: the caller shrank the group's pool to `slots`
        (after moving what it keeps below). Returns the bytes given back, as measured."""
        raise NotImplementedError(f"tier {self.name!r} cannot release slots")

    def move(self, group: int, src: int, dst: int, header: ChunkHeader) -> bool:
        """Copy the payload `src` holds, verified as `read` verifies it, to `dst` with the same
        header, then free `src` (a shrinking pool relocates what it keeps). False when `src` does
        not hold `header` or the write fails (counted as a miss, a corrupt drop or a failed
        write): `dst` then holds nothing valid and `src` is freed."""
        raise NotImplementedError(f"tier {self.name!r} cannot move slots")

    def _check_release(self, group: int, slots: int) -> None:
        lay = self.layout
        if not 0 <= group < lay.num_groups:
            raise ConfigError(f"group {group} out of range; this tier has {lay.num_groups} groups")
        if not 0 <= slots <= lay.num_slots[group]:
            raise ConfigError(f"cannot release group {group} down to {slots} slots; give 0.."
                              f"{lay.num_slots[group]}")

    def _check(self, group: int, slot: int, nbytes: int | None = None) -> None:
        lay = self.layout
        if not 0 <= group < lay.num_groups:
            raise ConfigError(f"group {group} out of range; this tier has {lay.num_groups} groups")
        if not 0 <= slot < lay.num_slots[group]:
            raise ConfigError(
                f"slot {slot} out of range for group {group} ({lay.num_slots[group]} slots)"
            )
        if nbytes is not None and nbytes > lay.slot_bytes[group]:
            raise ConfigError(
                f"payload of {nbytes} bytes does not fit group {group}'s slots of "
                f"{lay.slot_bytes[group]} bytes; size the tier from the same plan"
            )
