"""Both halves of the vLLM spec make a chunk's header in one place (`SpecContext.chunk_header`):
the scheduler's whole-chunk header (promotion at lookup, host-only hits) must be exactly the
worker's header of all of the chunk's blocks, or a promoted slot would never serve a load (its
header would not match the one the load asks for). A job that moves only some of a chunk's
blocks claims only their tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.core.keys import Namespace
from kvtier.core.load import load_geometry
from kvtier.core.plan import make_plan

pytest.importorskip("vllm")

from kvtier.integrations.vllm.common import ChunkItem, SpecContext  # noqa: E402
from kvtier.integrations.vllm.config import parse_config  # noqa: E402


@pytest.mark.parametrize("name", ["deepseek-v4-like", "gemma-3-27b-example", "qwen3-next-hybrid-blocks"])
def test_the_whole_chunk_header_is_the_workers_header_of_every_block(geometry_path, tmp_path: Path,
                                                                      name: str) -> None:
    plan = make_plan(load_geometry(geometry_path(name)))
    config = parse_config({"kvtier.tiers": "cpu", "kvtier.cpu_bytes": 1 << 30})
    h = b"\x42" * 32
    for gp in plan.cacheable_groups:
        bpc = plan.chunk_tokens // gp.group.tokens_per_block
        ctx = SpecContext(plan=plan, namespace=Namespace("m", "f", "bf16"), config=config, group_of={},
                          blocks_per_chunk=bpc)
        end = 3 * plan.chunk_tokens
        item = ChunkItem(gp.index, h, end - plan.chunk_tokens, end, ())
        every = [(100 + p, p) for p in range(bpc)]
        assert ctx.blocks_header(item, every) == ctx.whole_chunk_header(h, gp.index, end)
        if bpc > 1:  # a job from the chunk's second block on claims only those blocks' tokens
            part = ctx.blocks_header(item, every[1:])
            tpb = gp.group.tokens_per_block
            assert (part.token_start, part.token_end) == (item.token_start + tpb, end)
            assert part != ctx.whole_chunk_header(h, gp.index, end)
