"""Resizable pools (`Index.resize`), the learned share (kvtier.index.share) and the victim side
of coordinated eviction (`Index.victim`, `Index.demote`, endpoint orphans)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.core.geometry import Geometry, Group
from kvtier.core.plan import make_plan
from kvtier.errors import ConfigError
from kvtier.index.index import Index
from kvtier.index.share import LearnedShare


def hybrid(state_bytes: int = 1024):
    g = Geometry((Group("full", "full", 1, 16, bytes_per_token_per_layer=2),
                  Group("ssm", "state", 1, 16, state_bytes_per_layer=state_bytes)), 16)
    return make_plan(g, chunk_tokens=512)  # full 1024 B a chunk, ssm `state_bytes` a checkpoint


def three():
    g = Geometry((Group("full", "full", 1, 16, bytes_per_token_per_layer=2),
                  Group("swa", "sliding", 1, 16, bytes_per_token_per_layer=2, window=128),
                  Group("ssm", "state", 1, 16, state_bytes_per_layer=1024)), 16)
    return make_plan(g, chunk_tokens=512)


def filled(n: int = 6, slots: int = 8) -> Index:
    ix = Index(hybrid(), {"cpu": slots * 2048})
    for h in range(1, n + 1):
        ix.put(h, 0, "cpu")
        ix.put(h, 1, "cpu")
    return ix


def test_shrink_evicts_cold_then_least_recent_and_relocates_the_rest_below():
    ix = filled()
    ix.demote(2, 1, "cpu")
    ix.touch(1, 1, "cpu")  # recency, oldest first: 3, 4, 5, 6, 1 (2 is cold)
    r = ix.resize(1, "cpu", 4)
    assert r.slots == 4 and ix.slots(1, "cpu") == 4
    assert [e.chunk_hash for e in r.evicted] == [2, 3]
    held = {h: ix.where(h, 1)[0][1] for h in (1, 4, 5, 6)}
    assert all(s < 4 for s in held.values()) and len(set(held.values())) == 4
    assert {(m.chunk_hash, m.to_slot) for m in r.moved} <= set(held.items())
    assert all(m.from_slot >= 4 for m in r.moved) and r.moved
    # the pool works on: a new entry evicts, the slot stays below 4
    res = ix.put(7, 1, "cpu")
    assert res.slot is not None and res.slot < 4 and len(res.evicted) == 1


def test_shrink_never_moves_or_evicts_a_pinned_entry():
    ix = filled()
    slot = ix.where(6, 1)[0][1]
    assert slot == 5 and ix.pin(6, 1, "cpu")
    r = ix.resize(1, "cpu", 2)
    assert r.slots == 6  # slot 5 is pinned in place
    assert ix.where(6, 1) == [("cpu", 5)]
    assert 6 not in {e.chunk_hash for e in r.evicted}
    ix.unpin(6, 1, "cpu")


def test_grow_gives_new_slots_without_evicting():
    ix = filled(n=8)
    assert ix.resize(1, "cpu", 10).slots == 10
    for h in (9, 10):
        r = ix.put(h, 1, "cpu")
        assert r.status == "reserved" and r.evicted == ()
    assert ix.used(1, "cpu") == 10
    with pytest.raises(ConfigError, match="positive number of slots"):
        ix.resize(1, "cpu", 0)


def drive(ix: Index, requests: int, chunks: int, seed: int = 0) -> None:
    """Per request: `chunks` new full chunks warm, the state checkpoint warm at the last one only
    and cold elsewhere (placement where hits land)."""
    for r in range(requests):
        base = (seed + 1) * 1_000_000 + r * 100
        for i in range(chunks):
            ix.put(base + i, 0, "cpu")
        for i in range(chunks):
            ix.put(base + i, 1, "cpu", cold=i != chunks - 1)
        ix.observe()


def test_learned_share_equalises_warm_lifetimes():
    plan = hybrid(state_bytes=4096)  # ssm 4096 B, full 1024 B a chunk: proportional = 80% ssm
    ix = Index(plan, {"cpu": 200 * 5120}, share="learned")
    assert ix.learners[0].shares() == pytest.approx({0: 0.2, 1: 0.8}, abs=0.01)
    drive(ix, 3000, chunks=8)
    # warm bytes a request: full 8 x 1024, ssm 1 x 4096: ssm's lifetime-equal share is 1/3
    assert ix.learners[0].shares() == pytest.approx({0: 2 / 3, 1: 1 / 3}, abs=0.02)


def test_learned_share_never_goes_below_the_floor():
    ix = Index(hybrid(state_bytes=4096), {"cpu": 200 * 5120}, share="learned")
    for r in range(2000):  # nothing warm in ssm at all: its target is 0
        for i in range(4):
            ix.put(r * 10 + i, 0, "cpu")
            ix.put(r * 10 + i, 1, "cpu", cold=True)
        ix.observe()
    learner = ix.learners[0]
    assert ix.slots(1, "cpu") == learner.floor_slots[1] == 20  # 0.1 x 200 proportional slots
    assert ix.slots(0, "cpu") == (200 * 5120 - 20 * 4096) // 1024


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(0, 12), st.booleans()), min_size=1,
                max_size=300), st.integers(3, 40))
def test_learned_share_stays_within_the_tier_and_every_entry_in_its_pool(requests, rows):
    plan = hybrid(state_bytes=3072)
    capacity = rows * 4096 + 123
    ix = Index(plan, {"cpu": capacity}, share="learned")
    learner = ix.learners[0]
    learner.period = 4
    memory = learner.memory_bytes
    pinned: list[int] = []
    for r, (n, warm_at, pin) in enumerate(requests):
        for i in range(n):
            h = r * 100 + i
            ix.put(h, 0, "cpu")
            ix.put(h, 1, "cpu", cold=i != min(warm_at, n - 1))
        if pin and ix.pin(r * 100, 1, "cpu"):
            pinned.append(r * 100)
        if len(pinned) > 2:
            ix.unpin(pinned.pop(0), 1, "cpu")
        ix.observe()
        held = sum(ix.slots(g, "cpu") * plan.groups[g].chunk_bytes for g in (0, 1))
        assert held <= capacity or pinned  # a pinned entry may hold a pool above its target
        for g in (0, 1):
            assert ix.slots(g, "cpu") >= learner.floor_slots[g]
            assert ix.used(g, "cpu") <= ix.slots(g, "cpu")
            pool = ix._pool(g, "cpu")
            assert all(rec.slot < pool.num_slots for rec in pool.recs.values())
        assert learner.memory_bytes == memory  # 4 numbers per group, whatever the traffic
    for h in pinned:
        assert ix.contains(h, 1)


def test_learned_share_options_are_checked():
    with pytest.raises(ConfigError, match="step"):
        LearnedShare(Index(hybrid(), {"cpu": 1 << 20}), "cpu", step=0)


def test_evicting_a_checkpoint_demotes_the_other_groups_entry_at_that_endpoint():
    plan = three()  # full, swa (window 128: a hit reads one chunk), ssm: 1024 B each
    ix = Index(plan, {"cpu": 3 * 3072})  # 3 slots a group
    for h in (1, 2, 3):
        for g in (0, 1, 2):
            ix.put(h, g, "cpu")
    assert ix.victim(1, "cpu").chunk_hash == 1  # swa: least recent first
    ix.touch(1, 1, "cpu")  # swa 1 is now the most recent
    ix.touch(1, 0, "cpu")
    assert ix.victim(2, "cpu").chunk_hash == 1
    ix.resize(2, "cpu", 2)  # ssm 1 goes: no hit can end at chunk 1 any more
    assert not ix.contains(1, 2)
    # swa's entry at 1 was stored for that endpoint: it goes first now, although most recent
    assert ix.victim(1, "cpu").chunk_hash == 1
    assert ix.victim(0, "cpu").chunk_hash == 2  # the anchor serves longer hits: untouched


def test_victim_and_demote():
    ix = filled(n=3, slots=3)
    assert ix.victim(0, "cpu").chunk_hash == 1
    assert ix.demote(3, 0, "cpu") and ix.victim(0, "cpu").chunk_hash == 3
    assert not ix.demote(99, 0)
    ix.touch(3, 0, "cpu")  # a touch warms it again
    assert ix.victim(0, "cpu").chunk_hash == 1
    assert ix.put(4, 0, "cpu").evicted[0].chunk_hash == 1


def test_learned_share_leaves_no_bytes_empty_while_another_pool_evicts():
    """A full pool still filling (slowly: its stores a period below `step`) keeps at most what it
    holds plus `step`; the state pool's cold entries keep the rest (moving bytes by warm rate alone
    would shrink the state pool to 1/3 and evict them while the full pool sat on empty slots)."""
    ix = Index(hybrid(state_bytes=1024), {"cpu": 4000 * 2048}, share="learned")  # 4000 slots each
    for r in range(1800):  # full: 2 chunks warm; ssm: the last warm, the first cold
        for i in (0, 1):
            ix.put(r * 10 + i, 0, "cpu")
        ix.put(r * 10, 1, "cpu", cold=True)
        ix.put(r * 10 + 1, 1, "cpu")
        ix.observe()
    assert ix.used(0, "cpu") == ix.used(1, "cpu") == 3600  # nothing evicted
    assert ix.counters(1, "cpu")["evictions"] == 0
    for r in range(1800, 4000):  # the full pool fills: bytes move by warm rate again (2/3 full)
        for i in (0, 1):
            ix.put(r * 10 + i, 0, "cpu")
        ix.put(r * 10, 1, "cpu", cold=True)
        ix.put(r * 10 + 1, 1, "cpu")
        ix.observe()
    assert ix.learners[0].shares()[0] == pytest.approx(2 / 3, abs=0.02)


def test_learned_share_moves_nothing_while_every_pool_has_room():
    """Bytes moved while every pool still has empty slots serve no hit and cost resizes (in vLLM,
    moves and page releases): with every pool filling slowly the share stays where it started."""
    ix = Index(hybrid(state_bytes=1024), {"cpu": 100_000 * 2048}, share="learned")
    learner = ix.learners[0]
    start = learner.shares()
    for r in range(640):  # ten periods, two warm full chunks and one warm checkpoint a request
        for i in (0, 1):
            ix.put(r * 10 + i, 0, "cpu")
        ix.put(r * 10 + 1, 1, "cpu")
        ix.observe()
    assert learner.moves == 0 and learner.shares() == start
