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

No vLLM import: events are decoded as plain msgpack maps (`msgspec`), so this runs in a router
process of any vLLM version. `kvtier events --zmq ENDPOINT` prints what arrives and answers
queries.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

FULL_KINDS = ("full_attention", "mla_attention", "sink_full_attention")
SLIDING_KINDS = ("sliding_window", "sliding_window_mla")
STATE_KINDS = ("mamba",)


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
    held: dict[tuple[int, int], set[str]] = field(default_factory=dict)  # (group, hash) -> tiers
    children: dict[int | None, dict[tuple[int, ...], int]] = field(default_factory=dict)  # chain
    link: dict[int, tuple[int | None, tuple[int, ...]]] = field(default_factory=dict)  # hash -> its place in children
    groups_of: dict[int, set[int]] = field(default_factory=dict)  # hash -> groups holding it in some tier
    ignored: int = 0  # GPU events and unreadable ones


def tier_of(medium: str | None, ownership: str | None) -> str | None:
    """kvtier's tier name for an event's medium and ownership; None for the GPU cache."""
    if medium == "CPU" and ownership is None:
        return "cpu"
    if ownership and ownership.startswith("kvtier-"):
        return ownership[len("kvtier-"):]
    if medium in ("CPU", "STORAGE"):
        return medium.lower() if ownership is None else f"{medium.lower()}:{ownership}"
    return None


_TIER_ORDER = {"cpu": 0, "disk": 1, "redis": 2}


class PrefixIndex:
    """Per engine: which chunk of which group each tier holds. Thread-safe: a subscriber thread
    applies events while request threads ask `longest_prefix`."""

    def __init__(self) -> None:
        self._engines: dict[str, _Engine] = {}
        self._lock = threading.Lock()

    # -- events --------------------------------------------------------------------------------

    def apply(self, engine: str, events: Iterable[Mapping[str, object]]) -> None:
        """Apply decoded events (msgpack maps with a "type" tag, as vLLM encodes them)."""
        with self._lock:
            e = self._engines.setdefault(engine, _Engine())
            for ev in events:
                kind = ev.get("type")
                if kind == "BlockStored":
                    self._stored(e, ev)
                elif kind == "BlockRemoved":
                    self._removed(e, ev)
                else:  # AllBlocksCleared: the GPU cache's (kvtier announces every removal itself)
                    e.ignored += 1

    def _stored(self, e: _Engine, ev: Mapping[str, object]) -> None:
        tier = tier_of(ev.get("medium"), ev.get("ownership"))  # type: ignore[arg-type]
        hashes = ev.get("block_hashes") or []
        group = ev.get("group_idx")
        if tier is None or not hashes or group is None:
            e.ignored += 1
            return
        g = int(group)  # type: ignore[call-overload]
        spec = ev.get("kv_cache_spec_kind")
        if spec is not None:
            e.kinds[g] = (str(spec), ev.get("kv_cache_spec_sliding_window"))  # type: ignore[assignment]
        elif g not in e.kinds:
            e.kinds[g] = ("unknown", None)
        key = _h(hashes[-1])  # type: ignore[index]
        e.held.setdefault((g, key), set()).add(tier)
        e.groups_of.setdefault(key, set()).add(g)
        tokens = ev.get("token_ids") or []
        if tokens:  # a self-describing chunk: its place in the chain of hashes
            parent = None if ev.get("parent_block_hash") is None else _h(ev.get("parent_block_hash"))
            e.children.setdefault(parent, {})[tuple(tokens)] = key  # type: ignore[arg-type]
            e.link[key] = (parent, tuple(tokens))  # type: ignore[arg-type]
            if not e.chunk_tokens:
                e.chunk_tokens = len(tokens)  # type: ignore[arg-type]

    def _removed(self, e: _Engine, ev: Mapping[str, object]) -> None:
        tier = tier_of(ev.get("medium"), ev.get("ownership"))  # type: ignore[arg-type]
        group = ev.get("group_idx")
        if tier is None or group is None:
            e.ignored += 1
            return
        g = int(group)  # type: ignore[call-overload]
        for h in map(_h, ev.get("block_hashes") or []):  # type: ignore[arg-type]
            tiers = e.held.get((g, h))
            if tiers is None:
                continue
            tiers.discard(tier)
            if tiers:
                continue
            del e.held[(g, h)]
            groups = e.groups_of[h]
            groups.discard(g)
            if not groups:  # held nowhere: its chain link goes too, so the index stays bounded
                del e.groups_of[h]  # (a walk past it needs a full group to hold it anyway)
                parent, tokens = e.link.pop(h, (None, None))
                kids = e.children.get(parent)
                if tokens is not None and kids is not None and kids.get(tokens) == h:
                    del kids[tokens]
                    if not kids:
                        del e.children[parent]

    # -- queries -------------------------------------------------------------------------------

    def engines(self) -> list[str]:
        with self._lock:
            return sorted(self._engines)

    def summary(self) -> dict[str, dict]:
        """Per engine: chunk tokens and, per group, its residency rule and chunks per tier."""
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
                out[name] = {"chunk_tokens": e.chunk_tokens, "groups": groups, "ignored_events": e.ignored}
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
            h = e.children.get(parent, {}).get(tuple(tokens[i * c:(i + 1) * c]))
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
            held = set().union(*(e.held[(g, chain[j])] for g in e.groups_of.get(chain[j], ())))
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


def _h(value: object) -> int:
    """vLLM's external block hash: an int (or bytes in some versions): one comparable key."""
    if isinstance(value, (bytes, bytearray)):
        return int.from_bytes(value, "big")
    return int(value)  # type: ignore[call-overload]


# -- the ZMQ subscriber ------------------------------------------------------------------------

def decode_batch(payload: bytes) -> list[Mapping[str, object]]:
    """One vLLM event batch (msgpack `[ts, [events...], dp_rank]`) as plain maps."""
    import msgspec

    batch = msgspec.msgpack.decode(payload)
    events = batch[1] if isinstance(batch, (list, tuple)) and len(batch) > 1 else []
    return [ev for ev in events if isinstance(ev, dict)]


class Subscriber:
    """Subscribe to engines' ZMQ KV event publishers (vLLM's `--kv-events-config`) on a
    background thread, feeding `index`. `endpoints`: {engine name: "tcp://host:port"}."""

    def __init__(self, index: PrefixIndex, endpoints: Mapping[str, str], topic: str = "") -> None:
        import zmq

        self.index = index
        self.batches = 0
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        self._socks = []
        for name, endpoint in endpoints.items():
            s = self._ctx.socket(zmq.SUB)
            s.setsockopt_string(zmq.SUBSCRIBE, topic)
            s.connect(endpoint)
            self._socks.append((name, s))
        self._thread = threading.Thread(target=self._run, name="kvtier-router", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        for _, s in self._socks:
            poller.register(s, zmq.POLLIN)
        names = {s: n for n, s in self._socks}
        while not self._stop.is_set():
            for s, _ in poller.poll(100):
                frames = s.recv_multipart()
                # vLLM sends [topic, sequence number, payload]; the replay socket is not used
                try:
                    events = decode_batch(frames[-1])
                except Exception:  # noqa: BLE001 - a malformed batch is skipped, never fatal
                    continue
                self.index.apply(names[s], events)
                self.batches += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        for _, s in self._socks:
            s.close(0)
