"""Trace-to-prompt mapping: deterministic, prefix-preserving, scaled; conversations and order."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.loadgen import workloads as wl

TRACE = Path(__file__).parents[3] / "shared" / "traces" / "conversation_trace.jsonl"  # the whole trace
from kvtier.commands.bench_serve import DEFAULT_TRACE as SHIPPED  # noqa: E402 - its first 2,700 requests


def _trace(tmp_path: Path, records: list[dict]) -> list[dict]:
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in records))
    return wl.read_trace(p)


def test_a_block_is_the_same_in_every_process_and_differs_by_id_and_salt() -> None:
    one = wl.block_token_ids(42, 128, "s")
    assert one == wl.block_token_ids(42, 128, "s") and len(one) == 128
    assert all(wl.TOKEN_LOW <= t < wl.TOKEN_HIGH for t in one)
    # another interpreter (another PYTHONHASHSEED): the same ids, so two servers and two runs agree
    code = "from kvtier.loadgen.workloads import block_token_ids as b; print(b(42, 128, 's'))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"})
    assert json.loads(other.stdout) == one
    assert wl.block_token_ids(43, 128, "s") != one
    assert wl.block_token_ids(42, 128, "t") != one
    assert max(wl.block_token_ids(42, 512, "s", high=150)) < 150


def test_prompt_length_scales_the_trace_and_keeps_the_last_blocks_share() -> None:
    assert wl.prompt_length(6758, 14, 128) == 1690  # ceil(6758 / 4)
    assert wl.prompt_length(512 * 14, 14, 128) == 14 * 128
    assert wl.prompt_length(10**6, 2, 128) == 256  # never more than its blocks
    assert wl.prompt_length(1, 1, 128) == 1


def test_requests_share_exactly_their_common_blocks(tmp_path: Path) -> None:
    # requests 3 and 1585 of the conversation trace: 4 blocks in common, then different
    a = wl.prompt_ids([0, 42, 43, 44, 45], 2290, 128, "s")
    b = wl.prompt_ids([0, 42, 43, 44, 31961, 31962], 2615, 128, "s")
    assert len(a) == 573 and len(b) == 654
    assert a[:512] == b[:512]
    assert a[512:640] != b[512:640]


def test_conversations_group_by_the_first_two_ids_in_trace_order(tmp_path: Path) -> None:
    recs = _trace(tmp_path, [
        {"input_length": 600, "hash_ids": [0, 1]},
        {"input_length": 900, "hash_ids": [0, 5]},
        {"input_length": 1000, "hash_ids": [0, 1, 2]},
        {"input_length": 9000, "hash_ids": [0, 7] + list(range(100, 116))},  # too long
        {"input_length": 1400, "hash_ids": [0, 5, 6]},
        {"input_length": 9500, "hash_ids": [0, 7] + list(range(100, 117))},
        {"input_length": 1500, "hash_ids": [0, 1, 2, 3]},
    ])
    convs = wl.conversations(recs, 2, 2, 128, 1024, "s")
    assert [[t.hash_ids for t in c] for c in convs] == [[(0, 1), (0, 1, 2)], [(0, 5), (0, 5, 6)]]
    assert [t.turn for t in convs[0]] == [0, 1] and convs[1][0].conversation == 1
    assert len(convs[0][0].prompt_ids) == 150  # 600 trace tokens / 4
    assert convs[0][1].prompt_ids[:150] == convs[0][0].prompt_ids
    assert [(t.conversation, t.turn) for t in wl.interleave(convs)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert wl.working_set_tokens(convs, 128) == 5 * 128  # ids 0, 1, 2, 5, 6
    with pytest.raises(ConfigError, match=r"2 conversations .* fewer than --conversations 3; lower"):
        wl.conversations(recs, 3, 2, 128, 1024, "s")


def test_fresh_prompts_share_no_prefix() -> None:
    ps = wl.fresh_prompts(3, 300, "b")
    assert [len(p) for p in ps] == [300, 300, 300]
    assert len({p[:16] for p in ps}) == 3
    assert ps == wl.fresh_prompts(3, 300, "b")


def test_read_trace_names_the_bad_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"input_length": 5, "hash_ids": [1]}\n{"timestamp": 1}\n')
    with pytest.raises(ConfigError, match="line 2 is not a Mooncake request"):
        wl.read_trace(p)
    with pytest.raises(ConfigError, match="does not exist"):
        wl.read_trace(tmp_path / "missing.jsonl")


@pytest.mark.skipif(not TRACE.is_file(), reason="the shared Mooncake trace is not here")
def test_the_shipped_head_gives_the_whole_traces_conversations() -> None:
    """`kvtier bench serve`'s default trace is the first 2,700 requests: at the default sizes and
    at the e2e test's, its conversations are exactly the whole trace's."""
    head, whole = wl.read_trace(SHIPPED), wl.read_trace(TRACE)
    assert whole[:len(head)] == head and len(head) == 2700
    for sizes in ((6, 4, 128, 2048), (3, 2, 128, 512)):
        assert wl.conversations(head, *sizes, "s") == wl.conversations(whole, *sizes, "s"), sizes


def test_the_real_trace_gives_conversations_that_reuse_their_prefix() -> None:
    convs = wl.conversations(wl.read_trace(SHIPPED), 6, 4, 128, 2048, "s")
    assert len(convs) == 6 and all(len(c) == 4 for c in convs)
    for c in convs:
        for earlier, later in zip(c, c[1:]):
            assert earlier.hash_ids[:2] == later.hash_ids[:2]
            n = min(256, len(earlier.prompt_ids))
            assert later.prompt_ids[:n] == earlier.prompt_ids[:n]


def test_reusable_tokens_counts_leading_blocks_seen_in_full_before() -> None:
    def turn(ids: tuple[int, ...], n: int) -> wl.Turn:
        return wl.Turn(0, 0, ids, tuple(range(n)))

    turns = [turn((0, 1), 200),  # nothing seen yet; holds block 0 in full (block 1 partial)
             turn((0, 1, 2), 300),  # block 0 only: block 1 was partial in the first prompt
             turn((0, 1, 2, 3), 512),  # blocks 0 and 1 (block 2 was partial in the second)
             turn((9,), 128)]
    assert wl.reusable_tokens(turns, 128, 128) == 0 + 128 + 256 + 0
    assert wl.reusable_tokens(turns, 128, 256) == 0 + 0 + 256 + 0  # whole engine blocks only
