"""Where each block of a vLLM transfer job lands in kvtier's chunks: pure arithmetic, no torch,
no vLLM (tests/integrations/test_vllm_placement.py runs without either).

vLLM describes a job's engine side as one flat list of block ids with, per KV-cache group, how
many of them are that group's (`group_sizes`) and the logical index of the group's first block
(`block_indices`): its `GPULoadStoreSpec`. kvtier describes the other side as chunk items in
vLLM's key order (group by group, prefix order within a group: the manager's
`KvtierLoadStoreSpec`). `place` pairs them: per group, each item with its (block id, position in
chunk) pairs. `header_span` is the token span a header of such an item claims: only the
positions the job moves. `consecutive_runs` groups the chunks vLLM's copy handler moves into its
transfers (one per run of consecutive chunks of a group). `lookup_window` is the run of chunks
vLLM's hit search reads of a windowed group for a hit ending at a chunk boundary.

Rule: positions come from vLLM's block spec only, never carried in the items (one source: a
mismatch fails the job instead of a silent disagreement; docs/changelog.md, 2026-12-06).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar


class _Item(Protocol):
    """What placement reads of a chunk item (common.ChunkItem)."""

    @property
    def group(self) -> int: ...


Item = TypeVar("Item", bound=_Item)
Blocks = list[tuple[int, int]]  # (block id, position in chunk), positions ascending


@dataclass(frozen=True, slots=True)
class Misplaced:
    """A job whose blocks and items do not line up: it fails (a load is recomputed)."""

    reason: str  # the log line, without the "kvtier: " prefix
    noncontiguous: bool = False  # counted `jobs_noncontiguous`


def place(block_ids: Sequence[int], group_sizes: Sequence[int], block_indices: Sequence[int],
          items: Sequence[Item], blocks_per_chunk: int) -> list[tuple[int, list[tuple[Item, Blocks]]]] | Misplaced:
    """Per group with blocks: each chunk item with its (block id, position in chunk) pairs,
    following vLLM's rule: a group's blocks start at logical block `block_indices[g]`, so the
    first chunk may begin mid-chunk; items of a group are consecutive in vLLM's key order."""
    bpc = blocks_per_chunk
    out = []
    pos_b = pos_i = 0
    block_ids = [int(b) for b in block_ids]
    for g, (n, first) in enumerate(zip(group_sizes, block_indices)):
        if n == 0:
            continue
        skip = first % bpc
        num_chunks = -(-(n + skip) // bpc)
        group_items = items[pos_i:pos_i + num_chunks]
        if len(group_items) != num_chunks or any(it.group != g for it in group_items):
            return Misplaced(f"job layout mismatch in group {g} ({n} blocks from {first}, "
                             f"{len(group_items)} items)")
        placed: list[tuple[Item, Blocks]] = [(it, []) for it in group_items]
        for i, b in enumerate(block_ids[pos_b:pos_b + n]):
            p = skip + i
            placed[p // bpc][1].append((b, p % bpc))
        # Positions are derived from the count of blocks, so they are right only if the blocks
        # are contiguous: only the first chunk may start mid-chunk, every later one must be
        # whole. vLLM leaves out null blocks inside a chunk in some configurations (sliding
        # windows with prefix-cache retention); there a shorter later chunk would put blocks
        # at the wrong positions, so the job fails (a load is recomputed) instead.
        if any(len(blocks) != bpc for _, blocks in placed[1:]):
            return Misplaced(f"group {g}'s blocks are not contiguous ({n} blocks from {first} for "
                             f"{num_chunks} chunks); the job fails rather than guess positions",
                             noncontiguous=True)
        out.append((g, placed))
        pos_b += n
        pos_i += num_chunks
    if pos_i != len(items):
        return Misplaced(f"job has {len(items)} chunk items, vLLM's block spec covers {pos_i}")
    return out


def header_span(token_start: int, tokens_per_block: int, blocks: Blocks) -> tuple[int, int]:
    """The token span a header of the chunk starting at `token_start` claims when it covers only
    the block positions in `blocks`: a store records the span it really holds, a load asks for
    the span it needs, and a tier serves a load only from a chunk whose stored span contains the
    needed one (`payload.mismatch`). vLLM stores a group's first chunk from a block mid-chunk (a
    sliding group whose earlier blocks were freed); the positions it did not send are zeros in
    the payload and must never reach a block."""
    lo = min(p for _, p in blocks)
    hi = max(p for _, p in blocks) + 1
    return token_start + lo * tokens_per_block, token_start + hi * tokens_per_block


def lookup_window(kind: str, span: int, window: int | None = None, attention_chunk: int | None = None,
                  retained_tokens: int = 0, draft: bool = False) -> tuple[int, int] | None:
    """(chunks before, chunks after) a hit's end that vLLM's search reads of a group whose chunks
    span `span` tokens: a hit ending after chunk e reads chunks e - before + 1 .. e + after; None
    for a prefix from chunk 0 (full, MLA). vLLM 0.32/0.33 `get_sliding_window_size_in_chunks`:
    sliding max(cdiv(W, S), cdiv(W - 1 + retained, S)), chunked-local cdiv(A, S), state 1; an
    EAGLE/MTP drafter's group also reads the chunk after the hit (`_lookup_complete_chunks`).
    A hit ending inside a chunk (a prompt of whole chunks restores all but its last token) reads
    the same chunks as one ending after it, unless retained tokens widen the first window."""
    if kind == "sliding" and window:
        before = max(-(-window // span), -(-(window - 1 + retained_tokens) // span))
    elif kind == "chunked" and attention_chunk:
        before = -(-attention_chunk // span)
    elif kind == "state":
        before = 1
    else:
        return None
    return before, int(draft)


Chunk = TypeVar("Chunk", bound=tuple)  # (group, index in group, blocks, ...)


def consecutive_runs(chunks: Sequence[Chunk]) -> list[list[Chunk]]:
    """Chunks (group, index in group, blocks, ...) in runs of consecutive chunks of one group,
    in (group, index) order: vLLM's copy handler moves one run in one transfer (copies.py), and
    only a run's first chunk may start mid-chunk."""
    out: list[list[Chunk]] = []
    for c in sorted(chunks, key=lambda c: (c[0], c[1])):
        if out and out[-1][-1][0] == c[0] and out[-1][-1][1] == c[1] - 1:
            out[-1].append(c)
        else:  # a gap (a chunk copied otherwise) or another group
            out.append([c])
    return out
