"""One KV event checked at the boundary: `parse_event` turns a decoded msgpack map into an `Event`
or the name of the counter it lands in. Nothing here keeps state."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

FULL_KINDS = ("full_attention", "mla_attention", "sink_full_attention")
SLIDING_KINDS = ("sliding_window", "sliding_window_mla")  # vLLM's SlidingWindowSpec and its MLA subclass
CHUNKED_KINDS = ("chunked_local_attention",)
STATE_KINDS = ("mamba",)

_HASH_MIN, _HASH_END = -(1 << 63), 1 << 64  # msgpack's integers (vLLM's int hashes are 64-bit)
_HASH_BYTES = 64  # a bytes hash: vLLM's are 32 (sha256)
_TEXT_CHARS = 64  # medium, ownership, kind: vLLM's are short names
TOKEN_BYTES = array("I").itemsize  # a token id, packed: 0 <= id < 2**32 on every platform


@dataclass(frozen=True, slots=True)
class Limits:
    """What one engine can make the router keep. Anything over a cap is dropped and counted
    (`PrefixIndex.stats`); a dropped store only shortens predictions."""
    max_entries: int = 1_000_000  # (group, chunk) pairs held, across tiers: about 0.5 KiB each
    max_token_bytes: int = 256 << 20  # token ids held in the chain, 4 bytes each (index.PLACES_PER_HASH places a hash)
    max_groups: int = 256  # group ids 0 .. max_groups-1 (models have a handful)
    max_tiers: int = 16  # distinct tier names (kvtier has three)
    max_event_tokens: int = 65_536  # token ids in one event: one chunk's
    max_event_hashes: int = 65_536  # block hashes in one event: one chunk's blocks
    max_message_bytes: int = 64 << 20  # one ZMQ frame; ZMQ disconnects a peer that sends more

    def __post_init__(self) -> None:
        from kvtier.errors import ConfigError

        for name in self.__slots__:
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"router Limits.{name}={value!r}: give a positive integer")


@dataclass(frozen=True, slots=True)
class Event:
    """One checked `BlockStored` (stored) or `BlockRemoved` of a kvtier tier."""
    stored: bool
    tier: str
    group: int
    hashes: tuple[int, ...]
    parent: int | None = None
    tokens: bytes = b""  # the chunk's token ids packed (a quarter of a tuple's memory): its chain key
    spec: tuple[str, int | None] | None = None  # (kind, sliding window) when the event names them
    block_tokens: int = 0  # the group's tokens per block (vLLM's `block_size`); 0: not given


def tier_of(medium: str | None, ownership: str | None) -> str | None:
    """kvtier's tier name for an event's medium and ownership; None for the GPU cache."""
    if medium == "CPU" and ownership is None:
        return "cpu"
    if ownership and ownership.startswith("kvtier-"):
        return ownership[len("kvtier-"):]
    if medium in ("CPU", "STORAGE"):
        return medium.lower() if ownership is None else f"{medium.lower()}:{ownership}"
    return None


def parse_event(raw: object, limits: Limits) -> Event | str:
    """A decoded event checked whole, or the counter it lands in: "ignored" (the GPU cache's),
    "skipped_<field>" (an impossible value), "dropped_<what>" (over a cap). Nothing is applied
    before every field has passed, so no later step meets a bad value."""
    if not isinstance(raw, dict):
        return "skipped_event"
    kind = raw.get("type")
    if kind == "AllBlocksCleared":
        return "ignored"  # the GPU cache's: kvtier announces every removal itself
    if kind not in ("BlockStored", "BlockRemoved"):
        return "skipped_type"
    medium, ownership = raw.get("medium"), raw.get("ownership")
    if not _text(medium):
        return "skipped_medium"
    if not _text(ownership):
        return "skipped_ownership"
    tier = tier_of(medium, ownership)
    if tier is None:
        return "ignored"
    group = raw.get("group_idx")
    if type(group) is not int or group < 0:  # `type`: a bool is not a group
        return "skipped_group_idx"
    if group >= limits.max_groups:
        return "dropped_groups"
    hashes = raw.get("block_hashes")
    if not isinstance(hashes, list) or not hashes:
        return "skipped_block_hashes"
    if len(hashes) > limits.max_event_hashes:
        return "dropped_block_hashes"
    keys = tuple(map(_h, hashes))
    if None in keys:
        return "skipped_block_hashes"
    if kind == "BlockRemoved":
        return Event(False, tier, group, keys)  # type: ignore[arg-type]
    parent = raw.get("parent_block_hash")
    if parent is not None and (parent := _h(parent)) is None:
        return "skipped_parent_block_hash"
    tokens = raw.get("token_ids")
    tokens = [] if tokens is None else tokens
    if not isinstance(tokens, list):
        return "skipped_token_ids"
    if len(tokens) > limits.max_event_tokens:
        return "dropped_token_ids"
    packed = pack(tokens) if all(type(t) is int for t in tokens) else None
    if packed is None:
        return "skipped_token_ids"
    block = raw.get("block_size")
    block = 0 if block is None else block
    if type(block) is not int or not 0 <= block <= limits.max_event_tokens:
        return "skipped_block_size"
    spec, window = raw.get("kv_cache_spec_kind"), raw.get("kv_cache_spec_sliding_window")
    if spec is not None and not (isinstance(spec, str) and len(spec) <= _TEXT_CHARS):
        return "skipped_kv_cache_spec_kind"
    if window is not None and (type(window) is not int or window < 1):
        return "skipped_kv_cache_spec_sliding_window"
    return Event(True, tier, group, keys, parent, packed,  # type: ignore[arg-type]
                 None if spec is None else (spec, window), block)


def _text(value: object) -> bool:
    return value is None or (isinstance(value, str) and len(value) <= _TEXT_CHARS)


def _h(value: object) -> int | None:
    """vLLM's external block hash, an int (or bytes in some versions), as one comparable key; None
    when it is neither."""
    if type(value) is int and _HASH_MIN <= value < _HASH_END:
        return value
    if isinstance(value, bytes) and 0 < len(value) <= _HASH_BYTES:
        return int.from_bytes(value, "big")
    return None


def pack(tokens: Sequence[int]) -> bytes | None:
    """Token ids packed as a chain key; None when one is not a token id (negative, over 2**32)."""
    try:
        return array("I", tokens).tobytes()
    except (OverflowError, TypeError):
        return None


def decode_batch(payload: bytes) -> list[object]:
    """One vLLM event batch (msgpack `[ts, [events...], dp_rank]`): its events, each checked later
    (`parse_event`). Raises ValueError when the payload is not a batch."""
    import msgspec

    batch = msgspec.msgpack.decode(payload)
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not a KV event batch [ts, [events...], dp_rank]")
    return batch[1]
