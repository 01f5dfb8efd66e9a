"""kvtier's chunk plan under vLLM's chunking rule.

vLLM's offloading chunks every group by one `blocks_per_chunk`: a chunk of group g is
`blocks_per_chunk` of g's own blocks, so groups with different tokens per block (DeepSeek-V4:
256/64/8/4; Gemma 4 in vLLM: 256/256/128) have chunks of different token spans. vLLM's scheduler
decides which chunk of which group a hit needs; kvtier's index only has to size each group's
slots for that group's chunk. So inside vLLM, a group's chunk covers `span_tokens[g]` tokens
(`tokens_per_block[g] * blocks_per_chunk`) and holds `span * bytes_per_token` bytes; where every
group has the same span this is exactly `make_plan(geometry, blocks_per_chunk=...)`.

Mixed spans are accepted, as vLLM's native offloading accepts them: the hybrids kvtier exists for
are exactly those models.
"""

from __future__ import annotations

from dataclasses import replace

from kvtier.core.geometry import Geometry
from kvtier.core.plan import Plan, group_plan, make_plan


def engine_plan(geometry: Geometry, blocks_per_chunk: int,
                page_bytes: tuple[int, ...] | None = None) -> tuple[Plan, tuple[int, ...]]:
    """(plan, each group's chunk span in tokens) for vLLM's `blocks_per_chunk`.

    A state group (Mamba/GDN, vLLM's align mode) keeps one state page per block, and vLLM's
    worker moves a chunk as its `blocks_per_chunk` pages (only the last one is a hit's state), so
    inside vLLM its chunk is `blocks_per_chunk` state pages, not kvtier's one checkpoint.

    `page_bytes` (vLLM's bytes per block of each group, from its KV-cache specs) size every
    group's chunk exactly where kvtier's description rounds (DeepSeek V4's padded and compressed
    pages).

    Every group vLLM offloads is cacheable here: vLLM, not kvtier, decides which groups a hit
    needs (it leaves out the ones no hit can use), and a group kvtier declined would answer MISS
    for every key and so veto every hit of the model."""
    geometry = replace(geometry, groups=tuple(g if g.cacheable else replace(g, cacheable=True, reason="")
                                              for g in geometry.groups))
    spans = tuple(g.tokens_per_block * blocks_per_chunk for g in geometry.groups)
    attention = {s for g, s in zip(geometry.groups, spans) if g.cacheable and not g.is_state}
    if len(attention) <= 1 and len({s for g, s in zip(geometry.groups, spans) if g.cacheable}) <= 1:
        plan = make_plan(geometry, blocks_per_chunk=blocks_per_chunk)
        spans = tuple(plan.chunk_tokens for _ in geometry.groups)
    else:
        plan = Plan(geometry=geometry, chunk_tokens=min(attention or set(spans)),
                    groups=tuple(group_plan(i, g, g.bytes_for_tokens(span), blocks_per_chunk)
                                 for i, (g, span) in enumerate(zip(geometry.groups, spans))))
    groups = tuple(group_plan(gp.index, gp.group, gp.group.state_bytes * blocks_per_chunk, blocks_per_chunk)
                   if gp.group.is_state else gp for gp in plan.groups)
    if page_bytes is not None:  # vLLM's own bytes per block of each group (its specs)
        groups = tuple(group_plan(gp.index, gp.group, page * blocks_per_chunk, blocks_per_chunk)
                       for gp, page in zip(groups, page_bytes, strict=True))
    return replace(plan, groups=groups), spans
