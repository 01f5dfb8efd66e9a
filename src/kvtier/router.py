"""Which engine can restore how much of a prompt, from vLLM's KV events alone.

A KV-aware router (llm-d's precise prefix-cache scorer, Dynamo's KV router) sends a request to
the engine that holds the longest prefix of it. For a hybrid model "holds" is per group: a
sliding-window group keeps only the chunks of the last window before a boundary, a state group
only checkpoints, so a prefix whose chunk hashes are all present may still restore nothing. This
module keeps, per engine, what kvtier's events say each tier holds in each group, and answers the
longest prefix that restores in every group.

Input: vLLM's KV event stream (`--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://*:5557"}'`), whose `BlockStored` / `BlockRemoved` events kvtier fills
(integrations/vllm/events.py):
- `kv_cache_spec_kind` / `kv_cache_spec_sliding_window`: the group's residency rule;
- full-attention chunks carry their `token_ids` and `parent_block_hash`: the chain of chunk hashes
  a prompt is matched against (a chunk's hash is the last of its `block_hashes`; every group's
  chunk at the same boundary has the same hash);
- `medium` / `ownership`: the tier ("CPU" = kvtier's cpu tier, "STORAGE" + "kvtier-disk" /
  "kvtier-redis").
GPU prefix-cache events (medium "GPU") are counted and ignored: this index predicts what kvtier
restores, which is what the engine loads when its GPU cache does not hold the prefix.

The hit rule is kvtier's (docs/geometry.md): the largest T (a multiple of the chunk tokens, at most
prompt length - 1) such that every group known to the engine can restore T: full/MLA: chunks 0 ..
T/C-1; sliding W: the chunks holding tokens [T-W+1, T); mamba (state): the chunk ending at T (its
checkpoint); an unknown kind or chunked-local attention (its chunk size is not in the event):
every chunk, as full attention (never predicts more than restores).

Hostile input (anyone who reaches a publisher's port may send anything): every field is checked
in `parse_event`; a bad event is skipped and counted per engine (`PrefixIndex.stats`), never
raised. `Limits` caps what one engine makes the router keep; a restart, a gap in the sequence
numbers (unless replayed) or a geometry change mid-stream resets that engine. Whatever is refused,
the router predicts less, never more. Deployment: docs/vllm.md, "KV events".

No vLLM import: events are decoded as plain msgpack maps (`msgspec`), so this runs in a router
process of any vLLM version. `kvtier events --zmq ENDPOINT` prints what arrives and answers
queries.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

log = logging.getLogger("kvtier.router")

FULL_KINDS = ("full_attention", "mla_attention", "sink_full_attention")
SLIDING_KINDS = ("sliding_window", "sliding_window_mla")
STATE_KINDS = ("mamba",)

_HASH_MIN, _HASH_END = -(1 << 63), 1 << 64  # msgpack's integers (vLLM's int hashes are 64-bit)
_HASH_BYTES = 64  # a bytes hash: vLLM's are 32 (sha256)
_TEXT_CHARS = 64  # medium, ownership, kind: vLLM's are short names
_TOKEN_BYTES = array("I").itemsize  # a token id, packed: 0 <= id < 2**32 on every platform


@dataclass(frozen=True, slots=True)
class Limits:
    """What one engine can make the router keep. Anything over a cap is dropped and counted
    (`PrefixIndex.stats`); a dropped store only shortens predictions."""
    max_entries: int = 1_000_000  # (group, chunk) pairs held, across tiers: about 0.5 KiB each
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


@dataclass(frozen=True, slots=True)
class Restorable:
    """The longest prefix of a prompt an engine can restore in every group."""
    engine: str
    tokens: int  # 0: nothing
    tiers: tuple[str, ...]  # the tiers the chunks of that prefix are read from (fastest per chunk)


@dataclass
class _Engine:
    chunk_tokens: int = 0  # learned from a full-attention chunk's token ids
    kinds: dict[int, tuple[str, int | None]] = field(default_factory=dict)  # group -> (kind, window)
    held: dict[tuple[int, int], tuple[str, ...]] = field(default_factory=dict)  # (group, hash) -> tiers
    children: dict[int | None, dict[bytes, int]] = field(default_factory=dict)  # chain
    link: dict[int, tuple[int | None, bytes]] = field(default_factory=dict)  # hash -> its place in children
    groups_of: dict[int, int] = field(default_factory=dict)  # hash -> how many groups hold it (a set: 4x)
    tiers: dict[str, str] = field(default_factory=dict)  # tier names seen, one string each
    counts: dict[str, int] = field(default_factory=dict)  # skipped, dropped, resets: kept across resets


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
    packed = _pack(tokens) if all(type(t) is int for t in tokens) else None
    if packed is None:
        return "skipped_token_ids"
    spec, window = raw.get("kv_cache_spec_kind"), raw.get("kv_cache_spec_sliding_window")
    if spec is not None and not (isinstance(spec, str) and len(spec) <= _TEXT_CHARS):
        return "skipped_kv_cache_spec_kind"
    if window is not None and (type(window) is not int or window < 1):
        return "skipped_kv_cache_spec_sliding_window"
    return Event(True, tier, group, keys, parent, packed,  # type: ignore[arg-type]
                 None if spec is None else (spec, window))


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


def _pack(tokens: Sequence[int]) -> bytes | None:
    """Token ids packed as a chain key; None when one is not a token id (negative, over 2**32)."""
    try:
        return array("I", tokens).tobytes()
    except (OverflowError, TypeError):
        return None


_TIER_ORDER = {"cpu": 0, "disk": 1, "redis": 2}


class PrefixIndex:
    """Per engine: which chunk of which group each tier holds. Thread-safe: a subscriber thread
    applies events while request threads ask `longest_prefix`."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self._engines: dict[str, _Engine] = {}
        self._lock = threading.Lock()

    # -- events --------------------------------------------------------------------------------

    def apply(self, engine: str, events: Iterable[object]) -> None:
        """Apply decoded events (msgpack maps with a "type" tag, as vLLM encodes them). One that
        cannot be applied is counted for `engine` (`stats`), never raised."""
        with self._lock:
            for raw in events:
                ev = parse_event(raw, self.limits)
                if isinstance(ev, str):
                    self._count(engine, ev)
                elif ev.stored:
                    self._stored(engine, ev)
                else:
                    self._removed(self._engines.setdefault(engine, _Engine()), ev)

    def reset(self, engine: str, reason: str) -> None:
        """Forget what `engine` holds (it restarted, events were lost): counted `reset_<reason>`."""
        with self._lock:
            self._reset(engine, reason)

    def count(self, engine: str, counter: str, n: int = 1) -> None:
        """Add `n` to one of `engine`'s counters (the subscriber's: bad messages, replays)."""
        with self._lock:
            self._count(engine, counter, n)

    def _count(self, engine: str, counter: str, n: int = 1) -> None:
        if n:
            counts = self._engines.setdefault(engine, _Engine()).counts
            counts[counter] = counts.get(counter, 0) + n

    def _reset(self, engine: str, reason: str) -> _Engine:
        old = self._engines.get(engine)
        e = self._engines[engine] = _Engine(counts={} if old is None else old.counts)
        self._count(engine, f"reset_{reason}")
        return e

    def _stored(self, name: str, ev: Event) -> None:
        e = self._engines.setdefault(name, _Engine())
        g, n = ev.group, len(ev.tokens) // _TOKEN_BYTES
        known = e.kinds.get(g, ("unknown", None))
        if (n and e.chunk_tokens and n != e.chunk_tokens) or (ev.spec and known[0] != "unknown" and known != ev.spec):
            # a new chunk size or residency rule mid-stream: what was held was read under the old
            # one (a sliding group relabelled as state would over-predict), so it is forgotten
            e = self._reset(name, "geometry")
        e.kinds[g] = ev.spec or e.kinds.get(g, ("unknown", None))
        tier = e.tiers.get(ev.tier)
        if tier is None:
            if len(e.tiers) >= self.limits.max_tiers:
                self._count(name, "dropped_tiers")
                return
            tier = e.tiers[ev.tier] = ev.tier
        key = ev.hashes[-1]
        held = e.held.get((g, key))
        if held is None and len(e.held) >= self.limits.max_entries:
            self._count(name, "dropped_entries")
            return
        if held is None:
            e.groups_of[key] = e.groups_of.get(key, 0) + 1
        if held is None or tier not in held:
            e.held[(g, key)] = (held or ()) + (tier,)
        if n:  # a self-describing chunk: its place in the chain of hashes
            if e.link.get(key, (ev.parent, ev.tokens)) != (ev.parent, ev.tokens):
                _unlink(e, key)  # moved: its old place would stay behind
            e.children.setdefault(ev.parent, {})[ev.tokens] = key
            e.link[key] = (ev.parent, ev.tokens)
            e.chunk_tokens = n

    def _removed(self, e: _Engine, ev: Event) -> None:
        g = ev.group
        for h in ev.hashes:
            tiers = e.held.get((g, h))
            if tiers is None or ev.tier not in tiers:
                continue
            tiers = tuple(t for t in tiers if t != ev.tier)
            if tiers:
                e.held[(g, h)] = tiers
                continue
            del e.held[(g, h)]
            e.groups_of[h] -= 1
            if not e.groups_of[h]:  # held nowhere: its chain link goes too, so the index stays bounded
                del e.groups_of[h]  # (a walk past it needs a full group to hold it anyway)
                _unlink(e, h)

    # -- queries -------------------------------------------------------------------------------

    def engines(self) -> list[str]:
        with self._lock:
            return sorted(self._engines)

    def stats(self, engine: str) -> dict[str, int]:
        """`engine`'s counters: `ignored` (GPU cache events), `skipped_<field>` (an impossible value
        in that field), `dropped_<what>` (over a cap), `reset_<why>`, and the subscriber's."""
        with self._lock:
            e = self._engines.get(engine)
            return {} if e is None else dict(e.counts)

    def summary(self) -> dict[str, dict]:
        """Per engine: chunk tokens, per group its residency rule and chunks per tier, and counters."""
        with self._lock:
            out: dict[str, dict] = {}
            for name, e in sorted(self._engines.items()):
                groups: dict[int, dict] = {}
                for g, (kind, window) in sorted(e.kinds.items()):
                    groups[g] = {"rule": rule(kind, window), "chunks": {}}
                for (g, _), tiers in e.held.items():
                    counts = groups.setdefault(g, {"rule": "unknown", "chunks": {}})["chunks"]
                    for t in tiers:
                        counts[t] = counts.get(t, 0) + 1
                out[name] = {"chunk_tokens": e.chunk_tokens, "groups": groups, "counts": dict(e.counts)}
            return out

    def longest_prefix(self, tokens: Sequence[int], engine: str | None = None,
                       group_blind: bool = False) -> list[Restorable]:
        """Per engine (or the one named), the longest prefix of `tokens` it restores in every
        group, longest first. `group_blind=True` answers as a router that ignores the groups
        would (a hash held in any group = a hit): shown wrong past a sliding window."""
        with self._lock:
            names = [engine] if engine is not None else list(self._engines)
            out = [self._longest(n, self._engines.get(n, _Engine()), tokens, group_blind) for n in names]
        return sorted(out, key=lambda r: (-r.tokens, r.engine))

    def _longest(self, name: str, e: _Engine, tokens: Sequence[int], blind: bool) -> Restorable:
        c = e.chunk_tokens
        if not c:
            return Restorable(name, 0, ())
        chain: list[int] = []
        parent: int | None = None
        while (len(chain) + 1) * c <= len(tokens):
            i = len(chain)
            chunk = _pack(tokens[i * c:(i + 1) * c])
            h = None if chunk is None else e.children.get(parent, {}).get(chunk)
            if h is None:
                break
            chain.append(h)
            parent = h
        for k in range(len(chain), 0, -1):
            t = k * c
            if t > len(tokens) - 1:  # the engine computes at least the last token
                continue
            need = self._blind_need(e, chain, k) if blind else self._need(e, chain, k, t)
            if need is not None:
                return Restorable(name, t, tuple(sorted(need, key=lambda x: _TIER_ORDER.get(x, 9))))
        return Restorable(name, 0, ())

    def _need(self, e: _Engine, chain: list[int], k: int, t: int) -> set[str] | None:
        """The tiers the chunks of a hit of t tokens are read from, or None when some group
        cannot restore t."""
        c = e.chunk_tokens
        tiers: set[str] = set()
        for g, (kind, window) in e.kinds.items():
            if kind in SLIDING_KINDS and window:
                first = max(0, t - int(window) + 1) // c
                chunks = range(first, k)
            elif kind in STATE_KINDS:
                chunks = range(k - 1, k)
            else:  # full, MLA, unknown, chunked local (its chunk size is not in the event)
                chunks = range(k)
            for j in chunks:
                held = e.held.get((g, chain[j]))
                if not held:
                    return None
                tiers.add(min(held, key=lambda x: _TIER_ORDER.get(x, 9)))
        return tiers

    def _blind_need(self, e: _Engine, chain: list[int], k: int) -> set[str] | None:
        tiers: set[str] = set()
        for j in range(k):
            held = set().union(*(e.held.get((g, chain[j]), ()) for g in e.kinds))
            if not held:
                return None
            tiers.add(min(held, key=lambda x: _TIER_ORDER.get(x, 9)))
        return tiers


