"""Policy-specific behaviour on hand-derived sequences."""

from __future__ import annotations

from kvtier.index.policies import ARC, FIFO, LRU, S3FIFO

ANY = lambda k: True  # noqa: E731


def test_lru_touch_refreshes():
    p = LRU(3)
    for k in "abc":
        p.insert(k)
    p.touch("a")
    assert p.victim(ANY) == "b"
    p.remove("b")
    p.insert("d")
    assert p.victim(ANY) == "c"  # order now c, a, d


def test_fifo_touch_does_not_refresh():
    p = FIFO(3)
    for k in "abc":
        p.insert(k)
    p.touch("a")
    assert p.victim(ANY) == "a"


def test_arc_adapts_target_on_ghost_hits():
    p = ARC(4)
    for k in "abcd":
        p.insert(k)  # T1 = a b c d
    p.touch("a")
    p.touch("b")  # T1 = c d, T2 = a b, p = 0
    assert p.victim(ANY) == "c"  # |T1| = 2 > p = 0: T1's LRU
    p.remove("c")  # B1 = c
    p.insert("e")  # T1 = d e
    assert p.victim(ANY) == "d"
    p.remove("d")  # B1 = c d
    p.insert("c")  # ghost hit in B1: p = 0 + max(|B2|/|B1| = 0, 1) = 1; c -> T2 = a b c
    assert p.p == 1.0 and list(p.t2) == ["a", "b", "c"] and list(p.b1) == ["d"]
    assert p.victim(ANY) == "a"  # |T1| = 1 is not > p = 1: T2's LRU
    p.remove("a")  # B2 = a
    p.insert("a")  # ghost hit in B2: p = 1 - max(|B1|/|B2| = 1, 1) = 0
    assert p.p == 0.0 and list(p.t2) == ["b", "c", "a"]
    assert p.victim(ANY) == "e"  # |T1| = 1 > p = 0
    # a T1 key that may not go falls back to T2
    assert p.victim(lambda k: k != "e") == "b"


def test_arc_ghost_lists_bounded():
    p = ARC(3)
    for i in range(50):
        if len(p) == 3:
            p.remove(p.victim(ANY))
        p.insert(i)
    assert len(p.t1) + len(p.b1) <= 3
    assert len(p.t1) + len(p.t2) + len(p.b1) + len(p.b2) <= 6


def test_s3fifo_filters_one_hit_wonders():
    p = S3FIFO(10)  # small queue of 1 slot, ghost queue of 9
    p.insert("a")
    assert p.victim(ANY) == "a"  # S is at its share; a was never used again
    p.remove("a")  # a becomes a ghost
    p.insert("a")  # ghost hit: straight into M
    assert list(p.m) == ["a"] and not p.s
    p.insert("b")
    p.touch("b")  # b used once in S
    # S is full: b was used, so it moves to M; S is empty, M's oldest with count 0 goes: a
    assert p.victim(ANY) == "a"
    assert list(p.m) == ["a", "b"] and not p.s
    p.touch("a")  # a: count 1
    # S below its share (0 < 1) and M non-empty: M's oldest a has count 1 -> reinserted with 0
    assert p.victim(ANY) == "b"
    assert list(p.m) == ["b", "a"] and p.m["a"] == 0
    p.remove("b")  # removal from M leaves no ghost
    assert "b" not in p.g


def test_s3fifo_pinned_keys_move_to_tail():
    p = S3FIFO(10)
    p.insert("x")
    p.insert("y")
    assert p.victim(lambda k: k != "x") == "y"
    assert list(p.s) == ["y", "x"]
