"""`PrefixIndex`: per engine, which chunk of which group each tier holds, learned from the events,
and the prefix of a prompt each engine restores (lookup.py's rule)."""

from __future__ import annotations

import heapq
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .events import (CHUNKED_KINDS, FULL_KINDS, SLIDING_KINDS, STATE_KINDS, TOKEN_BYTES, Event, Limits,
                     pack, parse_event)
from .lookup import GroupRule, hit_tokens, loaded_chunks, window_chunks

_TIER_ORDER = {"cpu": 0, "disk": 1, "redis": 2}
# a chunk hash ends one chunk of every group; groups of different chunk spans (DeepSeek V4: six)
# reach it from different parents and tokens, so a hash keeps a few places, the oldest dropped
# past this many: hostile stores of one hash at ever new places stay bounded
PLACES_PER_HASH = 8
_UNKNOWN = object()  # a chunk whose parent no event named


@dataclass(frozen=True, slots=True)
class Restorable:
    """The longest prefix of a prompt an engine can restore in every group."""
    engine: str
    tokens: int  # 0: nothing
    tiers: tuple[str, ...]  # the tiers the chunks of that prefix are read from (fastest per chunk)
    # (group, tier, tokens): per group, the tokens of the chunks it loads from each tier (a windowed
    # group loads only its window): what a router weighs by each tier's cost
    loads: tuple[tuple[int, str, int], ...] = ()


@dataclass
class _Group:
    kind: str = "unknown"
    window: int | None = None
    block_tokens: int = 0  # tokens per block (the events' block_size)
    chunk_tokens: int = 0  # tokens per chunk, from a chunk's token ids


@dataclass
class _Engine:
    groups: dict[int, _Group] = field(default_factory=dict)
    blocks_per_chunk: int = 0  # vLLM's one blocks_per_chunk: a group without token ids spans block x this
    held: dict[tuple[int, int], tuple[str, ...]] = field(default_factory=dict)  # (group, hash) -> tiers
    parent: dict[tuple[int, int], int | None] = field(default_factory=dict)  # (group, hash) -> the chunk's parent
    children: dict[int | None, dict[bytes, int]] = field(default_factory=dict)  # chain: parent -> tokens -> hash
    links: dict[int, tuple[tuple[int | None, bytes], ...]] = field(default_factory=dict)  # hash -> its places (PLACES_PER_HASH)
    token_bytes: int = 0  # bytes of token ids the links hold (`Limits.max_token_bytes`)
    groups_of: dict[int, int] = field(default_factory=dict)  # hash -> how many groups hold it
    tiers: dict[str, str] = field(default_factory=dict)  # tier names seen, one string each
    counts: dict[str, int] = field(default_factory=dict)  # skipped, dropped, resets: kept across resets

    def span(self, g: _Group) -> int:
        """`g`'s tokens per chunk: from its chunks' token ids, else its tokens per block x blocks
        per chunk, else (events without either: a vLLM placeholder) the other groups' span when
        they all agree; 0 when unknown."""
        span = g.chunk_tokens or g.block_tokens * self.blocks_per_chunk
        if span:
            return span
        known = {x.chunk_tokens or x.block_tokens * self.blocks_per_chunk for x in self.groups.values()} - {0}
        return known.pop() if len(known) == 1 else 0

    def alignment(self) -> int:
        """One chunk size to show: the full-attention groups' span when they agree, else the smallest."""
        full = {self.span(g) for g in self.groups.values() if g.kind in FULL_KINDS} - {0}
        spans = full if len(full) == 1 else {self.span(g) for g in self.groups.values()} - {0}
        return min(spans, default=0)


