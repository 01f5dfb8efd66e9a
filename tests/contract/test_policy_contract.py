"""One contract, every eviction policy: the same suite runs against each name in POLICIES."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigError
from kvtier.index.policies import POLICIES, make_policy

NAMES = sorted(POLICIES)


@pytest.fixture(params=NAMES)
def name(request):
    return request.param


def test_empty_policy_has_no_victim(name):
    p = make_policy(name, 4)
    assert len(p) == 0 and "a" not in p
    assert p.victim(lambda k: True) is None


def test_insert_contains_len_and_remove(name):
    p = make_policy(name, 4)
    for k in "abc":
        p.insert(k)
    assert len(p) == 3 and all(k in p for k in "abc") and "d" not in p
    p.insert("a")  # re-insert of a resident key is a touch, not a second copy
    assert len(p) == 3
    p.remove("b")
    assert "b" not in p and len(p) == 2
    p.remove("b")  # removing an absent key is a no-op
    p.touch("zz")  # touching an absent key is a no-op
    assert len(p) == 2 and "zz" not in p


def test_victim_does_not_remove_and_respects_evictable(name):
    p = make_policy(name, 4)
    for k in "abcd":
        p.insert(k)
    v = p.victim(lambda k: True)
    assert v in p and len(p) == 4
    only_c = p.victim(lambda k: k == "c")
    assert only_c == "c" and len(p) == 4
    assert p.victim(lambda k: False) is None
    assert {k for k in "abcd" if k in p} == set("abcd")


def test_unknown_name_and_bad_capacity():
    with pytest.raises(ConfigError, match="unknown eviction policy 'mru'.*lru"):
        make_policy("mru", 4)
    with pytest.raises(ConfigError, match="capacity 0"):
        make_policy("lru", 0)


OPS = st.lists(
    st.tuples(st.sampled_from(["insert", "touch", "remove", "pin", "unpin"]), st.integers(0, 11)),
    max_size=120,
)


@pytest.mark.parametrize("policy_name", NAMES)
@settings(max_examples=60, deadline=None)
@given(ops=OPS, capacity=st.integers(1, 6))
def test_driven_like_the_index(policy_name, ops, capacity):
    """Drive the policy as a pool does: at capacity, ask for a victim among unpinned keys."""
    p = make_policy(policy_name, capacity)
    resident: set[int] = set()
    pinned: set[int] = set()
    for op, k in ops:
        if op == "insert" and k not in resident:
            if len(resident) == capacity:
                v = p.victim(lambda key: key not in pinned)
                if v is None:
                    assert resident <= pinned  # only when every key is pinned
                    continue
                assert v in resident and v not in pinned
                p.remove(v)
                resident.discard(v)
            p.insert(k)
            resident.add(k)
        elif op == "touch":
            p.touch(k)
        elif op == "remove":
            p.remove(k)
            resident.discard(k)
            pinned.discard(k)
        elif op == "pin" and k in resident:
            pinned.add(k)
        elif op == "unpin":
            pinned.discard(k)
        assert len(p) == len(resident)
        assert all(key in p for key in resident)
        assert not any(key in p for key in set(range(12)) - resident)
