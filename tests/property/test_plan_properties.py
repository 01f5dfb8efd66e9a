"""Planner properties over random geometries (hypothesis).

The oracles below are written from DESIGN.md's hit rules in terms of token positions, not by
calling the planner's own chunk arithmetic, so they check `chunks_for_hit` as well.
"""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigError
from kvtier.core.geometry import Geometry, Group
from kvtier.core.plan import Plan, hit_unit, make_plan

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BLOCKS = [1, 2, 3, 4, 8, 16, 32, 48, 64, 256]


@st.composite
def groups(draw: st.DrawFn, index: int) -> Group:
    kind = draw(st.sampled_from(["full", "mla", "sliding", "chunked", "state"]))
    cacheable = draw(st.booleans() | st.just(True))
    common = dict(name=f"g{index}", kind=kind, num_layers=draw(st.integers(1, 8)),
                  tokens_per_block=draw(st.sampled_from(BLOCKS)), cacheable=cacheable,
                  reason="" if cacheable else "scratch")
    if kind == "state":
        return Group(**common, state_bytes_per_layer=draw(st.integers(1, 10**6)))
    extra: dict[str, int] = {}
    if kind == "sliding":
        # windows one past a chunk-size multiple catch an off-by-one in "the last W-1 tokens"
        extra["window"] = draw(st.integers(1, 2000) | st.sampled_from([2, 17, 65, 257, 513, 769, 1025]))
    if kind == "chunked":
        extra["attention_chunk"] = draw(st.integers(1, 2000) | st.sampled_from([256, 512, 768, 1024]))
    return Group(**common, bytes_per_token_per_layer=draw(st.integers(1, 4096)), **extra)


@st.composite
def geometries(draw: st.DrawFn) -> Geometry:
    n = draw(st.integers(1, 5))
    return Geometry(tuple(draw(groups(i)) for i in range(n)),
                    tokens_per_hash=draw(st.sampled_from([1, 4, 16, 64])))


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    g = draw(geometries())
    multiple = draw(st.none() | st.integers(1, 4))
    return make_plan(g, chunk_tokens=None if multiple is None else multiple * hit_unit(g))


def needed_tokens(g: Group, t: int) -> range:
    """Token positions a group must have restored so the token at position t can be computed."""
    if g.kind in ("full", "mla"):
        return range(0, t)
    if g.kind == "sliding":
        assert g.window is not None
        return range(max(0, t - (g.window - 1)), t)
    if g.kind == "chunked":
        assert g.attention_chunk is not None
        return range((t // g.attention_chunk) * g.attention_chunk, t)
    raise AssertionError(g.kind)


def oracle_chunks(plan: Plan, gi: int, t: int) -> set[int]:
    g, c = plan.groups[gi].group, plan.chunk_tokens
    if not g.cacheable or t == 0:
        return set()
    if g.is_state:
        return {t // c - 1}  # the checkpoint taken at exactly t is stored with that chunk
    toks = needed_tokens(g, t)
    return set(range(toks.start // c, (toks.stop - 1) // c + 1)) if len(toks) else set()


@SETTINGS
@given(plans())
def test_every_cacheable_group_tiles_a_chunk_and_no_chunk_splits_a_block(plan: Plan) -> None:
    c = plan.chunk_tokens
    assert c % plan.geometry.tokens_per_hash == 0  # chunk boundaries are hash boundaries
    for gp in plan.groups:
        if not gp.cacheable:
            assert gp.blocks_per_chunk is None
            continue
        assert c % gp.group.tokens_per_block == 0
        if gp.group.is_state:
            assert gp.blocks_per_chunk == 1 and gp.chunk_bytes == gp.group.state_bytes
        else:
            assert gp.blocks_per_chunk * gp.group.tokens_per_block == c
            assert gp.chunk_bytes == c * gp.group.bytes_per_token


@SETTINGS
@given(geometries())
def test_the_plan_is_deterministic(g: Geometry) -> None:
    a = make_plan(g)
    b = make_plan(Geometry.from_dict(g.to_dict()))
    assert a == b and a.chunk_tokens >= 256 and a.chunk_tokens % hit_unit(g) == 0
    assert a.chunk_tokens - hit_unit(g) < 256 or a.chunk_tokens == hit_unit(g)


@SETTINGS
@given(geometries(), st.integers(1, 5000))
def test_explicit_chunk_tokens_accepted_exactly_when_every_unit_divides_it(g: Geometry, c: int) -> None:
    ok = c % g.tokens_per_hash == 0 and all(c % x.tokens_per_block == 0 for x in g.cacheable_groups)
    try:
        plan = make_plan(g, chunk_tokens=c)
    except ConfigError as exc:
        assert not ok and "\n" not in str(exc)
    else:
        assert ok and plan.chunk_tokens == c


@SETTINGS
@given(plans(), st.integers(0, 40))
def test_chunks_for_hit_follow_the_rules_and_restore_never_exceeds_naive(plan: Plan, k: int) -> None:
    t = k * plan.chunk_tokens
    for gp in plan.groups:
        got = list(plan.chunks_for_hit(gp.index, t))
        assert set(got) == oracle_chunks(plan, gp.index, t)
        assert len(got) <= k
    assert plan.restore_bytes(t) <= plan.naive_restore_bytes(t)
    assert plan.restore_bytes(t + plan.chunk_tokens - 1) == plan.restore_bytes(t)  # rounds down


@SETTINGS
@given(plans(), st.integers(0, 12), st.data())
def test_best_hit_agrees_with_a_brute_force_oracle(plan: Plan, n_chunks: int, data: st.DataObject) -> None:
    c = plan.chunk_tokens
    prompt = n_chunks * c + data.draw(st.integers(0, c))
    have = {
        (gp.index, i)
        for gp in plan.groups
        for i in range(n_chunks + 1)
        if data.draw(st.floats(0, 1)) < 0.85
    }
    best = plan.best_hit(prompt, lambda g, i: (g, i) in have)
    oracle = 0
    for t in range(0, prompt, c):  # t <= prompt - 1, multiples of C
        if all(oracle_chunks(plan, gp.index, t) <= {i for (g, i) in have if g == gp.index}
               for gp in plan.groups):
            oracle = t
    if not plan.cacheable_groups:
        oracle = 0
    assert best == oracle


@SETTINGS
@given(plans(), st.integers(0, 30 * 256))
def test_store_chunks_are_exactly_the_chunks_some_hit_reads(plan: Plan, num_tokens: int) -> None:
    c = plan.chunk_tokens
    n = num_tokens // c
    for gp in plan.groups:
        read: set[int] = set()
        for k in range(1, n + 1):  # every hit a later prompt could take from this prefix
            read |= oracle_chunks(plan, gp.index, k * c)
        assert plan.store_chunks(gp.index, num_tokens) == sorted(read)
        assert all(i < n for i in read)  # only full chunks


def test_lcm_sanity() -> None:
    g = Geometry((Group("a", "full", 1, 48, bytes_per_token_per_layer=1),
                  Group("b", "state", 1, 64, state_bytes_per_layer=1)), tokens_per_hash=16)
    assert hit_unit(g) == math.lcm(16, 48, 64) == 192
