"""Eviction by worth (kvtier.index.worth): w = 0 is LRU; w > 0 keeps what saves more compute."""

from __future__ import annotations

import random

from kvtier.index.policies import LRU
from kvtier.index.worth import WorthLRU, WorthWeight, worth_value


def always(key):
    return True


def test_worth_picks_a_different_victim_than_lru():
    # a was stored first and seen once more since (sightings 1: worth 2 against a mean of 1 for
    # new entries: z = 1); b, c, d were stored after a's last use and never seen again.
    value = worth_value("full", lambda t: float(t), 512, lambda k: 0)
    for w, expect in ((0.0, "a"), (1.0, "b")):
        pol = WorthLRU(4, WorthWeight(w), value)
        lru = LRU(4)
        for p in (pol, lru):
            p.insert("a")
            p.touch("a")
            for k in "bcd":
                p.insert(k)
        assert lru.victim(always) == "a"
        # LRU: a (oldest use). Worth: a's priority = its clock 2 + w x z x slots = 2 + 4 = 6,
        # above b's 3, c's 4 and d's 5: b goes first.
        assert pol.victim(always) == expect


def test_state_worth_grows_with_the_prefix_a_hit_saves():
    depth = {"shallow": 0, "deep": 9}.get
    value = worth_value("state", lambda t: t * t + 10.0 * t, 512, lambda k: depth(k, 0))
    assert value("deep", 0) > value("shallow", 0)
    assert value("shallow", 1) == 2 * value("shallow", 0)  # sightings count too
    pol = WorthLRU(2, WorthWeight(1.0), value)
    pol.insert("deep")
    pol.insert("shallow")
    assert pol.victim(always) == "shallow"  # LRU would take "deep"


def test_weight_zero_is_lru_exactly():
    rng = random.Random(3)
    pol, lru = WorthLRU(64, WorthWeight(0.0), lambda k, s: rng.random() * (1 + s)), LRU(64)
    held: set[int] = set()
    for step in range(5000):
        k = rng.randrange(200)
        if k in held:
            pol.touch(k)
            lru.touch(k)
        elif len(held) < 64:
            pol.insert(k)
            lru.insert(k)
            held.add(k)
        else:
            v = pol.victim(always)
            assert v == lru.victim(always), step
            for p in (pol, lru):
                p.remove(v)
            held.discard(v)
        if step % 97 == 0:
            assert pol.victim(lambda x: x % 2 == 0) == lru.victim(lambda x: x % 2 == 0)


def test_heap_stays_bounded():
    pol = WorthLRU(32, WorthWeight(2.0), lambda k, s: 1.0 + s)
    for k in range(32):
        pol.insert(k)
    for i in range(20000):
        pol.touch(i % 32)
        if i % 50 == 0:
            v = pol.victim(always)
            pol.remove(v)
            pol.insert(100000 + i)
    assert len(pol.heap) <= pol.heap_bound == 4 * 32 + 64
    assert len(pol) == 32 and len(pol.sightings) == 32


def test_touches_alone_keep_the_heap_bounded():
    """A pool that is touched but never evicts from (it fits) must not grow its heap either."""
    pol = WorthLRU(32, WorthWeight(2.0), lambda k, s: 1.0 + s)
    for k in range(32):
        pol.insert(k)
    for i in range(10000):
        pol.touch(i % 32)
        assert len(pol.heap) <= pol.heap_bound
