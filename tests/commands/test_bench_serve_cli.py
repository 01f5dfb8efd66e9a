"""`kvtier bench serve`: flag validation (one line naming the value and the fix, exit 2, before
any server starts), and the pure parts of its report."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.commands import bench_serve as bs
from kvtier.loadgen.stats import Sample


@pytest.mark.parametrize("argv, message", [
    (["--turns", "1"], "--turns 1 must be at least 2 (a single turn reuses nothing)"),
    (["--max-tokens", "1"], "--max-tokens 1 must be at least 2"),
    (["--conversations", "0"], "--conversations 0 must be at least 1"),
    (["--requests", "-3"], "--requests -3 must be at least 1"),
    (["--block-tokens", "600"], "--block-tokens 600 is more than the trace's 512-token blocks; use 1..512"),
    (["--prompt-tokens", "4000"], "--prompt-tokens 4000 exceeds --max-prompt-tokens 2048"),
    (["--workloads", "a,x"], "--workloads 'a,x': give each of a, b, c at most once"),
    (["--workloads", "a,a"], "--workloads 'a,a': give each of a, b, c at most once"),
    (["--workloads", ""], "--workloads '': give each of a, b, c at most once"),
    (["--delay-ms", "-1"], "--delay-ms -1.0 must be within 0..10000"),
    (["--cpu-bytes", "lots"], "--cpu-bytes 'lots' must be a positive size, e.g. 1GiB"),
    (["--redis-bytes", "0"], "--redis-bytes '0' must be a positive size"),
    (["--threads-bind", "zero"], "--threads-bind 'zero' is not a CPU list; use e.g. 0-1"),
    (["--redis-url", "rediss://h:1/0"], "--redis-url 'rediss://h:1/0' must be redis://host:port/db"),
    (["--redis-url", "redis://:pw@h:1/0"], "without a password"),
    (["--workloads", "c", "--redis-server", "no-such-redis"], "--redis-server 'no-such-redis' is not on PATH"),
    (["--trace", "/no/such.jsonl"], "--trace '/no/such.jsonl' is not a file"),
    (["--model", "/no/such/model"], "--model '/no/such/model' is not a model directory"),
    (["--log-dir", "/no/such/dir"], "--log-dir '/no/such/dir' is not an existing directory"),
    (["--startup-timeout-s", "0"], "--startup-timeout-s 0.0 must be > 0"),
])
def test_bad_flags_are_one_line_usage_errors(argv: list[str], message: str, capsys, tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"input_length": 600, "hash_ids": [0, 1]}\n')
    base = ["bench", "serve", "--trace", str(trace), "--model", str(tmp_path)]
    (tmp_path / "config.json").write_text("{}")
    code = main(base + argv)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err


def test_cpu_list_and_redis_address() -> None:
    assert bs.cpu_list([0, 1]) == "0-1" and bs.cpu_list([3]) == "3" and bs.cpu_list([0, 2, 3]) == "0,2,3"
    assert bs.redis_address("redis://127.0.0.1:6380/2") == ("127.0.0.1", 6380, 2)
    assert bs.redis_address("redis://h") == ("h", 6379, 0)


def test_restored_chunks_become_tokens_only_for_one_group() -> None:
    s = [Sample(1.0, 2.0, (0.1,), 2, 100)]
    before = {"loaded_chunks_cpu": 2, "loaded_chunks_group0": 2}
    after = {"loaded_chunks_cpu": 7, "loaded_chunks_group0": 7, "store_chunks": 3}
    one = bs.workload_result(s, s, before, after, groups=1, chunk_tokens=128)
    assert one["restored_chunks"] == {"cpu": 5} and one["restored_tokens"] == {"cpu": 640}
    assert one["kvtier_counters"] == {"loaded_chunks_cpu": 5, "loaded_chunks_group0": 5, "store_chunks": 3}
    assert one["ratios_with_over_without"]["ttft_p50_s"] == 1.0
    two = bs.workload_result(s, s, before, after, groups=2, chunk_tokens=128)
    assert two["restored_chunks"] == {"cpu": 5} and two["restored_tokens"] == {"cpu": None}


def test_report_headline_ratios_point_the_documented_way() -> None:
    import argparse

    fast, slow = Sample(1.0, 2.0, (0.1,), 4, 10), Sample(4.0, 5.0, (0.2,), 4, 10)
    w = {"a": bs.workload_result([slow], [fast], {}, {"loaded_chunks_cpu": 3}, 1, 128),
         "b": bs.workload_result([fast], [slow], {}, {}, 1, 128),
         "c": bs.workload_result([fast], [slow], {}, {"loaded_chunks_redis": 1}, 1, 128)}
    a = argparse.Namespace(threads_bind="0-1", engine_block_tokens=128, conversations=1, turns=2,
                           block_tokens=128, max_prompt_tokens=512, requests=1, prompt_tokens=10,
                           max_tokens=4, delay_ms=2.0, cpu_bytes="1GiB", redis_bytes="1GiB", dtype="auto",
                           workloads=("a", "b", "c"))
    w["a"]["prefilled_tokens"] = {"without": 300, "with": 120}
    r = bs.report(a, "m", "http", w, {}, {}, 5, 1000)
    assert r["ttft_p50_speedup"] == 4.0  # without / with
    assert r["prefill_token_ratio"] == 2.5  # prompt tokens computed, without / with
    assert r["no_reuse_throughput_ratio"] == pytest.approx((4 / 5) / (4 / 2))  # with / without
    assert r["slow_redis_itl_p99_ratio"] == pytest.approx(2.0)  # with / without
    assert r["restored_tokens"] == {"cpu": 384, "redis": 128}
    assert r["targets_met"] == {"ttft_p50_speedup": True, "no_reuse_throughput_ratio": False,
                                "slow_redis_itl_p99_ratio": False}
    text = bs.human(r)
    assert "ttft_p50_speedup: 4.00 (target >= 3.0: met)" in text
    assert "prefill_token_ratio: 2.50" in text
    assert "restored by kvtier: cpu 384 tokens (3 chunks)" in text


def test_auto_bind_leaves_the_last_cpu_to_the_client() -> None:
    assert bs.auto_bind([0, 1]) == "0" and bs.auto_bind([0, 1, 2, 3]) == "0-2"
    assert bs.auto_bind([5]) == "5" and bs.auto_bind([0, 2, 4]) == "0,2"


def test_later_turns_leave_out_each_conversations_first() -> None:
    from kvtier.loadgen.workloads import Turn

    turns = [Turn(0, 0, (1,), (1,)), Turn(1, 0, (2,), (2,)), Turn(0, 1, (1,), (1,)), Turn(1, 1, (2,), (2,))]
    slow = [Sample(t, t + 1, (0.1,), 2, 1) for t in (9.0, 9.0, 4.0, 2.0)]
    fast = [Sample(t, t + 1, (0.1,), 2, 1) for t in (9.0, 9.0, 1.0, 1.0)]
    lt = bs.later_turns(turns, slow, fast)
    assert lt == {"requests": 2, "ttft_p50_s_without": 3.0, "ttft_p50_s_with": 1.0, "ttft_p50_speedup": 3.0}
