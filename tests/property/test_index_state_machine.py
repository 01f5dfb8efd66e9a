"""Hypothesis state machine for kvtier.index.index against a plain model of every entry.

Invariants after every step: no slot double-booked, every slot in range (also after a pool
is resized), capacity never exceeded, pinned and reserved entries never evicted or moved, lookup returns only committed entries
(at their recorded slots) and a hit every group can actually restore.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.core.geometry import Geometry, Group
from kvtier.index.index import Index
from kvtier.core.plan import make_plan

PLAN = make_plan(
    Geometry(
        groups=(
            Group("full", "full", 1, 16, bytes_per_token_per_layer=2),
            Group("swa", "sliding", 1, 16, bytes_per_token_per_layer=2, window=40),
            Group("ssm", "state", 1, 16, state_bytes_per_layer=64),
            Group("draft", "full", 1, 16, bytes_per_token_per_layer=2, cacheable=False,
                  reason="draft head"),
        ),
        tokens_per_hash=16,
    ),
    chunk_tokens=32,
)
TOTAL = sum(gp.chunk_bytes for gp in PLAN.cacheable_groups)  # 64 + 64 + 64
TIERS = ("cpu", "disk")
GROUPS = (0, 1, 2)
HASHES = st.integers(0, 3)


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ix = Index(PLAN, {"cpu": TOTAL, "disk": 2 * TOTAL + 10}, policy="lru")
        # (hash, group, tier) -> [state, pins, slot]; state in reserved/committed/doomed
        self.model: dict[tuple[int, int, str], list] = {}

    def _gone(self, key) -> None:
        del self.model[key]

    @rule(h=HASHES, g=st.sampled_from(GROUPS), tier=st.sampled_from(TIERS))
    def reserve(self, h, g, tier):
        r = self.ix.reserve(h, g, tier)
        for e in r.evicted:
            key = (e.chunk_hash, e.group, e.tier)
            state, pins, slot = self.model[key]
            assert state == "committed" and pins == 0 and slot == e.slot, (key, self.model[key])
            assert (e.group, e.tier) == (g, tier)
            self._gone(key)
        key = (h, g, tier)
        if r.status == "reserved":
            assert key not in self.model
            self.model[key] = ["reserved", 1, r.slot]
        elif r.status == "present":
            assert self.model[key][0] in ("reserved", "committed")
        elif r.status == "busy":
            assert self.model[key][0] == "doomed"
        else:
            assert r.status == "full" and key not in self.model
            same = [v for k, v in self.model.items() if k[1:] == (g, tier)]
            assert len(same) == self.ix.slots(g, tier)
            assert all(v[1] > 0 for v in same)  # full only when every entry is pinned

    @rule(h=HASHES, g=st.sampled_from(GROUPS), tier=st.sampled_from(TIERS), cold=st.booleans())
    def put(self, h, g, tier, cold):
        r = self.ix.put(h, g, tier, cold=cold)
        for e in r.evicted:
            key = (e.chunk_hash, e.group, e.tier)
            state, pins, slot = self.model[key]
            assert state == "committed" and pins == 0 and slot == e.slot
            self._gone(key)
        key = (h, g, tier)
        if r.status == "reserved":
            self.model[key] = ["committed", 0, r.slot]
        elif r.status == "full":
            assert all(v[1] > 0 for k, v in self.model.items() if k[1:] == (g, tier))
        else:
            assert key in self.model

    @rule(h=HASHES, g=st.sampled_from(GROUPS))
    def touch_all(self, h, g):
        held = any(self.model.get((h, g, t), [None])[0] == "committed" for t in TIERS)
        assert self.ix.touch_all(h, g) == held

    @rule(data=st.data())
    def commit_or_abort(self, data):
        reserved = sorted(k for k, v in self.model.items() if v[0] == "reserved")
        if not reserved:
            return
        key = data.draw(st.sampled_from(reserved))
        if data.draw(st.booleans()):
            self.ix.commit(*key)
            self.model[key][0:2] = ["committed", 0]
        else:
            self.ix.abort(*key)
            self._gone(key)

    @rule(data=st.data())
    def pin(self, data):
        committed = sorted(k for k, v in self.model.items() if v[0] == "committed")
        if committed:
            key = data.draw(st.sampled_from(committed))
            assert self.ix.pin(*key)
            self.model[key][1] += 1

    @rule(data=st.data())
    def unpin(self, data):
        pinned = sorted(k for k, v in self.model.items() if v[0] != "reserved" and v[1] > 0)
        if pinned:
            key = data.draw(st.sampled_from(pinned))
            self.ix.unpin(*key)
            self.model[key][1] -= 1
            if self.model[key][0] == "doomed" and self.model[key][1] == 0:
                self._gone(key)

    @rule(h=HASHES, g=st.sampled_from(GROUPS), tier=st.sampled_from(TIERS))
    def remove(self, h, g, tier):
        key = (h, g, tier)
        expected = key in self.model and self.model[key][0] == "committed"
        assert self.ix.remove(h, g, tier) == expected
        if expected:
            if self.model[key][1]:
                self.model[key][0] = "doomed"
            else:
                self._gone(key)

    @rule(g=st.sampled_from(GROUPS), tier=st.sampled_from(TIERS), slots=st.integers(1, 5))
    def resize(self, g, tier, slots):
        r = self.ix.resize(g, tier, slots)
        assert r.slots == self.ix.slots(g, tier) >= slots
        for e in r.evicted:  # only unpinned committed entries go
            key = (e.chunk_hash, e.group, e.tier)
            state, pins, slot = self.model[key]
            assert state == "committed" and pins == 0 and slot == e.slot and (e.group, e.tier) == (g, tier)
            self._gone(key)
        for m in r.moved:  # only unpinned committed entries move, from above the new size
            key = (m.chunk_hash, m.group, m.tier)
            state, pins, slot = self.model[key]
            assert state == "committed" and pins == 0 and slot == m.from_slot >= r.slots > m.to_slot
            self.model[key][2] = m.to_slot
        if r.slots > slots:  # kept larger only for pinned or reserved entries above `slots`
            held = [v for k, v in self.model.items() if k[1:] == (g, tier)]
            assert len(held) > slots or any(v[1] and v[2] == r.slots - 1 for v in held)

    @rule(chain=st.lists(HASHES, min_size=1, max_size=4, unique=True), extra=st.integers(0, 40))
    def lookup(self, chain, extra):
        prompt = len(chain) * 32 + extra - 39  # sometimes shorter than the chain
        hit = self.ix.lookup(chain, prompt)
        assert hit.tokens % 32 == 0 and hit.tokens <= max(0, prompt - 1)
        for g, loads in enumerate(hit.chunks):
            assert [ld.chunk_index for ld in loads] == list(PLAN.chunks_for_hit(g, hit.tokens))
            for ld in loads:
                assert ld.chunk_hash == chain[ld.chunk_index]
                state, _, slot = self.model[(ld.chunk_hash, g, ld.tier)]
                assert state == "committed" and slot == ld.slot
                # the first tier in order that holds it
                first = next(t for t in TIERS
                             if self.model.get((ld.chunk_hash, g, t), [None])[0] == "committed")
                assert ld.tier == first

    @invariant()
    def slots_and_capacity(self):
        for tier in TIERS:
            for g in GROUPS:
                entries = [v for k, v in self.model.items() if k[1:] == (g, tier)]
                slots = [v[2] for v in entries]
                assert len(slots) == len(set(slots)), "slot double-booked"
                assert all(0 <= s < self.ix.slots(g, tier) for s in slots)
                assert len(entries) <= self.ix.slots(g, tier)
                assert self.ix.used(g, tier) == len(entries)

    @invariant()
    def visibility_matches_model(self):
        for h in range(4):
            for g in GROUPS:
                for tier in TIERS:
                    v = self.model.get((h, g, tier))
                    assert self.ix.contains(h, g, tier) == (v is not None and v[0] == "committed")


IndexMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestIndexMachine = IndexMachine.TestCase
