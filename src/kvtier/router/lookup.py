"""vLLM's offloading hit, as its scheduler computes it, for a router that knows only which chunks
are held: `hit_tokens` is `OffloadingConnectorScheduler._lookup_complete_chunks` (vLLM 0.32 and
0.33 alike) with nothing computed on the GPU and every lookup answered at once.

Each group looks up chunks of its own span (tokens per block x blocks per chunk): full attention
the longest run from chunk 0, a windowed group (sliding, chunked local, mamba) the last run of
its window in chunks; a group that lowers the hit makes the windowed groups look again, until the
hit settles. With a windowed group the hit is at most prompt length - 1 and need not be a
multiple of a chunk (a 1,408-token prompt restores 1,407: the last chunk is loaded, its last token
recomputed); mamba groups round it down to their chunk. An EAGLE/MTP drafter's group needs one
chunk past the hit, which it then gives up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GroupRule:
    """One group as vLLM's offloading scheduler looks it up."""
    group: int
    chunk_tokens: int  # tokens per block x blocks per chunk
    window_chunks: int | None = None  # None: full attention (a prefix from chunk 0)
    window_tokens: int = 0  # a SlidingWindowSpec's window: its first load window widens past a partial chunk
    retained_tokens: int = 0  # vLLM's extra_retained_tokens (speculative lookahead - 1)
    mamba: bool = False  # a state group in align mode: the hit rounds down to its chunk
    draft: bool = False  # an EAGLE/MTP drafter's group

    def load_window(self, tokens: int) -> int:
        """`GroupOffloadConfig.load_window_size_in_chunks`: the chunks a hit of `tokens` loads."""
        window = self.window_chunks or 0
        if self.window_tokens:
            pad = -tokens % self.chunk_tokens
            window = max(window, _cdiv(self.window_tokens - 1 + self.retained_tokens + pad, self.chunk_tokens))
        return window


def window_chunks(kind: str, window: int | None, chunk_tokens: int, retained_tokens: int = 0) -> int | None:
    """`get_sliding_window_size_in_chunks` from what an event names: None for full attention."""
    from .events import CHUNKED_KINDS, SLIDING_KINDS, STATE_KINDS

    if kind in SLIDING_KINDS and window:
        return max(_cdiv(window, chunk_tokens), _cdiv(window - 1 + retained_tokens, chunk_tokens))
    if kind in CHUNKED_KINDS:  # its local chunk travels in the window field (kvtier fills it)
        return _cdiv(window, chunk_tokens) if window else UNBOUNDED
    if kind in STATE_KINDS:
        return 1
    return None  # full, MLA, unknown kinds: every chunk of the prefix


UNBOUNDED = 1 << 40  # a window never filled: the lookup asks every chunk from 0 (never more than restores)


def hit_tokens(rules: Sequence[GroupRule], prompt_tokens: int, held: Callable[[int, int], bool]) -> int:
    """The tokens vLLM restores for a prompt of `prompt_tokens` tokens when `held(group, j)` says
    whether chunk j of a group (its tokens [j*S, (j+1)*S)) is in some tier."""
    if not rules:
        return 0
    full = [r for r in rules if r.window_chunks is None]
    windowed = sorted((r for r in rules if r.window_chunks is not None), key=lambda r: r.window_chunks, reverse=True)
    max_hit = prompt_tokens
    if windowed:  # the last prompt token is recomputed for its logits
        max_hit -= 1
        mamba = [r.chunk_tokens for r in rules if r.mamba]
        if mamba:
            max_hit -= max_hit % max(mamba)
    hit = 0
    verified: set[int] = set()  # drafter groups that gave up their extra chunk this round
    todo: Sequence[GroupRule] = full + windowed
    while todo:
        looked_windowed = False
        groups, todo = todo, ()
        for r in groups:
            s = r.chunk_tokens
            keys = prompt_tokens // s  # complete chunks of the prompt
            unverified = r.draft and r.group not in verified
            max_hit = min(max_hit, keys * s)
            if max_hit < s:
                return 0
            query = min(max_hit + s, keys * s) if unverified else max_hit
            chunks = min(_cdiv(query, s), keys)
            if r.window_chunks is None:
                n = 0
                while n < chunks and held(r.group, n):
                    n += 1
            else:
                end = min(max_hit, (chunks - int(unverified)) * s)
                n = _window_lookup(r.group, chunks, r.window_chunks + int(unverified),
                                   r.load_window(end) + int(unverified), held)
            if n == 0:
                return 0
            if unverified:
                n -= 1
                verified.add(r.group)
            max_hit = min(max_hit, s * n)
            if max_hit < s:
                return 0
            if max_hit < hit:
                if not r.draft:
                    verified.clear()
                if looked_windowed and not todo:
                    todo = windowed
            looked_windowed |= r.window_chunks is not None
            hit = max_hit
    return hit


def loaded_chunks(rule: GroupRule, tokens: int) -> range:
    """The chunks of `rule`'s group a hit of `tokens` loads."""
    end = _cdiv(tokens, rule.chunk_tokens)
    if rule.window_chunks is None:
        return range(end)
    return range(max(0, end - rule.load_window(tokens)), end)


def _window_lookup(group: int, chunks: int, window: int, first_window: int,
                   held: Callable[[int, int], bool]) -> int:
    """`_sliding_window_lookup`: the end of the last run of `window` held chunks, scanning from
    the end (the first run may need `first_window`); else the run from chunk 0."""
    run, need = 0, first_window or window
    for j in range(chunks - 1, -1, -1):
        if held(group, j):
            run += 1
        else:
            run, need = 0, window
        if run == need:
            return j + need
    return run


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
