"""Eviction policies behind one small interface (one instance per index pool).

```
insert(key)                  a key was admitted into the pool
touch(key)                   a key was hit or stored again
remove(key)                  a key left the pool (evicted, freed, corrupt)
victim(evictable) -> key | None
                             the next key to evict among those with evictable(key) True;
                             it does not remove the key: the caller frees the slot, then calls
                             remove(key). It may reorder internal queues (S3-FIFO promotes).
__len__, __contains__        resident keys only (ghost entries are not counted)
```

The index decides *when* to evict (its pool is full) and which keys may go (pinned keys may
not: `evictable`); a policy only orders the resident keys. Keeping capacity out of the
policy means the same policy code serves a pool of 3 slots and one of 3 million, and a pinned
key can never be lost because a policy decided to drop it on insert (the rejected design:
cachetools-style caches that evict inside `__setitem__`).

`capacity` (slots of the pool) sizes only the policies' own bookkeeping: ARC's target and
ghost lists, S3-FIFO's small queue and ghost queue.

Policies, by name (`POLICIES`): `lru`, `fifo`, `arc` (Megiddo & Modha, FAST'03), `s3fifo`
(Yang et al., SOSP'23). Belady's MIN needs the future and lives in `kvtier.replay.oracle`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

from kvtier.errors import ConfigError

Key = Hashable
Evictable = Callable[[Key], bool]


class EvictionPolicy(Protocol):
    name: str

    def insert(self, key: Key) -> None: ...
    def touch(self, key: Key) -> None: ...
    def remove(self, key: Key) -> None: ...
    def victim(self, evictable: Evictable) -> Key | None: ...
    def __len__(self) -> int: ...
    def __contains__(self, key: object) -> bool: ...


def _first(queue: OrderedDict[Key, object], evictable: Evictable) -> Key | None:
    for key in queue:
        if evictable(key):
            return key
    return None


class LRU:
    """Least recently used: victim is the oldest insert-or-touch."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        self._q: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        self._q[key] = None
        self._q.move_to_end(key)

    def touch(self, key: Key) -> None:
        if key in self._q:
            self._q.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._q.pop(key, None)

    def victim(self, evictable: Evictable) -> Key | None:
        return _first(self._q, evictable)

    def __len__(self) -> int:
        return len(self._q)

    def __contains__(self, key: object) -> bool:
        return key in self._q


class FIFO(LRU):
    """First in, first out: a touch does not refresh (a baseline, and cheap)."""

    name = "fifo"

    def touch(self, key: Key) -> None:
        return None


