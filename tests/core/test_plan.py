"""The chunk planner on real geometries, against hand-derived numbers.

Each expected value is derived in the comment above it from the geometry's published sizes:
C = chunk_tokens, L = lcm(tokens_per_hash, tokens_per_block of every cacheable group).
"""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.core.geometry import Geometry, Group
from kvtier.core.load import load_geometry
from kvtier.core.hf_config import geometry_from_hf_config
from kvtier.core.plan import hit_unit, make_plan


@pytest.fixture
def v4(geometry_path) -> Geometry:
    return load_geometry(geometry_path("deepseek-v4-like"))


@pytest.fixture
def example(geometry_path) -> Geometry:
    return load_geometry(geometry_path("gemma-3-27b-example"))


def test_deepseek_v4_like_groups_of_256_64_8_4_tokens(v4: Geometry) -> None:
    plan = make_plan(v4)
    # L = lcm(64 hash, 256, 64, 8, 4) = 256 (the not-cacheable mtp group does not count);
    # the smallest multiple of 256 that is >= 256 is 256.
    assert hit_unit(v4) == 256 and plan.chunk_tokens == 256
    # blocks per chunk: 256/256, 256/64, 256/8, 256/4; mtp is not cacheable
    assert [g.blocks_per_chunk for g in plan.groups] == [1, 4, 32, 64, None]
    # chunk bytes = 256 tokens * bytes per token per layer * layers:
    # compressed 256*146*20, swa 256*584*43, indexer 256*132*20, tail 256*584*1, mtp 256*584*1
    assert [g.chunk_bytes for g in plan.groups] == [747520, 6428672, 675840, 149504, 149504]
    # hit of 1024 tokens = 4 chunks: full groups need 4; swa (W=128) needs tokens 897..1023,
    # all in chunk 3 -> 1; mtp 0.
    assert [len(plan.chunks_for_hit(i, 1024)) for i in range(5)] == [4, 1, 4, 4, 0]
    assert list(plan.chunks_for_hit(1, 1024)) == [3]
    # 4*747520 + 6428672 + 4*675840 + 4*149504 = 12720128
    assert plan.restore_bytes(1024) == 12720128
    # naive: 4 chunks of every cacheable group = 4 * (747520+6428672+675840+149504)
    assert plan.naive_restore_bytes(1024) == 32006144


def test_issue_example_with_a_1056_token_state_group(example: Geometry) -> None:
    plan = make_plan(example)
    # L = lcm(16, 16, 16, 1056) = 1056; tail (4 tokens, not cacheable) does not count
    assert plan.chunk_tokens == 1056
    assert [g.blocks_per_chunk for g in plan.groups] == [66, 66, 1, None]
    # global 1056*8192*10, local 1056*8192*52, gdn 1048576*36, tail 1056*256*2
    assert [g.chunk_bytes for g in plan.groups] == [86507520, 449839104, 37748736, 540672]
    # hit 3200 rounds down to 3168 = 3 chunks. local (W=1024): tokens 2145..3167, chunk 2 only.
    assert plan.round_hit(3200) == 3168
    assert [list(plan.chunks_for_hit(i, 3200)) for i in range(4)] == [[0, 1, 2], [2], [2], []]
    # 3*86507520 + 449839104 + 37748736
    assert plan.restore_bytes(3168) == 747110400
    assert plan.naive_restore_bytes(3168) == 3 * (86507520 + 449839104 + 37748736)
    # bytes per cached token: (86507520 + 449839104 + 37748736) / 1056
    assert plan.bytes_per_cached_token == pytest.approx(574095360 / 1056)


def test_gemma_3_27b_from_config(hf_config) -> None:
    plan = make_plan(geometry_from_hf_config(hf_config("gemma-3-27b")))
    # C = 256; sliding 256*8192*52 = 109051904; full 256*8192*10 = 20971520
    assert [g.chunk_bytes for g in plan.groups] == [109051904, 20971520]
    # hit 4096 (16 chunks): sliding W=1024 needs tokens 3073..4095 = chunks 12..15 (4); full 16
    assert [list(plan.chunks_for_hit(i, 4096)) for i in range(2)][0] == [12, 13, 14, 15]
    assert plan.restore_bytes(4096) == 4 * 109051904 + 16 * 20971520
    assert plan.naive_restore_bytes(4096) == 16 * (109051904 + 20971520)


