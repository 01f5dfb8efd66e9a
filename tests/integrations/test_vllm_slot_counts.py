"""Both halves of the vLLM spec size each tier alike: the worker lays its slabs out from
`SpecContext.slot_counts()` (no index), the scheduler from `SpecContext.new_index()`; the numbers
must be the same for every share rule, whether the groups' chunks span the same tokens or not."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.core.keys import Namespace
from kvtier.core.load import load_geometry
from kvtier.core.plan import make_plan

pytest.importorskip("vllm")

from kvtier.integrations.vllm.common import SpecContext  # noqa: E402
from kvtier.integrations.vllm.config import parse_config  # noqa: E402


@pytest.mark.parametrize("name", ["deepseek-v4-like", "gemma-3-27b-example", "qwen3-next-hybrid-blocks"])
@pytest.mark.parametrize("share", ["proportional", "equal"])
@pytest.mark.parametrize("mixed", [False, True])
def test_slot_counts_are_the_indexs(geometry_path, tmp_path: Path, name: str, share: str, mixed: bool) -> None:
    plan = make_plan(load_geometry(geometry_path(name)))
    total = sum(gp.chunk_bytes for gp in plan.cacheable_groups)
    config = parse_config({"kvtier.tiers": "cpu,disk", "kvtier.directory": str(tmp_path),
                           "kvtier.cpu_bytes": 40 * total + 777, "kvtier.disk_bytes": 900 * total + 5,
                           "kvtier.share": share})
    spans = tuple((256 >> (2 * i)) if mixed else plan.chunk_tokens for i in range(len(plan.groups)))
    ctx = SpecContext(plan=plan, namespace=Namespace("m", "f", "bf16"), config=config, group_of={},
                      blocks_per_chunk=1, span_tokens=spans)
    index = ctx.new_index()
    assert ctx.slot_counts() == {(t, gp.index): index.slots(gp.index, t)
                                 for t in ("cpu", "disk") for gp in plan.cacheable_groups}
    for tier in ("cpu", "disk"):
        layout = ctx.tier_layout(tier)
        assert layout.num_slots == tuple(index.slots(gp.index, tier) if gp.cacheable else 0 for gp in plan.groups)
        assert layout.slot_bytes == tuple(gp.chunk_bytes if gp.cacheable else 0 for gp in plan.groups)
    assert ctx.mixed_spans == mixed
    if mixed:  # the shares are per token then, and the dead-first rule is off
        assert index.anchors == () and isinstance(ctx.share(), dict) == (share == "proportional")
