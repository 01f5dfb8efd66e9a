"""kvtier.placement "hits" for sliding-window groups through vLLM's real scheduler and both
connector halves (the engine-less harness, vllm_engineless/harness.py), on vLLM 0.32 and 0.33:
a follow-up turn still restores its whole previous prompt, and over 12 sessions of Mooncake's
conversation trace a Gemma-3-like engine restores at least what "every" restores in the same cpu
bytes (the same share: sliding groups keep their proportional bytes in vLLM), every loaded
position of every group checked against what its earlier forward wrote."""

from __future__ import annotations

import pytest

from test_vllm_engineless import TRACE, _start, every_and_hits, ok, restored
from vllm_versions import fixtures

GEMMA3_LIKE = ["sliding", "sliding", "full", "sliding"]
SCENARIOS = [
    # window 48 (3 chunks of 16). Not 49 (C divides W - 1): there vLLM itself offers 3 chunks
    # of a sliding group's window but its search reads 4, so B restores nothing with "every" too
    {"name": "follow_up", "layers": GEMMA3_LIKE, "extra": {"kvtier.placement": "hits"}},
    {"name": "multi_turn_sliding", "trace": str(TRACE), "sessions": 12, "layers": GEMMA3_LIKE,
     "extra": {"kvtier.cpu_bytes": "1536KiB"}},
]


results, _no_driver_left = fixtures(lambda version: _start(version, SCENARIOS), timeout=600)


def test_a_follow_up_turn_restores_its_whole_previous_prompt(results: dict) -> None:
    """A: 200 tokens stored; B: A + 8 tokens restores 12 whole chunks (192 tokens), every
    sliding group's window of 3 chunks among them."""
    restored(ok(results, "follow_up"), 192)


def test_sliding_placement_restores_what_every_chunk_restores_in_the_same_bytes(results: dict) -> None:
    every, hits = every_and_hits(results, "multi_turn_sliding")
    r = results["multi_turn_sliding"]
    assert every["slots"] == {"vllm0_sliding": 48, "vllm1_sliding": 48, "vllm2_sliding": 48, "vllm3_full": 48}, every
    # share "auto" keeps sliding groups' proportional bytes: the same slots as "every"
    assert hits["slots"] == every["slots"], r
    assert hits["hit_requests"] >= every["hit_requests"], r
    assert hits["restored_tokens"] >= every["restored_tokens"] > 0, r