class PrefixIndex:
    """Per engine: which chunk of which group each tier holds. Thread-safe: a subscriber thread
    applies events while request threads ask `longest_prefix`.

    `shared_tiers`: {tier: engines} for a tier several engines read, e.g. {"redis": ["e0", "e1"]}
    for engines on one Redis with one namespace: a chunk any of them announces in that tier counts
    for all of them. `draft_groups`: the group ids vLLM marks as an EAGLE/MTP drafter's, and
    `retained_tokens` vLLM's extra_retained_tokens (speculative lookahead - 1): neither travels in
    the events, and both change the hit where speculative decoding is on."""

    def __init__(self, limits: Limits | None = None, *, shared_tiers: Mapping[str, Iterable[str]] | None = None,
                 draft_groups: Iterable[int] = (), retained_tokens: int = 0) -> None:
        self.limits = limits or Limits()
        self.shared = {tier: frozenset(names) for tier, names in (shared_tiers or {}).items()}
        self.draft_groups = frozenset(draft_groups)
        self.retained_tokens = retained_tokens
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
        n = len(ev.tokens) // TOKEN_BYTES
        g = e.groups.get(ev.group)
        if g is not None and n and g.chunk_tokens and n < g.chunk_tokens and 0 < ev.block_tokens < g.block_tokens:
            self._count(name, "ignored_partial")  # a recurrent group's partial tail: not modelled
            return
        if g is not None and self._changed(e, g, ev, n):
            # a new chunk size or residency rule mid-stream: what was held was read under the old
            # one (a sliding group relabelled as state would over-predict), so it is forgotten
            e = self._reset(name, "geometry")
            g = None
        tier = e.tiers.get(ev.tier)
        if tier is None:
            if len(e.tiers) >= self.limits.max_tiers:
                self._count(name, "dropped_tiers")
                return
            tier = e.tiers[ev.tier] = ev.tier
        key = (ev.group, ev.hashes[-1])
        held = e.held.get(key)
        if held is None and len(e.held) >= self.limits.max_entries:
            self._count(name, "dropped_entries")
            return
        place = (ev.parent, ev.tokens) if n else None
        places = e.links.get(key[1], ()) if n else ()
        new_place = place is not None and place not in places
        full = new_place and len(places) >= PLACES_PER_HASH  # the oldest place makes room
        if new_place and (e.token_bytes - (len(places[0][1]) if full else 0) + len(ev.tokens)
                          > self.limits.max_token_bytes):
            self._count(name, "dropped_tokens")
            return
        if g is None:
            g = e.groups[ev.group] = _Group()
        if ev.spec:
            g.kind, g.window = ev.spec
        if ev.block_tokens:
            g.block_tokens = ev.block_tokens
        if n:
            g.chunk_tokens = n
            if ev.block_tokens and n % ev.block_tokens == 0:
                e.blocks_per_chunk = n // ev.block_tokens
        h = key[1]
        if held is None:
            e.groups_of[h] = e.groups_of.get(h, 0) + 1
        if held is None or tier not in held:
            e.held[key] = (held or ()) + (tier,)
        if place is not None:  # a self-describing chunk: its parent, and its place in the chain of hashes
            e.parent[key] = ev.parent
            if new_place:  # a hash at a few places (groups of other chunk spans end at it), never one per store
                if full:
                    _unlink_place(e, h, places[0])
                    places = places[1:]
                e.children.setdefault(ev.parent, {})[ev.tokens] = h
                e.links[h] = places + (place,)
                e.token_bytes += len(ev.tokens)

    @staticmethod
    def _changed(e: _Engine, g: _Group, ev: Event, n: int) -> bool:
        if ev.spec and g.kind != "unknown" and (g.kind, g.window) != ev.spec:
            return True
        if n and g.chunk_tokens and n != g.chunk_tokens:
            return True
        if ev.block_tokens and g.block_tokens and ev.block_tokens != g.block_tokens:
            return True
        return bool(n and ev.block_tokens and e.blocks_per_chunk and n != ev.block_tokens * e.blocks_per_chunk)

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
            e.parent.pop((g, h), None)
            e.groups_of[h] -= 1
            if not e.groups_of[h]:  # held nowhere: its chain links go too, so the index stays bounded
                del e.groups_of[h]  # (a walk past it needs a group to hold it anyway)
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
        """Per engine: chunk tokens, per group its residency rule, chunk tokens and chunks per tier,
        and counters."""
        with self._lock:
            out: dict[str, dict] = {}
            for name, e in sorted(self._engines.items()):
                groups: dict[int, dict] = {}
                for gi, g in sorted(e.groups.items()):
                    groups[gi] = {"rule": rule(g.kind, g.window), "chunk_tokens": e.span(g), "chunks": {}}
                for (gi, _), tiers in e.held.items():
                    counts = groups[gi]["chunks"]
                    for t in tiers:
                        counts[t] = counts.get(t, 0) + 1
                out[name] = {"chunk_tokens": e.alignment(), "groups": groups, "counts": dict(e.counts)}
            return out

    def longest_prefix(self, tokens: Sequence[int], engine: str | None = None,
                       group_blind: bool = False) -> list[Restorable]:
        """Per engine (or the one named), the longest prefix of `tokens` it restores in every
        group, longest first. `group_blind=True` answers as a router that ignores the groups
        would (a hash held in any group = a hit): shown wrong past a sliding window."""
        with self._lock:
            names = [engine] if engine is not None else list(self._engines)
            out = [self._longest(n, tokens, group_blind) for n in names]
        return sorted(out, key=lambda r: (-r.tokens, r.engine))

    def _views(self, name: str) -> list[tuple[_Engine, frozenset[str] | None]]:
        """`name`'s own state (every tier counts) and each peer's with the tiers it shares."""
        out: list[tuple[_Engine, frozenset[str] | None]] = [(self._engines.get(name, _Engine()), None)]
        peers: dict[str, set[str]] = {}
        for tier, names in self.shared.items():
            if name in names:
                for peer in names - {name}:
                    peers.setdefault(peer, set()).add(tier)
        out += [(self._engines[p], frozenset(t)) for p, t in sorted(peers.items()) if p in self._engines]
        return out

    def _longest(self, name: str, tokens: Sequence[int], blind: bool) -> Restorable:
        views = self._views(name)
        e = views[0][0]
        # an engine that has not named every group yet reads a shared tier by its peers' geometry
        rules = next((r for v, _ in views if v.groups and (r := self._rules(v))), [])
        buf = pack(tokens)
        if not rules or buf is None:
            return Restorable(name, 0, ())
        spans = {r.chunk_tokens for r in rules} | {v.span(g) for v, _ in views[1:] for g in v.groups.values()}
        pos = _positions(views, buf, len(tokens), sorted(spans - {0}))
        keys = {r.group: _chunk_hashes(views, r, pos, len(tokens)) for r in rules}

        def where(g: int, j: int) -> set[str]:
            h = keys[g][j]
            out: set[str] = set()
            if h is not None:
                for v, shared in views:
                    tiers = v.held.get((g, h), ())
                    out.update(tiers if shared is None else shared.intersection(tiers))
            return out

        if blind:
            return self._blind(name, e, tokens, pos, views)
        t = hit_tokens(rules, len(tokens), lambda g, j: bool(where(g, j)))
        loads: dict[tuple[int, str], int] = {}
        for r in rules if t else ():
            for j in loaded_chunks(r, t):
                key = (r.group, min(where(r.group, j), key=_tier_rank))
                loads[key] = loads.get(key, 0) + r.chunk_tokens
        used = {tier for _, tier in loads}
        return Restorable(name, t, tuple(sorted(used, key=_tier_rank)),
                          tuple((g, tier, n) for (g, tier), n in sorted(loads.items())))

    def _rules(self, e: _Engine) -> list[GroupRule]:
        """vLLM's lookup rule of every group the engine named; [] while a group's span is unknown
        (its chunks cannot be named) or a group id below the highest one named never announced a
        chunk: vLLM numbers its groups 0..n-1, and a group that announced nothing holds nothing."""
        if len(e.groups) <= max(e.groups, default=-1):
            return []
        rules = []
        for gi, g in sorted(e.groups.items()):
            span = e.span(g)
            if not span:
                return []
            rules.append(GroupRule(
                gi, span, window_chunks(g.kind, g.window, span, self.retained_tokens),
                window_tokens=(g.window or 0) if g.kind in SLIDING_KINDS else 0,
                retained_tokens=self.retained_tokens, mamba=g.kind in STATE_KINDS, draft=gi in self.draft_groups))
        return rules

    def _blind(self, name: str, e: _Engine, tokens: Sequence[int], pos: dict[int, int | None],
               views: list) -> Restorable:
        c = e.alignment()
        k = 0
        tiers: set[str] = set()
        while (k + 1) * c <= len(tokens) - 1 and (h := pos.get((k + 1) * c)) is not None:
            held = set().union(*(v.held.get((g, h), ()) for v, _ in views for g in v.groups))
            if not held:
                break
            tiers.add(min(held, key=_tier_rank))
            k += 1
        return Restorable(name, k * c, tuple(sorted(tiers, key=_tier_rank)) if k else ())


