"""Admission policies on hand-made request sequences with hand-derived answers."""

from __future__ import annotations

import json

import pytest

from kvtier.index.admission import ADMISSIONS, NthSighting, PrefixAdmission, TinyLFU, make_admission
from kvtier.errors import ConfigError
from kvtier.core.geometry import Geometry, Group
from kvtier.core.plan import make_plan
from kvtier.replay.run import replay
from kvtier.replay.trace import load_trace


def test_all_admits_everything():
    a = make_admission("all")
    assert a.admit([1, 2, 3]) == 3 and a.admit([]) == 0 and a.memory_bytes == 0


def test_nth_sighting_by_hand():
    a = make_admission("nth:2")
    assert a.admit([1, 2, 3]) == 0  # first sighting of all three
    assert a.admit([1, 2, 3]) == 3  # second sighting
    assert a.admit([1, 2, 4]) == 2  # 4 is new: the admitted part stays a prefix
    assert a.admit([9, 2]) == 0  # 2 was seen, but its predecessor 9 was not: prefix-closed
    b = make_admission("nth:3")
    assert [b.admit([b"\x01" * 32]) for _ in range(4)] == [0, 0, 1, 1]


def test_nth_sighting_ages():
    a = NthSighting(n=2, sample=2)
    assert a.admit([7]) == 0  # count(7) = 1, one add
    assert a.admit([8]) == 0  # second add: every counter halves, count(7) = 0
    assert a.admit([7]) == 0  # 7 looks new again
    assert a.admit([7]) == 1


def test_tinylfu_doorkeeper_by_hand():
    a = TinyLFU(threshold=2)
    assert a.admit([1]) == 0  # doorkeeper bit set, sketch untouched
    assert a.sketch.estimate(_key(1)) == 0
    assert a.admit([1]) == 1  # frequency 1 (doorkeeper) + this sighting = 2
    t3 = TinyLFU(threshold=3)
    assert [t3.admit([5]) for _ in range(3)] == [0, 0, 1]
    aged = TinyLFU(threshold=2, sample=2)
    assert aged.admit([1]) == 0
    assert aged.admit([2]) == 0  # 2 sightings: reset, the doorkeeper forgets 1
    assert aged.admit([1]) == 0


def _key(x):
    from kvtier.index.admission import _h64

    return _h64(x)


def test_prefix_admits_everything_while_learning():
    a = PrefixAdmission(warmup=4, sample=1)
    assert a.admit([1, 2, 3]) == 3
    assert a.admit([1, 2, 3, 4]) == 4  # head 1 2 3 seen, tail 4: classes still warming up


def test_prefix_learns_that_last_chunks_are_not_reused():
    # conversations: turn k+1 repeats turn k's chunks but the last one (a partial block whose
    # hash changes), so tail bodies are reused and last chunks never are
    a = PrefixAdmission(warmup=8, sample=1, horizon=30)  # an untouched chunk fails after 30
    answers = []
    for conv in range(60):
        turn = [conv * 10_000 + j for j in range(4)]  # a 4-chunk first turn
        answers.append((a.admit(turn), len(turn)))
        turn2 = turn[:-1] + [conv * 10_000 + 100 + j for j in range(4)]
        a.admit(turn2)
    # early on everything is admitted; once the classes have outcomes, the last chunk is not
    assert answers[0] == (4, 4)
    assert answers[-1] == (3, 4)
    assert a.stats[(0, 3, True)][0] == 0  # no last chunk of a first turn was ever asked again


def test_prefix_rejects_tails_of_a_class_never_reused():
    # long (16-chunk) one-off documents are never asked again; 2-chunk prompts always are
    a = PrefixAdmission(warmup=8, sample=1, horizon=200)
    for i in range(80):
        doc = [10**6 + i * 100 + j for j in range(16)]
        a.admit(doc)
        short = [2 * 10**6 + i * 10 + j for j in range(2)]
        a.admit(short)
        a.admit(short)  # asked again at once
    new_doc = [9 * 10**6 + j for j in range(16)]
    assert a.admit(new_doc) == 0  # a whole new tail of a class never reused: nothing stored
    assert a.admit([8 * 10**6, 8 * 10**6 + 1]) == 2  # short prompts are reused: admitted


@pytest.mark.parametrize("name", sorted(ADMISSIONS))
def test_memory_stays_bounded(name):
    a = make_admission(name)
    for i in range(5_000):
        a.admit([i * 8 + j for j in range(8)])
    assert a.memory_bytes <= 4 << 20


def test_make_admission_options_and_errors():
    assert make_admission("nth:3").n == 3
    assert make_admission("prefix:ratio=1.5,warmup=10").ratio == 1.5
    with pytest.raises(ConfigError, match="unknown admission policy 'lfu'"):
        make_admission("lfu")
    with pytest.raises(ConfigError, match="n >= 2"):
        make_admission("nth:1")
    with pytest.raises(ConfigError, match="not a number"):
        make_admission("prefix:ratio=x")
    with pytest.raises(ConfigError, match="unknown option .bogus.; tinylfu takes: threshold, width"):
        make_admission("tinylfu:bogus=1")


def test_replay_with_nth_admission_by_hand(tmp_path):
    g = Geometry((Group("full", "full", 1, 16, bytes_per_token_per_layer=2),), 16)
    plan = make_plan(g, chunk_tokens=512)
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps({"hash_ids": [1, 2]}) for _ in range(3)))
    trace = load_trace(p, plan)
    # r1: nothing stored (first sighting) | r2: miss, stores 1 2 | r3: hits 2 of 2
    r = replay(plan, trace, {"cpu": 8 * 1024}, "lru", admission=make_admission("nth:2"),
               admission_name="nth:2")
    assert (r.hit_chunks, r.total_chunks) == (2, 6)
    assert r.written_bytes["cpu"]["full"] == 2 * 1024
    assert r.admission == "nth:2"
