"""The worth tuner with replay's requests and a scoring function of its caller's.

The rule is `kvtier.index.tuning.WorthTuner` (replay, the Store and vLLM's manager tune w with it;
`kvtier replay --policy worth` through `kvtier.index.tuning.worth_index`). This view takes
`kvtier.replay.trace.Request`s and scores a window with `score(trace, w)` instead of the shadow
replay, for experiments and tests of the adoption rule; its window holds replay's integer ids
(packed, 8 bytes a chunk).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.index.tuning import FADE, GRID, REQUEST_BYTES, Record, renumber, worth_options
from kvtier.index.tuning import WorthTuner as _Tuner
from kvtier.index.worth import WorthWeight
from kvtier.replay.trace import Request, Trace

__all__ = ["CHUNK_BYTES", "FADE", "GRID", "REQUEST_BYTES", "WorthTuner", "worth_options"]

CHUNK_BYTES = 8  # one chunk id in the window (replay's integer ids)


class WorthTuner(_Tuner):
    """`kvtier.index.tuning.WorthTuner`, inline, fed replay's Requests, scored by `score`."""

    def __init__(self, weight: WorthWeight, score: Callable[[Trace, float], float], tier: str, *,
                 max_chunks: int = 32768, period: int = 32768, grid: Sequence[float] = GRID) -> None:
        super().__init__(None, weight, runner="inline", max_chunks=max_chunks, period=period, grid=grid,
                         hash_bytes=CHUNK_BYTES)
        self.score, self.tier = score, tier

    def add(self, req: Request) -> None:
        """Remember one request (the oldest leave while the window holds too many chunks)."""
        self._add(tuple(req.chunks), req.prompt_tokens, req.input_tokens)

    def observe(self, req: Request, evicted: bool) -> None:  # type: ignore[override]
        super().observe(req.chunks, req.prompt_tokens, req.input_tokens, evicted)

    def _scores(self, window: tuple[Record, ...]) -> list[float]:
        reqs = tuple(Request(float(t), chunks, p, i) for t, (chunks, p, i) in enumerate(renumber(window)))
        trace = Trace("worth-window", reqs, len({h for q in reqs for h in q.chunks}),
                      sum(len(q.chunks) for q in reqs), sum(q.input_tokens for q in reqs))
        return [self.score(trace, w) for w in self.grid]

    @staticmethod
    def max_memory_bytes(max_chunks: int, candidates: int = len(GRID)) -> int:  # type: ignore[override]
        return _Tuner.max_memory_bytes(max_chunks, CHUNK_BYTES, candidates)