def _positions(views: list[tuple[_Engine, frozenset[str] | None]], buf: bytes, n: int,
               spans: list[int]) -> dict[int, int | None]:
    """Every prompt position a chain of announced chunks reaches from 0, with its hash."""
    pos: dict[int, int | None] = {0: None}
    todo = [0]
    while todo:
        p = heapq.heappop(todo)
        h = pos[p]
        for v, _ in views:
            kids = v.children.get(h)
            if not kids:
                continue
            for s in spans:
                q = p + s
                if q > n or q in pos:
                    continue
                child = kids.get(buf[p * TOKEN_BYTES:q * TOKEN_BYTES])
                if child is not None:
                    pos[q] = child
                    heapq.heappush(todo, q)
    return pos


def _chunk_hashes(views: list[tuple[_Engine, frozenset[str] | None]], r: GroupRule, pos: dict[int, int | None],
                  n: int) -> list[int | None]:
    """The hash of each complete chunk of `r`'s group in a prompt of `n` tokens: from the chain, or
    down from a later chunk of the group through the parent its event named (a sliding group keeps
    only a window, whose first chunk the chain may not reach)."""
    s = r.chunk_tokens
    out = [pos.get((j + 1) * s) for j in range(n // s)]
    for j in range(len(out) - 2, -1, -1):
        if out[j] is None and out[j + 1] is not None:
            for v, _ in views:
                p = v.parent.get((r.group, out[j + 1]), _UNKNOWN)
                if p is not _UNKNOWN:
                    out[j] = p  # type: ignore[assignment]
                    break
    return out


def _tier_rank(tier: str) -> int:
    return _TIER_ORDER.get(tier, 9)


def rule(kind: str, window: int | None) -> str:
    """A group's residency rule in words, as the hit rule reads it."""
    if kind in SLIDING_KINDS and window:
        return f"sliding {window}: the chunks of the last {int(window) - 1} tokens before a boundary"
    if kind in CHUNKED_KINDS and window:
        return f"chunked {window}: the chunks of the local chunk holding the boundary"
    if kind in STATE_KINDS:
        return "state: a checkpoint at the boundary"
    if kind in FULL_KINDS:
        return "full: every chunk of the prefix"
    return f"{kind}: every chunk of the prefix (assumed)"


def _unlink(e: _Engine, h: int) -> None:
    for place in e.links.pop(h, ()):
        _unlink_place(e, h, place)


def _unlink_place(e: _Engine, h: int, place: tuple[int | None, bytes]) -> None:
    parent, tokens = place
    e.token_bytes -= len(tokens)
    kids = e.children.get(parent)
    if kids is not None and kids.get(tokens) == h:
        del kids[tokens]
        if not kids:
            del e.children[parent]
