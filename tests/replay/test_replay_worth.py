"""The worth policy in replay (kvtier.replay.worth): tuner bounds, ties to LRU, w = 0 is LRU."""

from __future__ import annotations

import json
import random

import pytest

from kvtier.cli import main
from kvtier.core.geometry import Geometry, Group
from kvtier.core.plan import make_plan
from kvtier.errors import ConfigError
from kvtier.index.placement import HitsLand
from kvtier.index.worth import WorthWeight
from kvtier.replay.run import replay
from kvtier.replay.trace import Request, load_trace
from kvtier.replay.worth import GRID, REQUEST_BYTES, WorthTuner, worth_options


def hybrid():
    g = Geometry((Group("full", "full", 1, 16, bytes_per_token_per_layer=2),
                  Group("ssm", "state", 1, 16, state_bytes_per_layer=4096)), 16)
    return make_plan(g, chunk_tokens=512)


def conversations(tmp_path, n=400, seed=5):
    """Multi-turn conversations over a few shared system prompts, interleaved."""
    rng = random.Random(seed)
    rows, live, next_id = [], [], 10_000
    for i in range(n):
        if not live or rng.random() < 0.3:
            prompt = [rng.randrange(4)] + [next_id + j for j in range(rng.randrange(1, 6))]
            next_id += 10
            live.append(prompt)
        conv = rng.choice(live)
        conv.extend(next_id + j for j in range(rng.randrange(1, 4)))
        next_id += 10
        rows.append({"timestamp": i, "input_length": 512 * len(conv), "hash_ids": list(conv)})
        if len(live) > 12:
            live.pop(rng.randrange(len(live)))
    p = tmp_path / "conv.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def test_tuner_window_is_bounded_in_bytes():
    # stated bound: (8 + REQUEST_BYTES) bytes x max_chunks + 8 x (1 + candidates)
    tuner = WorthTuner(WorthWeight(), lambda t, w: 0.0, "cpu", max_chunks=1000, period=10**9)
    assert WorthTuner.max_memory_bytes(1000) == (8 + REQUEST_BYTES) * 1000 + 8 * (1 + len(GRID))
    rng = random.Random(1)
    for i in range(5000):
        tuner.observe(Request(i, tuple(range(rng.randrange(1, 300))), 512, 512), True)
        assert tuner.chunks <= 1000 and len(tuner.window) <= 1000
        assert tuner.memory_bytes <= WorthTuner.max_memory_bytes(1000)
    assert tuner.chunks > 1000 - 300  # it does keep a window


def test_tuner_keeps_lru_on_ties_and_adopts_a_better_weight():
    weight = WorthWeight()
    tuner = WorthTuner(weight, lambda t, w: 5.0, "cpu", max_chunks=100, period=10)
    for i in range(50):
        tuner.observe(Request(i, (i,), 512, 512), True)
    assert weight.w == 0.0 and tuner.tunings and set(tuner.tunings) == {0.0}
    tuner = WorthTuner(weight, lambda t, w: -abs(w - 2.0), "cpu", max_chunks=100, period=10)
    tuner.observe(Request(0, (0,), 512, 512), False)  # nothing evicted yet: no tuning
    assert tuner.tunings == []
    for i in range(1, 30):
        tuner.observe(Request(i, (i,), 512, 512), True)
    assert weight.w == 2.0


def test_worth_with_weight_zero_replays_as_lru(tmp_path):
    plan = hybrid()
    trace = load_trace(conversations(tmp_path), plan)
    caps = {"cpu": 40 * (1024 + 4096)}
    a = replay(plan, trace, caps, "lru", share="learned", placement=HitsLand(plan))
    b = replay(plan, trace, caps, "worth:w=0", share="learned", placement=HitsLand(plan))
    assert a.hit_chunks > 0
    assert (a.hit_chunks, a.hit_tokens, a.written_bytes, a.evictions) == \
        (b.hit_chunks, b.hit_tokens, b.written_bytes, b.evictions)
    assert b.policy == "worth(w=0)"


def test_worth_changes_victims_and_tunes(tmp_path):
    plan = hybrid()
    trace = load_trace(conversations(tmp_path), plan)
    caps = {"cpu": 40 * (1024 + 4096)}
    lru = replay(plan, trace, caps, "lru", share="learned", placement=HitsLand(plan))
    fixed = replay(plan, trace, caps, "worth:w=4", share="learned", placement=HitsLand(plan))
    assert fixed.evictions != lru.evictions or fixed.hit_chunks != lru.hit_chunks
    tuned = replay(plan, trace, caps, "worth:max_chunks=200,period=200", share="learned",
                   placement=HitsLand(plan))
    assert tuned.policy.startswith("worth(w=") and tuned.policy.endswith(", tuned)")


def test_worth_options():
    assert worth_options("worth") == {}
    assert worth_options("worth:w=2,period=10") == {"w": 2.0, "period": 10}
    for bad in ("worth:alpha=1", "worth:w=x", "worth:period=0", "lru"):
        with pytest.raises(ConfigError):
            worth_options(bad)


def test_one_group_default_is_every_chunk_lru(tmp_path, capsys):
    # replay's default on a one-group model: every-chunk LRU, bit for bit (docs/admission.md)
    trace = str(conversations(tmp_path, n=200))
    rc = main(["replay", trace, "--geometry", "llama-3-8b", "--tier", "cpu=5%", "--json"])
    assert rc == 0
    default = json.loads(capsys.readouterr().out)["policies"][0]
    rc = main(["replay", trace, "--geometry", "llama-3-8b", "--tier", "cpu=5%", "--policy", "lru",
               "--placement", "every", "--share", "proportional", "--json"])
    assert rc == 0
    lru = json.loads(capsys.readouterr().out)["policies"][0]
    assert default["policy"] == lru["policy"] == "lru"
    assert default["hit_chunks"] > 0
    for k in ("hit_chunks", "hit_tokens", "written_bytes", "evictions", "flops_saved"):
        assert default[k] == lru[k], k