class ARC:
    """Adaptive Replacement Cache.

    T1 holds keys seen once recently, T2 keys seen at least twice; B1/B2 remember keys evicted
    from T1/T2 (ghosts, no slot). A re-insert found in B1 grows the target size `p` of T1, one
    found in B2 shrinks it. `victim` takes T1's LRU key when |T1| > p (or T2 has none that may
    go), else T2's. Ghost lists are trimmed so |T1|+|B1| <= c and the total stays <= 2c.
    `remove` of a resident key turns it into a ghost (an eviction); the split interface cannot
    tell an eviction from a drop, and a ghost of a dropped key costs one dict entry.
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        self.c = max(1, capacity)
        self.p = 0.0
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        if key in self.t1 or key in self.t2:
            self.touch(key)
            return
        if key in self.b1:
            self.p = min(float(self.c), self.p + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        self._trim_ghosts()

    def touch(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            self.b2[key] = None
        else:
            return
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        while self.b1 and len(self.t1) + len(self.b1) > self.c:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.c:
            self.b2.popitem(last=False)

    def victim(self, evictable: Evictable) -> Key | None:
        first, second = (self.t1, self.t2) if self.t1 and len(self.t1) > self.p else (self.t2, self.t1)
        key = _first(first, evictable)
        return key if key is not None else _first(second, evictable)

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2


class S3FIFO:
    """S3-FIFO: a small FIFO (10% of capacity) filters one-hit wonders from a main FIFO.

    New keys enter S (or M when their ghost is in G). Each key has a 2-bit use count, raised by
    touch. `victim`: while S is over its share (or M is empty), S's oldest key moves to M if it
    was used since insertion (count >= 1; count reset), else it is the victim (and becomes a
    ghost in G on remove). Otherwise M's oldest key is reinserted at M's head with count - 1
    while its count is > 0; the first with count 0 is the victim. A key that may not be evicted
    (pinned: in use) moves to its queue's tail, as if just used. G keeps at most |M|'s share of keys (capacity - small).
    Choice: "used since insertion" is count >= 1 (the common reading of the paper's rule).
    """

    name = "s3fifo"

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.small_cap = max(1, self.capacity // 10)
        self.ghost_cap = max(1, self.capacity - self.small_cap)
        self.s: OrderedDict[Key, int] = OrderedDict()
        self.m: OrderedDict[Key, int] = OrderedDict()
        self.g: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        if key in self.s or key in self.m:
            self.touch(key)
            return
        if key in self.g:
            del self.g[key]
            self.m[key] = 0
        else:
            self.s[key] = 0

    def touch(self, key: Key) -> None:
        if key in self.s:
            self.s[key] = min(3, self.s[key] + 1)
        elif key in self.m:
            self.m[key] = min(3, self.m[key] + 1)

    def remove(self, key: Key) -> None:
        if key in self.s:
            del self.s[key]
            self.g[key] = None
            while len(self.g) > self.ghost_cap:
                self.g.popitem(last=False)
        else:
            self.m.pop(key, None)

    def victim(self, evictable: Evictable) -> Key | None:
        if len(self.s) >= self.small_cap or not self.m:
            key = self._evict_small(evictable)
            if key is not None:
                return key
        key = self._evict_main(evictable)
        return key if key is not None else self._evict_small(evictable)

    def _evict_small(self, evictable: Evictable) -> Key | None:
        # A key that may not go (pinned: in use) moves to the tail, as if just used.
        for _ in range(len(self.s)):
            key, count = next(iter(self.s.items()))
            if not evictable(key):
                self.s.move_to_end(key)
            elif count >= 1:
                del self.s[key]
                self.m[key] = 0
            else:
                return key
        return None

    def _evict_main(self, evictable: Evictable) -> Key | None:
        # Counts are <= 3, so 4 passes over M reach a count-0 key if one may go at all.
        for _ in range(4 * len(self.m)):
            key, count = next(iter(self.m.items()))
            if evictable(key):
                if count == 0:
                    return key
                self.m[key] = count - 1
            self.m.move_to_end(key)
        return None

    def __len__(self) -> int:
        return len(self.s) + len(self.m)

    def __contains__(self, key: object) -> bool:
        return key in self.s or key in self.m


POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {
    "lru": LRU,
    "fifo": FIFO,
    "arc": ARC,
    "s3fifo": S3FIFO,
}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """A fresh policy for a pool of `capacity` slots; ConfigError for an unknown name."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ConfigError(
            f"unknown eviction policy {name!r}; use one of: {', '.join(POLICIES)}"
        ) from None
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
        raise ConfigError(f"policy capacity {capacity!r} must be a positive number of slots")
    return cls(capacity)


def policy_options(name: str, base: str, keys: Sequence[str], real: str, usage: str) -> dict[str, float | int]:
    """`base` or `base:key=value,...` -> {key: value}: `real` a non-negative number, every other key
    a positive integer; anything else raises ConfigError naming the option and `usage`."""
    head, _, rest = name.partition(":")
    if head != base:
        raise ConfigError(f"{name!r} is not a {base} policy name")
    out: dict[str, float | int] = {}
    for part in filter(None, rest.split(",")):
        key, eq, value = part.partition("=")
        if not eq or key not in keys:
            raise ConfigError(f"policy {name!r}: option {part!r}; {usage}")
        try:
            out[key] = float(value) if key == real else int(value)
        except ValueError:
            raise ConfigError(f"policy {name!r}: {key}={value!r} is not a number") from None
        if out[key] < 0 or (key != real and out[key] == 0):
            raise ConfigError(f"policy {name!r}: {key}={value} must be positive")
    return out