def test_gpt_oss_20b(hf_config) -> None:
    plan = make_plan(geometry_from_hf_config(hf_config("gpt-oss-20b")))
    # C = 256; both groups 256 * 2048 * 12 = 6291456
    assert [g.chunk_bytes for g in plan.groups] == [6291456, 6291456]
    # hit 1000 -> 768 (3 chunks); sliding W=128 needs tokens 641..767 = chunk 2
    assert plan.round_hit(1000) == 768
    assert plan.restore_bytes(1000) == 4 * 6291456
    assert plan.naive_restore_bytes(1000) == 6 * 6291456


def test_deepseek_v3_mla(hf_config) -> None:
    plan = make_plan(geometry_from_hf_config(hf_config("deepseek-v3")))
    # C = 256; 256 tokens * 1152 B * 61 layers = 17989632; a hit of 10 chunks restores all 10
    assert plan.groups[0].chunk_bytes == 17989632
    assert plan.restore_bytes(2560) == plan.naive_restore_bytes(2560) == 10 * 17989632


def test_qwen3_next(hf_config) -> None:
    plan = make_plan(geometry_from_hf_config(hf_config("qwen3-next-80b-a3b")))
    # state group: one checkpoint per chunk, 2162688 B * 36 layers = 77856768;
    # full: 256 * 2048 * 12 = 6291456
    assert [(g.blocks_per_chunk, g.chunk_bytes) for g in plan.groups] == [(1, 77856768), (16, 6291456)]
    # hit 4096: the state checkpoint at 4096 (chunk 15) + 16 full chunks
    assert list(plan.chunks_for_hit(0, 4096)) == [15]
    assert plan.restore_bytes(4096) == 77856768 + 16 * 6291456
    assert plan.naive_restore_bytes(4096) == 16 * (77856768 + 6291456)


def test_llama_4_chunked_attention(hf_config) -> None:
    plan = make_plan(geometry_from_hf_config(hf_config("llama-4-scout")))
    # A = 8192, C = 256. hit 9984: chunked layers need tokens 8192..9983 = chunks 32..38
    assert list(plan.chunks_for_hit(0, 9984)) == list(range(32, 39))
    # hit 8192 = a multiple of A: the next token starts a new attention chunk, needs nothing
    assert list(plan.chunks_for_hit(0, 8192)) == []
    # storing 16384 tokens (64 chunks): chunk 31 (7936..8191) and chunk 63 end on an
    # attention-chunk boundary, so no hit (a multiple of C) reads them
    stored = plan.store_chunks(0, 16384)
    assert stored == [*range(0, 31), *range(32, 63)]
    assert plan.store_chunks(1, 16384) == list(range(64))  # full layers: everything


def test_default_chunk_is_the_smallest_multiple_of_l_not_below_256() -> None:
    def geo(tpb: int, hash_: int) -> Geometry:
        return Geometry((Group("a", "full", 1, tpb, bytes_per_token_per_layer=2),), hash_)

    assert make_plan(geo(16, 16)).chunk_tokens == 256
    assert make_plan(geo(48, 16)).chunk_tokens == 288  # L=48: 5*48=240 < 256 <= 6*48
    assert make_plan(geo(512, 16)).chunk_tokens == 512  # L=512 is already >= 256


def test_lcm_with_the_hash_unit() -> None:
    g = Geometry((Group("a", "full", 1, 16, bytes_per_token_per_layer=2),), 1000)
    # lcm(1000, 16) = 2000 >= 256
    assert hit_unit(g) == 2000 and make_plan(g).chunk_tokens == 2000


def test_chunk_tokens_errors_name_the_culprit_and_valid_sizes(v4: Geometry) -> None:
    # 192 is a multiple of the 64-token hash but not of the 256-token 'compressed' blocks
    with pytest.raises(ConfigError) as e:
        make_plan(v4, chunk_tokens=192)
    assert "'compressed'" in str(e.value) and "256" in str(e.value) and "512" in str(e.value)
    # 100 is not a multiple of the hash unit
    with pytest.raises(ConfigError, match="hash unit"):
        make_plan(v4, chunk_tokens=100)
    for bad in (0, -256, True, 256.0):
        with pytest.raises(ConfigError, match="positive multiple of 256"):
            make_plan(v4, chunk_tokens=bad)
    assert make_plan(v4, chunk_tokens=768).chunk_tokens == 768


