"""kvtier's chunk plan under vLLM's chunking rule.

vLLM's offloading chunks every group by one `blocks_per_chunk`: a chunk of group g is
`blocks_per_chunk` of g's own blocks, so groups with different tokens per block (DeepSeek-V4:
256/64/8/4; Gemma 4 in vLLM: 256/256/128) have chunks of different token spans. vLLM's scheduler
decides which chunk of which group a hit needs; kvtier's index only has to size each group's
slots for that group's chunk. So inside vLLM, a group's chunk covers `span_tokens[g]` tokens
(`tokens_per_block[g] * blocks_per_chunk`) and holds `span * bytes_per_token` bytes; where every
group has the same span this is exactly `make_plan(geometry, blocks_per_chunk=...)`.

Rejected alternative: refusing mixed spans (kvtier did until 2026-12), although vLLM's native
offloading accepts them; the hybrids kvtier exists for are exactly those models.
"""

from __future__ import annotations

from kvtier.core.geometry import Geometry
from kvtier.core.plan import Plan, group_plan, make_plan
from kvtier.errors import UnsupportedModelError


def engine_plan(geometry: Geometry, blocks_per_chunk: int) -> tuple[Plan, tuple[int, ...]]:
    """(plan, each group's chunk span in tokens) for vLLM's `blocks_per_chunk`."""
    spans = tuple(g.tokens_per_block * blocks_per_chunk for g in geometry.groups)
    attention = {s for g, s in zip(geometry.groups, spans) if g.cacheable and not g.is_state}
    if len(attention) <= 1:
        plan = make_plan(geometry, blocks_per_chunk=blocks_per_chunk)
        return plan, tuple(plan.chunk_tokens for _ in geometry.groups)
    state = [g.name for g in geometry.groups if g.cacheable and g.is_state]
    if state:
        raise UnsupportedModelError(
            f"groups {state} keep state checkpoints and the attention groups chunk "
            f"{sorted(attention)} tokens at blocks_per_chunk={blocks_per_chunk}; kvtier offloads "
            "state models in vLLM only when every attention group has the same tokens per block")
    groups = tuple(group_plan(i, g, span * g.bytes_per_token, blocks_per_chunk)
                   for i, (g, span) in enumerate(zip(geometry.groups, spans)))
    return Plan(geometry=geometry, chunk_tokens=min(attention), groups=groups), spans
