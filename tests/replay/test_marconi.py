"""The Marconi baseline (kvtier.replay.marconi): branch points, scores, the alpha bootstrap."""

from __future__ import annotations

import json

import pytest

from kvtier.core.cost import ComputeModel, Term
from kvtier.core.geometry import Geometry, Group
from kvtier.core.plan import make_plan
from kvtier.errors import ConfigError
from kvtier.replay.marconi import (BranchTree, MarconiPlacement, MarconiPolicy, Shared, marconi_options,
                                   marconi_replay, worth_fn)
from kvtier.replay.run import CostModel
from kvtier.replay.trace import load_trace


def hybrid():
    g = Geometry((Group("full", "full", 1, 16, bytes_per_token_per_layer=2),
                  Group("ssm", "state", 1, 16, state_bytes_per_layer=4096)), 16)
    return make_plan(g, chunk_tokens=512)  # full 1024 B a chunk, ssm 4096 B a checkpoint


def mooncake(tmp_path, *hash_lists):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps({"timestamp": i, "input_length": 512 * len(h), "hash_ids": h})
                           for i, h in enumerate(hash_lists)))
    return p


def test_branch_points_are_nodes_that_gain_a_second_child():
    t = BranchTree(100)
    assert t.insert([1, 2, 3]) == []
    assert t.insert([1, 2, 3, 4]) == []  # a leaf extended: a follow-up, not a branch
    assert t.insert([1, 2, 5]) == [1]  # node 2 had child 3, now 5 too
    assert t.insert([1, 2, 6]) == [1]  # a third child: still a branch point
    assert t.insert([1, 2]) == []  # nothing new
    assert t.insert([9]) == []  # a new root: no cached prefix to branch from
    assert t.depth(5) == 2 and t.depth(4) == 3 and t.depth(77) == 0


def test_tree_is_bounded():
    t = BranchTree(8)
    for r in range(100):
        t.insert([1000 + 10 * r + i for i in range(5)])
        assert len(t.nodes) <= 8
    assert t.memory_bytes <= 8 * 120


def test_placement_stores_state_only_at_branch_points_and_the_end():
    plan = hybrid()
    p = MarconiPlacement(plan, BranchTree(100))
    assert p.place([1, 2, 3, 4], 4) == {1: ({3}, ())}  # the last chunk only
    assert p.place([1, 2, 7, 8], 4) == {1: ({1, 3}, ())}  # + the branch at node 2 (index 1)
    assert p.place([1, 2, 7, 9], 2) == {1: ({1}, ())}  # only the admitted chunks; branch at 2 > n


def test_state_is_stored_at_the_branch_and_hit_by_the_third_request(tmp_path):
    plan = hybrid()
    trace = load_trace(mooncake(tmp_path, [1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 7, 8]), plan)
    r = marconi_replay(plan, trace, {"cpu": 100 * plan.chunk_bytes_all_groups}, alpha=0.0)
    # r1 stores ssm at chunk 3 only; r2 misses (no checkpoint at index 1), creates the branch
    # there and stores ssm 1 and 3; r3 hits 2 chunks and stores its last, 3
    assert r.hit_chunks == 2 and r.hit_requests == 1
    assert r.written_bytes["cpu"]["ssm"] == 4 * 4096
    assert r.written_bytes["cpu"]["full"] == 8 * 1024


def test_score_prefers_keeping_deep_entries_when_alpha_is_large():
    plan = hybrid()
    tree = BranchTree(100)
    tree.insert([1, 2, 3, 4, 5, 6, 7, 8])
    cost = CostModel(flops=1.0, compute=ComputeModel((Term("full", "full", 1, 1.0, 1.0),)))
    for alpha, want in ((0.0, 8), (10.0, 1)):
        pol = MarconiPolicy(4, Shared(tree, alpha))
        pol.worth = worth_fn(plan, 0, cost)
        for k in (1, 8, 3):  # depths 0, 7, 2
            pol.insert(k)
        pol.touch(1)  # recency order, oldest first: 8, 3, 1
        # alpha 0 is LRU (8); alpha 10: chunk 0 saves the fewest FLOPs per byte, and goes
        # although it is the most recent (score 1 + 0, against 0 + 10 for 8, ~0.3 + ~2.9 for 3)
        assert pol.victim(lambda k: True) == want
        assert pol.victim(lambda k: k != want) == 3
        pol.remove(8)
        assert 8 not in pol and len(pol) == 2


def test_worth_grows_with_depth_under_quadratic_attention():
    plan = hybrid()
    cost = CostModel(flops=1.0, compute=ComputeModel((Term("full", "full", 1, 1.0, 1.0),)))
    full, ssm = worth_fn(plan, 0, cost), worth_fn(plan, 1, cost)
    assert full(0) < full(1) < full(5)
    assert ssm(0) < ssm(1) < ssm(5)
    # a state checkpoint at depth d: F((d+1)C) / ((d+1) full chunks + the checkpoint)
    f = lambda n: n + n * (n + 1) / 2  # noqa: E731
    assert ssm(1) == pytest.approx(f(1024) / (2 * 1024 + 4096))


def test_alpha_is_tuned_once_after_the_first_eviction(tmp_path):
    plan = hybrid()
    rows = [[1000 * r + i for i in range(3)] for r in range(30)]
    trace = load_trace(mooncake(tmp_path, *rows), plan)
    cap = {"cpu": 6 * plan.chunk_bytes_all_groups}
    seen = []

    def score(window, alpha):  # the grid's scores, recorded
        seen.append((len(window.requests), alpha))
        return {0.0: 0.1, 0.5: 0.3, 2.0: 0.3, 4.0: 0.2}[alpha]

    import kvtier.replay.marconi as m

    r = m.marconi_replay(plan, trace, cap, grid=(0.0, 0.5, 2.0), factor=2, max_window=100)
    assert r.policy.startswith("marconi(alpha=") and "tuned" in r.policy
    tuner = m._Tuner(trace.requests, "cpu", 2, 100, score, (0.0, 0.5, 2.0, 4.0), Shared(BranchTree(8), 0.0))

    class Idx:  # evictions start after request index 3 (4 requests seen)
        plan = hybrid()

        def __init__(self):
            self.r = 0

        def counters(self, g, tier):
            return {"evictions": int(self.r >= 3)}

    idx = Idx()
    for i in range(30):
        idx.r = i
        tuner.observe(i, idx)
    # window: the next 2 x 4 requests; the tie between 0.5 and 2.0 goes to the smaller alpha
    assert seen == [(8, 0.0), (8, 0.5), (8, 2.0), (8, 4.0)] and tuner.shared.alpha == 0.5 and tuner.done


def test_options_and_cli(tmp_path, capsys):
    assert marconi_options("marconi") == {}
    assert marconi_options("marconi:alpha=0.5,tail=2") == {"alpha": 0.5, "tail": 2}
    for bad in ("marconi:beta=1", "marconi:tail=0", "marconi:alpha=x"):
        with pytest.raises(ConfigError):
            marconi_options(bad)
    from kvtier.cli import main

    geom = tmp_path / "g.json"
    geom.write_text(json.dumps(hybrid().geometry.to_dict()))
    trace = mooncake(tmp_path, [1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 7, 8])
    rc = main(["replay", str(trace), "--geometry", str(geom), "--tier", "cpu=100%", "--policy", "lru",
               "--policy", "marconi:alpha=0", "--json"])
    assert rc == 0
    rows = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["policies"]}
    assert rows["marconi(alpha=0)"]["hit_chunks"] == 2
    assert rows["lru"]["hit_chunks"] == 4  # every checkpoint stored: r2 and r3 hit 2 chunks each
