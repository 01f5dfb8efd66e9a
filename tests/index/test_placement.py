"""kvtier.index.placement: admission where hits land (endpoints learned online, bounded)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.core.geometry import Geometry, Group
from kvtier.core.plan import make_plan
from kvtier.index.branches import BranchTree
from kvtier.index.placement import COLD, WARM, HitsLand


def hybrid():
    g = Geometry((Group("full", "full", 1, 16, bytes_per_token_per_layer=2),
                  Group("swa", "sliding", 1, 16, bytes_per_token_per_layer=2, window=600),
                  Group("ssm", "state", 1, 16, state_bytes_per_layer=64)), 16)
    return make_plan(g, chunk_tokens=512)


def test_anchors_warm_state_warm_at_the_end_cold_elsewhere():
    h = HitsLand(hybrid())
    chunks = [1, 2, 3, 4, 5]
    assert h.admit(chunks, 0) == (WARM,) * 5
    # before warm-up: the last two chunks are endpoints (offsets 0 and 1)
    assert h.admit(chunks, 2) == (COLD, COLD, COLD, WARM, WARM)
    # a sliding window of 600 tokens reads the chunk before each endpoint too
    assert h.admit(chunks, 1) == (COLD, COLD, WARM, WARM, WARM)
    assert h.admit(chunks, 2, n=2) == (COLD, COLD)  # endpoints past the admitted chunks: none


def test_branch_points_are_warm():
    h = HitsLand(hybrid())
    h.learn([1, 2, 3, 4, 5, 6])
    ends = h.learn([1, 2, 9, 10, 11, 12])  # branches at node 2 (index 1)
    assert ends == {1, 4, 5}


def test_end_offsets_are_learned_from_follow_ups():
    h = HitsLand(hybrid(), warmup=8)
    for r in range(40):  # multi-turn: each turn repeats all but the previous prompt's last chunk
        base = [10_000 * r + i for i in range(4)]
        h.learn(base + [10_000 * r + 100])
        h.learn(base + [10_000 * r + 200, 10_000 * r + 201])
    # the seen prefix of each follow-up ended 1 chunk before the earlier request's end
    assert h.offsets() == (1,)
    assert h.learn([7, 8, 9, 10]) == {2}
    assert h.admit([7, 8, 9, 10], 2) == (COLD, COLD, WARM, COLD)
    for r in range(20):  # some follow-ups branch 2 chunks before the end: 20 of 80, >= 0.25 x 80
        base = [900_000 + 10_000 * r + i for i in range(4)]
        h.learn(base)
        h.learn(base[:2] + [900_000 + 10_000 * r + 50])
    assert h.offsets() == (1, 2)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=12), min_size=1, max_size=60))
def test_memory_is_bounded(requests):
    h = HitsLand(hybrid(), tree_nodes=32)
    for req in requests:
        chain, x = [], 0
        for v in req:  # chained ids: a prefix names itself
            x = x * 51 + v + 1
            chain.append(x)
        h.learn(chain)
        assert len(h.tree.nodes) <= 32
        assert h.memory_bytes <= HitsLand.max_memory_bytes(32)


def test_tree_marks_ends_of_old_nodes():
    t = BranchTree(100)
    t.insert([1, 2, 3, 4])
    assert [t.end_offset(x) for x in (1, 2, 3, 4)] == [3, 2, 1, 0]
    t.insert([1, 2])  # a shorter request ends at 2
    assert t.end_offset(2) == 0 and t.end_offset(9) == 8
