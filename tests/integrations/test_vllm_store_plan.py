"""Which tiers take a prepare_store call (the store plan in kvtier.integrations.vllm.manager):
vLLM's all-or-nothing rule on a real kvtier Index, without an engine."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier.core.geometry import Geometry, Group  # noqa: E402
from kvtier.core.plan import make_plan  # noqa: E402
from kvtier.index.index import Index  # noqa: E402
from kvtier.integrations.vllm.manager import chunks_to_store, plan_store, protect, reserve  # noqa: E402

TIERS = ("cpu", "disk")


def _index(cpu_slots: int, disk_slots: int, groups: int = 1) -> Index:
    geometry = Geometry(groups=tuple(Group(f"g{i}", "full", 1, 16, bytes_per_token_per_layer=2)
                                     for i in range(groups)), tokens_per_hash=16)
    plan = make_plan(geometry, chunk_tokens=32)
    per_group = plan.groups[0].chunk_bytes * groups
    return Index(plan, {"cpu": cpu_slots * per_group, "disk": disk_slots * per_group})


def _hold(ix: Index, *chunks: tuple[bytes, int], tiers: tuple[str, ...] = TIERS) -> None:
    for h, g in chunks:
        for tier in tiers:
            assert ix.put(h, g, tier).status == "reserved"


def _store(ix: Index, todo: list) -> tuple[object, dict, list]:
    """One prepare_store: plan under protection, then reserve; (plan, places, evicted entries)."""
    evicted: list = []
    with protect(ix, [c for _, c in todo]):
        plan = plan_store(ix, TIERS, todo)
        places: dict = {}
        for key, tier, slot, gone in ([] if plan.refused else reserve(ix, plan)):
            evicted.extend(gone)
            places.setdefault(key, []).append((tier, slot))
    return plan, places, evicted


def test_chunks_to_store_skips_unknown_pending_and_repeated_chunks() -> None:
    split = {"a": (b"A", 0), "a2": (b"A", 0), "b": (b"B", 0), "x": None, "p": (b"P", 0)}
    todo = chunks_to_store([(k, split.get(k)) for k in ("a", "x", "p", "a2", "b")], {"p"})
    assert todo == [("a", (b"A", 0)), ("b", (b"B", 0))]


def test_a_tier_that_cannot_take_every_new_chunk_takes_none_and_evicts_nothing() -> None:
    ix = _index(cpu_slots=2, disk_slots=8)
    _hold(ix, (b"old1", 0), (b"old2", 0), tiers=("cpu",))
    todo = [(k, (k.encode(), 0)) for k in ("a", "b", "c")]
    plan, places, evicted = _store(ix, todo)
    assert plan.taking == ("disk",) and not plan.refused
    assert plan.skipped == {("cpu", 0): 3}
    assert all(p == [("disk", p[0][1])] for p in places.values()) and set(places) == {"a", "b", "c"}
    assert evicted == [] and ix.contains(b"old1", 0, "cpu") and ix.contains(b"old2", 0, "cpu")


def test_all_or_nothing_counts_every_group_of_the_call() -> None:
    # cpu has room for group 0's two chunks but not group 1's three: cpu takes neither group
    ix = _index(cpu_slots=2, disk_slots=8, groups=2)
    todo = [("a0", (b"a", 0)), ("b0", (b"b", 0)), ("a1", (b"a", 1)), ("b1", (b"b", 1)), ("c1", (b"c", 1))]
    plan, places, _ = _store(ix, todo)
    assert plan.taking == ("disk",)
    assert plan.skipped == {("cpu", 0): 2, ("cpu", 1): 3}
    assert not any(ix.has_record(h, g, "cpu") for _, (h, g) in todo)


def test_a_chunk_given_in_the_call_is_never_the_victim() -> None:
    ix = _index(cpu_slots=2, disk_slots=8)
    _hold(ix, (b"A", 0), (b"B", 0), tiers=("cpu",))  # A is the least recently used
    todo = [("a", (b"A", 0)), ("c", (b"C", 0))]
    plan, places, evicted = _store(ix, todo)
    assert plan.new["cpu"] == [("c", (b"C", 0))]  # A is held there: not new
    assert [e.chunk_hash for e in evicted if e.tier == "cpu"] == [b"B"]
    assert ix.contains(b"A", 0, "cpu") and not ix.contains(b"B", 0, "cpu")
    assert ix.pin(b"A", 0, "cpu")  # unpinned again after the call: a pin takes
    # the control: without protection the same call evicts A, the chunk it was given
    ix2 = _index(cpu_slots=2, disk_slots=8)
    _hold(ix2, (b"A", 0), (b"B", 0), tiers=("cpu",))
    got: list = []
    for _, _, _, gone in reserve(ix2, plan_store(ix2, TIERS, todo)):
        got.extend(gone)
    assert [e.chunk_hash for e in got if e.tier == "cpu"] == [b"A"]


def test_no_tier_taking_the_new_chunks_refuses_the_call() -> None:
    ix = _index(cpu_slots=1, disk_slots=1)
    _hold(ix, (b"A", 0))
    for tier in TIERS:
        assert ix.pin(b"A", 0, tier)  # a load in flight: nothing to evict
    plan, places, evicted = _store(ix, [("b", (b"B", 0))])
    assert plan.refused and plan.taking == () and places == {} and evicted == []
    assert plan.skipped == {("cpu", 0): 1, ("disk", 0): 1}
    # nothing new is no refusal: every given chunk is held already
    assert not plan_store(ix, TIERS, [("a", (b"A", 0))]).refused


def test_a_new_chunk_is_reserved_in_every_tier_that_takes_the_call_in_tier_order() -> None:
    ix = _index(cpu_slots=2, disk_slots=2)
    _hold(ix, (b"A", 0), tiers=("disk",))
    plan, places, _ = _store(ix, [("a", (b"A", 0)), ("b", (b"B", 0))])
    assert plan.taking == TIERS
    assert [t for t, _ in places["a"]] == ["cpu"]  # disk holds A already
    assert [t for t, _ in places["b"]] == ["cpu", "disk"]
    assert ix.has_record(b"B", 0, "cpu") and ix.has_record(b"B", 0, "disk")
    # a reserved chunk is not new to that tier in a later call
    assert plan_store(ix, TIERS, [("b", (b"B", 0))]).new == {"cpu": [], "disk": []}
