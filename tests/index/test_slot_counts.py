"""`slot_counts` (kvtier.index.pool) answers the slots per (tier, group) an Index would have,
without building one: the same numbers for every shipped geometry and share rule, and the same
errors."""

from __future__ import annotations

import pytest

from kvtier.core.load import load_geometry
from kvtier.core.plan import make_plan
from kvtier.errors import ConfigError
from kvtier.index.index import Index
from kvtier.index.pool import slot_counts

GEOMETRIES = ["deepseek-v4-like", "gemma-3-27b-example", "gpt-oss-120b-fp8kv", "qwen3-next-hybrid-blocks"]


def _index_counts(index: Index, plan) -> dict[tuple[str, int], int]:  # noqa: ANN001
    return {(t, gp.index): index.slots(gp.index, t) for t in index.tiers for gp in plan.cacheable_groups}


@pytest.mark.parametrize("name", GEOMETRIES)
@pytest.mark.parametrize("share", ["proportional", "equal", "row-per-key", "fractions"])
def test_the_counts_are_the_index_pools(geometry_path, name: str, share: str) -> None:
    plan = make_plan(load_geometry(geometry_path(name)))
    rule: str | dict[str, float] = share
    if share == "fractions":  # uneven fractions summing to less than 1
        groups = plan.cacheable_groups
        rule = {gp.name: 0.9 * (i + 1) / sum(range(1, len(groups) + 1)) for i, gp in enumerate(groups)}
    total = sum(gp.chunk_bytes for gp in plan.cacheable_groups)
    for capacities in ({"cpu": 64 * total * len(plan.cacheable_groups) + 12345},
                       {"cpu": 7 * total * len(plan.cacheable_groups) + 1,
                        "disk": 1000 * total * len(plan.cacheable_groups) - 3}):
        got = slot_counts(plan, capacities, rule)
        assert got == _index_counts(Index(plan, capacities, share=rule), plan)
        assert list(got) == [(t, gp.index) for t in capacities for gp in plan.cacheable_groups]


@pytest.mark.parametrize("capacities, share", [({"cpu": 0}, "proportional"), ({"": 1 << 20}, "equal"),
                                               ({"cpu": True}, "equal"), ({"cpu": 1}, "proportional"),
                                               ({"cpu": 1 << 30}, "sideways"), ({"cpu": 1 << 30}, {"x": 0.5})])
def test_the_errors_are_the_index_errors(geometry_path, capacities: dict, share) -> None:  # noqa: ANN001
    plan = make_plan(load_geometry(geometry_path("gemma-3-27b-example")))
    with pytest.raises(ConfigError) as by_index:
        Index(plan, capacities, share=share)
    with pytest.raises(ConfigError) as by_counts:
        slot_counts(plan, capacities, share)
    assert str(by_counts.value) == str(by_index.value)
