"""kvtier.replay.run on small hand-made traces whose answers are derived by hand."""

from __future__ import annotations

import json

import pytest

from kvtier.errors import ConfigError
from kvtier.core.geometry import Geometry, Group
from kvtier.core.plan import make_plan
from kvtier.replay.oracle import next_uses
from kvtier.replay.run import CostModel, footprint_bytes, parse_size, replay
from kvtier.replay.trace import chunks_from_hash_ids, load_trace


def one_group(chunk_tokens: int = 512):
    g = Geometry((Group("full", "full", 1, 16, bytes_per_token_per_layer=2),), 16)
    return make_plan(g, chunk_tokens=chunk_tokens)  # chunk_bytes = 2 * chunk_tokens


def write_trace(tmp_path, rows, name="t.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def mooncake(tmp_path, *hash_lists):
    return write_trace(tmp_path, [
        {"timestamp": i, "input_length": 512 * len(h), "output_length": 1, "hash_ids": h}
        for i, h in enumerate(hash_lists)])


def test_lru_and_min_by_hand(tmp_path):
    plan = one_group()
    trace = load_trace(mooncake(tmp_path, [1, 2], [1, 2, 3], [1, 4], [1, 2]), plan)
    assert (trace.total_chunks, trace.unique_chunks) == (9, 4)
    cap = {"cpu": 2 * plan.chunk_bytes_all_groups}
    # LRU, 2 slots: r1 miss, stores 1 2 | r2 hits 1 2, stores 3 evicting 1 | r3 [1,4] misses,
    # stores 1 (evicts 2) and 4 (evicts 3) | r4 [1,2] hits 1, stores 2 (evicts 4).
    # Hits 0+2+0+1 = 3 of 9; 4 evictions; 6 chunks written (1 2 3 1 4 2).
    r = replay(plan, trace, cap, "lru")
    assert (r.hit_chunks, r.total_chunks, r.hit_requests) == (3, 9, 2)
    assert r.evictions["cpu"]["full"] == 4
    assert r.written_bytes["cpu"]["full"] == 6 * plan.chunk_bytes_all_groups
    # MIN: 3 and 4 have no later use, so they are never stored: hits 0+2+1+2 = 5 of 9
    m = replay(plan, trace, cap, "min")
    assert (m.hit_chunks, m.evictions["cpu"]["full"]) == (5, 0)
    assert m.admission == "oracle"


def test_min_evicts_the_farthest_next_use(tmp_path):
    plan = one_group()
    # next uses: 1 at r4 (index 3), 2 at index 4, 3 at index 5. r3 stores 3 (it has a next
    # use) into a full cache {1, 2}: MIN evicts the farthest resident, 2.
    trace = load_trace(mooncake(tmp_path, [1], [2], [3], [1], [2], [3]), plan)
    assert next_uses(trace) == [[3], [4], [5], [float("inf")], [float("inf")], [float("inf")]]
    m = replay(plan, trace, {"cpu": 2 * plan.chunk_bytes_all_groups}, "min")
    # r3: cache {1,2}, store 3 evicts 2 (next use 4 > 3) -> r4 [1] hit, r5 [2] miss, r6 [3] hit
    assert m.hit_chunks == 2


def test_hybrid_hit_needs_the_window_and_row_per_key_holds_less(tmp_path):
    g = Geometry((
        Group("full", "full", 1, 16, bytes_per_token_per_layer=2),
        Group("swa", "sliding", 1, 16, bytes_per_token_per_layer=2, window=600),
    ), 16)
    plan = make_plan(g, chunk_tokens=512)  # a hit of T reads swa chunks holding T-599..T-1: 2
    trace = load_trace(mooncake(tmp_path, [1, 2, 3], [1, 2, 3, 4]), plan)
    r = replay(plan, trace, {"cpu": 4 * plan.chunk_bytes_all_groups}, "lru")
    assert r.hit_chunks == 3
    assert r.loads["cpu"] == {"full": 3, "swa": 2}  # swa restores chunks 1 and 2 only
    # row-per-key: 4 rows shared by 2 groups -> 2 slots each: r2 holds [1,2] only ... r1 stores
    # 1 2 3 in full (3 evicts 1): hit of r2 is 0
    rows = replay(plan, trace, {"cpu": 4 * plan.chunk_bytes_all_groups}, "lru", share="row-per-key")
    assert rows.hit_chunks == 0


def test_tiers_write_through_and_promote(tmp_path):
    plan = one_group()
    b = plan.chunk_bytes_all_groups
    trace = load_trace(mooncake(tmp_path, [1], [2], [1], [3]), plan)
    # write-through (the store's policy): every new chunk goes to cpu and disk, an eviction is a
    # drop. r1: 1 -> cpu, disk | r2: 2 -> cpu (evicts 1), disk {1, 2} | r3: 1 hits on disk,
    # promoted to cpu (evicts 2) | r4: 3 -> cpu (evicts 1), disk (evicts 2, its LRU) {1, 3}
    r = replay(plan, trace, {"cpu": b, "disk": 2 * b}, "lru")
    assert r.hit_chunks == 1
    assert r.loads == {"cpu": {"full": 0}, "disk": {"full": 1}}
    assert r.written_bytes == {"cpu": {"full": 4 * b}, "disk": {"full": 3 * b}}
    assert r.evictions == {"cpu": {"full": 3}, "disk": {"full": 1}}


def test_cold_chunks_go_to_the_tiers_after_the_first(tmp_path):
    g = Geometry((
        Group("full", "full", 1, 16, bytes_per_token_per_layer=2),
        Group("swa", "sliding", 1, 16, bytes_per_token_per_layer=2, window=600),
    ), 16)
    plan = make_plan(g, chunk_tokens=512)
    b = plan.groups[1].chunk_bytes
    trace = load_trace(mooncake(tmp_path, [1, 2, 3, 4]), plan)
    # swa: hits read chunks 0..3, the last endpoint (T = 2048) reads 2, 3: warm; 0, 1 cold
    big = 100 * plan.chunk_bytes_all_groups
    two = replay(plan, trace, {"cpu": big, "disk": big}, "lru", tail_endpoints=1)
    assert two.written_bytes["cpu"]["swa"] == 2 * b and two.written_bytes["disk"]["swa"] == 4 * b
    assert two.written_bytes["cpu"]["full"] == two.written_bytes["disk"]["full"] == 4 * b
    one = replay(plan, trace, {"cpu": big}, "lru", tail_endpoints=1)  # one tier: cold entries in it
    assert one.written_bytes["cpu"]["swa"] == 4 * b


def test_cost_model_by_hand(tmp_path):
    plan = one_group()
    b = plan.chunk_bytes_all_groups  # 1024 bytes
    trace = load_trace(mooncake(tmp_path, [7, 8], [7, 8]), plan)
    cost = CostModel(active_params=1e9, flops=1e12, bandwidth={"cpu": 1024.0})
    r = replay(plan, trace, {"cpu": 4 * b}, "lru", cost=cost)
    # r2 hits 1024 tokens: 1024 * 2e9 / 1e12 = 2.048 s of compute; loads 2 chunks = 2 s
    assert r.hit_tokens == 1024
    assert r.compute_seconds_saved == pytest.approx(2.048)
    assert r.load_seconds == pytest.approx(2.0)
    assert r.prefill_seconds_saved == pytest.approx(0.048)
    assert r.prefill_seconds_total == pytest.approx(2048 * 2e-3)


def test_block_to_chunk_mapping():
    assert chunks_from_hash_ids([1, 2, 3], 512, 512) == (1, 2, 3)
    assert chunks_from_hash_ids([1, 2, 3], 512, 1024) == (2,)  # the last block of each chunk
    assert chunks_from_hash_ids([1, 2, 3, 4], 512, 1024) == (2, 4)
    assert chunks_from_hash_ids([1, 2], 512, 256) == (2, 3, 4, 5)
    with pytest.raises(ConfigError, match="do not nest"):
        chunks_from_hash_ids([1], 512, 768)


def test_token_id_trace_uses_the_store_hit_rule(tmp_path):
    plan = one_group(chunk_tokens=32)
    toks = list(range(70))
    p = write_trace(tmp_path, [{"token_ids": toks}, {"token_ids": toks}, {"token_ids": toks[:64]},
                               {"token_ids": toks[:64]}])
    trace = load_trace(p, plan)
    assert [len(r.chunks) for r in trace.requests] == [2, 2, 2, 2]
    r = replay(plan, trace, {"cpu": 4 * plan.chunk_bytes_all_groups}, "lru")
    # r2: 2 chunks (64 <= 69); r3, r4: 64 tokens may hit at most 63 -> 1 chunk each
    assert r.hit_chunks == 4
    assert r.hit_tokens == 64 + 32 + 32


def test_requests_replay_in_timestamp_order(tmp_path):
    plan = one_group()
    p = write_trace(tmp_path, [{"timestamp": 5, "hash_ids": [1]}, {"timestamp": 1, "hash_ids": [1]},
                               {"timestamp": 1, "hash_ids": [2]}])
    trace = load_trace(p, plan)
    assert [r.chunks for r in trace.requests] == [(1,), (2,), (1,)]
    assert replay(plan, trace, {"cpu": 4 * 1024}, "lru").hit_chunks == 1


def test_bad_traces_name_the_line(tmp_path):
    plan = one_group()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hash_ids": [1]}\n{"tokens": [1]}\n')
    with pytest.raises(ConfigError, match="bad.jsonl line 2 has neither 'hash_ids' nor 'token_ids'"):
        load_trace(bad, plan)
    bad.write_text('{"hash_ids": [1, "x"]}\n')
    with pytest.raises(ConfigError, match="line 1: hash_ids must be a list of integers"):
        load_trace(bad, plan)
    bad.write_text("nope\n")
    with pytest.raises(ConfigError, match="line 1 is not JSON"):
        load_trace(bad, plan)
    with pytest.raises(ConfigError, match="does not exist"):
        load_trace(tmp_path / "missing.jsonl", plan)


def test_parse_size():
    assert parse_size("1234") == 1234
    assert parse_size("64K") == 64_000
    assert parse_size("8MiB") == 8 << 20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("2 GiB") == 2 << 30
    assert parse_size("10%", 1000) == 100
    for bad in ("", "abc", "5XB", "-1", "0", "10%"):
        with pytest.raises(ConfigError):
            parse_size(bad)


def test_footprint(tmp_path):
    plan = one_group()
    trace = load_trace(mooncake(tmp_path, [1, 2], [1, 3]), plan)
    assert footprint_bytes(plan, trace) == 3 * 1024


def test_oracle_admission_bound(tmp_path):
    from kvtier.replay.oracle import OracleAdmission

    plan = one_group()
    trace = load_trace(mooncake(tmp_path, [1, 2], [1, 2, 3], [1, 4], [1, 2]), plan)
    cap = {"cpu": 2 * plan.chunk_bytes_all_groups}
    # LRU storing only chunks with a next use: r1 stores 1 2 | r2 hits 2, stores nothing new
    # (3 has no next use) | r3 hits 1 (4 not stored) | r4 hits 2 -> 5 of 9, like MIN here
    r = replay(plan, trace, cap, "lru", admission=OracleAdmission(next_uses(trace)))
    assert r.hit_chunks == 5
    # next use within 1 request: r1 stores 1 2 (both used by r2) | r2 hits 2, admits only 1
    # (2 is next used 2 requests on) | r3 hits 1, admits 1 | r4 hits 2 (2 was never evicted)
    near = replay(plan, trace, cap, "lru", admission=OracleAdmission(next_uses(trace), 1))
    assert near.hit_chunks == 2 + 1 + 2
    assert near.written_bytes["cpu"]["full"] == 2 * plan.chunk_bytes_all_groups


def test_oracle_admission_with_a_horizon_in_chunks(tmp_path):
    from kvtier.commands.replay import _oracle
    from kvtier.replay.oracle import OracleAdmission

    plan = one_group()
    trace = load_trace(mooncake(tmp_path, [1, 2], [1, 2, 3], [1, 4], [1, 2]), plan)
    fut = next_uses(trace)
    reqs = [list(r.chunks) for r in trace.requests]
    # chunks requested before r1..r4: 0 2 5 7. r2's chunk 2 is next used by r4: the chunks
    # requested in between are r3's, 2 of them -> admitted from chunk_horizon=2 on
    for d, want in ((0, [2, 1, 1, 0]), (1, [2, 1, 1, 0]), (2, [2, 2, 1, 0])):
        o = OracleAdmission(fut, chunk_horizon=d)
        assert [o.admit(r) for r in reqs] == want and o.name == f"oracle:chunks={d}"
    assert _oracle("oracle:chunks=2", fut)().chunk_horizon == 2
    for bad in ("oracle:chunks=0", "oracle:chunks=x", "oracle:-1"):
        with pytest.raises(ConfigError, match="positive number"):
            _oracle(bad, fut)
    with pytest.raises(ConfigError, match="not both"):
        OracleAdmission(fut, 1, chunk_horizon=1)


def test_admission_horizon_is_the_anchor_groups_chunks(tmp_path):
    from kvtier.replay.run import admission_horizon

    plan = one_group()  # 1024 bytes a chunk
    assert admission_horizon(plan, "cpu", 10 * 1024 + 5, "proportional") == 10
    g = Geometry((
        Group("swa", "sliding", 1, 16, bytes_per_token_per_layer=6, window=600),  # 3072 B a chunk
        Group("full", "full", 1, 16, bytes_per_token_per_layer=2),  # 1024 B a chunk
    ), 16)
    hybrid = make_plan(g, chunk_tokens=512)
    # proportional: 40960 // (3072 + 1024) = 10 chunks of each group
    assert admission_horizon(hybrid, "cpu", 40960, "proportional") == 10
    # half the bytes to the full group: 20480 // 1024 = 20 of its chunks (the sliding one gets 6)
    assert admission_horizon(hybrid, "cpu", 40960, {"full": 0.5, "swa": 0.5}) == 20


def test_tail_endpoints_store_only_the_windows_hits_read(tmp_path):
    from kvtier.replay.run import tail_chunks

    g = Geometry((
        Group("full", "full", 1, 16, bytes_per_token_per_layer=2),
        Group("swa", "sliding", 1, 16, bytes_per_token_per_layer=2, window=600),
        Group("ssm", "state", 1, 16, state_bytes_per_layer=64),
    ), 16)
    plan = make_plan(g, chunk_tokens=512)
    # 6 chunks, hits may end at 5*512 or 6*512: swa needs chunks 3,4 and 4,5; ssm checkpoints 4, 5
    assert tail_chunks(plan, 1, 6, 2) == [3, 4, 5]
    assert tail_chunks(plan, 2, 6, 2) == [4, 5]
    assert tail_chunks(plan, 1, 1, 2) == [0]
    # a next turn repeating all but the last block still hits in full
    trace = load_trace(mooncake(tmp_path, [1, 2, 3, 4], [1, 2, 3, 5, 6]), plan)
    b = plan.chunk_bytes_all_groups
    r = replay(plan, trace, {"cpu": 20 * b}, "lru", tail_endpoints=2)
    assert r.hit_chunks == 3
    # r1 writes full 1 2 3 4, swa 1 (cold) 2 3 4 (warm: hits at 3 or 4 chunks), ssm 1 2 (cold)
    # 3 4; r2 (hits 1 2 3) writes full 5 6, swa 5 6, ssm 5 6
    assert r.written_bytes["cpu"] == {"full": 6 * 1024, "swa": 6 * 1024, "ssm": 6 * 64}
    # tight pools: the cold entries go first. 4 slots per group: r2's swa 5 6 evict the cold 1
    # and then LRU's oldest warm 2 ... the hit of r2 is unchanged
    tight = replay(plan, trace, {"cpu": 4 * b}, "lru", tail_endpoints=2)
    assert tight.hit_chunks == 3


def test_compute_saved_is_the_share_of_prompt_flops(tmp_path):
    from kvtier.core.cost import ComputeModel, Term

    plan = one_group()
    trace = load_trace(mooncake(tmp_path, [7, 8], [7, 8, 9]), plan)
    # F(n) = n + n(n+1)/2: under causal attention a prefix's tokens are the cheap ones (each
    # attends to fewer keys), so the FLOPs share is below the token share
    model = ComputeModel((Term("full", "full", 1, 1.0, 1.0),))
    cost = CostModel(flops=1.0, compute=model)
    r = replay(plan, trace, {"cpu": 8 * plan.chunk_bytes_all_groups}, "lru", cost=cost)
    f = lambda n: n + n * (n + 1) // 2  # noqa: E731
    assert r.hit_tokens == 1024
    assert r.flops_saved == f(1024) and r.flops_total == f(1024) + f(1536)
    assert r.compute_saved == pytest.approx(f(1024) / (f(1024) + f(1536)))
    assert r.compute_saved < r.token_hit_rate
    assert r.compute_seconds_saved == pytest.approx(f(1024))
    assert r.to_dict()["compute_saved"] == r.compute_saved
    # a hit is capped at the request's input_length (Mooncake's last block is partial)
    short = load_trace(write_trace(tmp_path, [{"hash_ids": [7, 8]},
                                              {"hash_ids": [7, 8], "input_length": 900}], "s.jsonl"), plan)
    r = replay(plan, short, {"cpu": 8 * plan.chunk_bytes_all_groups}, "lru", cost=cost)
    assert r.flops_saved == f(900) and r.flops_total == f(1024) + f(900)
