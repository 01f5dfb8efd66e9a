"""kvtier.placement "hits" in the vLLM manager for sliding-window groups: a sliding chunk is stored
only if vLLM's own hit search reads it for a hit ending where hits land (the request's last
chunks, branch points), and vLLM's real search (`_sliding_window_lookup`, its window from
`get_sliding_window_size_in_chunks`) then still finds the whole hit at those ends."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.kv_offload.base import ReqContext  # noqa: E402

try:  # vLLM 0.33 moved it to the offloading config
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import get_sliding_window_size_in_chunks
except ImportError:  # vLLM 0.32
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import get_sliding_window_size_in_chunks
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (  # noqa: E402
    OffloadingConnectorScheduler,
)

from kvtier.core.geometry import Geometry, Group  # noqa: E402
from kvtier.integrations.vllm.manager import KvtierManager  # noqa: E402
from kvtier.integrations.vllm.placement import lookup_window  # noqa: E402
from vllm_manager_setup import manager, request_keys, row_bytes  # noqa: E402
from vllm_manager_setup import store as _store  # noqa: E402

TOKENS = 16
WINDOW = 3 * TOKENS + 1  # C divides W - 1: vLLM reads cdiv(W, C) = 4 chunks, kvtier's W - 1 rule 3


def _geometry(window: int) -> Geometry:
    return Geometry(groups=(
        Group(name="attn", kind="full", num_layers=1, tokens_per_block=TOKENS, bytes_per_token_per_layer=64,
              dtype="float16", layers=(0,)),
        Group(name="swa", kind="sliding", num_layers=1, tokens_per_block=TOKENS, bytes_per_token_per_layer=64,
              dtype="float16", layers=(1,), window=window),
    ), tokens_per_hash=TOKENS, name="sliding")


def _manager(tmp_path: Path, window: int = WINDOW, placement: str = "hits", **ctx_extra: object) -> KvtierManager:
    geom = _geometry(window)
    return manager(tmp_path, geom, {"cpu": 256 * row_bytes(geom)}, placement, **ctx_extra)


def _keys(seeds: list[int], req: str) -> tuple[ReqContext, list[list]]:
    """A request whose chunk i has hash seed seeds[i] (shared seeds: a shared prefix)."""
    return request_keys(req, seeds, TOKENS)


def _vllm_hit_chunks(m: KvtierManager, rc: ReqContext, swa_keys: list, end: int) -> int:
    """vLLM's own search of the sliding group for a hit ending after chunk end - 1 (the full
    group's prefix): the end of the last run of its window of held chunks, 0 on none."""
    spec = SlidingWindowSpec(block_size=TOKENS, num_kv_heads=1, head_size=8, dtype=torch.float16,
                             sliding_window=WINDOW)
    window = get_sliding_window_size_in_chunks(spec, TOKENS)
    return OffloadingConnectorScheduler._sliding_window_lookup(
        SimpleNamespace(manager=m), swa_keys[:end], window, rc, window)


def test_lookup_window_is_vllms_window() -> None:
    spec = dict(block_size=TOKENS, num_kv_heads=1, head_size=8, dtype=torch.float16)
    for span in (16, 32, 64):
        for w in (1, 16, 17, 48, 49, 64, 100, 512):
            for retained in (0, 1, 5):
                want = get_sliding_window_size_in_chunks(
                    SlidingWindowSpec(**spec, sliding_window=w, extra_retained_tokens=retained), span)
                assert lookup_window("sliding", span, window=w, retained_tokens=retained) == (want, 0)
        for a in (16, 48, 8192):
            want = get_sliding_window_size_in_chunks(ChunkedLocalAttentionSpec(**spec, attention_chunk_size=a), span)
            assert lookup_window("chunked", span, attention_chunk=a) == (want, 0)
    assert lookup_window("state", 16) == (1, 0)
    assert lookup_window("full", 16) is None
    assert lookup_window("sliding", 16, window=49, draft=True) == (4, 1)  # a drafter reads one chunk past


def test_sliding_chunks_only_where_vllm_reads_them_and_the_follow_up_hits_whole(tmp_path: Path) -> None:
    m = _manager(tmp_path)
    rc, keys = _keys(list(range(10)), "a")
    stored = _store(m, rc, keys[0] + keys[1])
    # the hit ends after chunk 9 (a next turn) or 8 (one repeating all but the last, partial
    # block): vLLM reads 4 sliding chunks before each, 5 .. 9; chunks 0 .. 4 are not stored
    assert stored == keys[0] + keys[1][5:]
    assert m.metrics.counts["store_skipped_placement"] == 5
    announced = [k for e in m.take_events() if not e.removed for k in e.keys]
    assert sorted(announced) == sorted(stored)  # what is skipped is never announced
    for end in (10, 9):  # vLLM's own search finds the whole hit at both ends
        assert _vllm_hit_chunks(m, rc, keys[1], end) == end
    assert _vllm_hit_chunks(m, rc, keys[1], 8) == 0  # ends nowhere near: nothing (was the cost)


def test_a_branch_point_keeps_the_window_before_it(tmp_path: Path) -> None:
    """B shares A's first 6 chunks and then differs: chunk 5 becomes a branch point, so B keeps
    the sliding run vLLM reads for a hit ending there (chunks 2 .. 5), and a third request on the
    same prefix hits all 6 chunks."""
    m = _manager(tmp_path)
    rc_a, ka = _keys(list(range(10)), "a")
    _store(m, rc_a, ka[0] + ka[1])
    rc_b, kb = _keys(list(range(6)) + [50 + i for i in range(4)], "b")
    stored = _store(m, rc_b, kb[0] + kb[1])
    assert kb[1][2] in stored and kb[1][3] in stored and kb[1][4] in stored  # 5 was stored by A
    assert kb[1][0] not in stored and kb[1][1] not in stored
    rc_c, kc = _keys(list(range(6)) + [90, 91], "c")
    assert _vllm_hit_chunks(m, rc_c, kc[1], 6) == 6


def test_every_stores_each_sliding_chunk(tmp_path: Path) -> None:
    m = _manager(tmp_path, placement="every")
    rc, keys = _keys(list(range(10)), "a")
    assert _store(m, rc, keys[0] + keys[1]) == keys[0] + keys[1]


@pytest.mark.parametrize("draft", [False, True])
def test_an_eagle_drafter_group_keeps_the_chunk_after_each_end(tmp_path: Path, draft: bool) -> None:
    """vLLM reads a drafter's group one chunk past the hit: the chunk after a branch point is kept
    for a drafter's group only."""
    m = _manager(tmp_path, draft_groups=frozenset({1} if draft else ()))
    rc_a, ka = _keys(list(range(10)), "a")
    _store(m, rc_a, ka[0] + ka[1])
    rc_b, kb = _keys(list(range(6)) + [50 + i for i in range(6)], "b")  # ends 11, 10: chunks 7 .. 11
    stored = _store(m, rc_b, kb[0] + kb[1])
    assert (kb[1][6] in stored) == draft  # after branch point 5
    assert kb[1][1] not in stored and kb[1][2] in stored and kb[1][7] in stored
