"""`adaptive` admission (miniature simulations of candidate rules) on hand-made sequences."""

from __future__ import annotations

import json

import pytest

from kvtier.index.admission import AdaptiveAdmission, make_admission
from kvtier.errors import ConfigError
from kvtier.core.geometry import Geometry, Group
from kvtier.core.plan import make_plan
from kvtier.replay.run import replay
from kvtier.replay.trace import load_trace


# a = 1, x1..x4 = 11..14, b = 2, c = 3
HAND = [[1], [1], [11, 12], [1], [13, 14], [2], [2], [3]]


def test_follows_the_candidate_whose_miniature_hit_most_by_hand():
    # candidates all and nth:2, miniatures of 2 slots, every chunk simulated (sample=1),
    # scores fade by 1 - 1/4 = 0.75 per chunk seen. Scores [all, nth:2], the choice is made
    # before each request from the scores after the previous one:
    a = AdaptiveAdmission(horizon=2, sample=1, window=4, candidates=("all", "nth:2"))
    got = [a.admit(r) for r in HAND]
    # r1 [a]   all: miss, stores a          nth: first sighting, stores nothing  [0, 0]    -> all: 1
    # r2 [a]   all: hit                     nth: miss, stores a (2nd sighting)    [1, 0]    -> all: 1
    # r3 [x1 x2] all: stores both, evicts a nth: nothing                          [.5625, 0] -> all: 2
    # r4 [a]   all: miss (evicted)          nth: hit                              [.42, 1]  -> all: 1
    # r5 [x3 x4] now nth:2 is followed: first sightings, nothing admitted         [.24, .56] -> 0
    # r6 [b]   nth: first sighting                                                [.18, .42] -> 0
    # r7 [b]   nth: second sighting, admitted; all's miniature hits b             [1.13, .32] -> 1
    # r8 [c]   all is followed again                                                          -> 1
    assert got == [1, 1, 2, 1, 0, 0, 1, 1]
    assert a.chosen == [5, 3]  # r1-r4 and r8 by all, r5-r7 by nth:2
    assert a.scores[0] == pytest.approx((0.421875 * 0.5625 * 0.75 * 0.75 + 1) * 0.75)  # r8: c missed
    assert a.current == 0


def test_keeps_the_current_choice_on_a_tie():
    # nothing ever hits: every score stays 0, so the first candidate answers throughout
    a = AdaptiveAdmission(horizon=4, sample=1, candidates=("nth:2", "all"))
    assert [a.admit([i, i + 1]) for i in range(0, 20, 2)] == [0] * 10
    assert a.current == 0


def test_sampling_and_memory_as_documented():
    assert AdaptiveAdmission(horizon=2047).sample == 1  # below 2048 chunks: exact
    two = AdaptiveAdmission(horizon=2048)
    assert (two.sample, two.slots) == (2, 1024)
    big = AdaptiveAdmission(horizon=1 << 15)
    assert (big.sample, big.slots) == (32, 1024)
    for i in range(20_000):
        big.admit([i * 8 + j for j in range(8)])
    assert all(len(m) <= big.slots for m in big.minis)
    assert big.memory_bytes <= 4.2 * (1 << 20)


def test_sampled_miniature_sees_only_its_sample():
    from kvtier.index.admission import _h64

    a = AdaptiveAdmission(horizon=8, sample=2, candidates=("all",))
    keys = list(range(40))
    a.admit(keys)
    sampled = [x for x in (_h64(k) for k in keys) if x % 2 == 0]
    assert 4 < len(sampled) < 40
    assert list(a.minis[0]) == sampled[-4:]  # 8 // 2 = 4 slots, LRU: the last 4 sampled ones
    a.admit(keys)  # the first sampled chunk was evicted: no hit (the prefix rule)
    assert a.scores[0] == 0


def test_bad_options_are_one_line_config_errors():
    with pytest.raises(ConfigError, match=r"sample=0 must be a positive integer"):
        make_admission("adaptive:sample=0")
    with pytest.raises(ConfigError, match=r"window='x'.*not a number"):
        make_admission("adaptive:window=x")
    with pytest.raises(ConfigError, match=r"unknown option 'bogus'.*adaptive takes: horizon, sample, window"):
        make_admission("adaptive:bogus=1")
    with pytest.raises(ConfigError, match=r"unknown admission policy 'lfu'"):
        AdaptiveAdmission(candidates=("all", "lfu"))
    with pytest.raises(ConfigError, match=r"cannot be 'adaptive'"):
        AdaptiveAdmission(candidates=("adaptive",))
    with pytest.raises(ConfigError, match=r"non-empty list"):
        AdaptiveAdmission(candidates="all")
    for bad in ("adaptive:sample=0", "adaptive:bogus=1"):
        with pytest.raises(ConfigError) as exc:
            make_admission(bad)
        assert "\n" not in str(exc.value)


def test_replay_drives_the_same_object_by_hand(tmp_path):
    # the hand trace of the first test, replayed through a real 2-chunk LRU: plain LRU hits
    # r2 and r7 (2 of 10 chunks). Following the answers [1,1,2,1,0,0,1,1]: r2 hits; r4's a was
    # evicted by r3; r7's b was not stored at r6 (nth:2 answered 0) -> 1 hit. The miniatures
    # judge past hits, so a switch can come too late to pay on a trace this short.
    g = Geometry((Group("full", "full", 1, 16, bytes_per_token_per_layer=2),), 16)
    plan = make_plan(g, chunk_tokens=512)
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps({"hash_ids": r}) for r in HAND))
    trace = load_trace(p, plan)
    one_chunk = 1024
    adm = AdaptiveAdmission(horizon=2, sample=1, window=4, candidates=("all", "nth:2"))
    r = replay(plan, trace, {"cpu": 2 * one_chunk}, "lru", admission=adm, admission_name="adaptive")
    plain = replay(plan, trace, {"cpu": 2 * one_chunk}, "lru")
    assert (plain.hit_chunks, plain.total_chunks) == (2, 10)  # r2 and r7
    assert (r.hit_chunks, r.total_chunks) == (1, 10)  # r2 only
    assert adm.chosen == [5, 3]
    # bytes written: all stores r1 a, r3 x1 x2, r4 a; r5 and r6 nothing; r7 b, r8 c
    assert r.written_bytes["cpu"]["full"] == 6 * one_chunk


def test_store_uses_adaptive_by_name():
    import torch

    from kvtier.core.keys import Namespace
    from kvtier.store.store import Store

    geom = Geometry((Group("full", "full", num_layers=1, tokens_per_block=16, bytes_per_token_per_layer=4),),
                    tokens_per_hash=16)
    plan = make_plan(geom, chunk_tokens=32)
    ns = Namespace("adaptive-test", geom.fingerprint(), "bfloat16")
    row = plan.cacheable_groups[0].chunk_bytes
    s = Store(plan, ns, cpu_bytes=10 * row, admission="adaptive")
    toks = list(range(100))
    pay = {(0, i): torch.full((row,), i, dtype=torch.uint8) for i in range(3)}
    assert s.save_tokens(toks, pay) == 3  # the first candidate, all, answers first
    assert s.lookup_tokens(toks).tokens == 96
