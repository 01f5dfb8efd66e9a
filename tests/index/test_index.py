"""kvtier.index.index: per-group pools, hits, reservations, pins, dead-first eviction, rebuild."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.core.geometry import Geometry, Group
from kvtier.index.index import Index
from kvtier.core.plan import make_plan

C = 32  # chunk tokens in these tests


def gptoss_like(window: int = 48):
    """A full group and a sliding group (window 48 -> a hit reads the last 2 chunks)."""
    g = Geometry(
        groups=(
            Group("full", "full", 2, 16, bytes_per_token_per_layer=4),
            Group("swa", "sliding", 2, 16, bytes_per_token_per_layer=4, window=window),
        ),
        tokens_per_hash=16,
    )
    return make_plan(g, chunk_tokens=C)  # chunk_bytes = 32 * 8 = 256 per group


def put_all(ix, hashes, groups=(0, 1), tier="cpu"):
    for g in groups:
        for h in hashes:
            r = ix.put(h, g, tier)
            assert r.status in ("reserved", "present")


def test_eight_equal_groups_hold_sixteen_payloads_not_two():
    groups = tuple(Group(f"g{i}", "full", 1, 16, bytes_per_token_per_layer=2) for i in range(8))
    plan = make_plan(Geometry(groups=groups, tokens_per_hash=16), chunk_tokens=C)
    payload = plan.groups[0].chunk_bytes
    ix = Index(plan, {"cpu": 16 * payload})
    assert [ix.slots(g, "cpu") for g in range(8)] == [2] * 8
    put_all(ix, ["a", "b"], groups=range(8))
    held = sum(ix.contains(h, g) for h in "ab" for g in range(8))
    assert held == 16
    assert ix.lookup(["a", "b"], 2 * C + 1).tokens == 2 * C
    # the same bytes under row-per-key accounting (each key reserves all groups' bytes)
    rows = Index(plan, {"cpu": 64 * payload}, share="row-per-key")
    assert sum(rows.slots(g, "cpu") for g in range(8)) == 8
    assert sum(Index(plan, {"cpu": 64 * payload}).slots(g, "cpu") for g in range(8)) == 64


def test_share_rules():
    plan = gptoss_like()
    assert Index(plan, {"cpu": 10 * 512}).slots(0, "cpu") == 10
    ix = Index(plan, {"cpu": 10 * 512}, share={"full": 0.8, "swa": 0.2})
    assert (ix.slots(0, "cpu"), ix.slots(1, "cpu")) == (16, 4)
    with pytest.raises(ConfigError, match="missing"):
        Index(plan, {"cpu": 5120}, share={"full": 1.0})
    with pytest.raises(ConfigError, match="sum to 1.200"):
        Index(plan, {"cpu": 5120}, share={"full": 0.8, "swa": 0.4})
    with pytest.raises(ConfigError, match="unknown share rule 'fair'"):
        Index(plan, {"cpu": 5120}, share="fair")


def test_construction_errors():
    plan = gptoss_like()
    with pytest.raises(ConfigError, match="tier 'cpu' has capacity 0 bytes"):
        Index(plan, {"cpu": 0})
    with pytest.raises(ConfigError, match="less than one chunk .256 bytes.*at least 512 bytes"):
        Index(plan, {"cpu": 300})
    with pytest.raises(ConfigError, match="unknown eviction policy 'mru'"):
        Index(plan, {"cpu": 4096}, policy="mru")
    with pytest.raises(ConfigError, match="no tiers"):
        Index(plan, {})


def test_hit_needs_full_prefix_and_sliding_window_chunks():
    ix = Index(gptoss_like(), {"cpu": 8 * 512})
    hs = ["h0", "h1", "h2", "h3"]
    put_all(ix, hs, groups=(0,))
    ix.put("h3", 1, "cpu")
    # T=128 needs swa chunks 2,3 (tokens 81..127); T=96 needs 1,2; T=64 needs 0,1; T=32 needs 0
    assert ix.lookup(hs, 4 * C + 1).tokens == 0
    ix.put("h2", 1, "cpu")
    hit = ix.lookup(hs, 4 * C + 1)
    assert hit.tokens == 128
    assert [ld.chunk_index for ld in hit.chunks[0]] == [0, 1, 2, 3]
    assert [ld.chunk_index for ld in hit.chunks[1]] == [2, 3]
    # at most prompt_tokens - 1: a 128-token prompt may hit 96 at most, which needs swa 1,2
    assert ix.lookup(hs, 128).tokens == 0
    ix.put("h1", 1, "cpu")
    assert ix.lookup(hs, 128).tokens == 96
    # a prompt that diverges after chunk 1 hits what it shares, if the window is there: swa has
    # h1, h2, h3 but not h0, and T=64 needs swa chunks 0 and 1
    assert ix.lookup(["h0", "h1", "x2"], 3 * C + 1).tokens == 0
    ix.put("h0", 1, "cpu")
    assert ix.lookup(["h0", "h1", "x2"], 3 * C + 1).tokens == 64


def test_highest_tier_wins_and_mixed_tiers():
    ix = Index(gptoss_like(), {"cpu": 4 * 512, "disk": 8 * 512})
    put_all(ix, ["a", "b"], tier="disk")
    put_all(ix, ["a"], groups=(0,), tier="cpu")
    hit = ix.lookup(["a", "b"], 2 * C + 1)
    assert hit.tokens == 64
    assert [(ld.chunk_index, ld.tier) for ld in hit.chunks[0]] == [(0, "cpu"), (1, "disk")]
    assert [(ld.chunk_index, ld.tier) for ld in hit.chunks[1]] == [(0, "disk"), (1, "disk")]


def test_reserve_commit_abort_and_present():
    ix = Index(gptoss_like(), {"cpu": 2 * 512})
    r = ix.reserve("a", 0, "cpu")
    assert (r.status, r.slot, r.evicted) == ("reserved", 0, ())
    assert not ix.contains("a", 0) and ix.lookup(["a"], C + 1).tokens == 0
    assert ix.reserve("a", 0, "cpu").status == "present"
    ix.abort("a", 0, "cpu")
    assert ix.used(0, "cpu") == 0
    r = ix.reserve("a", 0, "cpu")
    ix.commit("a", 0, "cpu")
    assert ix.contains("a", 0, "cpu") and ix.where("a", 0) == [("cpu", r.slot)]
    with pytest.raises(ConfigError, match="without a reservation"):
        ix.commit("a", 0, "cpu")
    with pytest.raises(ConfigError, match="not a cacheable group"):
        ix.reserve("a", 5, "cpu")
    with pytest.raises(ConfigError, match="unknown tier 'ssd'"):
        ix.reserve("a", 0, "ssd")


def test_eviction_reports_victim_and_reuses_its_slot():
    ix = Index(gptoss_like(), {"cpu": 2 * 512}, policy="lru")
    put_all(ix, ["a", "b"], groups=(0,))
    ix.lookup(["a"], C + 1)  # "a" is not a hit for group 1, so no tokens; nothing touched
    ix.touch("a", 0, "cpu")  # now b is the LRU of group 0
    slot_b = ix.where("b", 0)[0][1]
    r = ix.reserve("c", 0, "cpu")
    assert r.status == "reserved" and r.slot == slot_b
    assert [(e.chunk_hash, e.group, e.tier, e.slot, e.dead) for e in r.evicted] == [("b", 0, "cpu", slot_b, False)]
    assert ix.counters(0, "cpu")["evictions"] == 1


def test_pins_block_eviction_and_remove_waits_for_unpin():
    ix = Index(gptoss_like(), {"cpu": 2 * 512})
    put_all(ix, ["a", "b"])
    hit = ix.lookup(["a", "b"], 2 * C + 1)
    assert hit.tokens == 64 and ix.pin_hit(hit)
    assert ix.reserve("c", 0, "cpu").status == "full"
    assert ix.counters(0, "cpu")["full"] == 1
    slot_a = ix.where("a", 0)[0][1]
    assert ix.remove("a", 0, "cpu")  # corrupt payload found while a load reads it
    assert not ix.contains("a", 0)  # hidden at once
    assert ix.reserve("a", 0, "cpu").status == "busy"
    ix.unpin_hit(hit)  # the last unpin frees a's slot
    r = ix.reserve("c", 0, "cpu")
    assert r.slot == slot_a and r.evicted == ()
    with pytest.raises(ConfigError, match="not pinned"):
        ix.unpin("b", 0, "cpu")


def test_pin_hit_is_all_or_nothing():
    ix = Index(gptoss_like(), {"cpu": 2 * 512})
    put_all(ix, ["a", "b"])
    hit = ix.lookup(["a", "b"], 2 * C + 1)
    ix.remove("b", 1, "cpu")
    assert not ix.pin_hit(hit)
    assert ix.reserve("x", 0, "cpu").status == "reserved"  # nothing left pinned: a and b evictable


def test_dead_sliding_chunk_goes_before_useful_data():
    ix = Index(gptoss_like(), {"cpu": 2 * 512}, policy="lru")
    put_all(ix, ["b"])  # b is older than a in both pools
    put_all(ix, ["a"])
    ix.remove("a", 0, "cpu")  # the full group lost a: no hit can read swa's a any more
    r = ix.reserve("c", 1, "cpu")
    assert [(e.chunk_hash, e.dead) for e in r.evicted] == [("a", True)]  # LRU alone would take b
    assert ix.counters(1, "cpu")["dead_evictions"] == 1
    assert ix.counters(1, "cpu")["evictions"] == 0


def test_dead_entry_revives_when_its_anchor_returns():
    ix = Index(gptoss_like(), {"cpu": 2 * 512}, policy="lru")
    put_all(ix, ["b"])
    put_all(ix, ["a"])
    ix.remove("a", 0, "cpu")  # swa's a is dead ...
    ix.put("a", 0, "cpu")  # ... and alive again (group 0 had a free slot: nothing evicted)
    assert ix.contains("b", 0)
    ix.touch("b", 1, "cpu")  # swa LRU order: a, b
    r = ix.put("x", 0, "cpu")  # group 0 full (b, a): LRU evicts b, so swa's b is dead
    assert [e.chunk_hash for e in r.evicted] == ["b"]
    r = ix.reserve("c", 1, "cpu")
    assert [(e.chunk_hash, e.dead) for e in r.evicted] == [("b", True)]  # LRU alone: a


def test_dead_rule_spans_tiers():
    ix = Index(gptoss_like(), {"cpu": 2 * 512, "disk": 2 * 512}, policy="lru")
    put_all(ix, ["b", "a"])
    ix.put("a", 0, "disk")
    ix.remove("a", 0, "cpu")  # the full group still holds a on disk: swa's a stays alive
    ix.put("c", 0, "cpu")  # into a's freed slot
    r = ix.put("c", 1, "cpu")
    assert [(e.chunk_hash, e.dead) for e in r.evicted] == [("b", False)]  # plain LRU
    ix.touch("a", 1, "cpu")  # swa LRU order: c, a
    ix.remove("a", 0, "disk")  # now no tier holds the full group's a
    r = ix.reserve("d", 1, "cpu")
    assert [(e.chunk_hash, e.dead) for e in r.evicted] == [("a", True)]


def test_rebuild_restores_entries_and_refuses_conflicts():
    plan = gptoss_like()
    ix = Index(plan, {"disk": 4 * 512})
    rejected = ix.rebuild([
        ("a", 0, "disk", 2), ("a", 1, "disk", 0), ("b", 0, "disk", 2),  # slot 2 taken
        ("c", 0, "disk", 9), ("a", 0, "disk", 1), ("d", 0, "ssd", 0),
    ])
    assert [(e.chunk_hash, e.group, e.tier, e.slot) for e in rejected] == [
        ("b", 0, "disk", 2), ("c", 0, "disk", 9), ("a", 0, "disk", 1), ("d", 0, "ssd", 0)]
    assert ix.where("a", 0) == [("disk", 2)] and ix.where("a", 1) == [("disk", 0)]
    assert ix.lookup(["a"], C + 1).tokens == 32
    slots = {ix.reserve(h, 0, "disk").slot for h in "xyz"}
    assert slots == {0, 1, 3}
    r = ix.reserve("w", 0, "disk")  # x, y, z are reserved (pinned): only a may go
    assert r.slot == 2 and [e.chunk_hash for e in r.evicted] == ["a"]
    assert ix.reserve("v", 0, "disk").status == "full"


def test_cold_entries_go_after_dead_and_before_the_policy():
    ix = Index(gptoss_like(), {"cpu": 3 * 512}, policy="lru")
    put_all(ix, ["a", "b"], groups=(0,))
    ix.put("a", 1, "cpu")
    ix.put("b", 1, "cpu", cold=True)  # newer than a, but cold
    ix.put("c", 1, "cpu")  # dead at once: group 0 has no c
    assert ix.stats()["tiers"]["cpu"]["groups"]["swa"]["cold"] == 1
    r = ix.put("d", 1, "cpu")
    assert [(e.chunk_hash, e.dead) for e in r.evicted] == [("c", True)]  # dead first
    r = ix.put("e", 1, "cpu")
    assert [(e.chunk_hash, e.dead) for e in r.evicted] == [("d", True)]  # d is dead too
    ix.put("e", 0, "cpu")  # group 0: a b e; swa: a b(cold) e
    r = ix.put("f", 0, "cpu")  # evicts a from group 0 (LRU): swa's a is now dead
    assert [e.chunk_hash for e in r.evicted] == ["a"]
    ix.put("f", 1, "cpu")  # swa: dead a goes before cold b
    assert ix.contains("b", 1) and not ix.contains("a", 1)
    ix.put("g", 0, "cpu")  # evicts b from group 0 -> swa's b is dead and cold
    ix.touch("e", 1, "cpu")
    assert ix.touch("b", 1, "cpu")  # a touch warms a cold entry (it stays dead here)
    assert ix.stats()["tiers"]["cpu"]["groups"]["swa"]["cold"] == 0


def test_cold_entry_is_evicted_before_warm_ones():
    ix = Index(gptoss_like(), {"cpu": 3 * 512}, policy="lru")
    put_all(ix, ["a", "b", "c"], groups=(0,))
    ix.put("a", 1, "cpu")
    ix.put("b", 1, "cpu", cold=True)
    ix.put("c", 1, "cpu")  # swa LRU order a, b, c; b is cold
    r = ix.put("d", 1, "cpu")  # (d itself is dead: group 0 has no d)
    assert [(e.chunk_hash, e.dead) for e in r.evicted] == [("b", False)]  # cold b, not LRU's a
    r = ix.put("e", 1, "cpu")
    assert [(e.chunk_hash, e.dead) for e in r.evicted] == [("d", True)]


def test_pinned_cold_entry_is_not_evicted():
    ix = Index(gptoss_like(), {"cpu": 1 * 512}, policy="lru")
    ix.put("a", 0, "cpu", cold=True)
    assert ix.pin("a", 0, "cpu")
    assert ix.put("b", 0, "cpu").status == "full"
    ix.unpin("a", 0, "cpu")
    assert [e.chunk_hash for e in ix.put("b", 0, "cpu").evicted] == ["a"]


def test_commit_cold():
    ix = Index(gptoss_like(), {"cpu": 2 * 512}, policy="lru")
    ix.put("a", 0, "cpu")
    ix.reserve("b", 0, "cpu")
    ix.commit("b", 0, "cpu", cold=True)  # newer than a, but cold: it goes first
    assert [e.chunk_hash for e in ix.put("c", 0, "cpu").evicted] == ["b"]
