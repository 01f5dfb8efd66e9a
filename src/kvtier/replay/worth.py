"""Online tuning of the worth weight w (`kvtier.index.worth`), for replay's default on hybrid
geometries (`kvtier replay --policy worth`; `worth:w=W` fixes w).

The tuner keeps a bounded window of the most recent requests (their chunk hashes: at most
`max_chunks` chunks in all). From the first eviction in the first tier on, every `period` chunks
requested it replays the window against each weight of `grid` in a *shadow*: a fresh index of the
same capacities, share and placement rule (`kvtier.replay.run.replay` with that w fixed), and
adopts the weight whose shadows saved the most prefill FLOPs, summed over the tunings so far with
the older ones fading by `FADE` (one window is noisy); a tie keeps the smaller weight, so
where worth does not pay (the window fits, every candidate scores the same) w stays 0: LRU.
Learns from the past only.

Memory (`memory_bytes`, bounded by `max_memory_bytes`): 8 bytes per chunk hash held (integer ids;
a store's 32-byte hashes would be 32) + 64 bytes per request record, at most `max_chunks` chunks
and as many records (a request has at least one chunk; empty ones are not kept), + the weight and
one fading score per candidate.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from kvtier.errors import ConfigError
from kvtier.index.worth import WorthWeight
from kvtier.replay.trace import Request, Trace

GRID = (0.0, 1.0, 2.0, 4.0)
FADE = 0.5  # each tuning, the candidates' past scores count half
REQUEST_BYTES = 64  # a request record: timestamp, token counts, the tuple header
CHUNK_BYTES = 8  # one chunk id in the window (replay's integer ids)


class WorthTuner:
    """Window of recent requests + periodic shadow replays over `grid` (module docstring)."""

    def __init__(self, weight: WorthWeight, score: Callable[[Trace, float], float], tier: str, *,
                 max_chunks: int = 32768, period: int = 32768, grid: Sequence[float] = GRID) -> None:
        if max_chunks <= 0 or period <= 0 or not grid or any(g < 0 for g in grid):
            raise ConfigError(f"worth tuner: max_chunks={max_chunks} and period={period} must be "
                              f"positive, grid={tuple(grid)} non-empty and >= 0")
        self.weight, self.score, self.tier = weight, score, tier
        self.max_chunks, self.period, self.grid = max_chunks, period, tuple(sorted(grid))
        self.window: deque[Request] = deque()
        self.chunks = 0  # chunks in the window
        self.since = 0  # chunks requested since the last tuning (or the first eviction)
        self.started = False
        self.tunings: list[float] = []  # the weight chosen at each tuning
        self.totals = [0.0] * len(self.grid)  # each candidate's fading sum of window scores

    def add(self, req: Request) -> None:
        """Remember one request (the oldest leave while the window holds too many chunks)."""
        n = len(req.chunks)
        if n == 0 or n > self.max_chunks:
            return
        self.window.append(req)
        self.chunks += n
        while self.chunks > self.max_chunks:
            self.chunks -= len(self.window.popleft().chunks)

    def observe(self, req: Request, evicted: bool) -> None:
        """After each request: remember it; tune when a period of chunks has gone by."""
        self.add(req)
        if not self.started:
            self.started = evicted
            return
        self.since += len(req.chunks)
        if self.since >= self.period:
            self.since = 0
            self.tune()

    def tune(self) -> float:
        """Replay the window under every weight; adopt the best (ties: the smaller weight)."""
        window = tuple(self.window)
        trace = Trace("worth-window", window, len({h for q in window for h in q.chunks}),
                      self.chunks, sum(q.input_tokens for q in window))
        scores = [self.score(trace, w) for w in self.grid]
        self.totals = [FADE * t + s for t, s in zip(self.totals, scores)]
        best = max(range(len(scores)), key=lambda i: (self.totals[i], -i))
        self.weight.w = self.grid[best]
        self.tunings.append(self.weight.w)
        return self.weight.w

    @property
    def memory_bytes(self) -> int:
        return CHUNK_BYTES * self.chunks + REQUEST_BYTES * len(self.window) + 8 * (1 + len(self.grid))

    @staticmethod
    def max_memory_bytes(max_chunks: int, candidates: int = len(GRID)) -> int:
        return (CHUNK_BYTES + REQUEST_BYTES) * max_chunks + 8 * (1 + candidates)


def worth_options(name: str) -> dict[str, float | int]:
    """`worth` or `worth:w=4,max_chunks=N,period=N` -> options (w fixes the weight: no tuning)."""
    from kvtier.index.policies import policy_options

    return policy_options(name, "worth", ("w", "max_chunks", "period"), "w", "worth takes w=W (fixed, no tuning), max_chunks=N, period=N")