def rule(kind: str, window: int | None) -> str:
    """A group's residency rule in words, as the hit rule reads it."""
    if kind in SLIDING_KINDS and window:
        return f"sliding {window}: the chunks of the last {int(window) - 1} tokens before a boundary"
    if kind in STATE_KINDS:
        return "state: a checkpoint at the boundary"
    if kind in FULL_KINDS:
        return "full: every chunk of the prefix"
    return f"{kind}: every chunk of the prefix (assumed)"


def _unlink(e: _Engine, h: int) -> None:
    parent, tokens = e.link.pop(h, (None, None))
    kids = e.children.get(parent)
    if tokens is not None and kids is not None and kids.get(tokens) == h:
        del kids[tokens]
        if not kids:
            del e.children[parent]


# -- the ZMQ subscriber --------------------------------------------------------------------------

def decode_batch(payload: bytes) -> list[object]:
    """One vLLM event batch (msgpack `[ts, [events...], dp_rank]`): its events, each checked later
    (`parse_event`). Raises ValueError when the payload is not a batch."""
    import msgspec

    batch = msgspec.msgpack.decode(payload)
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not a KV event batch [ts, [events...], dp_rank]")
    return batch[1]


class Subscriber:
    """Subscribe to engines' ZMQ KV event publishers (vLLM's `--kv-events-config`) on a background
    thread, feeding `index`. `endpoints`: {engine name: "tcp://host:port"}, or "bind:ENDPOINT" for
    an engine whose publisher connects (vLLM connects to a tcp endpoint without `*`, e.g. loopback);
    `replay`: {engine name: its `replay_endpoint`}, asked for the batches of a gap in the sequence."""

    def __init__(self, index: PrefixIndex, endpoints: Mapping[str, str], topic: str = "",
                 replay: Mapping[str, str] | None = None, replay_timeout_s: float = 1.0) -> None:
        import zmq

        from kvtier.errors import ConfigError

        if stray := sorted(set(replay or {}) - set(endpoints)):
            raise ConfigError(f"replay endpoints for {stray} name no engine of {sorted(endpoints)}; "
                              "name each replay endpoint by the engine whose publisher it belongs to")
        self.index = index
        self.batches = 0  # applied, replayed ones included
        self._replay, self._replay_timeout_s = dict(replay or {}), replay_timeout_s
        self._seq: dict[str, int] = {}  # engine -> the last sequence number applied
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        self._socks = []  # (engine, endpoint, SUB socket, its monitor of disconnections)
        for name, endpoint in endpoints.items():
            s = self._socket(zmq.SUB)
            s.setsockopt_string(zmq.SUBSCRIBE, topic)
            self._socks.append((name, endpoint, s, s.get_monitor_socket(zmq.EVENT_DISCONNECTED)))
            try:
                if endpoint.startswith("bind:"):
                    s.bind(endpoint.removeprefix("bind:"))
                else:
                    s.connect(endpoint)
            except zmq.ZMQError as exc:  # a taken port fails here, loudly
                self._close()
                raise ConfigError(f"engine {name!r}: ZMQ endpoint {endpoint!r} failed ({exc}); give e.g. "
                                  "tcp://10.0.0.5:5557, or bind:tcp://127.0.0.1:5557 on a free port") from None
        for name, endpoint in self._replay.items():  # asked only at a gap: checked now
            probe = self._socket(zmq.DEALER)
            try:
                probe.connect(endpoint)
            except zmq.ZMQError as exc:
                self._close()
                raise ConfigError(f"engine {name!r}: replay endpoint {endpoint!r} failed ({exc}); give the "
                                  "address vLLM binds its replay_endpoint on, e.g. tcp://10.0.0.5:5558") from None
            finally:
                probe.close(0)
        self._thread = threading.Thread(target=self._run, name="kvtier-router", daemon=True)
        self._thread.start()

    def _socket(self, kind: int):  # noqa: ANN202 - a zmq.Socket (zmq is imported lazily)
        import zmq

        s = self._ctx.socket(kind)
        s.setsockopt(zmq.MAXMSGSIZE, self.index.limits.max_message_bytes)
        s.setsockopt(zmq.LINGER, 0)
        return s

    def _run(self) -> None:
        import zmq

        poller, of = zmq.Poller(), {}
        for name, endpoint, s, monitor in self._socks:
            poller.register(s, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            of[s], of[monitor] = (name, None, s), (name, endpoint, s)
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                name, endpoint, sub = of[sock]
                try:
                    frames = sock.recv_multipart()
                    if endpoint is None:
                        self._receive(name, frames)
                    else:  # ZMQ drops a connection that sent over max_message_bytes for good
                        self.index.count(name, "disconnects")
                        if endpoint.startswith("bind:"):
                            continue  # the publisher connects again itself
                        with contextlib.suppress(zmq.ZMQError):
                            sub.disconnect(endpoint)
                        sub.connect(endpoint)  # (what was lost meanwhile is a gap)
                except Exception:  # noqa: BLE001 - this thread serves every engine: one message never stops it
                    self.index.count(name, "message_errors")
                    log.exception("kvtier router: a message from engine %r was not applied", name)

    def _receive(self, name: str, frames: list[bytes]) -> None:
        """vLLM's `[topic, seq (8 bytes big-endian), payload]`. A sequence number that goes back is
        a restarted engine, whose tiers went with it (no removal is sent after a kill): reset. A gap
        is filled from the replay endpoint, else (or where its buffer no longer reaches) reset."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.index.count(name, "bad_messages")
            return
        seq, last = int.from_bytes(frames[1], "big"), self._seq.get(name)
        if last is not None and seq <= last:
            self.index.reset(name, "restart")
            last = None
        start = 0 if last is None else last + 1
        if seq > start:  # missed [start, seq): at a first message, whatever the buffer still holds
            run = self._replayed(name, start, seq)
            if last is not None and len(run) < seq - start:
                self.index.reset(name, "gap")  # the batches after it are a suffix: kept
            self.index.count(name, "replayed_batches", len(run))
            for payload in run:
                self._apply(name, payload)
        self._seq[name] = seq
        self._apply(name, frames[2])

    def _replayed(self, name: str, start: int, end: int) -> list[bytes]:
        """The payloads of batches [s, end) from the engine's replay endpoint, for the smallest s
        it still holds (vLLM keeps `buffer_steps` batches); [] without one or on no answer."""
        import zmq

        if (endpoint := self._replay.get(name)) is None:
            return []
        got: dict[int, bytes] = {}
        s = self._socket(zmq.DEALER)  # a fresh one each time: no late answer to an earlier ask
        try:
            s.connect(endpoint)
            s.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self._replay_timeout_s
            while s.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                frames = s.recv_multipart()  # [b"", (topic,) seq, payload]; the end: seq -1, b""
                if len(frames) < 3 or len(frames[-2]) != 8 or not frames[-1]:
                    break
                seq = int.from_bytes(frames[-2], "big")
                if start <= seq < end:
                    got[seq] = frames[-1]
                if seq >= end - 1 or time.monotonic() >= deadline:
                    break
        finally:
            s.close(0)
        first = end
        while first - 1 in got:
            first -= 1
        return [got[n] for n in range(first, end)]

    def _apply(self, name: str, payload: bytes) -> None:
        try:
            events = decode_batch(payload)
        except ValueError:  # msgspec.DecodeError is one
            self.index.count(name, "bad_messages")
            return
        self.index.apply(name, events)
        self.batches += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._close()

    def _close(self) -> None:
        for _, _, s, monitor in self._socks:
            s.disable_monitor()
            monitor.close(0)
            s.close(0)