def test_explicit_blocks_per_chunk(v4: Geometry, geometry_path) -> None:
    # one count per group with equal spans: 2*256 = 8*64 = 64*8 = 128*4 = 512 tokens
    plan = make_plan(v4, blocks_per_chunk={"compressed": 2, "swa": 8, "indexer": 64,
                                           "indexer_tail": 128})
    assert plan.chunk_tokens == 512
    with pytest.raises(ConfigError) as e:
        make_plan(v4, blocks_per_chunk={"compressed": 1, "swa": 8})
    assert "'compressed'" in str(e.value) and "256" in str(e.value)
    assert "'swa'" in str(e.value) and "512" in str(e.value)
    # a single integer is the same count for every group: 16*256 != 16*64
    with pytest.raises(ConfigError, match="'compressed' a span of 4096 .* 'swa' a span of 1024"):
        make_plan(v4, blocks_per_chunk=16)
    gpt = load_geometry(geometry_path("gpt-oss-120b-fp8kv"))
    assert make_plan(gpt, blocks_per_chunk=32).chunk_tokens == 512
    with pytest.raises(ConfigError, match="'nope'"):
        make_plan(gpt, blocks_per_chunk={"nope": 4})
    with pytest.raises(ConfigError, match="positive"):
        make_plan(gpt, blocks_per_chunk=0)
    with pytest.raises(ConfigError, match="either"):
        make_plan(gpt, chunk_tokens=256, blocks_per_chunk=16)


def test_blocks_per_chunk_for_a_state_group(example: Geometry) -> None:
    with pytest.raises(ConfigError, match="'gdn' is a state group"):
        make_plan(example, blocks_per_chunk={"global": 66, "gdn": 2})
    assert make_plan(example, blocks_per_chunk={"global": 66, "local": 66, "gdn": 1}).chunk_tokens == 1056
    # a span that the state group's 1056-token blocks do not divide names that group
    with pytest.raises(ConfigError, match="'gdn'"):
        make_plan(example, blocks_per_chunk={"global": 16, "local": 16})


def test_max_and_best_hit(example: Geometry) -> None:
    plan = make_plan(example)  # C = 1056
    c = plan.chunk_tokens
    # at least one token must be computed: P = 1056 gives 0, P = 1057 gives 1056
    assert plan.max_hit_tokens(c) == 0 and plan.max_hit_tokens(c + 1) == c
    have_all = lambda g, i: True  # noqa: E731
    assert plan.best_hit(5 * c + 1, have_all) == 5 * c
    # global (full) misses chunk 3: hits end at 3 chunks at most
    assert plan.best_hit(5 * c + 1, lambda g, i: not (g == 0 and i == 3)) == 3 * c
    # local (sliding, W=1024 < C) misses chunk 1: only T = 2C needs it, others do not
    assert plan.best_hit(5 * c + 1, lambda g, i: not (g == 1 and i == 1)) == 5 * c
    # the state checkpoint exists only at 2C (chunk 1): the hit is 2C
    assert plan.best_hit(5 * c + 1, lambda g, i: g != 2 or i == 1) == 2 * c
    # the not-cacheable tail is never asked for
    assert plan.best_hit(5 * c + 1, lambda g, i: g != 3) == 5 * c
    assert plan.best_hit(5 * c + 1, lambda g, i: False) == 0


def test_sliding_window_reads_exactly_the_last_w_minus_1_tokens() -> None:
    g = Geometry((Group("s", "sliding", 1, 16, bytes_per_token_per_layer=1, window=257),
                  Group("f", "full", 1, 16, bytes_per_token_per_layer=1)), tokens_per_hash=16)
    plan = make_plan(g)  # C = 256
    # T = 512: the token at 512 attends to 256..512, so tokens 256..511 = chunk 1 only
    assert list(plan.chunks_for_hit(0, 512)) == [1]
    # W = 258 reaches token 255, in chunk 0
    g2 = Geometry((Group("s", "sliding", 1, 16, bytes_per_token_per_layer=1, window=258),), 16)
    assert list(make_plan(g2).chunks_for_hit(0, 512)) == [0, 1]
