"""The offline oracles of a replay, which know the trace's future: `next_uses` (for each request,
when each of its chunks is next asked for), `Belady` (MIN eviction on one pool: the farthest
next use goes) and `OracleAdmission` (store only what is asked again within a horizon). They
are reference rows, never online policies; split from `run` (the replay loop) because they are
their own job: computing and using the future.
"""

from __future__ import annotations

import heapq

from kvtier.index.index import ChunkHash
from kvtier.index.policies import Evictable
from kvtier.errors import ConfigError
from kvtier.replay.trace import Trace

NEVER = float("inf")


class Belady:
    """MIN on one pool: the victim is the resident key used farthest in the future.

    `next_use` is shared by every pool of a run and updated by the replay before each request;
    a key's next use only grows, so a heap entry is current iff it equals next_use[key].
    """

    name = "min"

    def __init__(self, capacity: int, next_use: dict[ChunkHash, float]) -> None:
        self.next_use = next_use
        self.resident: set[ChunkHash] = set()
        self.heap: list[tuple[float, int, ChunkHash]] = []
        self.seq = 0

    def _push(self, key: ChunkHash) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (-self.next_use.get(key, NEVER), self.seq, key))

    def insert(self, key: ChunkHash) -> None:
        self.resident.add(key)
        self._push(key)

    def touch(self, key: ChunkHash) -> None:
        if key in self.resident:
            self._push(key)

    def remove(self, key: ChunkHash) -> None:
        self.resident.discard(key)

    def victim(self, evictable: Evictable) -> ChunkHash | None:
        heap, skipped, found = self.heap, [], None
        while heap:
            neg, _, key = heap[0]
            if key not in self.resident or -neg != self.next_use.get(key, NEVER):
                heapq.heappop(heap)  # stale
                continue
            if evictable(key):
                found = key
                break
            skipped.append(heapq.heappop(heap))
        for item in skipped:
            heapq.heappush(heap, item)
        return found

    def __len__(self) -> int:
        return len(self.resident)

    def __contains__(self, key: object) -> bool:
        return key in self.resident


def next_uses(trace: Trace) -> list[list[float]]:
    """For request r and chunk position i: the index of the next request containing that hash."""
    out: list[list[float]] = [[] for _ in trace.requests]
    last: dict[ChunkHash, float] = {}
    for r in range(len(trace.requests) - 1, -1, -1):
        chunks = trace.requests[r].chunks
        out[r] = [last.get(h, NEVER) for h in chunks]
        for h in chunks:
            last[h] = r
    return out


class OracleAdmission:
    """Offline bound, not a policy: store the leading chunks whose next use is at most
    `horizon` requests ahead (all with a next use when None), or, with `chunk_horizon`, whose
    next use comes before `chunk_horizon` more chunks have been requested (the chunks of the
    requests in between, summed: a clock closer to what LRU forgets by than a request count).
    Needs the whole trace; replay calls `admit` once per request in order, so the call count
    is the request index."""

    def __init__(self, future: list[list[float]], horizon: int | None = None,
                 chunk_horizon: int | None = None) -> None:
        if horizon is not None and chunk_horizon is not None:
            raise ConfigError("oracle admission: give a horizon in requests or in chunks, not both")
        self.future = future
        self.horizon = horizon
        self.chunk_horizon = chunk_horizon
        self.clock: list[int] = []  # chunks requested before request r
        if chunk_horizon is not None:
            total = 0
            for fut in future:
                self.clock.append(total)
                total += len(fut)
            self.clock.append(total)
        self.r = 0
        self.name = ("oracle" if horizon is None and chunk_horizon is None else
                     f"oracle:{horizon}" if horizon is not None else f"oracle:chunks={chunk_horizon}")

    def admit(self, chunk_hashes: list[ChunkHash]) -> int:
        fut, r = self.future[self.r], self.r
        self.r += 1
        limit = NEVER if self.horizon is None else r + self.horizon
        k = 0
        if self.chunk_horizon is not None:
            clock, end = self.clock, self.clock[r + 1]
            while k < len(chunk_hashes) and fut[k] != NEVER and clock[int(fut[k])] - end <= self.chunk_horizon:
                k += 1
            return k
        while k < len(chunk_hashes) and fut[k] <= limit and fut[k] != NEVER:
            k += 1
        return k
